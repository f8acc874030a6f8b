"""The admin console's pages through Django's test client: access, forms, actions, dashboards."""

from __future__ import annotations

import json
import re

import pytest
from django.urls import reverse
from django.utils import timezone

from audit_app.models import AuditLog
from serving_app.deployments import autoscaling
from serving_app.engine.launch import build_launch_spec
from serving_app.metering.queries import percentile
from serving_app.models import Deployment, FleetPlan, Instance, Node, canaries
from serving_app.models.autoscalers import Autoscaler
from tenants_app.models import Tenant
from tests.factories import make_adapter, make_deployment, make_tenant

pytestmark = pytest.mark.django_db

PAGES = [
    ("console:overview", []),
    ("console:tenant-list", []),
    ("console:tenant-create", []),
    ("console:basemodel-list", []),
    ("console:loraadapter-list", []),
    ("console:deployment-list", []),
    ("console:deployment-create", []),
    ("console:audit-log", []),
    ("console:backup-list", []),
    ("console:event-list", []),
    ("console:node-list", []),
    ("console:guardrail-floor", []),
    ("console:dashboard", ["usage"]),
    ("console:dashboard", ["latency"]),
    ("console:dashboard", ["gpus"]),
]


def test_signed_out_visitor_is_sent_to_sign_in(client):
    response = client.get(reverse("console:overview"))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("console:login"))


@pytest.mark.parametrize(("name", "args"), PAGES)
def test_tenant_users_get_403_from_console_pages(login, acme, name, args):
    assert login(acme.owner).get(reverse(name, args=args)).status_code == 403


@pytest.mark.parametrize(("name", "args"), PAGES)
def test_platform_admin_sees_every_console_page(login, platform_admin, name, args):
    response = login(platform_admin).get(reverse(name, args=args))
    assert response.status_code == 200
    assert b"/static/vendor/htmx.min.js" in response.content
    # Nothing is loaded from another host (a bare "cdn" can occur in a random CSRF token).
    assert not re.search(rb'(src|href)="(https?:)?//', response.content)


def test_sign_in_sends_staff_to_console_and_tenant_users_to_their_portal(
    client, platform_admin, acme
):
    url = reverse("console:login")
    response = client.post(url, {"username": "root-admin", "password": "pw-12345678"})
    assert response["Location"] == reverse("console:overview")
    client.logout()
    response = client.post(url, {"username": "acme-member", "password": "pw-12345678"},
                           follow=True)
    assert response.redirect_chain[-1][0] == reverse("portal:tenant-home", args=["acme"])


def test_overview_shows_nodes_deployments_instances_and_tenant_load(
    login, platform_admin, acme, base_model, usage
):
    node = Node.objects.create(name="cpu-1", queue="node.cpu-1")
    deployment = make_deployment(base_model, [acme.tenant], name="support-bot")
    Instance.objects.create(deployment=deployment, node=node, state=Instance.State.READY, port=1)
    usage(acme.tenant, requests=50)
    response = login(platform_admin).get(reverse("console:overview"))
    body = response.content.decode()
    assert "cpu-1" in body and "support-bot" in body
    assert 'data-instance-state="ready"' in body
    # 50 requests over the last 5 minutes: 10.0 a minute, in acme's own row of the load table.
    [row] = [r for r in response.context["tenants"] if r["tenant"].slug == "acme"]
    assert row["load"]["rpm"] == pytest.approx(10.0)
    acme_row = re.search(r"<tr>\s*<td><a href=\"[^\"]*\">Acme Corp</a>.*?</tr>", body, re.S)
    assert acme_row and '<td class="num">10.0</td>' in acme_row.group(0)


def test_tenant_form_shows_the_models_validation_messages(login, platform_admin):
    client = login(platform_admin)
    response = client.post(reverse("console:tenant-create"), {
        "slug": "portal", "name": "Reserved", "status": "active", "priority_tier": 2,
        "tokens_per_minute": 100, "max_tokens_per_request": 500,
    })
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert errors["slug"] == ["'portal' is reserved; choose another slug."]
    assert "Cannot exceed tokens_per_minute (100)" in errors["max_tokens_per_request"][0]
    assert not Tenant.objects.filter(name="Reserved").exists()


