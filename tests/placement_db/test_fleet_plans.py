"""What-if plans as data: created through the API, the console and the admin with one validation
(the model's clean()), placed on their declared fleet with nothing started, shown on the GPU
allocation page beside the live allocation labelled as a plan, and platform admins' only."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.urls import reverse

from serving_app.fleet import plans as fleetplans
from serving_app.fleet.accounting import period_ending_now
from serving_app.fleet.place import place_replicas
from serving_app.fleet.report import accounting, allocation
from serving_app.management.commands.seed_demo import (
    TENANTS,
    THREE_DEPARTMENT_DEPLOYMENTS,
    THREE_DEPARTMENT_FLEET,
    seed_plan,
)
from serving_app.models import FleetPlan, Gpu, Instance
from tests.api.helpers import as_user, assert_forbidden_for
from tests.factories import make_base_model, make_deployment, make_tenant
from tests.placement_db.placement_helpers import make_node

pytestmark = pytest.mark.django_db

GPUS = "1xNVIDIA A100-SXM4-80GB:80GiB, 1:NVIDIA A100-SXM4-80GB:80GiB[3g.40gb,3g.40gb]"
FLEET = f"gpu-a: {GPUS}"


@pytest.fixture
def departments():
    """The demo's three tenants with their weights and quotas."""
    keep = ("priority_tier", "fair_share_weight", "gpu_memory_quota_gib")
    return [make_tenant(spec["slug"], **{k: spec[k] for k in keep}) for spec in TENANTS]


def plan_body(**fields):
    body = {"name": "next-quarter", "fleet": THREE_DEPARTMENT_FLEET,
            "deployments": THREE_DEPARTMENT_DEPLOYMENTS}
    body.update(fields)
    return body


def test_platform_admin_creates_a_plan_and_reads_its_placement(platform_admin, departments):
    client = as_user(platform_admin)
    response = client.post("/api/v1/fleet-plans/", plan_body(), format="json")
    assert response.status_code == 201, response.data
    assert response.data["created_by"] == "root-admin"
    placement = client.get(f"/api/v1/fleet-plans/{response.data['id']}/placement/").data
    assert placement["kind"] == "plan" and "nothing runs" in placement["label"]
    assert placement["summary"] == {
        "nodes": 1, "gpus": 4, "mig_devices": 5, "memory_total_bytes": 4 * 80 * 1024**3,
        "reserved_bytes": placement["summary"]["reserved_bytes"], "placed": 4, "refused": 0,
    }
    deployments = {d["name"]: d for d in placement["deployments"]}
    shared = deployments["shared-llama"]
    assert [(p["gpu_indexes"], p["mig_profile"]) for p in shared["placements"]] == [
        ([0], None), ([1], None)]
    assert {t["slug"]: t["share"] for t in shared["tenants"]} == {
        "customer-service": 0.5, "code-assistant": 0.25, "content-gen": 0.25}
    assert deployments["code-completion"]["placements"][0]["mig_profile"] == "3g.40gb"
    assert deployments["support-guard"]["placements"][0]["mig_profile"] == "1g.10gb"
    tenants = {t["slug"]: t for t in placement["tenants"]}
    assert tenants["customer-service"]["mig_slices"] == 1  # the guard's 1g.10gb
    assert tenants["code-assistant"]["deployments"] == ["shared-llama", "code-completion"]
    # Nothing ran and nothing is reserved: no node, GPU or instance row was written.
    assert not Gpu.objects.exists() and not Instance.objects.exists()
    assert allocation() == []


