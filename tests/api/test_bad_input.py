"""Bad input the API fuzz test found answering 500, now a 400 with a field error."""

from __future__ import annotations

import pytest

from serving_app.models import Gpu, Node
from tests.api.helpers import as_user

pytestmark = pytest.mark.django_db

NUL = "acme\x00"


def test_nul_character_in_a_tenant_slug_is_a_field_error(acme, platform_admin, base_model):
    for user, url, body in [
        (platform_admin, "/api/v1/deployments/",
         {"name": "d", "base_model": "llama-mini", "tenants": [NUL]}),
        (platform_admin, "/api/v1/plan/",
         {"name": "d", "base_model": "llama-mini", "tenants": [NUL]}),
        (acme.owner, "/api/v1/invitations/", {"tenant": NUL, "invited_as": "someone"}),
        (acme.owner, "/api/v1/api-keys/", {"tenant": NUL, "name": "k"}),
    ]:
        response = as_user(user).post(url, body, format="json")
        assert response.status_code == 400, (url, response.status_code)
        assert "does not exist" in str(response.data)


def test_nul_character_in_a_base_model_or_user_name_is_a_field_error(acme, platform_admin):
    client = as_user(platform_admin)
    response = client.post("/api/v1/deployments/",
                           {"name": "d", "base_model": "x\x00", "tenants": ["acme"]},
                           format="json")
    assert response.status_code == 400 and "base_model" in response.data
    response = client.post("/api/v1/memberships/", {"tenant": "acme", "user": "x\x00"},
                           format="json")
    assert response.status_code == 400 and "user" in response.data


def test_nul_character_in_an_autoscalers_deployment_name_is_a_field_error(platform_admin):
    response = as_user(platform_admin).post("/api/v1/autoscalers/", {"deployment": "d\x00"},
                                            format="json")
    assert response.status_code == 400 and "deployment" in response.data


def test_nul_character_in_a_path_or_query_is_not_a_500(acme, platform_admin):
    for user in (platform_admin, acme.owner):
        client = as_user(user)
        for url in ("/api/v1/tenants/ac%00me/", "/api/v1/adapters/?name=a%00b",
                    "/api/v1/tenants/?ordering=%00", "/api/v1/memberships/?user__username=%00",
                    "/api/v1/audit-log/?object_id=%00"):
            response = client.get(url)
            assert response.status_code in (200, 400, 403, 404), (url, response.status_code)


def test_huge_sample_window_is_capped_at_the_retention(platform_admin):
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="A100",
                             memory_total_bytes=80 * 1024**3)
    response = as_user(platform_admin).get(f"/api/v1/gpus/{gpu.pk}/samples/?hours=5.8e16")
    assert response.status_code == 200
    assert response.data["hours"] <= 24 * 366


def test_invitation_without_a_role_is_for_a_member(acme):
    response = as_user(acme.owner).post("/api/v1/invitations/",
                                        {"tenant": "acme", "invited_as": "someone"},
                                        format="json")
    assert response.status_code == 201 and response.data["role"] == "member"


def test_nul_character_in_a_tenants_sharing_group_is_a_field_error(acme, platform_admin):
    """Found by the fuzz test in CI: PUT /api/v1/tenants/{slug}/ with a NUL in the group."""
    response = as_user(platform_admin).patch(
        "/api/v1/tenants/acme/", {"prefix_cache_group": "group\x00"}, format="json")
    assert response.status_code == 400, response.status_code
    assert "prefix_cache_group" in response.data
