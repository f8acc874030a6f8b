"""Node failure and maintenance, as the reconciler decides them: a node whose heartbeat stopped is
declared lost and its instances replaced elsewhere; a cordoned node takes nothing new; a drained
node has its instances moved off one at a time, each old one stopped only once its replacement
is ready (it drains first: `serving_app.deployments.draining`, with the requests in flight given by
the test and no grace period). Node tasks are recorded (`sent`), not sent; the real agents and
engines are in tests/engine/test_node_failure.py. What the control plane did is an event
(`serving_app.models.events`); what an operator asked for, an audit entry."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from audit_app.models import AuditLog
from serving_app import signals
from serving_app.deployments import draining, reconcile
from serving_app.engine import agent
from serving_app.models import Deployment, Instance, Node
from serving_app.models.events import Event, Kind
from tests.factories import make_deployment, make_tenant

pytestmark = pytest.mark.django_db
State = Instance.State
START, STOP = "serving.start_instance", "serving.stop_instance"


def make_node(name: str, **fields) -> Node:
    fields.setdefault("max_instances", 3)
    return Node.objects.create(name=name, queue=f"node.{name}", last_heartbeat=timezone.now(),
                               **fields)


@pytest.fixture
def node_a():
    return make_node("cpu-a")


@pytest.fixture
def deployment(base_model):
    return make_deployment(base_model, [make_tenant("acme")], name="chat",
                           desired_state=Deployment.DesiredState.RUNNING, replicas=2)


@pytest.fixture
def invalidations():
    """Routing changes announced to the gateway workers (the signal its receiver listens to)."""
    calls: list[None] = []

    def heard(sender, **kwargs) -> None:
        calls.append(None)

    signals.instance_routing_changed.connect(heard, dispatch_uid="test-routing-changed")
    yield calls
    signals.instance_routing_changed.disconnect(dispatch_uid="test-routing-changed")


def running(deployment) -> list[Instance]:
    """The deployment's instances that are not stopping or stopped, by node then ordinal."""
    return list(deployment.instances.select_related("node")
                .exclude(state__in=(State.STOPPED, State.STOPPING))
                .order_by("node__name", "ordinal"))


def serving_on(node: Node, deployment) -> list[Instance]:
    """Place the deployment (everything on `node`, the only node yet) and make it ready."""
    reconcile.reconcile_all()
    Instance.objects.filter(deployment=deployment).update(state=State.READY, pid=4242)
    instances = running(deployment)
    assert {i.node_id for i in instances} == {node.pk}
    return instances


@pytest.fixture(autouse=True)
def in_flight(monkeypatch) -> dict[int, int]:
    """Requests in flight per instance, as the gateway's Redis would answer (0 if absent); a
    drained instance stops in the round it drains (no grace period)."""
    counts: dict[int, int] = {}
    monkeypatch.setattr(draining.inflight, "counts",
                        lambda ids: {i: counts.get(i, 0) for i in ids})
    monkeypatch.setattr(draining, "grace_seconds", lambda: 0.0)
    return counts


def events(kind: str) -> list[Event]:
    return list(Event.objects.filter(kind=kind).order_by("id"))


