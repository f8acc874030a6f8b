"""Every create, update, delete and action leaves an audit entry, from the API and the admin."""

from __future__ import annotations

import pytest

from audit_app.models import AuditLog
from tenants_app.models import ApiKey, Tenant
from tests.api.helpers import as_user, assert_forbidden_for, results
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db


def test_api_writes_are_audited_with_changed_fields(platform_admin):
    client = as_user(platform_admin)
    client.post(
        "/api/v1/tenants/",
        {"slug": "initech", "name": "Initech"},
        format="json",
        REMOTE_ADDR="10.1.2.3",
    )
    client.patch("/api/v1/tenants/initech/", {"requests_per_minute": 30}, format="json")
    client.delete("/api/v1/tenants/initech/")
    entries = list(AuditLog.objects.filter(via="api").order_by("id"))
    assert [e.action for e in entries] == ["create", "update", "delete"]
    created, updated, deleted = entries
    assert created.actor == platform_admin and created.via == "api"
    assert created.remote_addr == "10.1.2.3"
    assert created.changes["slug"] == "initech"
    assert updated.changes == {"requests_per_minute": [None, 30]}
    assert deleted.object_repr == "initech"


def test_actions_are_audited(platform_admin, acme, base_model):
    deployment = make_deployment(base_model, [acme.tenant])
    as_user(platform_admin).post(f"/api/v1/deployments/{deployment.pk}/start/")
    entry = AuditLog.objects.get(action="start")
    assert entry.changes == {"desired_state": ["stopped", "running"]}
    assert entry.object_id == str(deployment.pk)


def test_key_secret_never_reaches_the_audit_log(acme):
    response = as_user(acme.owner).post(
        "/api/v1/api-keys/", {"tenant": "acme", "name": "k"}, format="json"
    )
    secret = response.data["secret"]
    entry = AuditLog.objects.get(action="create", object_type="tenants_app.ApiKey")
    assert entry.tenant == acme.tenant
    assert secret not in str(entry.changes)
    assert "secret_hash" not in entry.changes
    key = ApiKey.objects.get()
    as_user(acme.owner).post(f"/api/v1/api-keys/{key.pk}/revoke/")
    assert AuditLog.objects.filter(action="revoke", object_id=str(key.pk)).exists()


def test_refused_writes_leave_no_entry(acme):
    as_user(acme.viewer).post("/api/v1/api-keys/", {"tenant": "acme", "name": "k"}, format="json")
    as_user(acme.owner).post("/api/v1/api-keys/", {"tenant": "acme"}, format="json")
    assert not AuditLog.objects.filter(via="api").exists()


def test_tenant_managers_read_only_their_tenants_entries(platform_admin, acme, globex):
    for tenant in ("acme", "globex"):
        as_user(platform_admin).post(
            "/api/v1/api-keys/", {"tenant": tenant, "name": "k"}, format="json"
        )
    rows = results(as_user(acme.admin).get("/api/v1/audit-log/"))
    assert {row["tenant"] for row in rows} == {"acme"}
    rows = results(as_user(platform_admin).get("/api/v1/audit-log/?via=api"))
    assert sorted(row["tenant"] for row in rows) == ["acme", "globex"]
    assert_forbidden_for([acme.member, acme.viewer], "get", "/api/v1/audit-log/")


def test_admin_changes_are_audited(client, platform_admin, acme):
    client.force_login(platform_admin)
    tenant = acme.tenant
    response = client.post(
        f"/admin/tenants_app/tenant/{tenant.pk}/change/",
        {
            "slug": "acme",
            "name": "Acme Renamed",
            "status": "active",
            "priority_tier": 2,
            "tokens_per_minute": 100000,
            "memberships-TOTAL_FORMS": 0,
            "memberships-INITIAL_FORMS": 0,
        },
    )
    assert response.status_code == 302, response.content[:2000]
    entry = AuditLog.objects.get(action="update", via="admin")
    assert entry.changes["name"] == ["Acme Corp", "Acme Renamed"]
    client.post(f"/admin/tenants_app/tenant/{tenant.pk}/delete/", {"post": "yes"})
    assert AuditLog.objects.filter(action="delete", via="admin").exists()
    assert not Tenant.objects.filter(pk=tenant.pk).exists()


def test_admin_validates_with_the_same_rules(client, platform_admin):
    client.force_login(platform_admin)
    response = client.post(
        "/admin/tenants_app/tenant/add/",
        {
            "slug": "api",
            "name": "x",
            "status": "active",
            "priority_tier": 2,
            "memberships-TOTAL_FORMS": 0,
            "memberships-INITIAL_FORMS": 0,
        },
    )
    assert response.status_code == 200
    assert b"is reserved" in response.content
    assert not Tenant.objects.filter(slug="api").exists()


def test_admin_key_creation_shows_the_secret_once(client, platform_admin, acme):
    client.force_login(platform_admin)
    response = client.post(
        "/admin/tenants_app/apikey/add/",
        {"tenant": acme.tenant.pk, "name": "from-admin", "allowed_models": "[]"},
        follow=True,
    )
    assert b"it is not shown again" in response.content
    key = ApiKey.objects.get(name="from-admin")
    text = response.content.decode()
    secret = text.split('<code id="secret-value">')[1].split("<")[0].strip()
    assert ApiKey.objects.for_secret(secret) == key
    assert AuditLog.objects.filter(action="create", object_id=str(key.pk), via="admin").exists()