def test_creating_a_tenant_is_audited_as_from_the_console(login, platform_admin):
    response = login(platform_admin).post(reverse("console:tenant-create"), {
        "slug": "initech", "name": "Initech", "status": "active", "priority_tier": 1,
        "latency_objective_ms": 800,
    })
    assert response.status_code == 302
    entry = AuditLog.objects.get(object_type="tenants_app.Tenant", action="create")
    assert entry.via == "console" and entry.actor_label == "root-admin"
    assert entry.changes["slug"] == "initech"


def test_editing_a_tenant_records_only_the_changed_fields(login, platform_admin, acme):
    client = login(platform_admin)
    response = client.post(reverse("console:tenant-edit", args=["acme"]), {
        "slug": "acme", "name": "Acme Corp", "status": "suspended", "priority_tier": 2,
        "tokens_per_minute": 100000,
    })
    assert response.status_code == 302
    entry = AuditLog.objects.get(action="update")
    assert entry.changes == {"status": ["active", "suspended"]}


def _deployment_post(base_model, tenants, adapters=(), **extra):
    data = {
        "name": "support-bot", "base_model": base_model.pk, "tenants": [t.pk for t in tenants],
        "adapters": [a.pk for a in adapters], "replicas": 1, "isolation_mode": "shared",
        "gpu_memory_utilization": 0.5, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
        "max_num_seqs": 8,
        "enable_prefix_caching": "on", "dtype": "auto", "quantization": "",
        "kv_cache_dtype": "auto", "max_loras": 2, "max_lora_rank": 16, "scheduling_policy": "fcfs",
    }
    data.update(extra)
    return data


def test_deployment_form_refuses_another_tenants_adapter_with_the_api_message(
    login, platform_admin, acme, globex, base_model, tmp_path
):
    adapter = make_adapter(globex.tenant, base_model, tmp_path / "a")
    response = login(platform_admin).post(
        reverse("console:deployment-create"),
        _deployment_post(base_model, [acme.tenant], [adapter]),
    )
    assert response.status_code == 200
    assert response.context["form"].errors["adapters"] == [
        f"{adapter} belongs to a tenant this deployment does not serve."
    ]
    assert not Deployment.objects.exists()


def test_deployment_form_runs_model_clean(login, platform_admin, acme, base_model):
    response = login(platform_admin).post(
        reverse("console:deployment-create"),
        _deployment_post(base_model, [acme.tenant], isolation_mode="mps"),
    )
    assert response.context["form"].errors["mps_thread_percentage"] == [
        "MPS isolation needs a thread percentage."
    ]


def test_plan_preview_shows_memory_and_placement_without_saving(
    login, platform_admin, acme, base_model
):
    Node.objects.create(name="cpu-1", queue="node.cpu-1", last_heartbeat=timezone.now())
    response = login(platform_admin).post(
        reverse("console:deployment-plan-new"), _deployment_post(base_model, [acme.tenant]),
        HTTP_HX_REQUEST="true",
    )
    body = response.content.decode()
    assert response.status_code == 200
    assert 'data-plan="ok"' in body and "cpu-1" in body and "KV cache" in body
    assert not Deployment.objects.exists()


def test_plan_preview_of_an_invalid_form_lists_its_errors(login, platform_admin, acme,
                                                          base_model):
    response = login(platform_admin).post(
        reverse("console:deployment-plan-new"),
        _deployment_post(base_model, [acme.tenant], max_num_seqs=0),
    )
    body = response.content.decode()
    assert 'data-plan="invalid"' in body
    assert "<strong>Max sequences per batch</strong>: Ensure this value is greater than" in body