# -- lost nodes --------------------------------------------------------------------------------
def test_a_silent_node_is_declared_lost_and_its_instances_replaced_elsewhere(
    sent, node_a, deployment, invalidations, settings
):
    old = serving_on(node_a, deployment)
    node_b = make_node("cpu-b")
    Node.objects.filter(pk=node_a.pk).update(
        last_heartbeat=timezone.now() - timedelta(seconds=settings.NODE_LOST_SECONDS + 1))
    sent.clear()
    invalidations.clear()
    reconcile.reconcile_all()

    assert Node.objects.get(pk=node_a.pk).lost_at is not None
    assert Node.objects.get(pk=node_a.pk).state == "lost"
    # Out of routing at once (no longer ready, and the gateway workers told), their engines
    # asked to stop through the lost node's own queue, for when its agent is back.
    assert {Instance.objects.get(pk=i.pk).state for i in old} == {State.STOPPING}
    assert invalidations
    assert sorted(task for task, pk in sent if pk in {i.pk for i in old}) == [STOP, STOP]
    replacements = running(deployment)
    assert [(i.node_id, i.ordinal, i.state) for i in replacements] == [
        (node_b.pk, 0, State.PENDING), (node_b.pk, 1, State.PENDING)]
    assert sorted(sent) == sorted([(STOP, i.pk) for i in old] + [(START, i.pk)
                                                                 for i in replacements])
    [lost] = events(Kind.NODE_LOST)
    assert lost.node_id == node_a.pk and lost.data["instances"] == ["chat#0", "chat#1"]
    replaced = events(Kind.REPLACED)
    assert [e.instance_id for e in replaced] == [i.pk for i in old]
    assert not AuditLog.objects.filter(action="node_lost").exists()  # no one asked for it

    sent.clear()
    reconcile.reconcile_all()
    assert sent == [] and len(events(Kind.NODE_LOST)) == 1  # declared once


def test_a_node_whose_heartbeat_is_recent_enough_is_not_lost(sent, node_a, deployment, settings):
    serving_on(node_a, deployment)
    Node.objects.filter(pk=node_a.pk).update(
        last_heartbeat=timezone.now() - timedelta(seconds=settings.NODE_LOST_SECONDS - 5))
    reconcile.reconcile_all()
    assert Node.objects.get(pk=node_a.pk).lost_at is None
    assert {i.state for i in running(deployment)} == {State.READY}


