"""The capacity pages: the deployment page's "Capacity" section (the curve's charts with the
tenants' objectives drawn on them, what each tenant's objectives cost, running and cancelling a
test, its progress), the tenant form pricing its objectives before they are saved (without
script for the saved values, through its htmx partial as they are typed), and the portal's
"what your objectives cost", which shows a tenant its own deployments and objectives only."""

from __future__ import annotations

import json
import re

import plotly.graph_objects as go
import pytest

from serving_app import lifecycle
from serving_app.models import CapacityTest, Deployment, Instance, Node
from tests.factories import H200_8B_CURVE, make_curve, make_deployment

pytestmark = pytest.mark.django_db

ROWS = H200_8B_CURVE



@pytest.fixture
def shared(base_model, acme, globex):
    acme.tenant.ttft_objective_ms = 135
    acme.tenant.save()
    globex.tenant.latency_objective_ms = 700
    globex.tenant.save()
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                                 max_num_seqs=128, desired_state=Deployment.DesiredState.RUNNING)
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    Instance.objects.create(deployment=deployment, node=node, port=18200, state="ready")
    return deployment


def page(client, deployment) -> str:
    response = client.get(f"/deployments/{deployment.pk}/")
    assert response.status_code == 200
    return response.content.decode()


def figures(html: str) -> dict:
    found = re.search(r'<script id="capacity-figures" type="application/json">(.*?)</script>',
                      html, re.S)
    assert found is not None
    return json.loads(found.group(1))


def test_the_curve_is_drawn_with_each_tenants_objective_and_what_it_costs(
        shared, platform_admin, login):
    make_curve(shared, ROWS)
    html = page(login(platform_admin), shared)
    drawn = figures(html)
    assert set(drawn) == {"ttft", "tpot", "e2e"}
    for figure in drawn.values():
        go.Figure(figure)  # plotly validates what the builder skips
    ttft = drawn["ttft"]
    assert ttft["data"][0]["x"] == [210, 1548, 4898, 8438, 12549]
    assert ttft["data"][0]["y"] == [20, 40, 90, 180, 400]
    labels = [s["label"]["text"] for s in ttft["layout"].get("shapes", [])]
    assert labels == ["acme objective (135 ms)"]
    assert [s["label"]["text"] for s in drawn["e2e"]["layout"]["shapes"]] == \
        ["globex objective (700 ms)"]
    assert 'id="capacity-chart-tpot"' in html
    table = html.split('id="tenant-objective-costs"')[1].split("</table>")[0]
    acme_row, globex_row = table.split("<tr>")[2:4]
    assert "6668" in acme_row and "53%" in acme_row and "about 48.0" in acme_row
    assert "first token" in acme_row
    assert "2665" in globex_row and "end to end" in globex_row  # 700: a third from 660 to 780


def test_without_a_curve_the_section_says_why_and_offers_the_test(shared, platform_admin,
                                                                   login):
    html = page(login(platform_admin), shared)
    assert "No capacity test of this deployment has succeeded yet" in html
    assert 'value="1, 2, 4, 8, 16, 32, 64, 128"' in html  # the defaults from max_num_seqs
    assert "sends real load to one of this deployment's engines" in html
    assert all(f["layout"]["xaxis"]["visible"] is False for f in figures(html).values())


def test_running_a_test_queues_it_and_shows_its_progress_until_it_ends(
        shared, platform_admin, login, enqueued):
    client = login(platform_admin)
    response = client.post(f"/deployments/{shared.pk}/capacity-tests/", {
        "input_tokens": "64", "output_tokens": "16", "concurrency": "1, 2",
        "requests_per_level": "8"}, follow=True)
    assert "queued on gpu-a" in response.content.decode()
    test = CapacityTest.objects.get()
    assert (test.concurrency, test.requests_per_level) == ([1, 2], 8)
    assert enqueued == [(lifecycle.RUN_CAPACITY_TEST, (test.pk,), {"queue": "node.gpu-a"})]
    test.begin()
    progress = client.get(f"/deployments/{shared.pk}/capacity-tests/progress/").content.decode()
    assert "0 of 2 levels measured" in progress and 'hx-trigger="every 2s"' in progress
    again = client.post(f"/deployments/{shared.pk}/capacity-tests/", {
        "input_tokens": "64", "output_tokens": "16", "concurrency": "1",
        "requests_per_level": "8"}, follow=True).content.decode()
    assert "Not started: Capacity test" in again and "wait for it to finish" in again
    cancelled = client.post(f"/capacity-tests/{test.pk}/cancel/", follow=True).content.decode()
    assert "cancelled: no more requests" in cancelled
    done = client.get(f"/deployments/{shared.pk}/capacity-tests/progress/").content.decode()
    assert "hx-trigger" not in done and "cancelled" in done