def test_create_then_start_scale_restart_stop_a_deployment(
    login, platform_admin, acme, base_model
):
    client = login(platform_admin)
    response = client.post(reverse("console:deployment-create"),
                           _deployment_post(base_model, [acme.tenant]))
    deployment = Deployment.objects.get(name="support-bot")
    assert response["Location"] == reverse("console:deployment-detail", args=[deployment.pk])
    assert deployment.created_by == platform_admin
    action = "console:deployment-action"
    panel = client.post(reverse(action, args=[deployment.pk, "start"]), HTTP_HX_REQUEST="true")
    assert b"Starting support-bot" in panel.content and b'id="instances-poll"' in panel.content
    deployment.refresh_from_db()
    assert deployment.desired_state == "running"
    client.post(reverse("console:deployment-scale", args=[deployment.pk]), {"replicas": 3})
    client.post(reverse(action, args=[deployment.pk, "restart"]))
    client.post(reverse(action, args=[deployment.pk, "stop"]))
    deployment.refresh_from_db()
    assert (deployment.replicas, deployment.generation, deployment.desired_state) == (
        3, 1, "stopped"
    )
    actions = list(AuditLog.objects.filter(object_type="serving_app.Deployment")
                   .order_by("id").values_list("action", "via"))
    assert actions == [("create", "console"), ("start", "console"), ("scale", "console"),
                       ("restart", "console"), ("stop", "console")]


def test_scale_refuses_out_of_range_replicas(login, platform_admin, acme, base_model):
    deployment = make_deployment(base_model, [acme.tenant])
    response = login(platform_admin).post(
        reverse("console:deployment-scale", args=[deployment.pk]), {"replicas": 99},
        HTTP_HX_REQUEST="true",
    )
    assert b"Not scaled" in response.content
    deployment.refresh_from_db()
    assert deployment.replicas == 1


def test_instance_panel_and_log_tail(login, platform_admin, acme, base_model, tmp_path):
    deployment = make_deployment(base_model, [acme.tenant])
    log = tmp_path / "engine.log"
    log.write_text("INFO starting\nINFO Application startup complete.\n")
    instance = Instance.objects.create(
        deployment=deployment, state=Instance.State.STARTING, log_path=str(log))
    spec = build_launch_spec(instance)  # recorded as the node agent records it
    Instance.objects.filter(pk=instance.pk).update(command=spec.argv, environment=spec.env)
    client = login(platform_admin)
    panel = client.get(reverse("console:deployment-instances", args=[deployment.pk]))
    assert b'data-instance-state="starting"' in panel.content
    page = client.get(reverse("console:instance-detail", args=[instance.pk])).content.decode()
    assert "Application startup complete." in page and instance.secret not in page
    assert "--max-num-seqs 64" in page and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in page
    assert b"startup complete" in client.get(
        reverse("console:instance-log", args=[instance.pk])).content


def test_an_adapter_whose_canary_failed_shows_why_it_is_not_routed(login, platform_admin, acme,
                                                                   base_model):
    deployment = make_deployment(base_model, [acme.tenant])
    entries = canaries.record({}, "acme--good", ok=True)
    entries = canaries.record(entries, "acme--bad", ok=False, error="HTTP 400: NaN logprob")
    instance = Instance.objects.create(deployment=deployment, state=Instance.State.READY,
                                       loaded_adapters=["acme--bad", "acme--good"], canary=entries)
    client = login(platform_admin)
    panel = client.get(reverse("console:deployment-instances", args=[deployment.pk])).content
    assert b"canary failed: acme--bad (not routed)" in panel
    page = client.get(reverse("console:instance-detail", args=[instance.pk])).content.decode()
    assert "Canary failed for adapter acme--bad: HTTP 400: NaN logprob (1 attempt; next try" in page
    assert 'id="routable-adapters">acme--good <' in page


def test_audit_log_filters_by_tenant(login, platform_admin, acme, globex):
    client = login(platform_admin)
    for slug in ("acme", "globex"):
        client.post(reverse("console:tenant-edit", args=[slug]), {
            "slug": slug, "name": slug.title(), "status": "active", "priority_tier": 0,
        })
    response = client.get(reverse("console:audit-log"), {"tenant": "globex"})
    entries = list(response.context["object_list"])
    assert {e.tenant.slug for e in entries} == {"globex"}
    assert [e.action for e in entries if e.via == "console"] == ["update"]


