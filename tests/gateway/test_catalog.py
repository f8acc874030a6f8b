"""The gateway's catalog (read from the database, no engine needed): a tenant's catalog holds only
the deployments that serve that tenant and that tenant's own adapters."""

from __future__ import annotations

import pytest

from gateway_app.catalog import load_snapshot
from tests.factories import make_adapter, make_base_model, make_deployment, make_tenant

pytestmark = pytest.mark.django_db


def test_a_deployment_serving_one_tenant_is_absent_from_the_others_catalog(tmp_path):
    acme, globex = make_tenant("acme"), make_tenant("globex")
    shared_model = make_base_model(tmp_path / "models", "shared-base")
    private_model = make_base_model(tmp_path / "models", "acme-only")
    style = make_adapter(acme, shared_model, tmp_path / "adapters", name="style")
    tone = make_adapter(globex, shared_model, tmp_path / "adapters", name="tone")
    make_deployment(shared_model, [acme, globex], name="shared", desired_state="running",
                    adapters=[style, tone])
    make_deployment(private_model, [acme], name="private", desired_state="running")
    make_deployment(make_base_model(tmp_path / "models", "stopped-one"), [globex],
                    name="stopped", desired_state="stopped")

    snapshot = load_snapshot()
    assert set(snapshot.routes[acme.pk]) == {"shared-base", "acme-only", "style"}
    assert set(snapshot.routes[globex.pk]) == {"shared-base", "tone"}
    assert snapshot.routes[acme.pk]["style"].targets[0].adapter == "acme--style"


def test_the_monthly_budget_is_seeded_from_this_months_hourly_rollups(tmp_path):
    from datetime import timedelta

    from serving_app.models.usage import UsageHour, month_start

    acme = make_tenant("acme", monthly_token_budget=10_000)
    start = month_start()
    UsageHour.objects.create(bucket=start, tenant=acme, model="m", prompt_tokens=100,
                             completion_tokens=20)
    UsageHour.objects.create(bucket=start + timedelta(hours=5), tenant=acme, model="n",
                             prompt_tokens=3, completion_tokens=4)
    UsageHour.objects.create(bucket=start - timedelta(hours=1), tenant=acme, model="m",
                             prompt_tokens=5000, completion_tokens=5000)  # last month
    assert load_snapshot().tenants[acme.pk].month_used == 127


def test_the_portal_lists_exactly_what_the_gateway_routes(tmp_path):
    """One rule (`serving_app.deployments.catalog`): a stopped deployment, a co-tenant's adapter and
    an adapter shadowed by a base model's name are in neither; everything else is in both."""
    from ui_app.portal.views import catalog

    acme, globex = make_tenant("acme"), make_tenant("globex")
    shared = make_base_model(tmp_path / "models", "shared-base")
    other = make_base_model(tmp_path / "models", "other-base")
    style = make_adapter(acme, shared, tmp_path / "adapters", name="style")
    shadowed = make_adapter(acme, shared, tmp_path / "adapters", name="other-base")
    tone = make_adapter(globex, shared, tmp_path / "adapters", name="tone")
    make_deployment(shared, [acme, globex], name="shared", desired_state="running",
                    adapters=[style, shadowed, tone])
    make_deployment(other, [acme], name="other", desired_state="running")
    make_deployment(make_base_model(tmp_path / "models", "stopped-one"), [acme],
                    name="stopped", desired_state="stopped")

    routes = load_snapshot().routes
    for tenant in (acme, globex):
        listed = {entry["name"]: entry for entry in catalog(tenant)}
        assert set(listed) == set(routes[tenant.pk])
    assert set(routes[acme.pk]) == {"shared-base", "other-base", "style"}
    assert routes[acme.pk]["other-base"].parent is None  # the base model, not the adapter
    portal = {entry["name"]: entry for entry in catalog(acme)}
    assert portal["other-base"]["kind"] == "base model"
    assert portal["style"]["parent"] == "shared-base"


def test_only_an_instance_on_real_gpus_computes_prompt_logprobs(tmp_path):
    """A CPU engine with LoRA on (every engine the console starts has LoRA slots) dies computing
    a request's prompt logprobs beside another request (docs/engine-notes.md, section 10): an
    instance with no GPU, or with only GPUs declared in configuration, is marked so; one on an
    NVML-reported GPU is not."""
    from serving_app.models import Gpu, Instance, Node

    acme = make_tenant("acme")
    base = make_base_model(tmp_path / "models", "shared-base")
    style = make_adapter(acme, base, tmp_path / "adapters", name="style")
    deployment = make_deployment(base, [acme], name="shared", desired_state="running",
                                 adapters=[style])
    node = Node.objects.create(name="n1", queue="node.n1", address="127.0.0.1")
    real = Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="NVIDIA H100 80GB HBM3",
                              memory_total_bytes=80 * 2**30)
    declared = Gpu.objects.create(node=node, index=1, uuid="GPU-1", name="declared",
                                  memory_total_bytes=80 * 2**30, declared=True)
    instances = {}
    for port, gpus in ((18201, []), (18202, [declared]), (18203, [real, declared])):
        instance = Instance.objects.create(deployment=deployment, node=node, port=port,
                                           state="ready")
        instance.gpus.set(gpus)
        instances[instance.pk] = port

    entries = load_snapshot().instances[deployment.pk]
    computes = {instances[entry.id]: entry.prompt_logprobs for entry in entries}
    assert computes == {18201: False, 18202: False, 18203: True}


def test_flow_controlled_deployments_serving_a_tenant_with_objectives_are_held(tmp_path):
    """The admission controller watches a deployment under flow control that serves a tenant
    with a first token or per-token objective; not one without flow control, nor tenants
    without objectives."""
    support = make_tenant("support", ttft_objective_ms=400)
    flood = make_tenant("flood")
    shared = make_deployment(make_base_model(tmp_path / "models", "shared-base"),
                             [support, flood], name="shared", desired_state="running",
                             flow_control=True)
    make_deployment(make_base_model(tmp_path / "models", "fcfs-base"), [support, flood],
                    name="fcfs", desired_state="running", flow_control=False)
    snapshot = load_snapshot()
    assert snapshot.objectives == {shared.pk: (support.pk,)}
    assert snapshot.tenants[support.pk].ttft_objective_ms == 400
