"""scripts/join_node.sh joins a host from the console's join flow, run as an operator would run
it (against a live console, with --no-systemd and its env file in a temporary folder): it checks
the host and prints the report, exchanges the token, writes the node's settings, and a node
agent started with those settings alone registers and beats as the node; a second use is
refused, said plainly. scripts/check_node.py says what is missing."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import pytest
from django.db import connection

from serving_app.models import Node, NodeJoinToken
from tests.deploy.known import ROOT
from tests.engines import wait_until

ENGINE_VENV = ROOT / "var" / "engine-venv"


def run_join(console: str, name: str, token: str, env_file, *extra: str):
    return subprocess.run(
        ["bash", "scripts/join_node.sh", "--console", console, "--name", name, "--token", token,
         "--gpus", "", "--address", "127.0.0.1", "--engine-venv", str(ENGINE_VENV),
         "--env-file", str(env_file), "--min-disk-gib", "1", "--no-systemd", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120)


def read_env(path) -> dict[str, str]:
    return {key: value.strip('"') for key, _, value in (
        line.partition("=") for line in path.read_text().splitlines()
        if line and not line.startswith("#"))}


def start_agent(settings_file, var_dir) -> subprocess.Popen:
    """A node agent started the way the systemd unit starts it: the env file's settings and
    nothing of this test's environment (no DEBUG, no test settings)."""
    environment = {"PATH": os.environ["PATH"], "HOME": str(var_dir),
                   "CONSOLE_VAR_DIR": str(var_dir), **read_env(settings_file)}
    name = environment["NODE_NAME"]
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "console", "worker", "-Q", f"node.{name}",
         "--pool", "threads", "-c", "2", "-n", f"{name}@%h", "--without-gossip",
         "--without-mingle"], cwd=ROOT, env=environment, stdout=subprocess.DEVNULL,
        stderr=(var_dir / "agent.log").open("wb"), start_new_session=True)


@pytest.mark.django_db(transaction=True)
def test_the_script_joins_the_host_once_and_its_agent_registers(live_server, platform_admin,
                                                               tmp_path, settings):
    if not (ENGINE_VENV / "bin" / "python").exists():
        pytest.skip("engine environment not installed (scripts/setup_engine.sh)")
    # The node is handed this test's database (the console hands NODE_JOIN_DATABASE_URL).
    db = connection.settings_dict
    settings.NODE_JOIN_DATABASE_URL = (
        f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}")
    _, token = NodeJoinToken.issue("cpu-b", platform_admin)
    env_file = tmp_path / "agent.env"

    joined = run_join(live_server.url, "cpu-b", token, env_file)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert "Node check:" in joined.stdout and "vllm" in joined.stdout
    assert "joined as cpu-b (queue node.cpu-b)" in joined.stdout
    assert "OK       redis" in joined.stdout
    settings = read_env(env_file)
    assert (settings["NODE_NAME"], settings["ENGINE_VENV"]) == ("cpu-b", str(ENGINE_VENV))
    assert settings["DATABASE_URL"].startswith("postgres")
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    node = Node.objects.get(name="cpu-b")
    assert (node.queue, node.address) == ("node.cpu-b", "127.0.0.1")

    # An agent with those settings alone registers and beats as that node.
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    agent = start_agent(env_file, var_dir)
    try:
        wait_until(lambda: Node.objects.filter(name="cpu-b", agent_pid=agent.pid,
                                               last_heartbeat__isnull=False).exists(),
                   90, "the joined node's agent to register", agent)
    except RuntimeError:
        raise AssertionError((var_dir / "agent.log").read_text()[-3000:]) from None
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(30)

    # The same token again: refused, said plainly, nothing changed.
    env_file.unlink()
    again = run_join(live_server.url, "cpu-b", token, env_file)
    assert again.returncode == 1 and "used already" in again.stderr
    assert not env_file.exists() and Node.objects.filter(name="cpu-b").count() == 1


def test_the_check_says_what_is_missing_and_fails():
    result = subprocess.run(
        [sys.executable, "scripts/check_node.py", "--console", "http://127.0.0.1:9",
         "--gpus", "nvml", "--engine-venv", "/nonexistent", "--min-disk-gib", "1e9",
         "--address", "192.0.2.1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    report = {line.split()[1]: line.split()[0] for line in result.stdout.splitlines()
              if line.startswith("  ")}
    assert report["python"] == "OK"
    assert {report[name] for name in ("vllm", "disk", "address", "console")} == {"MISSING"}
    # NVML: missing exactly where the NVIDIA driver's library cannot be loaded.
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert report["nvml"] == "MISSING"
        assert "install the NVIDIA driver" in result.stdout
    assert "Not ready:" in result.stdout
