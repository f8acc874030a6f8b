"""The usage writer's rollups: log-spaced latency and TTFT histograms, server errors apart from
429s and other 4xx, the deployment, the ten-second buckets and the all-time total."""

from __future__ import annotations

import importlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.apps import apps as django_apps

from gateway_app.writer import persist
from serving_app import migrations
from serving_app.models.usage import (
    GUARDRAIL_FIELDS_KEPT,
    LATENCY_BUCKETS_MS,
    TOTAL_BUCKET,
    GuardrailHour,
    GuardrailMinute,
    GuardrailTotal,
    UsageEvent,
    UsageHour,
    UsageMinute,
    UsageTenSecond,
    UsageTotal,
    bucket_index,
    histogram_quantile,
)
from tests.factories import make_tenant

pytestmark = pytest.mark.django_db

AT = datetime(2026, 11, 30, 12, 0, 7, tzinfo=UTC)


def event(i: int, *, at: datetime = AT, status: int = 200, latency: float = 100.0,
          ttft: float | None = None, deployment: int | None = 7, tenant: int) -> dict:
    return {"id": f"r-{i}", "at": at.timestamp(), "tenant": tenant, "endpoint": "completions",
            "model": "m", "deployment": deployment, "status": status, "prompt": 2,
            "completion": 3, "latency_ms": latency, "ttft_ms": ttft}


def test_buckets_are_log_spaced_and_keep_the_old_edges():
    widths = [b / a for a, b in zip(LATENCY_BUCKETS_MS, LATENCY_BUCKETS_MS[1:], strict=False)]
    assert max(widths) <= 1.3 and min(widths) >= 1.2
    assert {100, 250, 500, 1000, 2500, 5000, 10000} <= set(LATENCY_BUCKETS_MS)
    assert bucket_index(500) == LATENCY_BUCKETS_MS.index(500)
    assert bucket_index(500.01) == LATENCY_BUCKETS_MS.index(500) + 1
    assert bucket_index(10**9) == len(LATENCY_BUCKETS_MS)


def test_a_threshold_between_old_edges_is_judged_closely():
    """600 ms against requests at 550 and 650 ms: the old 500-1000 ms bucket could not tell
    them apart; the fine buckets put them on either side."""
    counts = [0] * len(LATENCY_BUCKETS_MS)
    counts[bucket_index(550)] += 90
    counts[bucket_index(650)] += 10
    p95 = histogram_quantile(counts, 100, 650, 0.95)
    assert 630 < p95 <= 800
    p50 = histogram_quantile(counts, 100, 650, 0.50)
    assert 500 < p50 <= 630


def test_each_rollup_counts_server_errors_ttft_and_deployment():
    tenant = make_tenant("meter").pk
    events = [
        event(1, status=200, latency=480, ttft=90, tenant=tenant),
        event(2, status=502, latency=30, tenant=tenant),
        event(3, status=429, latency=2, deployment=None, tenant=tenant),
        event(4, status=400, latency=5, tenant=tenant),
        event(5, status=200, latency=150_000, ttft=120_000, tenant=tenant),
        event(6, at=AT + timedelta(seconds=5), status=503, latency=40, tenant=tenant),
    ]
    assert persist(events) == 6

    ten = {(r.bucket, r.deployment_id): r for r in UsageTenSecond.objects.all()}
    assert set(ten) == {(AT.replace(second=0), 7), (AT.replace(second=0), 0),
                        (AT.replace(second=10), 7)}
    first = ten[(AT.replace(second=0), 7)]
    assert (first.requests, first.errors, first.server_errors, first.rate_limited) == (4, 2, 1, 0)
    assert (first.latency_le_10, first.latency_le_32, first.latency_le_500) == (1, 1, 1)
    assert first.ttft_count == 2 and first.ttft_le_100 == 1 and first.ttft_ms_max == 120_000
    assert first.latency_ms_max == 150_000  # above the last bound: in no bucket, but the max
    assert sum(getattr(first, f"latency_le_{b}") for b in LATENCY_BUCKETS_MS) == 3
    assert ten[(AT.replace(second=0), 0)].rate_limited == 1

    for rollup in (UsageMinute, UsageHour, UsageTotal):
        rows = {r.deployment_id: r for r in rollup.objects.all()}
        assert rows[7].requests == 5 and rows[7].server_errors == 2 and rows[0].requests == 1
    assert UsageTotal.objects.get(deployment_id=7).bucket == TOTAL_BUCKET


def test_redelivered_events_are_not_counted_again_in_any_rollup():
    tenant = make_tenant("again").pk
    events = [event(i, tenant=tenant) for i in range(3)]
    assert persist(events) == 3
    assert persist(events) == 0
    for rollup in (UsageTenSecond, UsageMinute, UsageHour, UsageTotal):
        assert rollup.objects.get().requests == 3


