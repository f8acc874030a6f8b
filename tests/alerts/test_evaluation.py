"""The evaluator against data stored as the console stores it (GPU samples, usage rolled up by
the real writer), round by round at chosen times: pending, firing after `for`, hysteresis,
resolution, no data, one transition and one notification per channel each time."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
import redis
from django.core.exceptions import ValidationError
from django.utils import timezone

from alerts_app.evaluate import evaluate
from alerts_app.models import Alert, AlertRule, AlertTransition, Channel, Notification, Silence
from gateway_app.catalog import InstanceEntry
from gateway_app.writer import persist
from serving_app.deployments import inflight, sharing
from serving_app.models import Instance, Node
from serving_app.models.revisions import Rollout
from tests.alerts.conftest import default_rules_migration, gpu_sample, make_rule, traffic
from tests.factories import make_engine_sample
from tests.gateway.conftest import REDIS_URL
from tests.gateway.test_flow_units import Engine, run
from tests.gateway.test_flow_units import tenant as flow_tenant

pytestmark = pytest.mark.django_db
State = Alert.State


def gpu_rule(**fields) -> AlertRule:
    return make_rule(**{"metric": "gpu_utilization", "scope": "node", "comparison": ">",
                        "threshold": 90, "recovery_threshold": 80, "window_seconds": 20,
                        "for_seconds": 30, "severity": "critical", **fields})


def test_gpu_rule_goes_pending_fires_after_for_holds_in_the_band_and_resolves(gpu,
                                                                           platform_hook):
    rule = gpu_rule()
    t0 = timezone.now()

    def round_at(seconds: int, utilization: float) -> Alert | None:
        at = t0 + timedelta(seconds=seconds)
        gpu_sample(gpu, at, utilization)
        evaluate(now=at)
        return Alert.objects.filter(rule=rule).first()

    # The 20-second window's mean: 50, 72.5, 80.7, then 96.3 (above 90) from 30 s on.
    for seconds, utilization in ((0, 50), (10, 95), (20, 97)):
        assert round_at(seconds, utilization) is None  # ok alerts are not stored
    alert = round_at(30, 97)
    assert alert.state == State.PENDING and alert.pending_since is not None
    pending_since = alert.pending_since
    assert round_at(40, 97).state == State.PENDING
    assert round_at(50, 97).state == State.PENDING
    alert = round_at(60, 97)
    assert alert.state == State.FIRING  # 30 s after it went pending
    assert (alert.fired_at - pending_since).total_seconds() >= rule.for_seconds
    assert alert.values and alert.values[-1][1] == pytest.approx(97)
    # Means 93, 89, 85: under the threshold but above the recovery threshold: still firing.
    for seconds in (70, 80, 90):
        assert round_at(seconds, 85).state == State.FIRING
    alert = round_at(100, 50)  # mean 73.3: under 80
    assert alert.state == State.OK and alert.resolved_at is not None

    kinds = list(AlertTransition.objects.order_by("at").values_list("kind", flat=True))
    assert kinds == ["firing", "resolved"]
    sent = Notification.objects.filter(channel=platform_hook).order_by("created_at")
    assert [n.kind for n in sent] == ["firing", "resolved"]
    firing = sent[0].payload
    assert firing["rule"]["id"] == rule.pk and firing["alert"]["scope"] == "node gpu-a"
    assert firing["value"] > 90 and firing["threshold"] == 90 and firing["values"]


def test_no_samples_is_no_data_and_a_firing_alert_says_so(gpu, platform_hook):
    rule = gpu_rule(for_seconds=0)
    t0 = timezone.now()
    evaluate(now=t0)
    alert = Alert.objects.get(rule=rule)
    assert alert.state == State.NO_DATA and alert.value is None  # a GPU node without samples
    gpu_sample(gpu, t0 + timedelta(seconds=5), 99)
    evaluate(now=t0 + timedelta(seconds=10))
    assert Alert.objects.get(rule=rule).state == State.FIRING
    evaluate(now=t0 + timedelta(seconds=60))  # the sample left the 20 s window
    alert = Alert.objects.get(rule=rule)
    assert alert.state == State.NO_DATA
    assert [n.kind for n in Notification.objects.order_by("pk")] == ["firing", "no_data"]


def test_a_round_repeated_at_the_same_time_changes_nothing(gpu, platform_hook):
    gpu_rule(for_seconds=0)
    at = timezone.now()
    gpu_sample(gpu, at, 99)
    evaluate(now=at)
    evaluate(now=at)
    evaluate(now=at + timedelta(seconds=1))
    assert AlertTransition.objects.count() == 1 and Notification.objects.count() == 1


def test_failure_rate_per_deployment_counts_5xx_not_429_or_other_4xx(served, platform_hook):
    acme, globex, deployment = served
    rule = make_rule(metric="error_rate", scope="deployment", threshold=5, window_seconds=60,
                     min_requests=10)
    now = timezone.now()
    traffic(acme, now - timedelta(seconds=20), n=90, deployment=deployment.pk)
    traffic(acme, now - timedelta(seconds=15), n=8, status=429, deployment=deployment.pk)
    traffic(globex, now - timedelta(seconds=10), n=8, status=400, deployment=deployment.pk)
    traffic(globex, now - timedelta(seconds=5), n=4, status=502, deployment=deployment.pk)
    evaluate(now=now)  # 4 of 110 failed on the serving side: 3.6%
    assert not Alert.objects.filter(rule=rule).exists()
    traffic(acme, now - timedelta(seconds=3), n=10, status=503, deployment=deployment.pk)
    evaluate(now=now + timedelta(seconds=1))
    alert = Alert.objects.get(rule=rule)
    assert alert.scope_key == f"deployment:{deployment.pk}" and alert.tenant is None
    assert alert.value == pytest.approx(100 * 14 / 120) and alert.state == State.FIRING


def test_latency_percentile_crosses_a_threshold_between_the_old_bucket_edges(served):
    acme, _, deployment = served
    rule = make_rule(metric="latency", scope="deployment", threshold=640, percentile=95,
                     window_seconds=60)
    now = timezone.now()
    traffic(acme, now - timedelta(seconds=30), n=90, latency=550, deployment=deployment.pk)
    traffic(acme, now - timedelta(seconds=30), n=4, latency=650, deployment=deployment.pk)
    # Refused before routing: not part of the deployment's latency.
    traffic(acme, now - timedelta(seconds=30), n=50, latency=1, status=429)
    evaluate(now=now)
    assert not Alert.objects.filter(rule=rule).exists()  # p95 629 ms, in 500..630: below 640
    traffic(acme, now - timedelta(seconds=20), n=6, latency=650, deployment=deployment.pk)
    evaluate(now=now + timedelta(seconds=1))
    alert = Alert.objects.get(rule=rule)
    assert alert.state == State.FIRING and 630 < alert.value <= 800


def test_tenant_objective_rule_judges_each_tenant_against_its_own_objective(served):
    acme, globex, deployment = served  # acme: 300 ms objective; globex: none
    rule = AlertRule.objects.get(key="latency-objective")
    AlertRule.objects.filter(pk=rule.pk).update(for_seconds=0, min_requests=1)
    now = timezone.now()
    traffic(acme, now - timedelta(seconds=30), n=20, latency=450, deployment=deployment.pk)
    traffic(globex, now - timedelta(seconds=30), n=20, latency=5000, deployment=deployment.pk)
    evaluate(now=now)
    (alert,) = Alert.objects.filter(rule=rule)
    assert alert.tenant == acme and alert.threshold == 300 and alert.state == State.FIRING


def test_budget_rules_fire_at_80_and_100_percent(served):
    acme, _, deployment = served  # budget 1000 tokens; each request counts 15
    now = timezone.now()
    traffic(acme, now - timedelta(minutes=5), n=54, deployment=deployment.pk)  # 810 tokens
    evaluate(now=now)
    firing = {a.rule.key for a in Alert.objects.filter(state=State.FIRING)}
    assert firing == {"budget-80"}
    traffic(acme, now - timedelta(minutes=4), n=13, deployment=deployment.pk)  # 1005
    evaluate(now=now + timedelta(seconds=1))
    firing = {a.rule.key for a in Alert.objects.filter(state=State.FIRING)}
    assert firing == {"budget-80", "budget-100"}
    assert Alert.objects.get(rule__key="budget-100").tenant == acme


def test_notifications_are_routed_to_the_tenant_concerned_and_the_platform(served, receiver,
                                                                           platform_hook):
    acme, globex, deployment = served
    acme_hook = Channel.objects.create(tenant=acme, name="acme", kind="webhook",
                                       url="https://hooks.example.com/acme", min_severity="info")
    globex_hook = Channel.objects.create(tenant=globex, name="globex", kind="webhook",
                                         url="https://hooks.example.com/globex")
    quiet = Channel.objects.create(name="pager", kind="webhook", url="https://pager.example.com",
                                   min_severity="critical")
    own = make_rule(tenant=acme, metric="rate_limited", scope="tenant", threshold=10)
    now = timezone.now()
    traffic(acme, now - timedelta(seconds=10), n=10, status=429)
    traffic(acme, now - timedelta(minutes=5), n=54, deployment=deployment.pk)
    evaluate(now=now)
    by_channel = {}
    for n in Notification.objects.select_related("transition__alert__rule"):
        by_channel.setdefault(n.channel_id, set()).add(n.transition.alert.rule.key or "own")
    # The tenant's own rule reaches only its channel; the platform's budget rule about it
    # reaches the platform's channels (by severity) and the tenant's; never another tenant's.
    assert by_channel[acme_hook.pk] == {"own", "budget-80"}
    assert by_channel[platform_hook.pk] == {"budget-80"}
    assert globex_hook.pk not in by_channel and quiet.pk not in by_channel
    assert Alert.objects.get(rule=own).tenant == acme


def test_an_active_silence_turns_the_notification_into_a_silenced_log_entry(gpu,
                                                                          platform_hook):
    rule = gpu_rule(for_seconds=0)
    now = timezone.now()
    Silence.objects.create(rule=rule, starts_at=now - timedelta(minutes=1),
                           ends_at=now + timedelta(hours=1), reason="maintenance")
    Silence.objects.create(ends_at=now - timedelta(seconds=1), starts_at=now - timedelta(hours=1),
                           reason="over")
    gpu_sample(gpu, now, 99)
    evaluate(now=now)
    (notification,) = Notification.objects.all()
    assert notification.state == Notification.State.SILENCED


def test_an_alert_whose_deployment_is_deleted_resolves(served, platform_hook):
    acme, _, deployment = served
    rule = make_rule(metric="error_rate", scope="deployment", threshold=5, window_seconds=60)
    now = timezone.now()
    traffic(acme, now - timedelta(seconds=5), n=10, status=500, deployment=deployment.pk)
    evaluate(now=now)
    assert Alert.objects.get(rule=rule).state == State.FIRING
    deployment.delete()
    evaluate(now=now + timedelta(seconds=1))
    assert Alert.objects.get(rule=rule).state == State.OK
    assert [n.kind for n in Notification.objects.order_by("pk")] == ["firing", "resolved"]


def test_enqueues_each_notification_after_the_round_commits(gpu, platform_hook,
                                                          django_capture_on_commit_callbacks):
    gpu_rule(for_seconds=0)
    gpu_sample(gpu, timezone.now(), 99)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        evaluate()
        assert Notification.objects.filter(state="pending").count() == 1
    assert len(callbacks) == 1


def test_the_default_rules_are_valid_rules(db):
    """What the data migration creates passes the same validation as any rule."""
    for fields in default_rules_migration().DEFAULTS:
        AlertRule(**fields).full_clean(validate_unique=False)
    assert {f["key"] for f in default_rules_migration().DEFAULTS} == {
        "gpu-utilization", "latency", "failure-rate", "latency-objective", "budget-80",
        "budget-100"}


def test_engine_queue_depth_adds_up_and_kv_cache_is_the_fullest_engines(served, platform_hook):
    """From the engines' own /metrics samples (EngineSample, as the node agents store them)."""
    _, _, deployment = served
    node = Node.objects.create(name="cpu-a", queue="node.cpu-a", last_heartbeat=timezone.now())
    engines = [Instance.objects.create(deployment=deployment, node=node, ordinal=i,
                                       state="ready") for i in range(2)]
    queue = make_rule(metric="engine_queue", scope="deployment", threshold=10,
                      window_seconds=30)
    kv = make_rule(metric="kv_cache", scope="node", threshold=90, window_seconds=30)
    now = timezone.now()
    for seconds in (20, 10):
        make_engine_sample(engines[0], now - timedelta(seconds=seconds), requests_waiting=6,
                           kv_cache_usage=0.95)
        make_engine_sample(engines[1], now - timedelta(seconds=seconds), requests_waiting=5,
                           kv_cache_usage=0.40)
    make_engine_sample(engines[0], now - timedelta(minutes=5), requests_waiting=100)  # old
    evaluate(now=now)
    waiting = Alert.objects.get(rule=queue)
    assert waiting.scope_key == f"deployment:{deployment.pk}" and waiting.value == 11
    assert waiting.state == State.FIRING
    full = Alert.objects.get(rule=kv)
    assert full.scope_label == "node cpu-a" and full.value == pytest.approx(95)
    evaluate(now=now + timedelta(minutes=2))  # no samples in the window any more
    assert Alert.objects.get(rule=queue).state == State.NO_DATA


