"""Stopping an engine stops every process of its session, not only the leader.

A real vLLM server is a tree (the API server, its EngineCore, worker processes). These tests
launch real process trees through `supervisor.launch` (a leader, its child and a grandchild), so
that signalling only the leader leaves the others running, as it would leave a real engine's
EngineCore. The real engine's own stop and SIGKILL clean-up are checked by
tests/engine/test_engine_lifecycle.py; what no real engine does on demand (ignore SIGTERM) is
played here by a tree that ignores it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from django.utils import timezone

from serving_app.engine import agent, supervisor
from serving_app.models import Instance, Node
from tests.factories import make_deployment, make_tenant

State = Instance.State


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is `sid`."""
    return [process.pid for process in supervisor.session_members(sid)]


TREE = (
    "import os, signal, subprocess, sys, time\n"
    "depth, ready, stubborn = int(sys.argv[1]), sys.argv[2], sys.argv[3] == 'stubborn'\n"
    "if stubborn:\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if depth < 2:\n"
    "    subprocess.Popen([sys.executable, __file__, str(depth + 1), ready, sys.argv[3]])\n"
    "else:\n"
    "    open(ready, 'w').close()\n"
    "while True:\n"
    "    time.sleep(60)\n"
)


def launch_tree(tmp_path: Path, *, stubborn: bool = False, env: dict[str, str] | None = None,
                extra_args: tuple[str, ...] = ()) -> int:
    """A leader with a child and a grandchild, all in the leader's new session; returns the
    leader's pid once all three run. `stubborn`: every one of them ignores SIGTERM."""
    ready = tmp_path / "ready"
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    argv = [sys.executable, str(script), "0", str(ready), "stubborn" if stubborn else "plain",
            *extra_args]
    launched = supervisor.launch(argv, env or {}, tmp_path / "tree.log")
    deadline = timezone.now().timestamp() + 30
    while not ready.exists() or len(session_members(launched.pid)) < 3:
        assert timezone.now().timestamp() < deadline, "the process tree did not start"
        time.sleep(0.05)
    return launched.pid


@pytest.fixture
def cleanup():
    pids: list[int] = []
    yield pids
    for pid in pids:
        for member in session_members(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGKILL)


def test_stop_leaves_no_process_of_the_engine_session(tmp_path, cleanup):
    leader = launch_tree(tmp_path)
    cleanup.append(leader)
    assert supervisor.stop(leader, grace_seconds=5) == "terminated"
    assert session_members(leader) == []


def test_an_engine_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, cleanup):
    """No real vLLM ignores SIGTERM on demand (its API server shuts its EngineCore down), so a
    tree whose every process ignores it stands in for an engine hung in its shutdown."""
    leader = launch_tree(tmp_path, stubborn=True)
    cleanup.append(leader)
    started = time.monotonic()
    assert supervisor.stop(leader, grace_seconds=1) == "killed"
    assert time.monotonic() - started >= 1  # SIGTERM was given its grace period first
    assert session_members(leader) == []


@pytest.fixture
def node_config(db):
    config = agent.AgentConfig(name="cpu-pg", address="127.0.0.1", engine_env="", gpus="")
    Node.objects.create(name=config.name, queue=config.queue, last_heartbeat=timezone.now())
    return config


def engine_instance(base_model, config, state=State.READY) -> Instance:
    deployment = make_deployment(base_model, [make_tenant("acme")], name="pg")
    return Instance.objects.create(deployment=deployment, node=Node.objects.get(name=config.name),
                                   state=state, port=18377)


def kill_leader(leader: int) -> None:
    os.kill(leader, signal.SIGKILL)
    deadline = timezone.now().timestamp() + 30
    while supervisor.is_alive(leader):
        assert timezone.now().timestamp() < deadline
        time.sleep(0.05)
    assert len(session_members(leader)) == 2  # the orphans still run


@pytest.mark.django_db
def test_supervision_clears_the_children_of_an_engine_whose_leader_was_killed(
    tmp_path, base_model, node_config, cleanup
):
    """SIGKILL of the engine's leader orphans its children (a real engine's EngineCore); the
    agent, finding the leader dead, must stop what is left of its session."""
    instance = engine_instance(base_model, node_config)
    leader = launch_tree(tmp_path)
    cleanup.append(leader)
    Instance.objects.filter(pk=instance.pk).update(pid=leader)
    kill_leader(leader)
    agent.supervise_once(node_config)
    assert Instance.objects.get(pk=instance.pk).state == State.FAILED
    assert session_members(leader) == []


@pytest.mark.django_db
def test_stopping_an_instance_whose_leader_was_killed_clears_its_orphans(
    tmp_path, base_model, node_config, cleanup
):
    """A stop that arrives before supervision noticed the dead leader still leaves nothing."""
    instance = engine_instance(base_model, node_config)
    leader = launch_tree(tmp_path)
    cleanup.append(leader)
    Instance.objects.filter(pk=instance.pk).update(pid=leader)
    kill_leader(leader)
    agent.stop_instance(instance.pk, node_config)
    assert Instance.objects.get(pk=instance.pk).state == State.STOPPED
    assert session_members(leader) == []


@pytest.mark.django_db
def test_stopping_an_engine_that_ignores_sigterm_kills_it(tmp_path, base_model, node_config,
                                                          cleanup, settings):
    """The node agent's stop, end to end on a stand-in engine that ignores SIGTERM (its port on
    its command line and the instance's secret in its environment, as a real engine's)."""
    settings.ENGINE_STOP_GRACE_SECONDS = 1
    instance = engine_instance(base_model, node_config)
    leader = launch_tree(tmp_path, stubborn=True, env={"VLLM_API_KEY": instance.secret},
                         extra_args=("--port", str(instance.port)))
    cleanup.append(leader)
    Instance.objects.filter(pk=instance.pk).update(pid=leader)
    assert agent.stop_instance(instance.pk, node_config) == "killed"
    assert Instance.objects.get(pk=instance.pk).state == State.STOPPED
    assert session_members(leader) == []


def test_an_engine_inherits_none_of_the_agents_secrets(tmp_path, monkeypatch, settings):
    """The agent's environment holds the console's database URL and secret key; the engine gets
    the host basics, its stack's variables, what the launch spec sets and what the site allows."""
    monkeypatch.setenv("DATABASE_URL", "postgres://console:hunter2@db/console")
    monkeypatch.setenv("SECRET_KEY", "not-for-engines")
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://broker/0")
    monkeypatch.setenv("HF_HOME", "/srv/hf")
    monkeypatch.setenv("SITE_PROXY_CONF", "kept")
    settings.ENGINE_ENV_ALLOW = ["SITE_*"]
    out = tmp_path / "env.txt"
    launched = supervisor.launch(
        [sys.executable, "-c", f"import os, json; open({str(out)!r}, 'w').write("
                               "json.dumps(dict(os.environ)))"],
        {"VLLM_API_KEY": "instance-secret"}, tmp_path / "engine.log")
    deadline = time.monotonic() + 10
    while supervisor.exit_code(launched.pid) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    seen = json.loads(out.read_text())
    assert not {"DATABASE_URL", "SECRET_KEY", "CELERY_BROKER_URL"} & set(seen)
    assert seen["VLLM_API_KEY"] == "instance-secret"
    assert seen["HF_HOME"] == "/srv/hf"
    assert seen["SITE_PROXY_CONF"] == "kept"
    assert seen["PATH"] == os.environ["PATH"]
