"""The demo ships what production ships: scripts/demo.sh runs the console with DEBUG on (a
console on http://127.0.0.1) and still serves collectstatic's hashed, compressed copies, which
whitenoise marks immutable, never the plain files from static/ (4.8 MB of plotly.js revalidated
on every page)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import django
django.setup()
from django.conf import settings
from django.templatetags.static import static
print(json.dumps({"storage": settings.STORAGES["staticfiles"]["BACKEND"], "debug": settings.DEBUG,
                  "finders": settings.WHITENOISE_USE_FINDERS,
                  "autorefresh": settings.WHITENOISE_AUTOREFRESH,
                  "plotly": static("vendor/plotly.min.js")}))
"""


def demo_environment() -> dict[str, str]:
    """The variables scripts/demo.sh exports with their defaults (`export X="${X:-value}"`)."""
    script = (ROOT / "scripts" / "demo.sh").read_text()
    return dict(re.findall(r'^export (\w+)="\$\{\1:-([^}]*)\}"', script, re.MULTILINE))


def settings_under(env: dict[str, str], static_root: Path) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("DEBUG", "STATIC_HASHED", "DJANGO_SETTINGS_MODULE")}
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + PROBE], cwd=ROOT, check=True,
        capture_output=True, text=True,
        env={**clean, **env, "STATIC_ROOT": str(static_root),
             "DJANGO_SETTINGS_MODULE": "console.settings"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_demo_serves_the_hashed_compressed_static_files(tmp_path):
    env = demo_environment()
    assert env.get("DEBUG") == "true" and env.get("STATIC_HASHED") == "true"
    # What `collectstatic` leaves: a manifest naming each file's hashed copy.
    (tmp_path / "staticfiles.json").write_text(json.dumps(
        {"version": "1.1", "paths": {"vendor/plotly.min.js": "vendor/plotly.min.0123abcd.js"}}))
    seen = settings_under(env, tmp_path)
    assert seen["debug"] is True
    assert seen["storage"] == "console.staticfiles.ConsoleStaticFilesStorage"
    assert seen["plotly"].endswith("vendor/plotly.min.0123abcd.js")  # hashed: immutable
    assert seen["finders"] is False and seen["autorefresh"] is False  # STATIC_ROOT's copies


def test_development_without_the_demos_setting_serves_the_plain_files(tmp_path):
    seen = settings_under({"DEBUG": "true"}, tmp_path)
    assert seen["plotly"].endswith("vendor/plotly.min.js") and seen["finders"] is True
