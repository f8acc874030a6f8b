"""Money budgets in the API: platform admins set them, a tenant's members read their own,
others get 404; bad input is a field error."""

from __future__ import annotations

import pytest

from tenants_app.models import ApiKey, MoneyBudget
from tests.api.helpers import as_user, assert_forbidden_for, assert_hidden_from

pytestmark = pytest.mark.django_db

URL = "/api/v1/money-budgets/"


def test_admin_sets_a_tenant_and_a_key_budget(platform_admin, acme):
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    client = as_user(platform_admin)
    tenant = client.post(URL, {"tenant": "acme", "amount": "100.50", "period": "month",
                               "time_zone": "Europe/Berlin", "soft_threshold_percent": 80},
                         format="json")
    assert tenant.status_code == 201, tenant.data
    assert tenant.data["amount"] == "100.500000" and tenant.data["api_key"] is None
    own = client.post(URL, {"tenant": "acme", "api_key": key.pk, "amount": "10",
                            "period": "day", "rolling": True}, format="json")
    assert own.status_code == 201, own.data
    assert own.data["rolling"] is True and tenant.data["rolling"] is False
    again = client.post(URL, {"tenant": "acme", "amount": "1"}, format="json")
    assert again.status_code == 400  # one budget per tenant


def test_bad_budgets_are_field_errors(platform_admin, acme, globex):
    theirs, _ = ApiKey.objects.create_key(tenant=globex.tenant, name="theirs")
    client = as_user(platform_admin)
    cases = {"amount": {"amount": "0"}, "period": {"period": "fortnight"},
             "time_zone": {"time_zone": "Nowhere/Land"}, "api_key": {"api_key": theirs.pk},
             "soft_threshold_percent": {"soft_threshold_percent": 150},
             "rolling": {"rolling": "sometimes"}}
    for field, change in cases.items():
        response = client.post(URL, {"tenant": "acme", "amount": "5", **change}, format="json")
        assert response.status_code == 400 and field in response.data, (field, response.data)


def test_members_read_their_tenants_budget_only(platform_admin, acme, globex):
    budget = MoneyBudget.objects.create(tenant=acme.tenant, amount=5)
    listed = as_user(acme.member).get(URL)
    assert [row["id"] for row in listed.data["results"]] == [budget.pk]
    assert_hidden_from([globex.owner], f"{URL}{budget.pk}/")
    assert_forbidden_for([acme.owner], "patch", f"{URL}{budget.pk}/", {"amount": "50"})