def test_bad_plans_are_field_errors_and_nothing_is_saved(platform_admin, departments):
    client = as_user(platform_admin)
    response = client.post("/api/v1/fleet-plans/", plan_body(
        fleet="gpu-a: 1x80GiB[4g.40gb,4g.40gb]\nnonsense",
        deployments=[{"name": "x", "model": "no-such-model", "tenants": ["nobody"]}],
    ), format="json")
    assert response.status_code == 400
    assert set(response.data) == {"fleet", "deployments"}
    assert response.data["fleet"] == [
        "line 1 (gpu-a): the MIG devices of GPU 0 take 8 compute slices; a GPU has 7 (in GPU "
        "declaration entry '1x80GiB[4g.40gb,4g.40gb]')",
        "line 2: expected NODE: GPUS, such as 'node-a: 4xNVIDIA A100-SXM4-80GB:80GiB'",
    ]
    response = client.post("/api/v1/fleet-plans/", plan_body(
        fleet=FLEET,
        deployments=[{"name": "x", "model": "no-such-model", "tenants": ["nobody"]},
                     {"name": "y", "model": "m", "tenants": ["content-gen"], "replicas": 99}],
    ), format="json")
    assert response.status_code == 400
    assert response.data["deployments"] == [
        "deployment 2 (y): replicas must be an integer from 1 to 64"]
    response = client.post("/api/v1/fleet-plans/", plan_body(
        fleet=FLEET, deployments=[{"name": "x", "model": "no-such-model", "tenants": ["nobody"]}],
    ), format="json")
    assert response.data["deployments"] == [
        "deployment 1 (x): there is no tenant 'nobody'",
        "deployment 1 (x): there is no base model 'no-such-model'; register it, or give the "
        "model's architecture as an object",
    ]
    assert client.post("/api/v1/fleet-plans/", plan_body(deployments="[not json"),
                       format="json").status_code == 400
    assert client.post("/api/v1/fleet-plans/", plan_body(policy="random", headroom=0.9),
                       format="json").data.keys() == {"policy", "headroom"}
    assert not FleetPlan.objects.exists()


def test_a_registered_base_model_is_planned_from_its_files(platform_admin, departments,
                                                          tmp_path):
    make_base_model(tmp_path / "models", "llama-mini")
    plan = FleetPlan(name="mini", fleet=FLEET, deployments=[
        {"name": "mini-shared", "model": "llama-mini", "tenants": ["content-gen"],
         "isolation": "mig", "max_num_seqs": 8},
    ])
    plan.full_clean()
    plan.save()
    (dep,) = fleetplans.plan_result(plan)["deployments"]
    assert dep["ok"] and dep["model"] == "llama-mini"
    assert dep["placements"][0]["mig_profile"] == "3g.40gb"


def test_a_tenant_removed_after_saving_refuses_only_its_deployments(departments):
    plan = seed_plan()
    departments[0].delete()  # customer-service
    result = fleetplans.plan_result(plan)
    refused = {d["name"]: d["reason"] for d in result["deployments"] if not d["ok"]}
    assert refused == {
        "shared-llama": "there is no tenant customer-service any more",
        "support-guard": "there is no tenant customer-service any more",
    }
    assert result["summary"]["placed"] == 2


def test_model_validation_is_the_same_in_every_front_door(departments):
    plan = FleetPlan(name="bad", fleet="", deployments=[{"name": "x"}])
    with pytest.raises(ValidationError) as caught:
        plan.full_clean()
    assert set(caught.value.message_dict) == {"fleet", "deployments"}


def test_tenants_see_no_plan(acme, departments):
    plan = seed_plan()
    for user in (acme.owner, acme.admin, acme.member):
        assert_forbidden_for([user], "get", "/api/v1/fleet-plans/")
        assert_forbidden_for([user], "get", f"/api/v1/fleet-plans/{plan.pk}/placement/")
        assert_forbidden_for([user], "post", "/api/v1/fleet-plans/", plan_body(name="mine"))
        assert not FleetPlan.objects.for_user(user).exists()
    assert FleetPlan.objects.count() == 1


def test_gpu_page_shows_the_plan_beside_the_live_allocation_labelled_as_a_plan(
    client, platform_admin, departments, acme
):
    make_node("live-gpu", "1xNVIDIA L4:24GiB")
    plan = seed_plan(platform_admin)
    client.force_login(platform_admin)
    page = client.get(reverse("console:dashboard", args=["gpus"]))
    html = page.content.decode()
    assert page.status_code == 200
    assert 'id="chart-by_deployment"' in html  # the live allocation
    assert 'id="chart-plan_by_deployment"' in html and 'id="what-if-plan"' in html
    assert '<span class="badge plan">PLAN</span> What-if plan: three-departments' in html
    assert "not running: no engine is started and nothing is reserved" in html
    assert "shared-llama" in html and "MIG 3g.40gb" in html
    data = client.get(reverse("console:dashboard-data", args=["gpus"])
                      + f"?plan={plan.pk}").json()
    title = data["figures"]["plan_by_tenant"]["layout"]["title"]["text"]
    assert title == "PLAN three-departments, not running: per tenant"
    bars = {t["name"] for t in data["figures"]["plan_by_tenant"]["data"]}
    assert {"customer-service", "code-assistant", "content-gen"} <= bars
    live_bars = {t["name"] for t in data["figures"]["by_deployment"]["data"]}
    assert "shared-llama" not in live_bars  # the plan is not mixed into the live chart
    # Tenant users get no console page, hence no plan.
    client.force_login(acme.owner)
    assert client.get(reverse("console:dashboard", args=["gpus"])).status_code == 403
    assert client.get(reverse("console:fleetplan-detail", args=[plan.pk])).status_code == 403