def test_a_disabled_rules_alerts_end_without_a_notification(gpu, platform_hook):
    rule = gpu_rule(for_seconds=0)
    now = timezone.now()
    gpu_sample(gpu, now, 99)
    evaluate(now=now)
    assert Alert.objects.get(rule=rule).state == State.FIRING
    AlertRule.objects.filter(pk=rule.pk).update(enabled=False)
    evaluate(now=now + timedelta(seconds=1))
    assert Alert.objects.get(rule=rule).state == State.OK
    assert [n.kind for n in Notification.objects.all()] == ["firing"]


def test_gateway_queue_wait_is_the_mean_wait_through_the_gateways_queue(served, settings):
    """From the counters the gateway's own flow-control scripts keep in Redis (driven here on
    real Redis as a gateway worker drives them): requests dispatched with their waits, and a
    waiter that left the queue with the time it had waited."""
    acme, globex, deployment = served
    settings.GATEWAY = {**settings.GATEWAY, "REDIS_URL": REDIS_URL, "FLOW_CONTROL": True}
    deployment.flow_control = True
    deployment.save(update_fields=["flow_control"])
    instance = Instance.objects.create(deployment=deployment, ordinal=0, state="ready")
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(sharing.prefix(deployment.pk) + "*"):
        client.delete(key)
    client.delete(inflight.key(instance.pk))
    client.close()
    rule = make_rule(metric="gateway_queue_wait", scope="tenant", threshold=50,
                     window_seconds=60)
    per_deployment = make_rule(metric="gateway_queue_wait", scope="deployment", threshold=50,
                               window_seconds=60)

    async def scenario(meter):
        engine = Engine(meter, 1)
        engine.deployment = deployment.pk
        engine.instances = [InstanceEntry(instance.pk, deployment.pk, "", "", frozenset(), 1)]
        a = dataclasses.replace(flow_tenant(), id=acme.pk)
        g = dataclasses.replace(flow_tenant(), id=globex.pk)
        await engine.send(a)  # dispatched at once
        waiting = await engine.send(a)
        gone = await engine.send(g)
        await asyncio.sleep(0.3)
        assert await meter.flow.leave(gone, engine.slots[gone]) == 0  # left after 0.3 s
        engine.futures.pop(gone)
        await asyncio.sleep(0.3)
        await engine.finish()  # `waiting` gets the slot after 0.6 s
        assert engine.running == [waiting]
        await engine.finish()

    run(scenario)
    now = timezone.now()
    evaluate(now=now)
    acme_wait = Alert.objects.get(rule=rule, scope_key=f"tenant:{acme.pk}")
    # Two requests dispatched: one at once, one after about 600 ms.
    assert acme_wait.state == State.FIRING and 300 <= acme_wait.value < 3000
    globex_wait = Alert.objects.get(rule=rule, scope_key=f"tenant:{globex.pk}")
    assert globex_wait.state == State.FIRING and 300 <= globex_wait.value < 3000
    overall = Alert.objects.get(rule=per_deployment)
    assert overall.value == pytest.approx((2 * acme_wait.value + globex_wait.value) / 3)
    # Minutes later the window holds no request through the queue: no data.
    evaluate(now=now + timedelta(minutes=3))
    assert Alert.objects.get(rule=per_deployment).state == State.NO_DATA


