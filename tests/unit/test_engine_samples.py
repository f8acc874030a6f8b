"""Engine samples are rolled up per instance and hour, then pruned past their retention; the
beat task does both, rollup first, so no sample goes before its hour is rolled up."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from serving_app.models import Instance
from serving_app.models.engine_metrics import EngineHour, EngineSample, quantile_ms
from serving_app.tasks import roll_up_engine_samples
from tests.factories import make_deployment, make_engine_sample, make_tenant

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 3, 12, 30, tzinfo=UTC)


@pytest.fixture
def instances(base_model):
    deployment = make_deployment(base_model, [make_tenant("acme")], name="chat")
    return [Instance.objects.create(deployment=deployment, ordinal=n) for n in (0, 1)]


def sample(instance, at, *, running=0, waiting=0, kv=0.0, prompt=0, generation=0, ttft=(),
           adapters=(), seconds=10.0):
    return make_engine_sample(
        instance, at, interval_seconds=seconds, requests_running=running,
        requests_waiting=waiting, kv_cache_usage=kv, prompt_tokens=prompt,
        generation_tokens=generation, ttft_buckets=[list(b) for b in ttft],
        active_adapters=list(adapters),
    )


def test_finished_hours_are_rolled_up_per_instance(instances):
    first, second = instances
    ten = NOW.replace(hour=10, minute=0)
    sample(first, ten + timedelta(minutes=5), running=2, waiting=4, kv=0.2, prompt=100,
           generation=40, ttft=[(0.0, 0.1, 3)], adapters=["acme--style"])
    sample(first, ten + timedelta(minutes=50), running=4, waiting=0, kv=0.4, prompt=300,
           generation=60, ttft=[(0.0, 0.1, 1), (0.1, 0.25, 4)])
    sample(second, ten + timedelta(minutes=7), running=1, prompt=50)
    sample(first, ten + timedelta(hours=1, minutes=2), running=9)  # 11:02: a finished hour
    sample(first, NOW - timedelta(minutes=1), running=9)  # the current hour: not yet

    assert EngineHour.objects.roll_up(NOW) == 3
    hour = EngineHour.objects.get(instance=first, bucket=ten)
    assert (hour.samples, hour.seconds) == (2, 20.0)
    assert (hour.requests_running_mean, hour.requests_running_max) == (3.0, 4.0)
    assert (hour.requests_waiting_mean, hour.requests_waiting_max) == (2.0, 4.0)
    assert hour.kv_cache_usage_mean == pytest.approx(0.3)
    assert (hour.prompt_tokens, hour.generation_tokens) == (400, 100)
    assert hour.ttft_buckets == [[0.0, 0.1, 4], [0.1, 0.25, 4]]
    assert quantile_ms(hour.ttft_buckets, 0.5) == pytest.approx(100.0)
    assert hour.adapter_samples == {"acme--style": 1}
    assert EngineHour.objects.get(instance=second, bucket=ten).prompt_tokens == 50
    assert EngineHour.objects.filter(bucket=NOW.replace(minute=0)).count() == 0


def test_rolling_up_again_changes_nothing_and_the_next_hour_follows(instances):
    first = instances[0]
    ten = NOW.replace(hour=10, minute=0)
    sample(first, ten + timedelta(minutes=5), prompt=100)
    assert EngineHour.objects.roll_up(NOW) == 1
    assert EngineHour.objects.roll_up(NOW) == 0  # nothing finished since
    before = list(EngineHour.objects.values())
    sample(first, NOW + timedelta(minutes=10), prompt=7)  # 12:40
    assert EngineHour.objects.roll_up(NOW + timedelta(hours=1)) == 1  # 13:30: 12:00 finished
    assert list(EngineHour.objects.filter(bucket=ten).values()) == before
    assert EngineHour.objects.get(bucket=NOW.replace(minute=0)).prompt_tokens == 7


def test_an_hour_is_rolled_up_only_a_minute_after_it_ends(instances):
    sample(instances[0], NOW.replace(hour=11, minute=59, second=55), prompt=1)
    assert EngineHour.objects.roll_up(NOW.replace(hour=12, minute=0, second=30)) == 0
    assert EngineHour.objects.roll_up(NOW.replace(hour=12, minute=1, second=30)) == 1


def test_samples_and_hours_past_their_retention_are_pruned(instances, settings):
    settings.ENGINE_SAMPLE_RETENTION_HOURS = 2
    settings.ENGINE_ROLLUP_RETENTION_DAYS = 3
    first = instances[0]
    old = sample(first, NOW - timedelta(hours=3))
    kept = sample(first, NOW - timedelta(hours=1))
    EngineHour.objects.create(instance=first, deployment=first.deployment,
                              bucket=NOW - timedelta(days=4))
    recent = EngineHour.objects.create(instance=first, deployment=first.deployment,
                                       bucket=NOW - timedelta(days=2))
    assert EngineSample.objects.prune(NOW) == 1
    assert EngineHour.objects.prune(NOW) == 1
    assert list(EngineSample.objects.values_list("pk", flat=True)) == [kept.pk]
    assert list(EngineHour.objects.values_list("pk", flat=True)) == [recent.pk]
    assert not EngineSample.objects.filter(pk=old.pk).exists()


def test_the_beat_task_rolls_up_an_hour_before_pruning_its_samples(instances, settings):
    settings.ENGINE_SAMPLE_RETENTION_HOURS = 1
    now = datetime.now(UTC)
    sample(instances[0], now - timedelta(hours=3), prompt=42)
    result = roll_up_engine_samples()
    assert result == {"rolled_up": 1, "samples_pruned": 1, "hours_pruned": 0}
    assert EngineHour.objects.get().prompt_tokens == 42
    assert not EngineSample.objects.exists()


def test_samples_go_with_their_instance(instances):
    sample(instances[0], NOW)
    EngineHour.objects.create(instance=instances[0], deployment=instances[0].deployment,
                              bucket=NOW.replace(minute=0))
    instances[0].deployment.delete()
    assert not EngineSample.objects.exists() and not EngineHour.objects.exists()
