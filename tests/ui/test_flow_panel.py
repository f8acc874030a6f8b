"""The deployment page's flow-control panel: its budget and, per tenant, the queue, waits and
served against entitled share from the gateway's counters in Redis, with Jain's index."""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings
from django.urls import reverse

from gateway_app.objectives import CONTROL_LUA
from serving_app.deployments import sharing
from tests.factories import make_deployment
from tests.ui.conftest import flow_minute

pytestmark = pytest.mark.django_db


def test_the_deployment_page_shows_shares_waits_and_the_fairness_index(
    platform_admin, acme, globex, base_model, login
):
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                                 max_num_seqs=8)
    a, g = acme.tenant.pk, globex.tenant.pk
    counters = {f"n:{a}": 4, f"w:{a}": 1000, f"b:{a}": 4, f"s:{a}": 300,
                f"n:{g}": 1, f"w:{g}": 0, f"b:{g}": 1, f"s:{g}": 100}
    with flow_minute(deployment.pk, counters, queued={g: ["r1"]}):
        page = login(platform_admin).get(
            reverse("console:deployment-detail", args=[deployment.pk])).content.decode()
    assert "each instance is sent at most 10 requests at a time" in page  # 8 + allowance 2
    # (300 + 100)^2 / (2 (300^2 + 100^2)) = 0.8
    assert "Jain's index over the backlogged tenants: <strong>0.800</strong>" in page
    assert "250 ms" in page and "75%" in page and "25%" in page


@pytest.fixture
def flow_counters(acme, globex, base_model):
    """A running shared deployment under flow control, and a minute of the gateway's counters
    for it: acme dispatched 4 requests that waited 1 s in all and had one leave the queue
    after 500 ms; globex dispatched 1 at once."""
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                                 max_num_seqs=8, desired_state="running", flow_control=True)
    a, g = acme.tenant.pk, globex.tenant.pk
    with flow_minute(deployment.pk, {
        f"n:{a}": 4, f"w:{a}": 1000, f"b:{a}": 4, f"s:{a}": 300, f"x:{a}": 1, f"xw:{a}": 500,
        f"n:{g}": 1, f"w:{g}": 0, f"b:{g}": 1, f"s:{g}": 100,
    }):
        yield deployment


def _series(payload: dict) -> dict[str, list]:
    return {trace["name"]: trace["y"] for trace in payload["figures"]["queue_wait"]["data"]}


def test_the_latency_dashboard_charts_queue_waits_and_reports_each_deployment(
    flow_counters, platform_admin, login
):
    client = login(platform_admin)
    payload = client.get(reverse("console:dashboard-data", args=["latency"]),
                         {"range": "1h"}).json()
    waits = _series(payload)
    # acme: (1000 + 500) ms over 4 dispatched + 1 that left; globex: 0 ms over 1.
    assert waits["acme on shared"][-1] == 300 and waits["globex on shared"][-1] == 0
    assert len(waits["acme on shared"]) == 60  # one point a minute of the hour
    tables = payload["tables"]
    assert "Flow control, last 60 minutes" in tables
    assert "Jain's index over the backlogged tenants: 0.800" in tables
    assert "250 ms" in tables and "75%" in tables
    page = client.get(reverse("console:dashboard", args=["latency"])).content.decode()
    assert 'id="chart-queue_wait"' in page
    # A week's range shows the two hours the gateway keeps.
    week = client.get(reverse("console:dashboard-data", args=["latency"]),
                      {"range": "7d"}).json()
    assert len(_series(week)["acme on shared"]) == 120


def test_a_tenants_portal_charts_only_its_own_waits_by_model(flow_counters, acme, login):
    client = login(acme.viewer)
    payload = client.get(reverse("portal:dashboard-data", args=["acme", "latency"]),
                         {"range": "1h"}).json()
    waits = _series(payload)
    assert list(waits) == [flow_counters.base_model.name]
    assert waits[flow_counters.base_model.name][-1] == 300
    assert "globex" not in payload["tables"] and "Jain" not in payload["tables"]
    assert "shared" not in str(payload["figures"]["queue_wait"])


