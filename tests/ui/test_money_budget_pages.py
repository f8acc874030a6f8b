"""Money budgets' pages: the console lists every budget with its period's spend, what the
gateway holds in Redis beyond it, what is left and when the period ends, and adds or changes
one with the model's own field errors; the portal shows a tenant its own budgets only."""

from __future__ import annotations

from decimal import Decimal

import pytest
import redis
from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from serving_app.models import KeyUsage
from serving_app.models.usage import key_usage_bucket
from tenants_app.models import ApiKey, MoneyBudget

pytestmark = pytest.mark.django_db


def _budget(tenant, **fields) -> MoneyBudget:
    budget = MoneyBudget(tenant=tenant, **{"amount": Decimal(10), "period": "day",
                                           "time_zone": "Europe/Berlin", **fields})
    budget.full_clean()
    budget.save()
    return budget


def test_the_console_lists_spent_reserved_remaining_and_the_period_end(login, platform_admin,
                                                                       acme):
    budget = _budget(acme.tenant)
    KeyUsage.objects.create(bucket=key_usage_bucket(timezone.now()), tenant=acme.tenant,
                            api_key_id=0, requests=3, cost=Decimal("2.5"))
    # The gateway's counter: the 2.5 written plus 1.25 reserved by requests in flight.
    start, end = budget.bounds()
    client = redis.Redis.from_url(settings.GATEWAY["REDIS_URL"])
    counter = f"gw:{{t{acme.tenant.pk}}}:money:{budget.pk}:{int(start.timestamp())}"
    client.set(counter, 3_750_000_000, ex=60)
    try:
        body = login(platform_admin).get(reverse("console:moneybudget-list")).content.decode()
    finally:
        client.delete(counter)
    row = body[body.index("<tbody>"):body.index("</tbody>")]
    assert "acme" in row and "the tenant's own" in row and "day, Europe/Berlin" in row
    assert ">10.00<" in row and ">2.50<" in row and ">1.25<" in row
    assert "6.25 <span" in row and "(37.5% used)" in row
    assert end.strftime("%Y-%m-%d %H:%M:%S UTC") in row
    assert reverse("console:moneybudget-edit", args=[budget.pk]) in row


def test_the_budgets_page_is_for_platform_admins(login, acme):
    assert login(acme.owner).get(reverse("console:moneybudget-list")).status_code == 403


def test_the_form_shows_the_models_field_errors_and_saves_a_rolling_key_budget(
        login, platform_admin, acme, globex):
    acme_key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="ci")
    client = login(platform_admin)
    url = reverse("console:moneybudget-create")
    form = {"tenant": globex.tenant.pk, "api_key": acme_key.pk, "amount": "5",
            "period": "week", "time_zone": "Mars/Olympus", "hard_limit": "on"}
    response = client.post(url, form)
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert "Unknown time zone" in errors["time_zone"][0]
    assert errors["api_key"] == ["This key is not one of the tenant's."]
    form.update(tenant=acme.tenant.pk, time_zone="UTC", rolling="on")
    response = client.post(url, form)
    assert response.status_code == 302, response.context["form"].errors
    budget = MoneyBudget.objects.get(api_key=acme_key)
    assert budget.rolling and budget.period == "week"
    listed = client.get(reverse("console:moneybudget-list")).content.decode()
    assert "rolling week" in listed
    edit = reverse("console:moneybudget-edit", args=[budget.pk])
    response = client.post(edit, {**form, "amount": "0"})
    assert "Ensure this value is greater than or equal to" in response.context["form"].errors[
        "amount"][0]
    client.post(edit, {**form, "amount": "7.5"})
    budget.refresh_from_db()
    assert budget.amount == Decimal("7.5")


def test_the_portal_shows_a_tenant_its_own_budgets(login, acme, globex):
    _budget(acme.tenant, amount=Decimal("12.5"))
    _budget(globex.tenant, amount=Decimal("99"))
    body = login(acme.member).get(reverse("portal:tenant-home", args=["acme"])).content.decode()
    assert "Money budgets" in body and ">12.50<" in body and "99.00" not in body
    other = login(globex.member).get(reverse("portal:tenant-home", args=["globex"]))
    assert "12.50" not in other.content.decode()
