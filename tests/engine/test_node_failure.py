"""Node failure and drain, end to end: two real node agents (Celery workers) and a control worker
with beat, real CPU vLLM engines.

The agent of the node serving a deployment is frozen with SIGSTOP until the reconciler declares
its node lost: the instance leaves the gateway's routing at once and is replaced on the other
node, while its engine (not frozen: it runs in a session of its own) goes on running. Then the
agent is let go with SIGCONT: its node is back, and the engine it still runs is stopped, never
adopted beside its replacement. Last, the node now serving is drained: the instance moves back
to the first node, its replacement ready before it stops, so the deployment is never without a
ready instance. Then, scaled to one replica on each node with traffic going through a gateway,
the first node's agent is killed with SIGKILL together with its engine: its instance is replaced
on the other node, and no request sent after the node was declared lost fails. Five engine
starts, at most three engines alive at once.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from audit_app.models import AuditLog
from benchmarks.gateway_bench import kill_group
from gateway_app.catalog import load_snapshot
from serving_app.models import Instance, Node
from serving_app.models.events import Event, Kind
from tenants_app.models import ApiKey
from tests.api.helpers import as_user
from tests.engine.conftest import Traffic, engine_sessions, wait_for
from tests.engine.test_engine_lifecycle import (
    START_TIMEOUT,
    complete,
    create_deployment,
    register_model,
)
from tests.gateway.conftest import start_gateway

pytestmark = [pytest.mark.engine, pytest.mark.celery]
State = Instance.State
LOST_SECONDS = 6  # the agents beat every second


def routed(deployment_id: int) -> set[int]:
    """The instances the gateway routes the deployment's requests to (what a gateway worker
    loads when told the catalog changed)."""
    return {entry.id for entry in load_snapshot().instances.get(deployment_id, ())}


def live(deployment_id: int) -> list[Instance]:
    return list(Instance.objects.select_related("node").filter(deployment_id=deployment_id)
                .exclude(state=State.STOPPED).order_by("pk"))


def ready_on(deployment_id: int, node: str) -> Instance | None:
    return Instance.objects.select_related("node").filter(
        deployment_id=deployment_id, node__name=node, state=State.READY).first()


@pytest.mark.engines(2)
def test_a_lost_node_is_replaced_its_engine_stopped_when_back_then_a_drain_moves_it_back(
    cluster, gateway_redis, platform_admin, acme
):
    cluster.env.update(NODE_LOST_SECONDS=str(LOST_SECONDS), GATEWAY_REDIS_URL=gateway_redis,
                       GATEWAY_CATALOG_REFRESH_SECONDS="0.5")
    cluster.start_control()
    cluster.start_agent("cpu-a")
    cluster.start_agent("cpu-b")
    register_model(platform_admin)
    deployment = create_deployment(platform_admin)["id"]
    client = as_user(platform_admin)
    assert client.post(f"/api/v1/deployments/{deployment}/start/").status_code == 200
    old = wait_for(lambda: ready_on(deployment, "cpu-a"), START_TIMEOUT, "ready on cpu-a")
    assert routed(deployment) == {old.pk}

    # Freeze cpu-a's agent: no heartbeat, no task taken. Its engine goes on running.
    agent_a = cluster.processes["agent-cpu-a"].pid
    os.kill(agent_a, signal.SIGSTOP)
    try:
        try:
            wait_for(lambda: Node.objects.filter(name="cpu-a", lost_at__isnull=False).exists(),
                     LOST_SECONDS + 30, "cpu-a declared lost")
        except AssertionError as exc:  # what the reconciler was doing meanwhile
            raise AssertionError(f"{exc}; the control worker's log ends with:\n"
                                 f"{cluster.log('control')[-3000:]}") from None
        assert routed(deployment) == set()  # out of routing at once
        assert Instance.objects.get(pk=old.pk).state == State.STOPPING
        new = wait_for(lambda: ready_on(deployment, "cpu-b"), START_TIMEOUT,
                       "the replacement ready on cpu-b")
        assert routed(deployment) == {new.pk}
        assert complete(new, "tiny-llama")["choices"][0]["text"]
        assert engine_sessions(old.secret) == {old.pid}  # still running: its agent is frozen
    finally:
        os.kill(agent_a, signal.SIGCONT)

    # Back: the engine the agent still runs is stopped, not adopted beside its replacement.
    wait_for(lambda: Instance.objects.filter(pk=old.pk, state=State.STOPPED).exists(), 60,
             "the replaced engine stopped")
    # Stopped means signalled to the end: a process SIGKILLed after the grace period may still
    # be exiting (its stop event says so) when the state is written, never for long.
    stopped = Event.objects.filter(instance_id=old.pk, kind=Kind.STOPPED).last()
    wait_for(lambda: engine_sessions(old.secret) == set(), 30,
             f"the replaced engine's processes gone ({stopped and stopped.message})")
    node_a = Node.objects.get(name="cpu-a")
    assert node_a.lost_at is None and node_a.state == "ready"
    assert [i.pk for i in live(deployment)] == [new.pk]
    assert Instance.objects.get(pk=new.pk).state == State.READY
    kinds = set(Event.objects.values_list("kind", flat=True))
    assert {Kind.NODE_LOST, Kind.REPLACED, Kind.NODE_BACK} <= kinds

    # Drain cpu-b: the instance moves back to cpu-a, never leaving the deployment without a
    # ready instance, and the old one is stopped only once its replacement is ready.
    node_b = Node.objects.get(name="cpu-b")
    response = client.post(f"/api/v1/nodes/{node_b.pk}/drain/")
    assert response.status_code == 200, response.data
    deadline = time.monotonic() + START_TIMEOUT + 60
    while Node.objects.filter(pk=node_b.pk, draining=True).exists():
        assert time.monotonic() < deadline, Node.objects.get(pk=node_b.pk).drain_status
        assert Instance.objects.filter(deployment_id=deployment, state=State.READY).exists()
        time.sleep(0.2)
    # Drained: nothing of cpu-b runs any more.
    assert engine_sessions(new.secret) == set()
    [moved] = live(deployment)
    assert (moved.node.name, moved.state, moved.replaces_id) == ("cpu-a", State.READY, new.pk)
    replaced = Event.objects.get(kind=Kind.REPLACED, data__reason="drain")
    assert moved.ready_at <= replaced.created_at  # ready before the old one was asked to stop
    # It left routing first and stopped once drained (nothing was in flight).
    assert Event.objects.filter(kind=Kind.DRAINED, instance_id=new.pk).exists()
    node_b.refresh_from_db()
    assert (node_b.cordoned, node_b.state) == (True, "cordoned")
    assert AuditLog.objects.filter(action="drain", object_id=str(node_b.pk), via="api").exists()
    assert complete(moved, "tiny-llama")["choices"][0]["text"]

    # One replica on each node, traffic through the gateway; cpu-a's agent is killed with
    # SIGKILL together with its engine. Its instance is replaced on cpu-b, and every request
    # sent once the node was declared lost succeeds (the other replica serves meanwhile).
    assert client.post(f"/api/v1/nodes/{node_b.pk}/uncordon/").status_code == 200
    Node.objects.filter(name="cpu-a").update(max_instances=1)  # the second replica: cpu-b
    scaled = client.post(f"/api/v1/deployments/{deployment}/scale/", {"replicas": 2},
                         format="json")
    assert scaled.status_code == 200, scaled.data
    other = wait_for(lambda: ready_on(deployment, "cpu-b"), START_TIMEOUT, "ready on cpu-b")
    _, secret = ApiKey.objects.create_key(tenant=acme.tenant, name="node-failure")
    gateway = start_gateway(cluster.env["DATABASE_URL"], workers=1,
                            GATEWAY_REDIS_URL=gateway_redis)
    traffic = None
    try:
        wait_for(lambda: routed(deployment) == {moved.pk, other.pk}, 30, "both routed")
        traffic = Traffic(gateway.client(secret, timeout=120)).start()
        time.sleep(2)
        cluster.stop_process("agent-cpu-a", signal.SIGKILL)
        for session in engine_sessions(moved.secret):
            os.killpg(session, signal.SIGKILL)
        wait_for(lambda: not engine_sessions(moved.secret), 10, "cpu-a's engine gone")
        try:
            wait_for(lambda: Node.objects.filter(name="cpu-a", lost_at__isnull=False).exists(),
                     LOST_SECONDS + 30, "cpu-a declared lost")
        except AssertionError as exc:  # what the reconciler was doing meanwhile
            raise AssertionError(f"{exc}; the control worker's log ends with:\n"
                                 f"{cluster.log('control')[-3000:]}") from None
        lost_at = Node.objects.get(name="cpu-a").lost_at.timestamp()
        assert routed(deployment) == {other.pk}
        replacement = wait_for(
            lambda: Instance.objects.filter(deployment_id=deployment, node__name="cpu-b",
                                            state=State.READY).exclude(pk=other.pk).first(),
            START_TIMEOUT, "the replacement ready on cpu-b")
        wait_for(lambda: routed(deployment) == {other.pk, replacement.pk}, 30,
                 "the replacement routed")
        sent_before = traffic.ok
        time.sleep(2)
        traffic.stop()
        assert traffic.ok > sent_before
        after_lost = [error for error, sent in zip(traffic.failures, traffic.failed_sent_at,
                                                   strict=True) if sent >= lost_at]
        assert after_lost == [], after_lost[:5]
        assert Instance.objects.get(pk=moved.pk).state in (State.STOPPING, State.STOPPED)
        assert Event.objects.filter(kind=Kind.REPLACED, instance_id=moved.pk,
                                    data__node="cpu-a").exists()
    finally:
        if traffic is not None:
            traffic.stop()
        kill_group(gateway.proc)
