"""A tenant's settings for sharing an engine: its fair-share weight (platform admins set it in the
console, the API and the admin, with the same validation) and its band (the priority tier)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from gateway_app.catalog import load_snapshot
from tenants_app.models import PriorityTier, Tenant
from tests.api.helpers import as_user, assert_forbidden_for
from tests.factories import make_tenant

pytestmark = pytest.mark.django_db


def test_a_new_tenant_has_weight_one_and_its_tier_as_band(platform_admin):
    response = as_user(platform_admin).post(
        "/api/v1/tenants/", {"slug": "initech", "name": "Initech", "priority_tier": 1},
        format="json",
    )
    assert response.status_code == 201, response.data
    assert response.data["fair_share_weight"] == 1
    tenant = Tenant.objects.get(slug="initech")
    assert (tenant.fair_share_weight, tenant.band) == (1, PriorityTier.HIGH)


def test_platform_admin_sets_the_weight_through_the_api(platform_admin, acme):
    response = as_user(platform_admin).patch(
        "/api/v1/tenants/acme/", {"fair_share_weight": 3}, format="json"
    )
    assert response.status_code == 200, response.data
    acme.tenant.refresh_from_db()
    assert acme.tenant.fair_share_weight == 3


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "greater than or equal to 1"),
        (1001, "less than or equal to 1000"),
        ("heavy", "valid integer"),
        (None, "may not be null"),
    ],
)
def test_a_bad_weight_is_a_field_error_and_changes_nothing(platform_admin, acme, value, message):
    response = as_user(platform_admin).patch(
        "/api/v1/tenants/acme/", {"fair_share_weight": value}, format="json"
    )
    assert response.status_code == 400
    assert set(response.data) == {"fair_share_weight"}
    assert message in str(response.data["fair_share_weight"][0])
    acme.tenant.refresh_from_db()
    assert acme.tenant.fair_share_weight == 1


def test_tenant_users_cannot_raise_their_own_weight(acme):
    assert_forbidden_for(
        [acme.owner, acme.admin, acme.member], "patch", "/api/v1/tenants/acme/",
        {"fair_share_weight": 50},
    )
    acme.tenant.refresh_from_db()
    assert acme.tenant.fair_share_weight == 1


def test_console_form_sets_the_weight_and_refuses_zero_with_the_models_message(
    client, platform_admin, acme
):
    client.force_login(platform_admin)
    url = reverse("console:tenant-edit", args=["acme"])
    form = {"slug": "acme", "name": "Acme Corp", "status": "active", "priority_tier": 2,
            "tokens_per_minute": 100000}
    response = client.post(url, {**form, "fair_share_weight": 0})
    assert response.status_code == 200
    assert response.context["form"].errors["fair_share_weight"] == [
        "Ensure this value is greater than or equal to 1."
    ]
    assert client.post(url, {**form, "fair_share_weight": 4}).status_code == 302
    acme.tenant.refresh_from_db()
    assert acme.tenant.fair_share_weight == 4
    # A post that leaves the field out (an older form, a script) keeps the weight.
    assert client.post(url, form).status_code == 302
    acme.tenant.refresh_from_db()
    assert acme.tenant.fair_share_weight == 4
    page = client.get(reverse("console:tenant-detail", args=["acme"])).content.decode()
    assert "Fair-share weight</dt><dd>4</dd>" in page


def test_admin_form_validates_the_weight_like_the_api(client, platform_admin, acme):
    client.force_login(platform_admin)
    url = f"/admin/tenants_app/tenant/{acme.tenant.pk}/change/"
    form = {"slug": "acme", "name": "Acme Corp", "status": "active", "priority_tier": 2,
            "tokens_per_minute": 100000, "memberships-TOTAL_FORMS": 0,
            "memberships-INITIAL_FORMS": 0}
    response = client.post(url, {**form, "fair_share_weight": 0})
    assert response.status_code == 200
    assert b"greater than or equal to 1" in response.content
    assert client.post(url, {**form, "fair_share_weight": 2}).status_code == 302
    acme.tenant.refresh_from_db()
    assert acme.tenant.fair_share_weight == 2


def test_the_gateway_catalog_carries_weight_and_band():
    tenant = make_tenant("heavy", fair_share_weight=5, priority_tier=PriorityTier.LOW)
    entry = load_snapshot().tenants[tenant.pk]
    assert (entry.weight, entry.priority) == (5, 3)
