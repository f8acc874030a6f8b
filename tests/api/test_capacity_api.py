"""Capacity tests and what an objective costs, in the management API: starting one (its
defaults, its settings' field errors, the 409s while one is live or no instance is ready, the
task sent to the node's queue), cancelling one, and `objective-cost/` with its field errors,
each tenant's saved objectives, and the cross-tenant 404 and role 403."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from serving_app import frontier, lifecycle
from serving_app.models import CapacityTest, Deployment, Instance, Node
from tests.api.helpers import as_user, assert_forbidden_for
from tests.factories import H200_8B_CURVE, make_curve, make_deployment

pytestmark = pytest.mark.django_db

ROWS = H200_8B_CURVE



@pytest.fixture
def shared(base_model, acme, globex):
    """A deployment of acme and globex with a ready instance on a node."""
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                                 max_num_seqs=256, desired_state=Deployment.DesiredState.RUNNING)
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    Instance.objects.create(deployment=deployment, node=node, port=18200, state="ready")
    return deployment


def start(user, **body):
    return as_user(user).post("/api/v1/capacity-tests/", {"deployment": "shared", **body},
                              format="json")


def test_a_start_takes_the_deployments_defaults_and_goes_to_its_nodes_queue(
        shared, platform_admin, enqueued):
    response = start(platform_admin)
    assert response.status_code == 201, response.data
    data = response.data
    assert (data["state"], data["deployment"], data["node_name"]) == ("queued", "shared", "gpu-a")
    assert (data["input_tokens"], data["output_tokens"]) == (256, 128)
    assert data["concurrency"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert data["requests_per_level"] == 256 and data["levels_total"] == 9
    assert data["created_by"] == platform_admin.username
    assert enqueued == [(lifecycle.RUN_CAPACITY_TEST, (data["id"],), {"queue": "node.gpu-a"})]


@pytest.mark.parametrize(("body", "field"), [
    ({"concurrency": [0, 2]}, "concurrency"),
    ({"concurrency": list(range(1, 12))}, "concurrency"),
    ({"concurrency": [1, 1]}, "concurrency"),
    ({"concurrency": [1, 64], "requests_per_level": 16}, "requests_per_level"),
    ({"output_tokens": 1}, "output_tokens"),
    ({"input_tokens": 1000, "output_tokens": 100}, "input_tokens"),  # past max_model_len
    ({"deployment": "nowhere"}, "deployment"),
])
def test_bad_settings_are_field_errors(shared, platform_admin, enqueued, body, field):
    shared.max_model_len = 1024
    shared.save()
    response = start(platform_admin, **body)
    assert response.status_code == 400 and field in response.data, response.data
    assert CapacityTest.objects.count() == 0 and enqueued == []


def test_no_second_test_while_one_is_live_and_none_without_a_ready_instance(
        shared, platform_admin, enqueued):
    assert start(platform_admin, concurrency=[1]).status_code == 201
    refused = start(platform_admin, concurrency=[1])
    assert refused.status_code == 409 and "is queued" in refused.data["detail"]
    CapacityTest.objects.update(state="failed")
    Instance.objects.update(state="starting")
    refused = start(platform_admin, concurrency=[1])
    assert refused.status_code == 409 and "no ready instance" in refused.data["detail"]


def test_a_cancel_stops_a_live_test_once(shared, platform_admin, enqueued):
    test = CapacityTest.objects.start(shared, platform_admin, concurrency=[1])
    url = f"/api/v1/capacity-tests/{test.pk}/cancel/"
    response = as_user(platform_admin).post(url)
    assert response.status_code == 200 and response.data["state"] == "cancelled"
    again = as_user(platform_admin).post(url)
    assert again.status_code == 409 and "already cancelled" in again.data["detail"]
    assert test.begin() is False  # its agent finds it cancelled and runs nothing


def test_tenants_neither_run_nor_read_capacity_tests(shared, acme, enqueued):
    test = CapacityTest.objects.start(shared, None, concurrency=[1])
    for user in (acme.owner, acme.admin, acme.viewer):
        assert as_user(user).get("/api/v1/capacity-tests/").status_code == 403
        assert as_user(user).get(f"/api/v1/capacity-tests/{test.pk}/").status_code == 403
    assert_forbidden_for([acme.owner], "post", "/api/v1/capacity-tests/",
                         {"deployment": "shared"})
    assert_forbidden_for([acme.owner], "post", f"/api/v1/capacity-tests/{test.pk}/cancel/")


def test_the_list_shows_the_points_newest_first(shared, platform_admin):
    older = make_curve(shared, ROWS[:2])
    newer = make_curve(shared, ROWS)
    data = as_user(platform_admin).get(f"/api/v1/capacity-tests/?deployment={shared.pk}").data
    assert [t["id"] for t in data["results"]] == [newer.pk, older.pk]
    assert [p["concurrency"] for p in data["results"][0]["points"]] == [1, 8, 32, 64, 128]


def cost_url(deployment, query: str = "") -> str:
    return f"/api/v1/deployments/{deployment.pk}/objective-cost/?{query}"


def test_objective_cost_before_any_curve_says_how_to_get_one(shared, platform_admin):
    data = as_user(platform_admin).get(cost_url(shared, "ttft_ms=100")).data
    assert data["cost"] is None and data["capacity_test"] is None
    assert "No capacity test of shared has succeeded yet" in data["detail"]


def test_objective_cost_on_the_newest_curve_and_each_tenants_saved_objectives(
        shared, platform_admin, acme, globex):
    make_curve(shared, ROWS)
    acme.tenant.ttft_objective_ms = 135
    acme.tenant.save()
    data = as_user(platform_admin).get(cost_url(shared, "ttft_ms=135&tpot_ms=&e2e_ms=2000")).data
    assert data["objectives"] == {"ttft_ms": 135.0, "tpot_ms": None, "e2e_ms": 2000.0}
    cost = data["cost"]
    assert (cost["reach"], cost["limited_by"]) == ("part", "ttft")
    assert cost["concurrency"] == pytest.approx(48)
    assert cost["fraction"] == pytest.approx((4898 + 8438) / 2 / 12549)
    rows = {row["tenant"]: row for row in data["tenants"]}
    assert rows["acme"]["cost"]["tokens_per_s"] == pytest.approx((4898 + 8438) / 2)
    assert rows["globex"]["cost"]["reach"] == "whole"  # no objective: the whole curve


@pytest.mark.parametrize("query", ["ttft_ms=abc", "tpot_ms=-1", "e2e_ms=0", "ttft_ms=1e99"])
def test_a_bad_objective_is_a_field_error(shared, platform_admin, query):
    response = as_user(platform_admin).get(cost_url(shared, query))
    assert response.status_code == 400 and query.split("=")[0] in response.data


def test_a_tenant_reads_costs_of_its_own_deployments_and_objectives_only(
        shared, base_model, acme, globex):
    make_curve(shared, ROWS)
    globex.tenant.latency_objective_ms = 700
    globex.tenant.save()
    data = as_user(acme.viewer).get(cost_url(shared, "e2e_ms=700")).data
    assert [row["tenant"] for row in data["tenants"]] == ["acme"]
    assert "700" not in str(data["tenants"])  # globex's objective is not shown to acme
    theirs = make_deployment(base_model, [globex.tenant], name="globex-only")
    for user in (acme.owner, acme.viewer):
        assert as_user(user).get(cost_url(theirs)).status_code == 404


def test_the_command_starts_a_test_follows_it_and_writes_its_json(
        shared, monkeypatch, tmp_path, capsys):
    """The node agent stands in as a function that measures one level at once (its real run:
    tests/engine/test_capacity_test.py)."""
    def agent(name, test_id, **kw):
        test = CapacityTest.objects.get(pk=test_id)
        test.begin()
        test.add_point(frontier.summarise(1, 2.0, ttfts_s=[0.1], e2els_s=[0.8],
                                          output_lens=[8], failed=0), [])
        test.finish()

    monkeypatch.setattr(lifecycle, "enqueue", agent)
    out = tmp_path / "capacity.json"
    call_command("capacity_test", "shared", "--concurrency", "1", "--requests-per-level", "4",
                 "--wait", "--json", str(out))
    printed = capsys.readouterr().out
    assert "queued on gpu-a" in printed and "1 concurrent:" in printed and "succeeded" in printed
    report = json.loads(out.read_text())
    assert (report["state"], report["concurrency"], report["requests_per_level"]) == \
        ("succeeded", [1], 4)
    assert report["points"][0]["output_tokens"] == 8
    with pytest.raises(CommandError, match="wait for it to finish|no ready instance"):
        Instance.objects.update(state="failed")
        call_command("capacity_test", "shared")
