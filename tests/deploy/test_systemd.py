"""deploy/systemd: every unit passes `systemd-analyze verify` with nothing to say (its warnings,
such as an unknown key, fail too), runs the process it is named for with the restart policy it
needs, and the node agent's unit stops its engines with it."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest
from django.conf import settings

from tests.deploy.known import DEPLOY, ROOT, known_variables

UNITS = DEPLOY / "systemd"
INSTALL_DIR = "/opt/llm-console"
UNIT_FILES = sorted(path.name for path in UNITS.glob("*.service"))


def verify(tmp_path: Path, name: str, text: str) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` of the unit as installed in this checkout (its commands are
    checked to exist: the paths under /opt/llm-console point into this repository instead)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # A template is verified through an instance of it.
    target = tmp_path / name.replace("@.service", "@gpu-a.service")
    target.write_text(text.replace(INSTALL_DIR, str(ROOT)))
    return subprocess.run(["systemd-analyze", "verify", str(target)], capture_output=True,
                          text=True)


def service(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str
    parser.read_string((UNITS / name).read_text())
    return parser["Service"]


def test_there_is_a_unit_for_every_process():
    assert UNIT_FILES == ["llm-console-agent@.service", "llm-console-control-worker.service",
                          "llm-console-usage-writer.service", "llm-console-web.service"]


@pytest.mark.parametrize("name", UNIT_FILES)
def test_the_unit_passes_systemd_analyze_verify(tmp_path, name):
    result = verify(tmp_path, name, (UNITS / name).read_text())
    assert (result.returncode, result.stderr.strip()) == (0, "")


def test_a_misspelt_key_fails_the_check(tmp_path):
    text = (UNITS / "llm-console-web.service").read_text().replace("Restart=", "Restrat=")
    assert "Unknown key" in verify(tmp_path, "broken.service", text).stderr


@pytest.mark.parametrize(("name", "command"), [
    ("llm-console-web.service", "uvicorn console.asgi:application"),
    ("llm-console-control-worker.service", "celery -A console worker -Q control -B"),
    ("llm-console-usage-writer.service", "manage.py usage_writer"),
    ("llm-console-agent@.service", "celery -A console worker -Q node.%i"),
])
def test_each_unit_runs_its_process_from_the_install_with_its_settings(name, command):
    unit = service(name)
    assert command in unit["ExecStart"]
    assert unit["ExecStart"].startswith(f"{INSTALL_DIR}/.venv/bin/")
    # A required environment file (no "-": a unit without its settings does not start).
    assert "\nEnvironmentFile=/etc/llm-console/" in (UNITS / name).read_text()
    assert unit["Restart"] in {"always", "on-failure"}
    assert unit["User"] != "root"


def test_the_agent_stops_its_engines_with_it():
    unit = service("llm-console-agent@.service")
    assert unit["KillMode"] == "control-group"
    assert unit["SendSIGKILL"] == "yes"
    assert float(unit["TimeoutStopSec"]) > settings.ENGINE_STOP_GRACE_SECONDS * 2
    assert "NODE_NAME=%i" in unit["Environment"]


def test_the_example_environment_names_only_settings_the_console_reads():
    names = {line.split("=", 1)[0] for line in
             (UNITS / "console.env.example").read_text().splitlines()
             if line and not line.startswith("#")}
    assert names and names - known_variables() == set()