def test_ten_second_rollups_are_pruned_by_age():
    tenant = make_tenant("old").pk
    persist([event(1, tenant=tenant, at=AT - timedelta(days=2)), event(2, tenant=tenant)])
    assert UsageTenSecond.objects.prune(AT - timedelta(days=1)) == 1
    assert UsageTenSecond.objects.get().bucket == AT.replace(second=0)
    assert UsageMinute.objects.count() == 2


def test_the_migration_starts_the_totals_from_the_hour_rollups():
    """Counters exported after the upgrade include the usage counted before it."""
    tenant = make_tenant("history")
    for hours, requests in ((1, 5), (30, 7)):
        UsageHour.objects.create(bucket=AT - timedelta(hours=hours), tenant=tenant, model="m",
                                 requests=requests, server_errors=1, latency_ms_max=hours)
    migration = next(Path(migrations.__file__).parent.glob("*_usage_fine_histograms_*.py"))
    module = importlib.import_module(f"serving_app.migrations.{migration.stem}")
    module.seed_totals(django_apps, None)
    total = UsageTotal.objects.get(tenant=tenant)
    assert (total.requests, total.latency_ms_max, total.bucket) == (12, 30, TOTAL_BUCKET)



def test_guardrail_counts_are_rolled_up_per_minute_hour_and_ever():
    """Each event's `direction:action:CATEGORY` counts add up per tenant and bucket; a redelivered
    event is not counted twice; a malformed or negative count is dropped, not a failed batch."""
    acme, globex = make_tenant("acme"), make_tenant("globex")
    later = AT + timedelta(minutes=2)
    events = [
        {**event(1, tenant=acme.pk), "guardrails": {"input:redact:PHONE": 2,
                                                    "input:block:SECRET": 1}},
        {**event(2, tenant=acme.pk, at=later), "guardrails": {"input:redact:PHONE": 1,
                                                              "output:redact:PHONE": -3,
                                                              "nonsense": 4}},
        {**event(3, tenant=globex.pk), "guardrails": {"output:detect:EMAIL": 5}},
        event(4, tenant=globex.pk),
    ]
    assert persist(events) == 4
    assert persist(events[:1]) == 0  # redelivered: stored already, not counted again

    def counts(model) -> dict:
        return {(r.bucket, r.tenant_id, r.direction, r.action, r.category): r.count
                for r in model.objects.all()}

    minute = AT.replace(second=0)
    assert counts(GuardrailMinute) == {
        (minute, acme.pk, "input", "redact", "PHONE"): 2,
        (minute, acme.pk, "input", "block", "SECRET"): 1,
        (later.replace(second=0), acme.pk, "input", "redact", "PHONE"): 1,
        (minute, globex.pk, "output", "detect", "EMAIL"): 5,
    }
    hour = AT.replace(minute=0, second=0)
    assert counts(GuardrailHour)[(hour, acme.pk, "input", "redact", "PHONE")] == 3
    # ... found in two requests (the rollups count requests too: the dashboards' chart).
    assert GuardrailHour.objects.get(tenant=acme, category="PHONE").requests == 2
    assert counts(GuardrailTotal) == {
        (TOTAL_BUCKET, acme.pk, "input", "redact", "PHONE"): 3,
        (TOTAL_BUCKET, acme.pk, "input", "block", "SECRET"): 1,
        (TOTAL_BUCKET, globex.pk, "output", "detect", "EMAIL"): 5,
    }


def test_guardrail_fields_are_stored_with_the_event_bounded_and_well_formed():
    """Each event's per-field findings are kept as sent (strings cut to their limits); an
    entry without a positive count, or that is not an object, is dropped; at most
    GUARDRAIL_FIELDS_KEPT entries."""
    acme = make_tenant("acme")
    entry = {"direction": "input", "field": "messages[2].tool_calls[0].function.arguments.to",
             "detector": "phone", "category": "PHONE", "action": "redact", "count": 1}
    many = [{**entry, "field": f"messages[{i}].content"} for i in range(GUARDRAIL_FIELDS_KEPT + 9)]
    persist([
        {**event(1, tenant=acme.pk), "guardrail_fields": [
            entry, {**entry, "count": 0}, {**entry, "count": True}, "junk",
            {**entry, "field": "x" * 500}]},
        {**event(2, tenant=acme.pk), "guardrail_fields": many},
        {**event(3, tenant=acme.pk), "guardrail_fields": {"not": "a list"}},
    ])
    stored = {e.request_id: e.guardrail_fields for e in UsageEvent.objects.all()}
    assert stored["r-1"] == [entry, {**entry, "field": "x" * 200}]
    assert len(stored["r-2"]) == GUARDRAIL_FIELDS_KEPT
    assert stored["r-3"] == []