def _figures(response) -> dict:
    assert response.status_code == 200
    return json.loads(response.content)


def test_usage_dashboard_stacks_requests_by_tenant(login, platform_admin, acme, globex, usage):
    usage(acme.tenant, requests=30)
    usage(globex.tenant, requests=12, minutes_ago=20)
    data = _figures(login(platform_admin).get(
        reverse("console:dashboard-data", args=["usage"]), {"range": "1h"}))
    traces = {t["name"]: sum(t["y"]) for t in data["figures"]["requests"]["data"]}
    assert traces == {"acme": 30, "globex": 12}
    assert data["figures"]["requests"]["layout"]["barmode"] == "stack"
    assert "acme-" not in data["tables"] and "Acme Corp" in data["tables"]


def test_latency_dashboard_draws_objectives_and_percentiles(
    login, platform_admin, acme, usage
):
    Tenant.objects.filter(pk=acme.tenant.pk).update(latency_objective_ms=400)
    usage(acme.tenant, requests=20, latency_ms=200, errors=2, rate_limited=1)
    data = _figures(login(platform_admin).get(
        reverse("console:dashboard-data", args=["latency"]), {"range": "24h"}))
    names = [t["name"] for t in data["figures"]["p95"]["data"]]
    assert names == ["acme p95"]
    shapes = data["figures"]["p95"]["layout"]["shapes"]
    assert [(s["y0"], s["label"]["text"]) for s in shapes] == [(400, "acme objective (400 ms)")]
    p95 = [v for v in data["figures"]["p95"]["data"][0]["y"] if v is not None]
    assert len(p95) == 1 and 100 < p95[0] <= 250
    assert "met" in data["tables"]


def test_gpu_dashboard_without_gpus_says_so(login, platform_admin):
    data = _figures(login(platform_admin).get(reverse("console:dashboard-data", args=["gpus"])))
    assert "No GPUs registered" in json.dumps(data["figures"]["by_deployment"])


def test_every_range_answers(login, platform_admin, acme, usage):
    usage(acme.tenant)
    client = login(platform_admin)
    for key in ("1h", "24h", "7d", "30d"):
        data = _figures(client.get(reverse("console:dashboard-data", args=["usage"]),
                                   {"range": key}))
        assert data["range"] == key
        assert sum(sum(t["y"]) for t in data["figures"]["requests"]["data"]) == 10


def test_percentiles_interpolate_inside_histogram_buckets():
    hist = {"requests": 100, "latency_le_100": 50, "latency_le_250": 40, "latency_le_500": 10,
            "latency_ms_max": 480}
    assert percentile(hist, 0.5) == 100
    # latency_le_500 counts (400, 500]: the 95th of 100 is half-way into it.
    assert percentile(hist, 0.95) == pytest.approx(450)
    assert percentile({"requests": 0}, 0.5) is None
    # Above the last bound (100 s) the slowest request is the upper end.
    overflow = {"requests": 10, "latency_le_100": 5, "latency_ms_max": 200_000}
    assert 100_000 < percentile(overflow, 0.99) <= 200_000


def test_tenant_detail_links_to_its_portal(login, platform_admin):
    make_tenant("initech")
    body = login(platform_admin).get(reverse("console:tenant-detail", args=["initech"])).content
    assert reverse("portal:tenant-home", args=["initech"]).encode() in body


@pytest.mark.parametrize("name", ["usage", "latency", "gpus"])
def test_every_dashboard_figure_is_a_valid_plotly_figure(
    login, platform_admin, acme, globex, base_model, usage, name
):
    """The builders skip plotly's validation in the request path; plotly checks them here."""
    import plotly.graph_objects as go

    from tests.browser.seed import seed_gpus

    Tenant.objects.filter(pk=acme.tenant.pk).update(latency_objective_ms=400)
    usage(acme.tenant, requests=20, latency_ms=200)
    usage(globex.tenant, requests=5, latency_ms=20000, minutes_ago=70)
    seed_gpus([make_deployment(base_model, [acme.tenant], desired_state="running")])
    client = login(platform_admin)
    for key in ("1h", "24h", "7d", "30d"):
        data = _figures(client.get(reverse("console:dashboard-data", args=[name]),
                                   {"range": key}))
        for figure in data["figures"].values():
            go.Figure(figure)  # raises ValueError on any invalid property