def test_gateway_queue_wait_rules_are_refused_past_what_the_gateway_keeps(db):
    with pytest.raises(ValidationError) as refused:
        make_rule(metric="gateway_queue_wait", scope="cluster", threshold=100,
                  window_seconds=3 * 3600)
    assert "window_seconds" in refused.value.message_dict


def test_a_failed_rollout_fires_until_a_later_rollout_or_rollback(served, platform_hook):
    _, _, deployment = served
    rule = make_rule(metric="rollout_failed", scope="deployment", threshold=0)
    cluster = make_rule(metric="rollout_failed", scope="cluster", threshold=0)
    revision = deployment.applied_revision
    Rollout.objects.create(deployment=deployment, to_revision=revision,
                           state=Rollout.State.SUCCEEDED)
    evaluate()
    assert not Alert.objects.filter(rule__in=[rule, cluster]).exists()
    Rollout.objects.create(deployment=deployment, to_revision=revision,
                           state=Rollout.State.FAILED, reason="instance 3 never became ready")
    evaluate()
    failed = Alert.objects.get(rule=rule)
    assert failed.state == State.FIRING and failed.scope_label == "deployment llama"
    assert Alert.objects.get(rule=cluster).value == 1
    Rollout.objects.create(deployment=deployment, to_revision=revision,
                           state=Rollout.State.ROLLED_BACK)
    evaluate()
    assert Alert.objects.get(rule=rule).state == State.OK
    kinds = list(AlertTransition.objects.filter(alert__rule=rule)
                 .order_by("at").values_list("kind", flat=True))
    assert kinds == ["firing", "resolved"]


