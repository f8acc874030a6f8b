"""Autoscaling decisions from stored engine samples (serving_app/deployments/autoscaling.py), round
by round as the control worker's beat runs them, against PostgreSQL: windows, cooldowns, the range,
no data, scale to zero and the wake, and the event each change records."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import redis
from django.core.exceptions import ValidationError
from django.utils import timezone

from serving_app.deployments import autoscaling
from serving_app.models import Deployment, Instance, Node
from serving_app.models.autoscalers import Autoscaler, Metric
from serving_app.models.events import Event, Kind
from tests.factories import make_deployment, make_engine_sample, make_tenant

pytestmark = pytest.mark.django_db

INTERVAL = 10.0


@pytest.fixture(autouse=True)
def _interval(settings):
    settings.ENGINE_METRICS_INTERVAL_SECONDS = INTERVAL


@pytest.fixture
def world(base_model):
    node = Node.objects.create(name="cpu-1", queue="node.cpu-1")
    deployment = make_deployment(base_model, [make_tenant("acme")], name="chat",
                                 desired_state="running", replicas=1)
    return deployment, node


def ready(deployment: Deployment, node: Node, n: int) -> list[Instance]:
    return [Instance.objects.create(deployment=deployment, node=node, port=9000 + i, ordinal=i,
                                    state=Instance.State.READY) for i in range(n)]


def policy(deployment: Deployment, **fields) -> Autoscaler:
    defaults = {"enabled": True, "min_replicas": 1, "max_replicas": 3, "metric": Metric.WAITING,
                "target": 2.0, "up_window_seconds": 30, "down_window_seconds": 60,
                "up_cooldown_seconds": 60, "down_cooldown_seconds": 120}
    autoscaler = Autoscaler(deployment=deployment, **{**defaults, **fields})
    autoscaler.full_clean()
    autoscaler.save()
    return autoscaler


def round_at(autoscaler: Autoscaler, instances: list[Instance], at, generated: int = 5,
             **fields):
    """One beat: each instance's sample at `at`, then the autoscaler's evaluation."""
    for instance in instances:
        make_engine_sample(instance, at, interval_seconds=INTERVAL,
                           generation_tokens=generated, **fields)
    decision = autoscaling.evaluate(autoscaler.pk, now=at)
    autoscaler.refresh_from_db()
    instances[0].deployment.refresh_from_db()  # the test's own row
    return decision


def autoscale_entries(deployment: Deployment) -> list[Event]:
    return list(Event.objects.filter(kind=Kind.AUTOSCALE, deployment=deployment).order_by("id"))


def test_a_queue_held_over_the_up_window_scales_up_and_records_why(world):
    deployment, node = world
    instances = ready(deployment, node, 1)
    autoscaler = policy(deployment)
    t0 = timezone.now()
    # Six waiting on one instance, target two: three wanted; the up window (30 s) must be
    # covered by recommendations first.
    for step in (0, 10):
        decision = round_at(autoscaler, instances, t0 + timedelta(seconds=step),
                            requests_waiting=6)
        assert decision.recommendation == 3 and decision.replicas == 1
        assert "waiting for the up window" in autoscaler.last_decision
    decision = round_at(autoscaler, instances, t0 + timedelta(seconds=20), requests_waiting=6)
    assert decision.replicas == deployment.replicas == 3
    [entry] = autoscale_entries(deployment)
    assert entry.message.startswith("scaled up from 1 to 3: waiting requests averages 6.00")
    assert entry.data["replicas"] == [1, 3]
    assert entry.data["values"] == [6.0] and entry.data["target"] == 2.0
    assert "waiting requests averages 6.00" in entry.data["reason"]
    assert autoscaler.last_scaled_at == t0 + timedelta(seconds=20)
    assert autoscaler.last_decision.startswith("scaled up from 1 to 3")


def test_a_short_spike_does_not_scale_and_the_max_caps_the_count(world):
    deployment, node = world
    instances = ready(deployment, node, 1)
    autoscaler = policy(deployment, max_replicas=2)
    t0 = timezone.now()
    # The lull at 10 s is inside every 30-s window up to 40 s (its ends included).
    for step, waiting in ((0, 9), (10, 0), (20, 9), (30, 9), (40, 9)):
        round_at(autoscaler, instances, t0 + timedelta(seconds=step), requests_waiting=waiting)
        assert deployment.replicas == 1, step
    # Held over the whole window now (20 to 50 s): up, to the max (two), not to five.
    round_at(autoscaler, instances, t0 + timedelta(seconds=50), requests_waiting=9)
    assert deployment.replicas == 2
    assert autoscale_entries(deployment)[0].data["recommendation"] == 2


def test_an_idle_queue_scales_down_after_the_down_window_and_cooldowns_hold(world):
    deployment, node = world
    Deployment.objects.filter(pk=deployment.pk).update(replicas=2)
    instances = ready(deployment, node, 2)
    t0 = timezone.now()
    autoscaler = policy(deployment)
    Autoscaler.objects.filter(pk=autoscaler.pk).update(last_scaled_at=t0)
    autoscaler.refresh_from_db()
    for step in range(0, 70, 10):
        round_at(autoscaler, instances, t0 + timedelta(seconds=step), requests_waiting=0)
        assert deployment.replicas == 2, step
    # The window is covered at 60 s, but the down cooldown (120 s after the last change) holds.
    assert "in the down cooldown" in autoscaler.last_decision
    for step in range(70, 130, 10):
        round_at(autoscaler, instances, t0 + timedelta(seconds=step), requests_waiting=0)
    assert deployment.replicas == 1
    [entry] = autoscale_entries(deployment)
    assert entry.data["replicas"] == [2, 1]


def test_the_metric_at_its_target_within_the_tolerance_holds(world):
    deployment, node = world
    instances = ready(deployment, node, 2)
    Deployment.objects.filter(pk=deployment.pk).update(replicas=2)
    autoscaler = policy(deployment, metric=Metric.RUNNING, target=4.0, up_window_seconds=0,
                        down_window_seconds=0, up_cooldown_seconds=0, down_cooldown_seconds=0)
    t0 = timezone.now()
    # 4.3 per instance is within 10% of 4: hold. 5 is not: ceil(10 / 4) = 3.
    decision = round_at(autoscaler, instances, t0, requests_running=4, requests_waiting=0)
    assert decision.replicas == 2 and "at its target" in decision.reason
    decision = round_at(autoscaler, instances, t0 + timedelta(seconds=10), requests_running=5)
    assert decision.replicas == 3


def test_no_fresh_sample_or_an_instance_still_starting_means_no_decision(world):
    deployment, node = world
    instances = ready(deployment, node, 1)
    autoscaler = policy(deployment, up_window_seconds=0)
    t0 = timezone.now()
    make_engine_sample(instances[0], t0 - timedelta(seconds=60), requests_waiting=9)
    assert autoscaling.evaluate(autoscaler.pk, now=t0) is None
    autoscaler.refresh_from_db()
    assert "no fresh engine metric sample" in autoscaler.last_decision
    Instance.objects.create(deployment=deployment, node=node, port=9100, ordinal=5,
                            state=Instance.State.STARTING)
    assert round_at(autoscaler, instances, t0, requests_waiting=9) is None
    assert "1 instance(s) not ready yet" in autoscaler.last_decision
    assert deployment.replicas == 1 and autoscale_entries(deployment) == []


def test_a_count_outside_the_range_is_brought_into_it(world):
    deployment, node = world
    Deployment.objects.filter(pk=deployment.pk).update(replicas=5)
    autoscaler = policy(deployment, max_replicas=3)
    decision = autoscaling.evaluate(autoscaler.pk, now=timezone.now())
    deployment.refresh_from_db()
    assert decision.replicas == 3 and deployment.replicas == 3
    assert "outside the range 1-3" in autoscale_entries(deployment)[0].data["reason"]


def test_an_idle_deployment_scales_to_zero_and_a_request_wakes_it(world):
    deployment, node = world
    instances = ready(deployment, node, 1)
    autoscaler = policy(deployment, min_replicas=0, down_window_seconds=30,
                        down_cooldown_seconds=0)
    t0 = timezone.now()
    # Generating tokens with nothing waiting: one instance is still needed.
    for step in (0, 10, 20, 30):
        round_at(autoscaler, instances, t0 + timedelta(seconds=step), requests_waiting=0)
    assert deployment.replicas == 1
    # Nothing generated after 30 s: idle from 60 s (a whole down window without a token), and
    # zero once every recommendation of the down window says so.
    for step in (40, 50, 60, 70, 80):
        round_at(autoscaler, instances, t0 + timedelta(seconds=step), generated=0)
        assert deployment.replicas == 1, step
    round_at(autoscaler, instances, t0 + timedelta(seconds=90), generated=0)
    assert deployment.replicas == 0
    assert "nothing was generated over the down window" in \
        autoscale_entries(deployment)[-1].data["reason"]
    assert autoscaling.evaluate(autoscaler.pk, now=t0 + timedelta(seconds=100)) is None
    # The gateway's wake: back to one, once (a second wake finds it scaled).
    assert autoscaling.wake(deployment.pk) is True
    assert autoscaling.wake(deployment.pk) is False
    deployment.refresh_from_db()
    assert deployment.replicas == 1
    assert autoscale_entries(deployment)[-1].data["reason"] == \
        "a request arrived while at zero"


def test_disabled_or_stopped_deployments_are_left_alone(world):
    deployment, node = world
    instances = ready(deployment, node, 1)
    autoscaler = policy(deployment, enabled=False, up_window_seconds=0)
    assert round_at(autoscaler, instances, timezone.now(), requests_waiting=9) is None
    assert autoscaling.wake(deployment.pk) is False
    Autoscaler.objects.filter(pk=autoscaler.pk).update(enabled=True)
    Deployment.objects.filter(pk=deployment.pk).update(desired_state="stopped")
    assert round_at(autoscaler, instances, timezone.now(), requests_waiting=9) is None
    deployment.refresh_from_db()
    assert deployment.replicas == 1


@pytest.mark.parametrize(("fields", "field"), [
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ({"metric": Metric.KV_CACHE, "target": 1.5}, "target"),
    ({"max_replicas": 0}, "max_replicas"),
    ({"target": 0}, "target"),
])
def test_a_policy_that_cannot_work_is_refused_field_by_field(world, fields, field):
    deployment, _ = world
    with pytest.raises(ValidationError) as caught:
        policy(deployment, **fields)
    assert field in caught.value.message_dict
    assert not Autoscaler.objects.exists()


@pytest.fixture
def gateway_queue(settings):
    """Queues requests in the gateway's Redis as the flow-control tests drive it (tests/gateway),
    the control plane reading the same Redis; what it leaves there is removed afterwards (ids
    repeat across test databases)."""
    from serving_app.deployments import sharing
    from tests.gateway.conftest import REDIS_URL

    settings.GATEWAY = {**settings.GATEWAY, "REDIS_URL": REDIS_URL}
    client = redis.Redis.from_url(REDIS_URL)
    keys: list[str] = []

    def clear() -> None:
        for key in keys:
            for found in client.scan_iter(key):
                client.delete(found)

    def queue(deployment: Deployment, waiting: int, timeout: float = 30.0) -> None:
        """`waiting` requests of one tenant queued by the gateway's real admission script behind
        an instance whose dispatch budget (1) is taken: what flow control leaves in the
        gateway's queue while the engine's own queue stays empty."""
        from tests.gateway.test_flow_units import Engine, run, tenant

        async def scenario(meter):
            engine = Engine(meter, 1)
            engine.deployment = deployment.pk
            instance = engine.instances[0].id
            keys.extend([sharing.prefix(deployment.pk) + ":*", f"gw:{{i{instance}}}:*"])
            clear()
            entry = tenant()
            for _ in range(1 + waiting):
                await engine.send(entry)
            assert len(engine.running) == 1 and len(engine.futures) == waiting

        run(scenario, flow_queue_timeout=timeout)

    yield queue
    clear()
    client.close()


def test_requests_waiting_in_the_gateways_queue_count_as_waiting(world, gateway_queue):
    deployment, node = world
    instances = ready(deployment, node, 1)
    autoscaler = policy(deployment, up_window_seconds=0, up_cooldown_seconds=0)
    t0 = timezone.now()
    # The engine's own queue is empty (flow control keeps it within its allowance).
    decision = round_at(autoscaler, instances, t0, requests_waiting=0)
    assert decision.recommendation == 1 and decision.replicas == 1
    gateway_queue(deployment, 5)
    # Five waiting in the gateway, target two per instance: three instances.
    decision = round_at(autoscaler, instances, t0 + timedelta(seconds=10), requests_waiting=0)
    assert decision.recommendation == 3 and decision.replicas == 3
    entry = autoscale_entries(deployment)[-1]
    assert "5 of them waiting in the gateway's queue" in entry.message
    assert entry.data["gateway_queued"] == 5


def test_waiters_past_their_queue_deadline_are_not_counted(world, gateway_queue):
    deployment, node = world
    instances = ready(deployment, node, 1)
    autoscaler = policy(deployment, up_window_seconds=0, up_cooldown_seconds=0)
    # Left behind by a gateway that died: their deadline (0.2 s) passes.
    gateway_queue(deployment, 4, timeout=0.2)
    time.sleep(0.4)
    decision = round_at(autoscaler, instances, timezone.now(), requests_waiting=0)
    assert decision.recommendation == 1 and decision.replicas == 1
    assert "gateway's queue" not in autoscaler.last_decision


def test_an_unreadable_gateway_queue_leaves_the_engines_samples_to_decide(world, settings):
    deployment, node = world
    instances = ready(deployment, node, 1)
    autoscaler = policy(deployment, up_window_seconds=0, up_cooldown_seconds=0)
    settings.GATEWAY = {**settings.GATEWAY, "REDIS_URL": "redis://127.0.0.1:1/0"}  # nothing there
    decision = round_at(autoscaler, instances, timezone.now(), requests_waiting=6)
    assert decision.recommendation == 3 and decision.replicas == 3
    assert "could not be read" in autoscale_entries(deployment)[-1].message