def test_console_creates_edits_and_shows_a_plan(client, platform_admin, departments):
    client.force_login(platform_admin)
    response = client.post(reverse("console:fleetplan-create"), {
        "name": "tiny", "description": "", "fleet": "box: 1x24GiB[3x2g.8gb]",
        "deployments": '[{"name": "x", "model": {"num_layers": 2}, "tenants": ["content-gen"]}]',
        "policy": "binpack", "headroom": "",
    })
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert "take 6 compute slices" not in str(errors)  # 6 of 7 slices is allowed
    assert any("hidden_size is required" in e for e in errors["deployments"])
    response = client.post(reverse("console:fleetplan-create"), {
        "name": "tiny", "description": "", "fleet": "box: 1x24GiB[3x2g.8gb]",
        "deployments": "[]", "policy": "spread", "headroom": "0.2",
    })
    assert response.status_code == 302
    plan = FleetPlan.objects.get(name="tiny")
    assert plan.created_by == platform_admin and plan.headroom == 0.2
    page = client.get(reverse("console:fleetplan-detail", args=[plan.pk])).content.decode()
    assert "<span class=\"badge plan\">PLAN</span> tiny" in page
    assert "2g.8gb: free" in page
    edit = client.get(reverse("console:fleetplan-edit", args=[plan.pk]))
    assert edit.status_code == 200
    listing = client.get(reverse("console:fleetplan-list")).content.decode()
    assert "tiny" in listing


def test_admin_validates_plans_like_the_api(client, platform_admin, departments):
    client.force_login(platform_admin)
    response = client.post("/admin/serving_app/fleetplan/add/", {
        "name": "admin-plan", "description": "", "fleet": "box: 1x80GiB[4g.20gb,4g.20gb]",
        "deployments": "[]", "policy": "binpack", "headroom": "",
    })
    assert response.status_code == 200
    assert b"take 8 compute slices" in response.content
    response = client.post("/admin/serving_app/fleetplan/add/", {
        "name": "admin-plan", "description": "", "fleet": THREE_DEPARTMENT_FLEET,
        "deployments": "[]", "policy": "binpack", "headroom": "",
    })
    assert response.status_code == 302
    assert FleetPlan.objects.get(name="admin-plan").created_by == platform_admin


def test_a_declared_mig_node_agent_gets_mig_rows_and_placements_without_device_ids(
    departments, tmp_path
):
    """NODE_GPUS takes the same MIG syntax: the devices become rows and take MIG placements."""
    base = make_base_model(tmp_path / "models", "llama-mini")
    make_node("declared-mig", GPUS)
    parent = Gpu.objects.get(node__name="declared-mig", index=1, parent=None)
    assert parent.mig_mode and sorted(
        m.mig_profile for m in parent.mig_devices.all()) == ["3g.40gb", "3g.40gb"]
    deployment = make_deployment(base, departments[:1], isolation_mode="mig", max_num_seqs=8)
    (instance,), reason = place_replicas(deployment, [0])
    assert reason == ""
    (gpu,) = instance.gpus.all()
    assert gpu.parent_id == parent.pk and instance.environment == {}
    (dep,) = accounting(period_ending_now(timedelta(hours=1)))["deployments"]
    assert dep["mig_slices"] == 3  # the 3 of 3g.40gb, charged to its one tenant
    assert dep["tenants"][0]["mig_slices"] == 3


def test_the_demo_seed_leaves_the_gpu_page_showing_the_three_department_plan(client):
    """`manage.py seed_demo` (what scripts/demo.sh runs) on a host without GPUs: the GPU
    allocation page opens on the plan at once, all four deployments placed."""
    call_command("seed_demo", stdout=io.StringIO())
    call_command("seed_demo", stdout=io.StringIO())  # idempotent
    plan = FleetPlan.objects.get()
    assert plan.name == "three-departments"
    client.force_login(get_user_model().objects.get(username="admin"))
    html = client.get(reverse("console:dashboard", args=["gpus"])).content.decode()
    assert "What-if plan: three-departments" in html
    assert "4 deployments placed" in html and "refused" not in html
    assert "No GPUs registered" in client.get(
        reverse("console:dashboard-data", args=["gpus"])).json()["tables"]
