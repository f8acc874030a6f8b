"""Reconciler decisions, checked without workers: the node tasks are observed where they are
queued (`lifecycle.instance_task`, replaced by a recorder; the real queues are exercised end to
end in tests/engine)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving_app.deployments import draining, reconcile, rollout
from serving_app.models import Deployment, Instance, Node
from tests.factories import make_deployment, make_tenant

pytestmark = pytest.mark.django_db
State = Instance.State


@pytest.fixture
def node():
    return Node.objects.create(name="cpu-a", queue="node.cpu-a", last_heartbeat=timezone.now(),
                               max_instances=3)


@pytest.fixture
def deployment(base_model):
    return make_deployment(base_model, [make_tenant("acme")], name="chat",
                           desired_state=Deployment.DesiredState.RUNNING, replicas=2)


def active(deployment):
    return list(deployment.instances.exclude(state=State.STOPPED).order_by("ordinal"))


def test_missing_replicas_are_placed_and_started(sent, node, deployment):
    counts = reconcile.reconcile_deployment(deployment.pk)
    instances = active(deployment)
    assert counts["started"] == 2
    assert [(i.ordinal, i.node_id, i.state) for i in instances] == [
        (0, node.pk, State.PENDING), (1, node.pk, State.PENDING)]
    assert sorted(sent) == sorted(("serving.start_instance", i.pk) for i in instances)
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == [] and len(active(deployment)) == 2  # converged: nothing more to do


def test_nothing_is_half_placed_when_capacity_is_short(sent, node, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(replicas=5)
    reconcile.reconcile_deployment(deployment.pk)
    deployment.refresh_from_db()
    assert active(deployment) == [] and sent == []
    assert deployment.placement_error


def test_no_node_online_is_explained(sent, deployment):
    Node.objects.create(name="gone", queue="node.gone",
                        last_heartbeat=timezone.now() - timedelta(minutes=5))
    reconcile.reconcile_deployment(deployment.pk)
    deployment.refresh_from_db()
    assert "no node" in deployment.placement_error.lower()


def test_lost_and_cordoned_nodes_get_no_instances(sent, node, deployment):
    Node.objects.create(name="stale", queue="node.stale", max_instances=9,
                        last_heartbeat=timezone.now() - timedelta(minutes=5))
    Node.objects.create(name="cordoned", queue="node.cordoned", cordoned=True, max_instances=9,
                        last_heartbeat=timezone.now())
    reconcile.reconcile_deployment(deployment.pk)
    assert [i.node.name for i in active(deployment)] == ["cpu-a", "cpu-a"]


def test_scale_down_drains_the_highest_ordinals_then_stops_them(sent, node, deployment,
                                                                 monkeypatch):
    reconcile.reconcile_deployment(deployment.pk)
    Instance.objects.filter(deployment=deployment).update(state=State.READY, pid=12345)
    deployment.scale_to(1)
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    states = {i.ordinal: i.state for i in deployment.instances.all()}
    assert states == {0: State.READY, 1: State.DRAINING}
    assert sent == []  # out of routing first; stopped once its requests are done
    monkeypatch.setattr(draining.inflight, "counts", lambda ids: dict.fromkeys(ids, 0))
    Instance.objects.filter(state=State.DRAINING).update(
        state_changed_at=timezone.now() - timedelta(seconds=draining.grace_seconds()))
    reconcile.reconcile_deployment(deployment.pk)
    states = {i.ordinal: i.state for i in deployment.instances.all()}
    assert states == {0: State.READY, 1: State.STOPPING}
    assert [task for task, _ in sent] == ["serving.stop_instance"]


def test_stop_drains_what_serves_and_pending_without_process_stops_at_once(sent, node,
                                                                           deployment):
    reconcile.reconcile_deployment(deployment.pk)
    first, second = active(deployment)
    Instance.objects.filter(pk=first.pk).update(state=State.READY, pid=4242)
    deployment.stop()
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert Instance.objects.get(pk=first.pk).state == State.DRAINING
    assert Instance.objects.get(pk=second.pk).state == State.STOPPED
    assert sent == []


def test_restart_replaces_the_old_generation_one_by_one(sent, node, deployment):
    reconcile.reconcile_deployment(deployment.pk)
    Instance.objects.filter(deployment=deployment).update(state=State.READY, pid=1)
    deployment.restart()
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    # One new instance beside the old ones (the node takes three); nothing leaves routing yet.
    old = deployment.instances.filter(generation=0)
    assert {i.state for i in old} == {State.READY}
    [new] = deployment.instances.filter(generation=1)
    assert new.state == State.PENDING and sent == [("serving.start_instance", new.pk)]
    Instance.objects.filter(pk=new.pk).update(state=State.READY, pid=2)
    reconcile.reconcile_deployment(deployment.pk)
    assert sorted(i.state for i in old.all()) == [State.DRAINING, State.READY]


def test_failed_instance_restarts_after_exponential_backoff(sent, node, deployment, settings):
    settings.RESTART_BACKOFF_SECONDS = 2
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconcile.reconcile_deployment(deployment.pk)
    [instance] = active(deployment)
    history = [(timezone.now() - timedelta(seconds=s)).isoformat() for s in (30, 20)]
    Instance.objects.filter(pk=instance.pk).update(state=State.FAILED, restart_history=history)
    sent.clear()
    before = timezone.now()
    reconcile.reconcile_deployment(deployment.pk)
    after = timezone.now()
    instance.refresh_from_db()
    assert instance.state == State.FAILED and sent == []
    backoff = timedelta(seconds=8)  # 2 s x 2^2 for the third restart in the window
    assert before + backoff <= instance.next_restart_at <= after + backoff
    Instance.objects.filter(pk=instance.pk).update(next_restart_at=timezone.now())
    reconcile.reconcile_deployment(deployment.pk)
    instance.refresh_from_db()
    assert (instance.state, instance.restarts, len(instance.restart_history)) == (
        State.PENDING, 1, 3)
    assert sent == [("serving.start_instance", instance.pk)]


def test_backoff_is_capped_at_five_minutes(settings):
    settings.RESTART_BACKOFF_SECONDS = 2
    settings.RESTART_BACKOFF_MAX_SECONDS = 300
    assert [reconcile.backoff_seconds(n) for n in (0, 1, 2, 7, 8, 20)] == [2, 4, 8, 256, 300, 300]


def test_too_many_restarts_in_the_window_is_a_crash_loop(sent, node, deployment, settings):
    settings.CRASH_LOOP_RESTARTS = 3
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconcile.reconcile_deployment(deployment.pk)
    [instance] = active(deployment)
    recent = [(timezone.now() - timedelta(seconds=s)).isoformat() for s in (50, 40, 30)]
    Instance.objects.filter(pk=instance.pk).update(
        state=State.FAILED, restart_history=recent, last_error="The engine exited (code 1).")
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    instance.refresh_from_db()
    assert instance.state == State.CRASH_LOOP
    assert "3 restarts" in instance.last_error and "exited (code 1)" in instance.last_error
    assert sent == []


def test_old_restarts_outside_the_window_do_not_count(sent, node, deployment, settings):
    settings.CRASH_LOOP_RESTARTS = 2
    settings.RESTART_BACKOFF_SECONDS = 0
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconcile.reconcile_deployment(deployment.pk)
    [instance] = active(deployment)
    old = [(timezone.now() - timedelta(hours=s)).isoformat() for s in (3, 2)]
    Instance.objects.filter(pk=instance.pk).update(state=State.FAILED, restart_history=old)
    reconcile.reconcile_deployment(deployment.pk)
    assert Instance.objects.get(pk=instance.pk).state == State.PENDING


def test_adapter_changes_ask_ready_instances_to_sync(sent, node, deployment, tmp_path):
    from tests.factories import make_adapter

    reconcile.reconcile_deployment(deployment.pk)
    Instance.objects.filter(deployment=deployment).update(state=State.READY, pid=1)
    adapter = make_adapter(deployment.tenants.get(), deployment.base_model, tmp_path)
    deployment.adapters.add(adapter)
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert sorted(task for task, _ in sent) == ["serving.sync_adapters", "serving.sync_adapters"]
    Instance.objects.filter(deployment=deployment).update(adapter_errors={
        adapter.engine_name: "HTTP 400"})
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == []  # a failed load is not retried every round


def age(instance: Instance, seconds: float) -> None:
    """Make the instance look `seconds` into its current state."""
    Instance.objects.filter(pk=instance.pk).update(
        state_changed_at=timezone.now() - timedelta(seconds=seconds))


def test_a_stop_lost_with_the_broker_is_sent_again_once_per_period(sent, node, deployment,
                                                                   settings, monkeypatch):
    """A stop task lost with the broker would leave the instance stopping for ever: past the
    longest a stop can take, the reconciler sends it again (the agent's stop is idempotent)."""
    monkeypatch.setattr(draining.inflight, "counts", lambda ids: dict.fromkeys(ids, 0))
    monkeypatch.setattr(draining, "grace_seconds", lambda: 0.0)
    reconcile.reconcile_deployment(deployment.pk)
    Instance.objects.filter(deployment=deployment).update(state=State.READY, pid=4242)
    deployment.scale_to(1)
    reconcile.reconcile_deployment(deployment.pk)  # out of routing
    reconcile.reconcile_deployment(deployment.pk)  # nothing in flight: stopping
    stopping = deployment.instances.get(state=State.STOPPING)
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == []  # a stop in flight is not sent twice
    age(stopping, settings.ENGINE_STOP_GRACE_SECONDS + rollout.REDISPATCH_MARGIN_SECONDS + 1)
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == [("serving.stop_instance", stopping.pk)]
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == [("serving.stop_instance", stopping.pk)]  # the next one a period later
    # Also when the whole deployment is being stopped.
    deployment.stop()
    age(stopping, settings.ENGINE_STOP_GRACE_SECONDS + rollout.REDISPATCH_MARGIN_SECONDS + 1)
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert ("serving.stop_instance", stopping.pk) in sent


def test_a_start_that_lasts_past_its_timeout_is_sent_again(sent, node, deployment, settings):
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconcile.reconcile_deployment(deployment.pk)
    [instance] = active(deployment)
    Instance.objects.filter(pk=instance.pk).update(state=State.STARTING)
    age(instance, settings.ENGINE_START_TIMEOUT_SECONDS - 5)
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == []
    age(instance, settings.ENGINE_START_TIMEOUT_SECONDS + rollout.REDISPATCH_MARGIN_SECONDS + 1)
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == [("serving.start_instance", instance.pk)]
    assert active(deployment) == [Instance.objects.get(pk=instance.pk)]  # no second instance


def test_a_staging_start_is_sent_again_only_when_its_fetch_stopped_moving(sent, node,
                                                                          deployment):
    """A fetch of large files goes on for longer than any start timeout: while it reports
    progress its task is alive; a minute-scale silence means its agent died with it (a start
    sent again resumes the fetch from what the cache holds)."""
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconcile.reconcile_deployment(deployment.pk)
    [instance] = active(deployment)
    long_ago = rollout.STAGING_REDISPATCH_SECONDS + 1
    Instance.objects.filter(pk=instance.pk).update(state=State.STAGING, staging={
        "artifact": "llama v1", "bytes_done": 10, "bytes_total": 100,
        "updated": timezone.now().isoformat()})
    age(instance, long_ago)
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == []  # it moved just now
    Instance.objects.filter(pk=instance.pk).update(staging={
        "artifact": "llama v1", "bytes_done": 10, "bytes_total": 100,
        "updated": (timezone.now() - timedelta(seconds=long_ago)).isoformat()})
    reconcile.reconcile_deployment(deployment.pk)
    assert sent == [("serving.start_instance", instance.pk)]
    assert active(deployment) == [Instance.objects.get(pk=instance.pk)]  # no second instance


def test_nothing_is_sent_again_to_a_lost_node(sent, node, deployment, settings):
    reconcile.reconcile_deployment(deployment.pk)
    Instance.objects.filter(deployment=deployment).update(state=State.STOPPING, pid=4242)
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    for instance in active(deployment):
        age(instance, 3600)
    sent.clear()
    reconcile.reconcile_deployment(deployment.pk)
    assert [task for task, _ in sent if task == "serving.stop_instance"] == []
