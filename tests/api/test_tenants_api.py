"""Tenants, memberships and users through the management API, for every role."""

from __future__ import annotations

import pytest

from tenants_app.models import Invitation, Membership, Role, Tenant
from tests.api.helpers import as_user, assert_forbidden_for, assert_hidden_from, results

pytestmark = pytest.mark.django_db


def test_anonymous_is_refused(client):
    assert client.get("/api/v1/tenants/").status_code in (401, 403)


def test_token_authentication_for_scripts(platform_admin, client):
    platform_admin.set_password("a-long-password")
    platform_admin.save()
    response = client.post(
        "/api/v1/auth/token/", {"username": "root-admin", "password": "a-long-password"}
    )
    token = response.json()["token"]
    listed = client.get("/api/v1/tenants/", HTTP_AUTHORIZATION=f"Token {token}")
    assert listed.status_code == 200


def test_platform_admin_sees_every_tenant(platform_admin, acme, globex):
    slugs = [t["slug"] for t in results(as_user(platform_admin).get("/api/v1/tenants/"))]
    assert slugs == ["acme", "globex"]


def test_members_see_only_their_own_tenant(acme, globex, outsider):
    for user in (acme.owner, acme.viewer):
        slugs = [t["slug"] for t in results(as_user(user).get("/api/v1/tenants/"))]
        assert slugs == ["acme"]
    assert results(as_user(outsider).get("/api/v1/tenants/")) == []


def test_another_tenant_is_a_404(acme, globex, outsider):
    assert_hidden_from([acme.owner, acme.member, outsider], "/api/v1/tenants/globex/")


def test_only_platform_admins_create_and_change_tenants(platform_admin, acme):
    assert_forbidden_for(
        [acme.owner, acme.admin], "post", "/api/v1/tenants/", {"slug": "new-co", "name": "New"}
    )
    assert_forbidden_for(
        [acme.owner, acme.viewer], "patch", "/api/v1/tenants/acme/", {"requests_per_minute": 5}
    )
    response = as_user(platform_admin).post(
        "/api/v1/tenants/",
        {"slug": "initech", "name": "Initech", "requests_per_minute": 60},
        format="json",
    )
    assert response.status_code == 201, response.data
    assert Tenant.objects.get(slug="initech").requests_per_minute == 60


def test_bad_tenant_input_gets_field_errors_and_changes_nothing(platform_admin):
    response = as_user(platform_admin).post(
        "/api/v1/tenants/",
        {
            "slug": "api",
            "name": "x",
            "tokens_per_minute": 100,
            "max_tokens_per_request": 200,
            "requests_per_minute": -1,
        },
        format="json",
    )
    assert response.status_code == 400
    assert set(response.data) >= {"requests_per_minute"}
    response = as_user(platform_admin).post(
        "/api/v1/tenants/",
        {"slug": "api", "name": "x", "tokens_per_minute": 100, "max_tokens_per_request": 200},
        format="json",
    )
    assert response.status_code == 400
    assert "reserved" in str(response.data["slug"])
    assert "never be admitted" in str(response.data["max_tokens_per_request"])
    assert not Tenant.objects.filter(slug="api").exists()


def test_streamed_objectives_are_kept_and_checked_against_the_end_to_end_one(platform_admin):
    client = as_user(platform_admin)
    response = client.post("/api/v1/tenants/", {
        "slug": "support", "name": "Support", "latency_objective_ms": 2000,
        "ttft_objective_ms": 400, "tpot_objective_ms": 40}, format="json")
    assert response.status_code == 201, response.data
    assert (response.data["ttft_objective_ms"], response.data["tpot_objective_ms"]) == (400, 40)
    response = client.patch("/api/v1/tenants/support/", {"ttft_objective_ms": 2500},
                            format="json")
    assert response.status_code == 400
    assert "2,000 ms" in str(response.data["ttft_objective_ms"])
    response = client.patch("/api/v1/tenants/support/", {"tpot_objective_ms": 0,
                                                          "ttft_objective_ms": 700_000},
                            format="json")
    assert response.status_code == 400
    assert set(response.data) == {"tpot_objective_ms", "ttft_objective_ms"}
    assert Tenant.objects.get(slug="support").ttft_objective_ms == 400