def test_the_latency_dashboard_says_when_no_deployment_uses_flow_control(
    platform_admin, login, acme, base_model
):
    make_deployment(base_model, [acme.tenant], name="solo", desired_state="running",
                    flow_control=False)
    payload = login(platform_admin).get(reverse("console:dashboard-data",
                                                args=["latency"])).json()
    assert "No running deployment uses flow control" in payload["tables"]
    assert _series(payload) == {}


def test_the_deployment_page_shows_the_admission_controllers_budget_and_objectives(
    platform_admin, acme, globex, base_model, login
):
    """acme states latency objectives and has a request holding a slot; two steps of the
    gateway's controller (its own script) on reports of 1.25x and 0.8x the objective: the page
    shows the budget the others are held to, the objectives, the last measurement and when the
    budget changed."""
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                                 max_num_seqs=8)
    a = acme.tenant.pk
    with flow_minute(deployment.pk, {f"n:{a}": 1}):
        key = sharing.prefix(deployment.pk)
        client = redis.Redis.from_url(settings.GATEWAY["REDIS_URL"])
        client.hset(f"{key}:c", str(a), "300")
        control = client.register_script(CONTROL_LUA)
        now = int(time.time() * 1000)
        for step, (ratio, tpot) in enumerate([(1.25, 50.0), (0.8, 32.0)]):
            control(args=[key, now + 250 * step, 10, 2, ratio, -1, tpot, f",{a},", 400, 40])
        client.close()
        page = login(platform_admin).get(
            reverse("console:deployment-detail", args=[deployment.pk])).content.decode()
    assert "the others are sent at most <strong>5</strong> requests per instance (active" in page
    assert "first token 400 ms, per token 40 ms" in page
    assert "0.80 of the objective; first token —, per token 32.0 ms" in page
    # One change (10 to 5), the hold after it is not a change.
    assert page.count('<td class="num">5</td>') == 1


def test_the_deployment_page_says_what_the_urgent_batch_cap_is_and_why(
    platform_admin, acme, globex, base_model, login
):
    """The automatic cap, with the tenants that turn it on; an FCFS deployment serving such a
    tenant says what priority scheduling would do; the API gives the same figure."""
    from tenants_app.models import PriorityTier, Tenant

    Tenant.objects.filter(pk=acme.tenant.pk).update(priority_tier=PriorityTier.HIGH,
                                                     ttft_objective_ms=300)
    priority = make_deployment(base_model, [acme.tenant, globex.tenant], name="prio",
                               scheduling_policy="priority")
    fcfs = make_deployment(base_model, [acme.tenant], name="fcfs")
    client = login(platform_admin)

    def scheduling(deployment) -> str:
        page = client.get(reverse("console:deployment-detail", args=[deployment.pk]))
        text = page.content.decode()
        start = text.index('id="deployment-scheduling">')
        return text[start:text.index("</dd>", start)]

    assert ("at most 8 running beside an urgent request (automatic on GPU engines: "
            f"{acme.tenant.slug} high tier with a latency objective)") in scheduling(priority)
    assert (f"{acme.tenant.slug} has a latency objective at high tier: priority scheduling "
            "lets the engine protect it") in scheduling(fcfs)
    body = client.get(f"/api/v1/deployments/{priority.pk}/").json()
    assert (body["urgent_batch_cap"], body["effective_urgent_batch_cap"]) == (None, 8)
    Tenant.objects.filter(pk=acme.tenant.pk).update(ttft_objective_ms=None)
    assert "no urgent batch cap" in scheduling(priority)
    assert "priority scheduling" not in scheduling(fcfs)
    assert client.get(f"/api/v1/deployments/{priority.pk}/").json()[
        "effective_urgent_batch_cap"] == 0