def test_blocked_requests_per_tenant_fire_a_rule(acme, globex, platform_hook):
    """"More than 3 requests blocked by guardrails in 5 minutes", per tenant: the tenant whose
    requests were blocked fires, the other reads 0 (a count, not "no data"); a tenant's own
    rule sees its own blocks only; blocks older than the window do not count."""
    rule = make_rule(metric="guardrail_blocked", scope="tenant", comparison=">", threshold=3,
                     window_seconds=300, for_seconds=0)
    own = make_rule(metric="guardrail_blocked", scope="tenant", comparison=">", threshold=0,
                    window_seconds=300, for_seconds=0, tenant=globex.tenant)
    now = timezone.now()

    def blocked(tenant, at, n: int) -> None:
        persist([{"id": f"g-{next(_block_ids)}", "at": at.timestamp(), "tenant": tenant.pk,
                  "endpoint": "chat.completions", "model": "llama", "status": 400,
                  "error": "guardrail_blocked", "guardrails": {"input:block:ID_NUMBER": 1,
                                                               "input:redact:PHONE": 2}}
                 for _ in range(n)])

    blocked(acme.tenant, now - timedelta(minutes=20), 10)  # outside the window
    blocked(acme.tenant, now - timedelta(minutes=1), 3)
    evaluate(now=now)
    assert not Alert.objects.filter(rule=rule, state=State.FIRING).exists()
    blocked(acme.tenant, now, 1)
    evaluate(now=now + timedelta(seconds=10))
    firing = Alert.objects.get(rule=rule, state=State.FIRING)
    assert firing.scope_label == "tenant acme" and firing.value == 4
    assert not Alert.objects.filter(rule=own).exclude(state=State.OK).exists()
    blocked(globex.tenant, now, 1)
    evaluate(now=now + timedelta(seconds=20))
    assert Alert.objects.get(rule=own).state == State.FIRING
    assert Alert.objects.get(rule=own).scope_label == "tenant globex"


_block_ids = iter(range(1, 10**9))
