"""The deployment artefacts of deploy/: the images, compose, Kubernetes and systemd units.

Building the console image takes minutes (measured in docs/install.md, "Images"): more than CI's
budget allows, so `test_console_image.py` runs only with `IMAGE_TESTS=1` (it is not even
collected otherwise, so CI, where any skip fails the run, does not count it as a skip).
"""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("IMAGE_TESTS") == "1" else ["test_console_image.py"]
