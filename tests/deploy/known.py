"""What the deployment files may refer to, read from the code they deploy: the environment
variables the console and its node agent read, the entry point's commands, the probe paths."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Variables read by the entry point (deploy/llm-console.sh) and the Python runtime, not settings.
ENTRYPOINT_VARIABLES = {"PORT", "HOST", "WEB_CONCURRENCY", "FORWARDED_ALLOW_IPS",
                        "CELERY_CONCURRENCY", "LOG_LEVEL", "PATH", "PYTHONUNBUFFERED",
                        "DJANGO_SETTINGS_MODULE", "STATIC_ROOT"}


def setting_variables() -> set[str]:
    """Every variable console/settings.py reads (`env_*("NAME", ...)`, each also as NAME_FILE)
    and those the node agent reads (`os.environ.get("NODE_...")`: its configuration and its
    peer server)."""
    names = set(re.findall(r'env_\w+\(\s*"([A-Z][A-Z0-9_]*)"',
                           (ROOT / "console" / "settings.py").read_text()))
    for module in ("config.py", "agent.py"):
        names |= set(re.findall(r'os\.environ\.get\("([A-Z][A-Z0-9_]*)"',
                                (ROOT / "serving_app" / "engine" / module).read_text()))
    return names | {f"{name}_FILE" for name in names}


def known_variables() -> set[str]:
    return setting_variables() | ENTRYPOINT_VARIABLES


def entrypoint_commands() -> set[str]:
    """The commands deploy/llm-console.sh answers (its top-level `case` labels)."""
    text = (DEPLOY / "llm-console.sh").read_text()
    outer = text.split('case "$cmd" in', 1)[1].split("\nesac", 1)[0]
    return set(re.findall(r"^    ([a-z-]+)\)", outer, re.M))


def probe_paths() -> set[str]:
    """The unauthenticated probe paths console/urls.py serves."""
    urls = (ROOT / "console" / "urls.py").read_text()
    return {f"/{path}" for path in re.findall(r'path\("(healthz|readyz|metrics)"', urls)}
