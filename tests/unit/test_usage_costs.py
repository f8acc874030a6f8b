"""What each request costs, computed by the usage writer at the price card in force when it
arrived: exact decimals, cached prompt tokens priced apart, an adapter's own card, a price
change mid-period; cached tokens and costs summed in the rollups and per API key."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from gateway_app.writer import persist
from serving_app.models import KeyUsage, PriceCard, UsageEvent, UsageHour, UsageTotal
from tests.factories import make_adapter, make_deployment

pytestmark = pytest.mark.django_db

AT = datetime(2026, 11, 30, 12, 0, 7, tzinfo=UTC)


def event(i: int, deployment: int, tenant: int, *, at: datetime = AT, key: int = 11,
          prompt: int = 1000, cached: int = 0, completion: int = 200, adapter: str = "") -> dict:
    return {"id": f"c-{i}", "at": at.timestamp(), "tenant": tenant, "key": key,
            "endpoint": "chat.completions", "model": "m", "adapter": adapter,
            "deployment": deployment, "status": 200, "prompt": prompt, "cached": cached,
            "completion": completion, "latency_ms": 10.0}


def card(base, when, inp: str, cached: str, out: str, adapter=None) -> PriceCard:
    row = PriceCard(base_model=base, adapter=adapter, effective_from=when,
                    input_per_million=Decimal(inp), cached_input_per_million=Decimal(cached),
                    output_per_million=Decimal(out))
    row.full_clean()
    row.save()
    return row


def test_a_price_change_mid_period_costs_each_request_at_its_own_price(acme, base_model):
    dep = make_deployment(base_model, [acme.tenant])
    t = acme.tenant.pk
    old = card(base_model, AT - timedelta(days=30), "0.15", "0.075", "0.6")
    new = card(base_model, AT + timedelta(minutes=30), "0.30", "0.15", "1.2")
    persist([event(1, dep.pk, t), event(2, dep.pk, t, at=AT + timedelta(hours=1))])
    first, second = UsageEvent.objects.get(request_id="c-1"), UsageEvent.objects.get(
        request_id="c-2")
    # 1000 prompt tokens at 0.15 and 200 completion tokens at 0.6 per million.
    assert first.cost == Decimal("0.00015") + Decimal("0.00012")
    assert first.price_card_id == old.pk
    assert second.cost == Decimal("0.0003") + Decimal("0.00024")
    assert second.price_card_id == new.pk


def test_cached_tokens_are_recorded_priced_apart_and_summed(acme, base_model):
    dep = make_deployment(base_model, [acme.tenant])
    t = acme.tenant.pk
    card(base_model, AT - timedelta(days=1), "1", "0.1", "2")
    persist([event(1, dep.pk, t, cached=600), event(2, dep.pk, t, cached=0)])
    cached = UsageEvent.objects.get(request_id="c-1")
    assert cached.cached_tokens == 600
    # 400 fresh at 1, 600 cached at 0.1, 200 out at 2 (per million).
    assert cached.cost == (400 * Decimal(1) + 600 * Decimal("0.1") + 200 * Decimal(2)) / 10**6
    hour = UsageHour.objects.get()
    assert hour.cached_tokens == 600
    assert hour.cost == cached.cost + UsageEvent.objects.get(request_id="c-2").cost
    assert UsageTotal.objects.get().cost == hour.cost


def test_a_request_without_a_card_in_force_has_no_cost(acme, base_model):
    dep = make_deployment(base_model, [acme.tenant])
    card(base_model, AT + timedelta(days=1), "1", "1", "1")
    persist([event(1, dep.pk, acme.tenant.pk)])
    row = UsageEvent.objects.get()
    assert row.cost is None and row.price_card_id is None
    assert UsageHour.objects.get().cost == 0


def test_an_adapter_is_priced_at_its_own_card(acme, base_model, tmp_path):
    adapter = make_adapter(acme.tenant, base_model, tmp_path / "adapters", name="tuned")
    dep = make_deployment(base_model, [acme.tenant], adapters=[adapter])
    card(base_model, AT - timedelta(days=1), "1", "1", "1")
    own = card(base_model, AT - timedelta(days=1), "5", "5", "5", adapter=adapter)
    persist([event(1, dep.pk, acme.tenant.pk, adapter=adapter.engine_name)])
    assert UsageEvent.objects.get().price_card_id == own.pk


def test_a_keys_spend_is_a_query_over_its_buckets(acme, globex, base_model):
    dep = make_deployment(base_model, [acme.tenant, globex.tenant])
    card(base_model, AT - timedelta(days=1), "1", "1", "1")
    t = acme.tenant.pk
    persist([event(1, dep.pk, t, key=11), event(2, dep.pk, t, key=11, at=AT + timedelta(hours=2)),
             event(3, dep.pk, t, key=12), event(4, dep.pk, globex.tenant.pk, key=13)])
    each = Decimal(1200) / 10**6
    since = AT.replace(hour=0, minute=0, second=0)
    assert KeyUsage.objects.spend(t, since, key_id=11) == 2 * each
    assert KeyUsage.objects.spend(t, since, AT + timedelta(hours=1), key_id=11) == each
    assert KeyUsage.objects.spend(t, since) == 3 * each
    assert KeyUsage.objects.filter(tenant_id=t, api_key_id=11).count() == 2
    # Written again (a redelivered batch): nothing counted twice.
    persist([event(1, dep.pk, t, key=11)])
    assert KeyUsage.objects.spend(t, since, key_id=11) == 2 * each
