"""A multi-node group's supervision and stop against real processes: sleeping Pythons stand in
for the leader and the headless worker (started as the agents start engines, the instance's key
in their environment) and an HTTP endpoint for the leader's /health, so no vLLM is needed. Both
"nodes" are agents of this process, each with its own name; a task the leader's agent sends a
worker's agent is run at once (the real queues and the real engine: tests/engine/
test_multi_node_group.py)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from serving_app import lifecycle
from serving_app.engine import agent, supervisor
from serving_app.models import Instance, InstanceWorker, Node
from tests.factories import make_deployment, make_tenant
from tests.unit.test_supervision import Health, fake_engine, health_server  # noqa: F401

pytestmark = pytest.mark.django_db
State = Instance.State
Worker = InstanceWorker.State
LEADER = agent.AgentConfig(name="node-a", address="127.0.0.1", engine_env="", gpus="")
WORKER = agent.AgentConfig(name="node-b", address="127.0.0.1", engine_env="", gpus="")


@pytest.fixture
def group(tmp_path, base_model, health_server, monkeypatch):  # noqa: F811
    """A ready group: its leader answering /health on node-a, its worker running on node-b."""
    server, _ = health_server
    nodes = [Node.objects.create(name=c.name, queue=c.queue, last_heartbeat=timezone.now())
             for c in (LEADER, WORKER)]
    deployment = make_deployment(base_model, [make_tenant("acme")], name="grp",
                                 tensor_parallel_size=2, allow_multi_node=True)
    instance = Instance.objects.create(deployment=deployment, node=nodes[0], state=State.READY,
                                       port=server.server_address[1], master_addr="127.0.0.1",
                                       master_port=18490)
    leader = fake_engine(tmp_path, instance.secret, instance.port, "leader")
    Instance.objects.filter(pk=instance.pk).update(pid=leader.pid, log_path=leader.log_path)
    worker = fake_engine(tmp_path, instance.secret, 0, "worker")
    row = InstanceWorker.objects.create(instance=instance, node_rank=1, node=nodes[1],
                                        state=Worker.RUNNING, pid=worker.pid,
                                        log_path=worker.log_path)
    # The worker's agent runs what the leader's agent sends it.
    tasks = {lifecycle.STOP_WORKER: agent.stop_worker, lifecycle.START_WORKER: agent.start_worker}
    monkeypatch.setattr(lifecycle, "worker_task",
                        lambda name, pk, queue: tasks[name](pk, WORKER))
    monkeypatch.setattr(lifecycle, "deployment_changed", lambda pk: None)
    yield Instance.objects.get(pk=instance.pk), row
    for pid in (leader.pid, worker.pid):
        supervisor.stop(pid, 1)


def test_a_lost_worker_fails_the_group_and_stops_its_leader(group):
    instance, worker = group
    supervisor.stop(worker.pid, 1)  # the worker's process is gone (killed)
    agent.supervise_once(WORKER)
    worker.refresh_from_db()
    assert worker.state == Worker.FAILED and "headless worker exited" in worker.last_error

    agent.supervise_once(LEADER)
    instance.refresh_from_db()
    assert instance.state == State.FAILED
    assert "(node rank 1) failed" in instance.last_error
    assert supervisor.session_members(group[0].pid) == []  # the leader is stopped too
    worker.refresh_from_db()
    assert worker.state == Worker.STOPPED  # ready for the group's restart


def test_a_stop_leaves_no_process_of_the_group_on_either_node(group, settings, monkeypatch):
    settings.ENGINE_STOP_GRACE_SECONDS = 1
    # The leader's port is the /health stand-in's, which stays open: not waited for.
    monkeypatch.setattr(supervisor, "wait_port_free", lambda *args, **kwargs: True)
    instance, worker = group
    assert agent.stop_instance(instance.pk, LEADER) in ("terminated", "killed")
    instance.refresh_from_db()
    worker.refresh_from_db()
    assert (instance.state, worker.state) == (State.STOPPED, Worker.STOPPED)
    assert supervisor.session_members(group[0].pid) == []
    assert supervisor.session_members(group[1].pid) == []


def test_a_worker_whose_group_stopped_is_stopped_by_its_own_agent(group):
    instance, worker = group
    Instance.objects.filter(pk=instance.pk).update(state=State.STOPPED)  # its stop task lost
    agent.supervise_once(WORKER)
    worker.refresh_from_db()
    assert worker.state == Worker.STOPPED and supervisor.session_members(group[1].pid) == []
