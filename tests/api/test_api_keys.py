"""API keys through the management API: the secret is shown once and only its hash is kept."""

from __future__ import annotations

import pytest

from tenants_app.models import ApiKey
from tests.api.helpers import as_user, assert_forbidden_for, assert_hidden_from, results

pytestmark = pytest.mark.django_db


def create_key(user, tenant="acme", **extra):
    return as_user(user).post(
        "/api/v1/api-keys/", {"tenant": tenant, "name": "ci", **extra}, format="json"
    )


def test_creation_returns_the_secret_once(acme):
    response = create_key(acme.admin)
    assert response.status_code == 201, response.data
    secret = response.data["secret"]
    key = ApiKey.objects.get(pk=response.data["id"])
    assert key.secret_hash != secret and secret not in key.secret_hash
    assert ApiKey.objects.for_secret(secret) == key
    shown_again = as_user(acme.admin).get(f"/api/v1/api-keys/{key.pk}/")
    assert "secret" not in shown_again.data
    assert all("secret" not in row for row in results(as_user(acme.owner).get("/api/v1/api-keys/")))


def test_members_and_viewers_read_but_cannot_create_or_revoke(acme):
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    assert_forbidden_for(
        [acme.member, acme.viewer], "post", "/api/v1/api-keys/", {"tenant": "acme", "name": "x"}
    )
    assert_forbidden_for([acme.member, acme.viewer], "post", f"/api/v1/api-keys/{key.pk}/revoke/")
    assert len(results(as_user(acme.viewer).get("/api/v1/api-keys/"))) == 1


def test_another_tenants_key_is_a_404(acme, globex, outsider):
    key, _ = ApiKey.objects.create_key(tenant=globex.tenant, name="k")
    assert_hidden_from([acme.owner, outsider], f"/api/v1/api-keys/{key.pk}/")
    response = as_user(acme.owner).post(f"/api/v1/api-keys/{key.pk}/revoke/")
    assert response.status_code == 404
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None


def test_key_for_another_tenant_cannot_be_created(acme, globex):
    response = create_key(acme.owner, tenant="globex")
    assert response.status_code == 400 and "tenant" in response.data
    assert not ApiKey.objects.exists()


def test_revoked_key_is_unusable(acme):
    secret = create_key(acme.owner).data["secret"]
    key = ApiKey.objects.get()
    response = as_user(acme.owner).post(f"/api/v1/api-keys/{key.pk}/revoke/")
    assert response.status_code == 200 and response.data["revoked_at"] is not None
    assert response.data["is_usable"] is False
    assert ApiKey.objects.for_secret(secret) is None


def test_expired_key_is_unusable_and_past_expiry_refused(acme):
    response = create_key(acme.owner, expires_at="2000-01-01T00:00:00Z")
    assert response.status_code == 400 and "future" in str(response.data["expires_at"])
    assert not ApiKey.objects.exists()


def test_bad_allowed_models_is_a_field_error(acme):
    response = create_key(acme.owner, allowed_models="everything")
    assert response.status_code == 400 and "allowed_models" in response.data


def test_duplicate_key_name_is_a_field_error(acme):
    assert create_key(acme.owner).status_code == 201
    response = create_key(acme.owner)
    assert response.status_code == 400
    assert ApiKey.objects.count() == 1