def test_bad_settings_and_no_ready_instance_say_what_to_do(shared, platform_admin, login,
                                                            enqueued):
    client = login(platform_admin)
    # Refused settings: the page again, the form as typed, each message under its field.
    for typed, field, message in (
            ({"concurrency": "1, x"}, "concurrency", "Numbers separated by commas"),
            ({"output_tokens": "1"}, "output_tokens", "greater than or equal to 2"),
            ({"concurrency": "2, 2"}, "concurrency", "Each level once"),
            ({"requests_per_level": "2", "concurrency": "1, 8"}, "requests_per_level",
             "At least the highest concurrency level (8)"),
            ({"input_tokens": "99999"}, "input_tokens", "must fit the deployment's context")):
        response = client.post(f"/deployments/{shared.pk}/capacity-tests/", {
            "input_tokens": "64", "output_tokens": "16", "concurrency": "1",
            "requests_per_level": "8", **typed})
        assert response.status_code == 400, typed
        form = response.context["capacity_form"]
        assert form.errors[field] and message in " ".join(form.errors[field]), form.errors
        html = response.content.decode()
        section = html.split('id="capacity-test-form"')[1].split("</form>")[0]
        assert f'data-field="{field}"' in section and "errorlist" in section
        assert f'value="{typed[field]}"' in section  # as typed
    assert CapacityTest.objects.count() == 0 and enqueued == []
    Instance.objects.update(state="failed")
    none = client.post(f"/deployments/{shared.pk}/capacity-tests/", {
        "input_tokens": "64", "output_tokens": "16", "concurrency": "1",
        "requests_per_level": "8"}, follow=True).content.decode()
    assert "has no ready instance to measure" in none and enqueued == []


def test_the_tenant_form_prices_saved_objectives_without_script_and_typed_ones_as_typed(
        shared, platform_admin, login, acme):
    make_curve(shared, ROWS)
    client = login(platform_admin)
    form = client.get(f"/tenants/{acme.tenant.slug}/edit/").content.decode()
    costs = form.split('id="objective-costs"')[1]
    assert "shared" in costs and "6668" in costs and "53%" in costs
    assert 'hx-trigger="input delay:400ms from:#tenant-form"' in form
    typed = client.get(f"/tenants/{acme.tenant.slug}/objective-costs/",
                       {"ttft_objective_ms": "1000", "tpot_objective_ms": "",
                        "latency_objective_ms": "700"}).content.decode()
    assert "2665" in typed and "end to end" in typed
    wrong = client.get(f"/tenants/{acme.tenant.slug}/objective-costs/",
                       {"ttft_objective_ms": "-5"}).content.decode()
    assert "Not priced" in wrong and "12549" in wrong  # the bad value is no bound


def test_the_portal_shows_a_tenant_its_own_deployments_and_objectives_only(
        shared, base_model, acme, globex, login):
    make_curve(shared, ROWS)
    make_curve(make_deployment(base_model, [globex.tenant], name="globex-only"), ROWS)
    home = login(acme.viewer).get(f"/portal/{acme.tenant.slug}/").content.decode()
    panel = home.split('id="objective-costs-panel"')[1].split("</section>")[0]
    assert "shared" in panel and "6668" in panel
    assert "globex-only" not in panel and "700" not in panel.split("<table>")[0]
    tried = login(acme.viewer).get(f"/portal/{acme.tenant.slug}/",
                                   {"latency_objective_ms": "700"}).content.decode()
    assert "2665" in tried.split('id="objective-costs-panel"')[1]