def test_filtering_and_pagination(platform_admin, acme, globex):
    Tenant.objects.filter(slug="globex").update(status="suspended")
    client = as_user(platform_admin)
    assert [t["slug"] for t in results(client.get("/api/v1/tenants/?status=suspended"))] == [
        "globex"
    ]
    page = client.get("/api/v1/tenants/?limit=1&offset=1").data
    assert page["count"] == 2 and [t["slug"] for t in page["results"]] == ["globex"]


class TestMemberships:
    def test_platform_admin_adds_a_member_directly(self, platform_admin, acme, outsider):
        response = as_user(platform_admin).post(
            "/api/v1/memberships/",
            {"tenant": "acme", "user": "outsider", "role": "member"},
            format="json",
        )
        assert response.status_code == 201, response.data
        assert Membership.objects.filter(tenant=acme.tenant, user=outsider).exists()

    def test_owner_cannot_add_a_member_without_their_consent(self, acme, outsider):
        """Members join by invitation (tests/api/test_invitations.py), which they accept."""
        response = as_user(acme.owner).post(
            "/api/v1/memberships/",
            {"tenant": "acme", "user": "outsider", "role": "member"},
            format="json",
        )
        assert response.status_code == 403
        assert "invitation" in str(response.data)
        assert not Membership.objects.filter(user=outsider).exists()

    def test_members_and_viewers_cannot_manage_members(self, acme, outsider):
        assert_forbidden_for(
            [acme.member, acme.viewer],
            "post",
            "/api/v1/memberships/",
            {"tenant": "acme", "user": "outsider", "role": "member"},
        )
        viewer_membership = Membership.objects.get(user=acme.viewer)
        assert_forbidden_for(
            [acme.member], "delete", f"/api/v1/memberships/{viewer_membership.pk}/"
        )

    def test_admin_cannot_make_an_owner(self, acme, outsider):
        assert_forbidden_for(
            [acme.admin],
            "post",
            "/api/v1/invitations/",
            {"tenant": "acme", "invited_as": "outsider", "role": "owner"},
        )

    def test_inviting_to_another_tenant_is_a_field_error(self, acme, globex, outsider):
        response = as_user(acme.owner).post(
            "/api/v1/invitations/", {"tenant": "globex", "invited_as": "outsider"}, format="json"
        )
        assert response.status_code == 400
        assert "tenant" in response.data
        assert not Membership.objects.filter(user=outsider).exists()

    def test_other_tenants_memberships_are_404(self, acme, globex):
        membership = Membership.objects.get(user=globex.member)
        assert_hidden_from([acme.owner], f"/api/v1/memberships/{membership.pk}/")

    def test_last_owner_cannot_be_removed(self, acme):
        owner_membership = Membership.objects.get(user=acme.owner)
        response = as_user(acme.owner).delete(f"/api/v1/memberships/{owner_membership.pk}/")
        assert response.status_code == 400
        assert "at least one owner" in str(response.data)
        assert Membership.objects.filter(pk=owner_membership.pk).exists()

    def test_member_lists_own_tenant_memberships(self, acme, globex):
        rows = results(as_user(acme.viewer).get("/api/v1/memberships/"))
        assert {row["tenant"] for row in rows} == {"acme"}
        assert len(rows) == 4


class TestUsers:
    def test_platform_admin_creates_a_user(self, platform_admin):
        response = as_user(platform_admin).post(
            "/api/v1/users/", {"username": "newbie", "password": "long-enough-pw"}, format="json"
        )
        assert response.status_code == 201, response.data
        assert "password" not in response.data

    def test_short_password_is_a_field_error(self, platform_admin):
        response = as_user(platform_admin).post(
            "/api/v1/users/", {"username": "newbie", "password": "x"}, format="json"
        )
        assert response.status_code == 400 and "password" in response.data

    def test_tenant_users_cannot_list_users(self, acme):
        assert_forbidden_for([acme.owner], "get", "/api/v1/users/")


def test_role_choices_are_validated(acme, outsider):
    response = as_user(acme.owner).post(
        "/api/v1/invitations/",
        {"tenant": "acme", "invited_as": "outsider", "role": "emperor"},
        format="json",
    )
    assert response.status_code == 400 and "role" in response.data
    assert "emperor" in str(response.data["role"])  # named in the field's error
    assert not Invitation.objects.exists()
    # The same body with a real role is accepted: the refusal was about the role.
    response = as_user(acme.owner).post(
        "/api/v1/invitations/",
        {"tenant": "acme", "invited_as": "outsider", "role": Role.MEMBER},
        format="json",
    )
    assert response.status_code == 201, response.data
