"""Stopping an engine stops every process of its session, not only the leader.

A real vLLM server is a tree (the API server, its EngineCore, worker processes). These tests
launch a real three-process tree through `supervisor.launch` (a leader, its child and a
grandchild), so that signalling only the leader leaves the
others running, as it would leave a real engine's EngineCore. The engine-backed lifecycle test
checks the same with the real engine.
"""

from __future__ import annotations

import contextlib
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
    members = []
    for pid in supervisor.pids():
        fields = supervisor.proc_stat(pid)
        # fields: state ppid pgrp session ...
        if fields is not None and int(fields[3]) == sid and fields[0] != "Z":
            members.append(pid)
    return members


def launch_tree(tmp_path: Path) -> int:
    """A leader with a child and a grandchild, all in the leader's new session; returns the
    leader's pid once all three run."""
    ready = tmp_path / "ready"
    script = tmp_path / "tree.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "depth = int(sys.argv[1])\n"
        "if depth < 2:\n"
        "    subprocess.Popen([sys.executable, __file__, str(depth + 1)])\n"
        "else:\n"
        f"    open({str(ready)!r}, 'w').close()\n"
        "while True:\n"
        "    time.sleep(60)\n"
    )
    launched = supervisor.launch([sys.executable, str(script), "0"], {}, tmp_path / "tree.log")
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


def test_stop_kills_children_that_ignore_sigterm(tmp_path, cleanup):
    ready = tmp_path / "ready"
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "if sys.argv[1] == 'child':\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"    open({str(ready)!r}, 'w').close()\n"
        "else:\n"
        "    subprocess.Popen([sys.executable, __file__, 'child'])\n"
        "while True:\n"
        "    time.sleep(60)\n"
    )
    leader = supervisor.launch([sys.executable, str(script), "leader"], {},
                               tmp_path / "s.log").pid
    cleanup.append(leader)
    deadline = timezone.now().timestamp() + 30
    while not ready.exists():
        assert timezone.now().timestamp() < deadline
        time.sleep(0.05)
    assert supervisor.stop(leader, grace_seconds=0.5) == "killed"
    assert session_members(leader) == []


@pytest.mark.django_db
def test_supervision_clears_the_children_of_an_engine_whose_leader_was_killed(
    tmp_path, base_model, cleanup
):
    """SIGKILL of the engine's leader orphans its children (a real engine's EngineCore); the
    agent, finding the leader dead, must stop what is left of its session."""
    config = agent.AgentConfig(name="cpu-pg", address="127.0.0.1", engine_env="", gpus="")
    node = Node.objects.create(name=config.name, queue=config.queue,
                               last_heartbeat=timezone.now())
    deployment = make_deployment(base_model, [make_tenant("acme")], name="pg")
    leader = launch_tree(tmp_path)
    cleanup.append(leader)
    instance = Instance.objects.create(deployment=deployment, node=node, state=State.READY,
                                       port=1, pid=leader)
    os.kill(leader, signal.SIGKILL)
    deadline = timezone.now().timestamp() + 30
    while supervisor.is_alive(leader):
        assert timezone.now().timestamp() < deadline
        time.sleep(0.05)
    assert len(session_members(leader)) == 2  # the orphans still run
    agent.supervise_once(config)
    assert Instance.objects.get(pk=instance.pk).state == State.FAILED
    assert session_members(leader) == []
