"""Co-tenant privacy, written as the attacks: a tenant user reading a deployment shared with
other tenants learns nothing about them, nor about the host its engines run on.

Each test reads what the attacker reads and asserts the secret is not in the response body at
all (not only absent from one field), so a leak through any other field fails it too.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from audit_app.models import AuditLog
from serving_app.models import Instance, Node
from tests.api.helpers import as_user, results
from tests.factories import make_adapter, make_deployment, make_tenant, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def shared(acme, globex, base_model, tmp_path):
    """A deployment serving acme, globex and initech, with one adapter each and one running
    instance (node, port, pid, log and last error recorded)."""
    initech = make_tenant("initech")
    adapters = {
        t.slug: make_adapter(t, base_model, tmp_path / "adapters", name=f"{t.slug}-style")
        for t in (acme.tenant, globex.tenant, initech)
    }
    deployment = make_deployment(
        base_model, [acme.tenant, globex.tenant, initech], name="shared",
        adapters=list(adapters.values()), base_port=18555,
    )
    node = Node.objects.create(name="gpu-secret-host", queue="node.gpu-secret-host",
                               address="10.9.8.7")
    instance = Instance.objects.create(
        deployment=deployment, node=node, port=18777, pid=424242, state=Instance.State.READY,
        last_error="engine exited: /srv/hidden/engine.log says OOM",
        log_tail="INFO loading /srv/hidden/weights", log_path="/srv/hidden/engine.log",
    )
    return {"deployment": deployment, "adapters": adapters, "instance": instance,
            "initech": initech, "acme": acme, "globex": globex}


def body(response) -> str:
    assert response.status_code == 200, response.content[:500]
    return response.content.decode()


HOST_SECRETS = ("gpu-secret-host", "10.9.8.7", "18777", "424242", "/srv/hidden", "18555")


@pytest.mark.parametrize("role", ["owner", "admin", "member", "viewer"])
def test_viewer_of_a_shared_deployment_sees_only_its_own_tenant_and_adapters(shared, role):
    user = getattr(shared["acme"], role)
    client = as_user(user)
    detail = client.get(f"/api/v1/deployments/{shared['deployment'].pk}/")
    listed = client.get("/api/v1/deployments/")
    for response in (detail, listed):
        text = body(response)
        assert "globex" not in text and "initech" not in text
        for other in ("globex", "initech"):
            assert str(shared["adapters"][other].pk) not in json.dumps(
                json.loads(text).get("adapters", [])
            )
    data = detail.json()
    assert data["tenants"] == ["acme"]
    assert data["adapters"] == [shared["adapters"]["acme"].pk]


def test_tenant_user_sees_no_node_port_pid_log_or_error_of_an_instance(shared):
    client = as_user(shared["acme"].viewer)
    for url in (f"/api/v1/deployments/{shared['deployment'].pk}/", "/api/v1/deployments/",
                "/api/v1/deployments/?limit=500"):
        text = body(client.get(url))
        for secret in HOST_SECRETS:
            assert secret not in text, (url, secret)
    instance = client.get(f"/api/v1/deployments/{shared['deployment'].pk}/").json()["instances"]
    assert instance == [{"id": shared["instance"].pk, "ordinal": 0, "state": "ready"}]


def test_tenant_user_cannot_read_instances_or_nodes(shared):
    client = as_user(shared["acme"].owner)
    assert client.get("/api/v1/instances/").status_code == 403
    assert client.get(f"/api/v1/instances/{shared['instance'].pk}/").status_code == 403
    assert client.get("/api/v1/nodes/").status_code == 403


def test_platform_admin_still_sees_everything(shared, platform_admin):
    data = as_user(platform_admin).get(f"/api/v1/deployments/{shared['deployment'].pk}/").json()
    assert sorted(data["tenants"]) == ["acme", "globex", "initech"]
    assert len(data["adapters"]) == 3
    assert data["base_port"] == 18555
    assert data["instances"][0]["node"] == "gpu-secret-host"
    assert data["instances"][0]["port"] == 18777
    assert "/srv/hidden" in data["instances"][0]["last_error"]
    base_model_id = shared["deployment"].base_model_id
    model = as_user(platform_admin).get(f"/api/v1/base-models/{base_model_id}/")
    assert model.json()["path"]


def test_user_of_no_tenant_sees_no_base_model_path(base_model, outsider):
    client = as_user(outsider)
    for url in ("/api/v1/base-models/", f"/api/v1/base-models/{base_model.pk}/"):
        text = body(client.get(url))
        assert base_model.path not in text
        assert "path" not in (results(client.get(url)) if url.endswith("models/") else [{}])[0]


def test_tenant_owner_sees_no_base_model_or_adapter_path(shared):
    client = as_user(shared["acme"].owner)
    adapter = shared["adapters"]["acme"]
    for url in ("/api/v1/base-models/", "/api/v1/adapters/", f"/api/v1/adapters/{adapter.pk}/"):
        text = body(client.get(url))
        assert adapter.path not in text
        assert shared["deployment"].base_model.path not in text
        assert "/adapters/" not in text


def test_adapter_load_error_reaches_the_tenant_without_host_paths(shared):
    adapter = shared["adapters"]["acme"]
    adapter.last_error = (
        f"Loading into shared#0 failed (HTTP 400): no adapter at {adapter.path}/weights"
    )
    adapter.save(update_fields=["last_error"])
    data = as_user(shared["acme"].owner).get(f"/api/v1/adapters/{adapter.pk}/").json()
    assert "Loading into shared#0 failed (HTTP 400)" in data["last_error"]
    assert adapter.path not in data["last_error"]
    portal = Client()
    portal.force_login(shared["acme"].owner)
    page = body(portal.get("/portal/acme/adapters/"))
    assert "failed (HTTP 400)" in page
    assert adapter.path not in page


def test_audit_log_entries_of_the_tenant_carry_no_host_paths(shared, tmp_path):
    adapter = shared["adapters"]["acme"]
    AuditLog.objects.create(
        actor_label="acme-owner", action="create", object_type="serving_app.LoraAdapter",
        object_id=str(adapter.pk), object_repr=str(adapter), tenant=shared["acme"].tenant,
        changes={"path": adapter.path, "name": adapter.name,
                 "last_error": [None, f"missing {adapter.path}/x"]}, via="api",
    )
    owner = as_user(shared["acme"].owner)
    text = body(owner.get("/api/v1/audit-log/"))
    assert adapter.path not in text
    staff = as_user(make_user("staff-reader", staff=True))
    assert adapter.path in body(staff.get("/api/v1/audit-log/"))


def test_portal_pages_show_no_co_tenant_or_host_detail(shared):
    client = Client()
    client.force_login(shared["acme"].viewer)
    for url in ("/portal/acme/", "/portal/acme/models/", "/portal/acme/adapters/",
                "/portal/acme/playground/", "/portal/acme/keys/", "/portal/acme/members/",
                "/portal/acme/dashboards/usage/", "/portal/acme/dashboards/latency/",
                "/portal/acme/dashboards/usage/data/", "/portal/acme/dashboards/latency/data/"):
        text = body(client.get(url))
        for secret in (*HOST_SECRETS, "globex", "initech", shared["adapters"]["acme"].path,
                       shared["deployment"].base_model.path):
            assert secret not in text, (url, secret)


def test_filtering_by_another_tenants_slug_does_not_reveal_what_it_shares(shared):
    client = as_user(shared["acme"].viewer)
    assert results(client.get("/api/v1/deployments/?tenants__slug=globex")) == []
    assert results(client.get("/api/v1/deployments/?tenants__slug=initech")) == []
    assert len(results(client.get("/api/v1/deployments/?tenants__slug=acme"))) == 1
    staff = as_user(make_user("staff-filter", staff=True))
    assert len(results(staff.get("/api/v1/deployments/?tenants__slug=initech"))) == 1
