"""MIG profiles as NVIDIA names them ("3g.40gb": 3 of a GPU's 7 compute slices, 40 GB).

Plain Python with no Django and no project imports, at the bottom of the serving layers, so
that models, placement and the dashboards can all read a profile the same way.
"""

from __future__ import annotations

import re

# Compute slices of a MIG-capable GPU (A100, H100, H200): the "7" of "7g.80gb".
GPU_COMPUTE_SLICES = 7

_PROFILE_RE = re.compile(r"^(\d+)g\.(\d+(?:\.\d+)?)gb(\+me)?$", re.IGNORECASE)


def mig_slices(profile: str | None) -> int | None:
    """Compute slices of a MIG profile ("3g.40gb" -> 3); None for a name that is not one."""
    match = _PROFILE_RE.match((profile or "").strip())
    return int(match.group(1)) if match else None
