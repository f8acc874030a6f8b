"""A deployment's flow-control report (`GET /api/v1/deployments/{id}/flow/`): the counters the
gateway's scripts keep in Redis, read back as shares and Jain's index for platform admins, and
only its own rows for a tenant's member (no co-tenant, no index)."""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings

from serving_app.deployments import inflight, sharing
from serving_app.models import Instance
from tests.api.helpers import as_user
from tests.factories import add_member, make_deployment, make_tenant, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def shared(acme, globex, base_model):
    """acme (weight 3) and globex (weight 1) on one deployment; in the current minute acme was
    served 300 weighted tokens and globex 100, both backlogged; globex has 2 requests queued
    now and the instance 2 in flight."""
    acme.tenant.fair_share_weight = 3
    acme.tenant.save()
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared")
    instance = Instance.objects.create(deployment=deployment, ordinal=0, state="ready")
    client = redis.Redis.from_url(settings.GATEWAY["REDIS_URL"])
    key = sharing.prefix(deployment.pk)
    for stale in client.scan_iter(key + ":*"):
        client.delete(stale)
    client.delete(inflight.key(instance.pk))
    a, g = acme.tenant.pk, globex.tenant.pk
    minute = int(time.time() // 60)
    client.hset(f"{key}:m:{minute}", mapping={
        f"n:{a}": 3, f"w:{a}": 300, f"b:{a}": 2, f"s:{a}": 300,
        f"n:{g}": 1, f"w:{g}": 900, f"b:{g}": 1, f"s:{g}": 100, f"x:{g}": 1,
    })
    client.rpush(f"{key}:q:{g}", "r1", "r2")
    now_ms = time.time() * 1000
    client.zadd(inflight.key(instance.pk), {"r3": now_ms + 60_000,
                                                    "r4": now_ms + 60_000,
                                                    "gone": now_ms - 1})
    # The same requests as flow control holds them, with their tenants: `gone`'s lease is over.
    client.hset(f"{key}:cr", mapping={"r3": f"{a}|300", "r4": f"{g}|100", "gone": f"{a}|50"})
    client.zadd(f"{key}:cx", {"r3": now_ms + 60_000, "r4": now_ms + 60_000, "gone": now_ms - 1})
    yield {"deployment": deployment, "instance": instance}
    for stale in client.scan_iter(key + ":*"):
        client.delete(stale)
    client.delete(inflight.key(instance.pk))
    client.close()


def url(shared) -> str:
    return f"/api/v1/deployments/{shared['deployment'].pk}/flow/"


def test_platform_admins_see_every_tenants_share_and_the_fairness_index(shared, platform_admin):
    data = as_user(platform_admin).get(url(shared)).json()
    assert data["flow_control"] is True
    assert data["dispatched_now"] == {str(shared["instance"].pk): 2}
    rows = {r["tenant"]: r for r in data["tenants"]}
    assert rows["acme"]["served_share"] == 0.75 and rows["acme"]["entitled_share"] == 0.75
    assert rows["globex"]["served_share"] == 0.25 and rows["globex"]["entitled_share"] == 0.25
    assert rows["acme"]["mean_wait_ms"] == 100.0 and rows["globex"]["mean_wait_ms"] == 900.0
    assert (rows["globex"]["queued"], rows["globex"]["left_queue"]) == (2, 1)
    assert (rows["acme"]["in_flight"], rows["globex"]["in_flight"]) == (1, 1)
    # Service per unit of weight is equal (100 each): perfectly fair.
    assert data["jain_index"] == 1.0


def test_the_index_drops_when_service_ignores_the_weights(shared, platform_admin):
    client = redis.Redis.from_url(settings.GATEWAY["REDIS_URL"])
    minute = int(time.time() // 60)
    key = f"{sharing.prefix(shared['deployment'].pk)}:m:{minute}"
    client.hset(key, mapping={f"s:{shared['deployment'].tenants.get(slug='globex').pk}": 300})
    client.close()
    data = as_user(platform_admin).get(url(shared)).json()
    # acme 300/3 = 100, globex 300/1 = 300: (400)^2 / (2 * (100^2 + 300^2)) = 0.8
    assert data["jain_index"] == 0.8


@pytest.mark.parametrize("role", ["owner", "viewer"])
def test_a_tenant_member_sees_only_its_own_share_and_waits(shared, globex, role):
    response = as_user(getattr(globex, role)).get(url(shared))
    assert response.status_code == 200
    data = response.json()
    assert [r["tenant"] for r in data["tenants"]] == ["globex"]
    assert data["tenants"][0]["entitled_share"] == 0.25
    assert data["tenants"][0]["in_flight"] == 1
    assert data["jain_index"] is None and data["dispatched_now"] == {}
    assert "acme" not in response.content.decode()


def test_other_tenants_and_outsiders_get_a_404(shared, outsider):
    initech = make_tenant("initech")
    stranger = make_user("initech-owner")
    add_member(initech, stranger, "owner")
    for user in (outsider, stranger):
        assert as_user(user).get(url(shared)).status_code == 404


def test_without_flow_control_nothing_is_counted_in_flight(shared, platform_admin):
    """Requests to a first-come-first-served deployment hold no slot: their count is unknown
    here (null), not 0."""
    shared["deployment"].flow_control = False
    shared["deployment"].save(update_fields=["flow_control"])
    data = as_user(platform_admin).get(url(shared)).json()
    assert data["flow_control"] is False
    assert [r["in_flight"] for r in data["tenants"]] == [None, None]
