"""A deployment's flow-control report (`GET /api/v1/deployments/{id}/flow/`): the counters the
gateway's scripts keep in Redis, read back as shares and Jain's index for platform admins, and
only its own rows for a tenant's member (no co-tenant, no index)."""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings

from gateway_app.objectives import CONTROL_LUA
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


def test_platform_admins_see_the_admission_controllers_budget_and_what_it_measured(
        shared, platform_admin, globex):
    """acme states latency objectives and has a request holding a slot (r3): one step of the
    gateway's controller (its own script, on a worker's report of 1.25x the objective) halves
    the budget the others are held to. A tenant's member does not see it."""
    tenant = shared["deployment"].tenants.get(slug="acme")
    client = redis.Redis.from_url(settings.GATEWAY["REDIS_URL"])
    # What the admission script keeps beside r3's hold: its tenant's charges in flight.
    client.hset(sharing.prefix(shared["deployment"].pk) + ":c", str(tenant.pk), "300")
    control = client.register_script(CONTROL_LUA)
    control(args=[sharing.prefix(shared["deployment"].pk), 0, 130, 9, 1.25, 300.0, 50.0,
                  f",{tenant.pk},", 400, 40])
    client.close()
    data = as_user(platform_admin).get(url(shared)).json()["admission"]
    assert data["active"] is True and data["budget"] == 65 and data["full_budget"] == 130
    assert (data["ttft_objective_ms"], data["tpot_objective_ms"]) == (400, 40)
    assert (data["ratio"], data["tpot_ms"]) == (1.25, 50.0)
    assert [(p["budget"], p["ratio"]) for p in data["history"]] == [(65, 1.25)]
    assert as_user(globex.owner).get(url(shared)).json()["admission"] is None


def test_without_objectives_there_is_no_admission_state(shared, platform_admin):
    assert as_user(platform_admin).get(url(shared)).json()["admission"] is None