def test_figures_use_no_python_only_property_shortcuts(login, platform_admin, acme, usage):
    """plotly.js knows no `marker_color`-style magic underscores (only plotly.py does)."""
    usage(acme.tenant)
    client = login(platform_admin)
    for name in ("usage", "latency", "gpus"):
        data = _figures(client.get(reverse("console:dashboard-data", args=[name])))
        for figure in data["figures"].values():
            for trace in figure["data"]:
                assert not [k for k in trace if "_" in k], trace.keys()


def test_each_object_links_to_its_console_page_and_edits_return_there(
    login, platform_admin, acme, base_model, tmp_path
):
    """`get_absolute_url` is each object's console page (the admin's "view on site" too): it
    answers 200 with the object's name, and saving an edit form redirects back to it."""
    client = login(platform_admin)
    node = Node.objects.create(name="cpu-1", queue="node.cpu-1")
    deployment = make_deployment(base_model, [acme.tenant], name="support-bot")
    instance = Instance.objects.create(deployment=deployment, node=node, port=1)
    adapter = make_adapter(acme.tenant, base_model, tmp_path / "adapters", name="style")
    plan = FleetPlan.objects.create(name="mini", fleet="gpu-a: 1xNVIDIA A100-SXM4-80GB:80GiB",
                                   deployments=[])
    for obj, shown in [(acme.tenant, "Acme Corp"), (base_model, base_model.name),
                       (adapter, "style"), (node, "cpu-1"), (deployment, "support-bot"),
                       (instance, "support-bot"), (plan, "mini")]:
        response = client.get(obj.get_absolute_url())
        assert response.status_code == 200, obj
        assert shown in response.content.decode(), obj
    response = client.post(reverse("console:tenant-edit", args=["acme"]), {
        "slug": "acme", "name": "Acme Inc", "status": "active", "priority_tier": 2,
        "fair_share_weight": 1})
    assert response.status_code == 302, response.context and response.context["form"].errors
    assert response["Location"] == acme.tenant.get_absolute_url()


def test_autoscaling_is_set_on_its_page_and_shown_with_its_changes(
    login, platform_admin, acme, base_model
):
    deployment = make_deployment(base_model, [acme.tenant], name="support-bot",
                                 desired_state="running")
    client = login(platform_admin)
    page = client.get(deployment.get_absolute_url()).content.decode()
    assert "Off: the deployment runs the replicas it is given." in page
    url = reverse("console:deployment-autoscaling", args=[deployment.pk])
    form = {"enabled": "on", "min_replicas": "3", "max_replicas": "2", "metric": "waiting",
            "target": "2", "up_window_seconds": "30", "down_window_seconds": "300",
            "up_cooldown_seconds": "60", "down_cooldown_seconds": "300"}
    refused = client.post(url, form)
    assert refused.status_code == 200
    assert refused.context["form"].errors["min_replicas"] == ["Must not exceed max_replicas (2)."]
    assert not Autoscaler.objects.exists()
    saved = client.post(url, {**form, "min_replicas": "0"})
    assert saved["Location"] == deployment.get_absolute_url()
    assert AuditLog.objects.get(object_type="serving_app.Autoscaler").via == "console"
    assert autoscaling.wake(deployment.pk) is False  # one replica already
    Deployment.objects.filter(pk=deployment.pk).update(replicas=0)
    assert autoscaling.wake(deployment.pk) is True
    page = client.get(deployment.get_absolute_url()).content.decode()
    assert "0 to 2 (now 1)" in page and "Waiting requests per instance: 2.0" in page
    assert re.search(r"data-autoscale-change><td>[^<]+</td><td>0 → 1</td>"
                     r"<td>a request arrived while at zero</td>", page)
    assert login(acme.owner).get(url).status_code == 403