def test_a_lost_node_whose_agent_beats_again_is_back_and_its_old_engines_stay_replaced(
    sent, node_a, deployment, settings
):
    old = serving_on(node_a, deployment)
    make_node("cpu-b")
    Node.objects.filter(pk=node_a.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    reconcile.reconcile_all()
    config = agent.AgentConfig(name="cpu-a", address="127.0.0.1", engine_env="", gpus="")
    agent.heartbeat(config)
    node = Node.objects.get(pk=node_a.pk)
    assert node.lost_at is None and node.state == "ready"
    assert len(events(Kind.NODE_BACK)) == 1
    # Its old instances are not taken back: they stay stopping, and a stop lost meanwhile is
    # sent again to the agent now that it is back.
    assert {Instance.objects.get(pk=i.pk).state for i in old} == {State.STOPPING}
    Instance.objects.filter(pk__in=[i.pk for i in old]).update(
        state_changed_at=timezone.now() - timedelta(hours=1))
    sent.clear()
    reconcile.reconcile_all()
    assert sorted(sent) == sorted((STOP, i.pk) for i in old)
    agent.heartbeat(config)
    assert len(events(Kind.NODE_BACK)) == 1


# -- cordon and drain -------------------------------------------------------------------------
def test_a_cordoned_node_takes_no_new_instance_and_keeps_what_runs(sent, node_a, deployment):
    serving_on(node_a, deployment)
    assert node_a.cordon() == {"cordoned": [False, True]}
    assert node_a.cordon() == {}
    deployment.scale_to(3)
    reconcile.reconcile_all()
    assert len(running(deployment)) == 2
    assert "no node agent is online" in Deployment.objects.get(pk=deployment.pk
                                                               ).placement_error.lower()
    node_a.uncordon()
    reconcile.reconcile_all()
    assert len(running(deployment)) == 3


def test_drain_moves_one_instance_at_a_time_stopping_each_once_its_replacement_is_ready(
    sent, node_a, deployment, in_flight
):
    first, second = serving_on(node_a, deployment)
    node_b = make_node("cpu-b")
    assert node_a.drain() == {"cordoned": [False, True], "draining": [False, True]}

    reconcile.reconcile_all()
    [successor] = Instance.objects.filter(replaces=first)
    assert (successor.node_id, successor.ordinal, successor.state) == (node_b.pk, 0,
                                                                         State.PENDING)
    assert (START, successor.pk) in sent
    reconcile.reconcile_all()  # one at a time: nothing else moves while it starts
    assert not Instance.objects.filter(replaces=second).exists()
    assert {Instance.objects.get(pk=i.pk).state for i in (first, second)} == {State.READY}
    assert "waiting for the replacement" in Node.objects.get(pk=node_a.pk).drain_status

    Instance.objects.filter(pk=successor.pk).update(state=State.READY)
    sent.clear()
    in_flight[first.pk] = 1
    reconcile.reconcile_all()
    # Out of routing first; stopped once its request in flight is done.
    assert Instance.objects.get(pk=first.pk).state == State.DRAINING and sent == []
    in_flight[first.pk] = 0
    reconcile.reconcile_all()
    assert Instance.objects.get(pk=first.pk).state == State.STOPPING
    assert Event.objects.filter(kind=Kind.DRAINED, instance=first).exists()
    # The next move began once the first left routing.
    [successor2] = Instance.objects.filter(replaces=second)
    assert sorted(sent) == sorted([(STOP, first.pk), (START, successor2.pk)])
    assert successor2.node_id == node_b.pk
    Instance.objects.filter(pk=successor2.pk).update(state=State.READY)
    reconcile.reconcile_all()
    assert Instance.objects.get(pk=second.pk).state == State.STOPPING
    reconcile.reconcile_all()
    assert Node.objects.get(pk=node_a.pk).drain_status == "Waiting for 2 instance(s) to stop."
    Instance.objects.filter(pk__in=[first.pk, second.pk]).update(state=State.STOPPED)
    reconcile.reconcile_all()

    node = Node.objects.get(pk=node_a.pk)
    assert (node.draining, node.cordoned, node.state) == (False, True, "cordoned")
    assert node.drain_status.startswith("Drained")
    assert [i.node_id for i in running(deployment)] == [node_b.pk, node_b.pk]
    assert len(events(Kind.DRAIN_STEP)) == 2 and len(events(Kind.DRAIN_DONE)) == 1
    assert [e.data["reason"] for e in events(Kind.REPLACED)] == ["drain", "drain"]
    assert [e.node_id for e in events(Kind.NODE_DRAIN)] == [node_a.pk]
    assert AuditLog.objects.filter(action="drain", object_id=str(node_a.pk)).count() == 1


def test_a_drain_without_room_elsewhere_waits_and_says_why(sent, node_a, deployment):
    first, _ = serving_on(node_a, deployment)
    make_node("cpu-b", max_instances=0)
    node_a.drain()
    reconcile.reconcile_all()
    node = Node.objects.get(pk=node_a.pk)
    assert node.drain_status.startswith("Waiting: no room elsewhere for chat#0: Every online node")
    assert node.draining
    assert not Instance.objects.filter(replaces=first).exists()
    assert {i.state for i in running(deployment)} == {State.READY}  # still serving
    assert Deployment.objects.get(pk=deployment.pk).placement_error == ""
    reconcile.reconcile_all()
    assert len(events(Kind.DRAIN_WAITING)) == 1  # said once, not every round


def test_a_drain_with_nowhere_to_go_is_refused(sent, node_a, deployment):
    serving_on(node_a, deployment)
    with pytest.raises(ValidationError, match="no other node is online and uncordoned"):
        node_a.drain()
    assert not Node.objects.get(pk=node_a.pk).cordoned


def test_a_drain_ends_when_the_node_is_uncordoned(sent, node_a, deployment):
    first, _ = serving_on(node_a, deployment)
    make_node("cpu-b")
    node_a.drain()
    Node.objects.filter(pk=node_a.pk).update(cordoned=False)  # an edit, not `uncordon`
    reconcile.reconcile_all()
    node = Node.objects.get(pk=node_a.pk)
    assert (node.draining, node.drain_status) == (False, "Ended: the node was uncordoned.")
    assert not Instance.objects.filter(replaces=first).exists()
