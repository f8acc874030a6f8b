"""MPS isolation: the agent starts, checks and stops the node's MPS control daemon, and never
starts an `mps` engine without it (serving_app/engine/mps.py).

This machine has no GPU and no NVIDIA driver: `nvidia-cuda-mps-control` is absent, so the
refusal is real here. Where a daemon's behaviour is needed, `fake_control` stands in for it (no
GPU here to run the real one); it behaves as the real one was seen to on an H200
(docs/gpu-runs/2026-12-05-h200): `-d` starts it, a second `-d` says "An instance of this daemon
is already running" and exits 1, with CUDA_VISIBLE_DEVICES empty it exits 100, `get_server_list`
answers while it runs (no server until a client connects, as on an H100: the servers it lists
are those of `fake-servers`), `quit` stops it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from django.utils import timezone

from serving_app.engine import agent, mps, node_mps
from serving_app.models import Gpu, Instance, Node
from tests.factories import make_deployment, make_tenant

pytestmark = pytest.mark.django_db
State = Instance.State

FAKE_CONTROL = r"""#!/bin/sh
# Stand-in for nvidia-cuda-mps-control (no GPU on this machine): see tests/gpu/test_mps.py.
state="$CUDA_MPS_PIPE_DIRECTORY/fake-daemon"
if [ "$1" = "-d" ]; then
    if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ]; then exit 100; fi
    if [ -e "$state" ]; then echo "An instance of this daemon is already running" >&2; exit 1; fi
    echo running > "$state"; exit 0
fi
read -r command
case "$command" in
    get_server_list) [ -e "$state" ] || exit 1
        servers="$CUDA_MPS_PIPE_DIRECTORY/fake-servers"
        [ -e "$servers" ] && cat "$servers"
        exit 0 ;;
    quit) rm -f "$state" ;;
esac
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch, settings):
    folder = tmp_path / "bin"
    folder.mkdir()
    control = folder / mps.BINARY
    control.write_text(FAKE_CONTROL)
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    settings.MPS_PIPE_DIRECTORY = tmp_path / "mps-pipe"
    settings.MPS_LOG_DIRECTORY = tmp_path / "mps-log"
    return control


@pytest.fixture
def mps_instance(base_model):
    node = Node.objects.create(name="gpu-mps", queue="node.gpu-mps", last_heartbeat=timezone.now())
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-34ca2f35-400a-8b35-f9ea-4504daa4d4d1",
                             name="NVIDIA H200", memory_total_bytes=150754820096, declared=True)
    deployment = make_deployment(base_model, [make_tenant("acme")], name="mps-a",
                                 isolation_mode="mps", mps_thread_percentage=30)
    instance = Instance.objects.create(deployment=deployment, node=node, state=State.PENDING,
                                       gpu_memory_fraction=0.04)
    instance.gpus.set([gpu])
    return instance


def test_without_a_daemon_an_mps_engine_is_refused_with_the_reason_and_never_launched(
        mps_instance):
    assert shutil.which(mps.BINARY, path=mps.SEARCH_PATH) is None, "this machine has MPS"
    config = agent.AgentConfig(name="gpu-mps", address="127.0.0.1", engine_env="", gpus="",
                               engine_python=sys.executable)
    assert agent.start_instance(mps_instance.pk, config) == "failed"
    mps_instance.refresh_from_db()
    assert mps_instance.state == State.FAILED
    assert mps_instance.pid is None and mps_instance.command == []  # nothing was launched
    assert f"{mps.BINARY} is not installed" in mps_instance.last_error
    node = Node.objects.get(name="gpu-mps")
    assert node.mps["running"] is False and "not installed" in node.mps["error"]


def test_the_daemon_is_started_once_checked_and_stopped(fake_control, monkeypatch):
    # The agent's own processes run with no GPU visible; the daemon must still see them all.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert mps.status()["running"] is False
    started = mps.ensure_running()
    assert started["running"] is True and started["servers"] == []  # no client yet
    assert Path(started["CUDA_MPS_PIPE_DIRECTORY"]).is_dir()
    assert mps.ensure_running()["running"] is True  # already running: nothing started twice
    assert mps.stop()["running"] is False


def test_a_daemon_another_start_brought_up_meanwhile_is_used(fake_control, settings,
                                                             monkeypatch):
    settings.MPS_PIPE_DIRECTORY.mkdir(parents=True)
    # The daemon came up between our check and our start: "-d" answers "already running".
    (settings.MPS_PIPE_DIRECTORY / "fake-daemon").write_text("running")
    real_status = mps.status
    checks = []

    def not_running_at_first() -> dict[str, object]:
        checks.append(1)
        return {"running": False} if len(checks) == 1 else real_status()

    monkeypatch.setattr(mps, "status", not_running_at_first)
    assert mps.ensure_running()["running"] is True


def test_the_agent_stops_the_daemon_with_the_last_mps_engine(fake_control, mps_instance,
                                                            monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    node_mps.ensure_mps(mps_instance.node)
    node = Node.objects.get(pk=mps_instance.node_id)
    assert node.mps["running"] is True
    Instance.objects.filter(pk=mps_instance.pk).update(state=State.STOPPED)
    node_mps.stop_mps_if_unused(node)
    assert Node.objects.get(pk=node.pk).mps["running"] is False
    assert mps.status()["running"] is False


def test_the_agent_checks_the_running_daemon_again_as_it_supervises(fake_control, mps_instance,
                                                                   monkeypatch, settings):
    """The node's page follows the daemon: its server once an engine connects, and a daemon
    that stopped answering while its engines ran."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    config = agent.AgentConfig(name="gpu-mps", address="127.0.0.1", engine_env="", gpus="",
                               engine_python=sys.executable)
    node_mps.ensure_mps(mps_instance.node)
    node = Node.objects.get(pk=mps_instance.node_id)
    assert node.mps["running"] is True and node.mps["servers"] == []
    (settings.MPS_PIPE_DIRECTORY / "fake-servers").write_text("1502\n")  # an engine connected
    agent.supervise_once(config)
    node.refresh_from_db()
    assert node.mps["servers"] == ["1502"]
    (settings.MPS_PIPE_DIRECTORY / "fake-daemon").unlink()  # the daemon is gone
    agent.supervise_once(config)
    node.refresh_from_db()
    assert node.mps["running"] is False


def test_a_node_without_a_running_daemon_is_not_asked(mps_instance, monkeypatch):
    config = agent.AgentConfig(name="gpu-mps", address="127.0.0.1", engine_env="", gpus="",
                               engine_python=sys.executable)
    asked = []
    monkeypatch.setattr(mps, "status", lambda: asked.append(1) or {"running": True})
    node_mps.supervise_mps(config)
    assert asked == [] and Node.objects.get(pk=mps_instance.node_id).mps == {}
