"""Price cards: effective-dated and versioned token and GPU-second prices, through the API and
the console's pages, checked by the models' own `clean()`; the card in force at a moment."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from serving_app.models import GpuPriceCard, PriceCard, PriceTable
from tests.api.helpers import as_user, assert_forbidden_for
from tests.factories import make_adapter, make_base_model

pytestmark = pytest.mark.django_db

URL = "/api/v1/price-cards/"


def card(base, when, **prices) -> PriceCard:
    row = PriceCard(base_model=base, effective_from=when, **prices)
    row.full_clean()
    row.save()
    return row


def test_admin_adds_cards_each_a_new_version_with_exact_decimal_prices(platform_admin,
                                                                       base_model):
    client = as_user(platform_admin)
    start = timezone.now() - timedelta(days=3)
    first = client.post(URL, {
        "base_model": base_model.name, "effective_from": start.isoformat(),
        "input_per_million": "0.150000", "cached_input_per_million": "0.075",
        "output_per_million": "0.6", "currency": "EUR"}, format="json")
    assert first.status_code == 201, first.data
    assert first.data["version"] == 1 and first.data["in_force_now"] is True
    assert first.data["input_per_million"] == "0.150000"
    later = client.post(URL, {
        "base_model": base_model.name, "effective_from": (start + timedelta(days=10)).isoformat(),
        "input_per_million": "0.2", "output_per_million": "0.8", "currency": "EUR"},
        format="json")
    assert later.status_code == 201, later.data
    assert later.data["version"] == 2 and later.data["in_force_now"] is False


def test_bad_prices_are_field_errors(platform_admin, base_model, tmp_path, acme):
    client = as_user(platform_admin)
    now = timezone.now()
    other = make_base_model(tmp_path / "other", name="other-model")
    adapter = make_adapter(acme.tenant, other, tmp_path / "adapters")
    cases = {
        "input_per_million": {"input_per_million": "-1"},
        "currency": {"currency": "usd"},
        "adapter": {"adapter": adapter.pk},
        "base_model": {"base_model": "no-such-model"},
        "output_per_million": {"output_per_million": "1.1234567"},
    }
    for field, change in cases.items():
        body = {"base_model": base_model.name, "effective_from": now.isoformat(),
                "input_per_million": "1", "output_per_million": "2", **change}
        response = client.post(URL, body, format="json")
        assert response.status_code == 400, (field, response.data)
        assert field in response.data, (field, response.data)


def test_every_card_shares_one_currency(platform_admin, base_model):
    card(base_model, timezone.now(), input_per_million=Decimal(1), currency="USD")
    response = as_user(platform_admin).post("/api/v1/gpu-price-cards/", {
        "gpu_model": "NVIDIA H100 80GB HBM3", "per_gpu_second": "0.000833333",
        "effective_from": timezone.now().isoformat(), "currency": "EUR"}, format="json")
    assert response.status_code == 400
    assert "USD" in str(response.data["currency"])


def test_a_card_in_force_is_never_changed_but_a_scheduled_one_is(platform_admin, base_model):
    client = as_user(platform_admin)
    current = card(base_model, timezone.now() - timedelta(hours=1), input_per_million=Decimal(1))
    response = client.patch(f"{URL}{current.pk}/", {"input_per_million": "2"}, format="json")
    assert response.status_code == 400
    assert "input_per_million" in response.data
    current.refresh_from_db()
    assert current.input_per_million == Decimal(1)
    scheduled = card(base_model, timezone.now() + timedelta(days=1), input_per_million=Decimal(3))
    response = client.patch(f"{URL}{scheduled.pk}/", {"input_per_million": "4"}, format="json")
    assert response.status_code == 200, response.data


def test_the_card_in_force_at_a_moment_adapter_first(platform_admin, base_model, acme,
                                                     tmp_path):
    adapter = make_adapter(acme.tenant, base_model, tmp_path / "adapters")
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    v1 = card(base_model, t0, input_per_million=Decimal("1"))
    v2 = card(base_model, t0 + timedelta(days=10), input_per_million=Decimal("2"))
    own = PriceCard(base_model=base_model, adapter=adapter, effective_from=t0 + timedelta(days=5),
                    input_per_million=Decimal("9"))
    own.full_clean()
    own.save()
    table = PriceTable.load()
    at = (t0 + timedelta(days=1)).timestamp()
    assert table.price_at(base_model.pk, None, at).card_id == v1.pk
    assert table.price_at(base_model.pk, adapter.pk, at).card_id == v1.pk  # not yet its own
    assert table.price_at(base_model.pk, None, (t0 + timedelta(days=11)).timestamp()).card_id \
        == v2.pk
    assert table.price_at(base_model.pk, adapter.pk,
                          (t0 + timedelta(days=11)).timestamp()).card_id == own.pk
    assert table.price_at(base_model.pk, None, (t0 - timedelta(days=1)).timestamp()) is None

    client = as_user(platform_admin)
    response = client.get(f"{URL}in-force/", {"base_model": base_model.name,
                                              "at": "2026-11-12T00:00:00Z"})
    assert response.status_code == 200 and response.data["id"] == v2.pk
    response = client.get(f"{URL}in-force/", {"base_model": base_model.name,
                                              "adapter": adapter.pk,
                                              "at": "2026-11-07T00:00:00Z"})
    assert response.data["id"] == own.pk
    assert client.get(f"{URL}in-force/", {"base_model": base_model.name,
                                          "at": "2026-10-01T00:00:00Z"}).status_code == 404
    bad = client.get(f"{URL}in-force/", {"base_model": "nope", "at": "yesterday"})
    assert bad.status_code == 400 and {"base_model", "at"} <= set(bad.data)
    # What the API fuzz found: a NUL in a name, a digit that is not ASCII, a naive time.
    odd = client.get(f"{URL}in-force/", {"base_model": "x\x00y", "adapter": "\u00b2",
                                          "at": "2026-11-12T00:00:00"})
    assert odd.status_code == 400 and {"base_model", "adapter", "at"} <= set(odd.data)


def test_cached_tokens_are_priced_apart_exactly():
    price = PriceTable([]).price_at(1, None, 0.0)
    assert price is None
    from serving_app.models import TokenPrice

    price = TokenPrice(1, "USD", Decimal("0.15"), Decimal("0.075"), Decimal("0.6"))
    # 1000 prompt tokens of which 400 cached, 200 completion tokens.
    assert price.cost(1000, 400, 200) == Decimal("0.00009") + Decimal("0.00003") \
        + Decimal("0.00012")
    assert price.cost(1000, 0, 200) == Decimal("0.000270")
    assert isinstance(price.cost(3, 1, 7), Decimal)


def test_tenant_users_cannot_read_or_write_prices(acme, base_model):
    for user in (acme.owner, acme.member):
        assert as_user(user).get(URL).status_code == 403
    assert_forbidden_for([acme.owner], "post", URL, {"base_model": base_model.name})
    assert_forbidden_for([acme.owner], "get", "/api/v1/gpu-price-cards/")


def test_console_page_lists_cards_and_adds_one(platform_admin, base_model, client):
    client.force_login(platform_admin)
    card(base_model, timezone.now() - timedelta(days=1), input_per_million=Decimal("0.000125"))
    page = client.get("/prices/")
    assert page.status_code == 200
    assert b"0.000125 USD" in page.content and b"in force" in page.content
    response = client.post("/prices/gpu/new/", {
        "gpu_model": "NVIDIA H100 80GB HBM3", "mig_profile": "1g.10gb", "currency": "USD",
        "effective_from": "2026-12-01 00:00", "per_gpu_second": "0.0001"})
    assert response.status_code == 302, response.content[:2000]
    assert GpuPriceCard.objects.get().version == 1
    refused = client.post("/prices/new/", {
        "base_model": base_model.pk, "currency": "USD", "effective_from": "2026-12-01 00:00",
        "input_per_million": "-1", "cached_input_per_million": "0", "output_per_million": "0"})
    assert refused.status_code == 200 and b"greater than or equal to 0" in refused.content
