"""The placement endpoints: plan (saved and unsaved), GPU allocation, GPU samples; staff only.

Until console/urls.py includes ``serving_app.api.placement_views``, these tests route through a
test urlconf that adds it beside the console's own URLs.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving_app.fleet.place import place_replicas
from serving_app.models import Deployment, Gpu, GpuSample
from tests.api.helpers import as_user, assert_forbidden_for
from tests.factories import make_base_model, make_deployment
from tests.placement_db.placement_helpers import A100_80, make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def model_7b(tmp_path):
    return make_base_model(
        tmp_path / "models", "llama7b-like", layers=32, hidden=4096, heads=32, kv_heads=32,
        intermediate=11008, vocab=32000, max_positions=4096,
    )


@pytest.fixture
def gpu_cluster():
    return [make_node("node-a", A100_80), make_node("node-b", A100_80)]


def tenant_users(t):
    return [t.owner, t.admin, t.member, t.viewer]


def test_plan_of_a_saved_deployment(platform_admin, acme, model_7b, gpu_cluster):
    deployment = make_deployment(model_7b, [acme.tenant], replicas=2, max_num_seqs=8,
                                 max_model_len=4096)
    response = as_user(platform_admin).get(f"/api/v1/deployments/{deployment.pk}/plan/")
    assert response.status_code == 200, response.data
    body = response.data
    assert body["ok"] and body["deployment"] == deployment.pk
    assert [p["node"] for p in body["placements"]] != []
    assert len(body["placements"]) == 2
    # Llama-2-7B-like KV: 2 x 32 layers x 32 KV heads x 128 x 2 B.
    assert body["memory"]["kv_bytes_per_token"] == 524_288
    assert [(t["slug"], t["share"]) for t in body["tenants"]] == [("acme", 1.0)]
    assert body["tenants"][0]["charged_bytes"] == sum(
        p["reserved_bytes_per_gpu"] for p in body["placements"])
    assert any(line.startswith("KV cache:") for line in body["explain"])


def test_plan_of_a_deployment_that_does_not_fit(platform_admin, acme, model_7b):
    make_node("node-a", "2xNVIDIA L4:24GiB")
    deployment = make_deployment(model_7b, [acme.tenant], max_num_seqs=64, max_model_len=4096)
    body = as_user(platform_admin).get(f"/api/v1/deployments/{deployment.pk}/plan/").data
    assert body["ok"] is False
    assert body["reason"].startswith("needs ")
    assert "the largest free slot is 21.6 GiB on node-a GPU 0" in body["reason"]


def test_plan_of_an_unsaved_body_saves_nothing(platform_admin, acme, model_7b, gpu_cluster):
    body = {
        "name": "draft",
        "base_model": model_7b.name,
        "tenants": ["acme"],
        "replicas": 3,
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "isolation_mode": "shared",
    }
    response = as_user(platform_admin).post("/api/v1/plan/", body, format="json")
    assert response.status_code == 200, response.data
    assert response.data["ok"] and len(response.data["placements"]) == 3
    assert response.data["deployment"] is None and response.data["name"] == "draft"
    assert not Deployment.objects.exists()


def test_plan_of_an_invalid_body_gives_the_same_errors_as_create(platform_admin, acme, model_7b):
    body = {"name": "draft", "base_model": model_7b.name, "tenants": ["acme"],
            "tensor_parallel_size": 3}
    response = as_user(platform_admin).post("/api/v1/plan/", body, format="json")
    assert response.status_code == 400
    assert "not divisible by 3" in str(response.data["tensor_parallel_size"])


def test_gpu_allocation_lists_every_gpu_with_its_holders(platform_admin, acme, model_7b,
                                                         gpu_cluster):
    deployment = make_deployment(model_7b, [acme.tenant], max_num_seqs=8, max_model_len=4096)
    (instance,), _ = place_replicas(deployment, [0])
    response = as_user(platform_admin).get("/api/v1/gpu-allocation/")
    assert response.status_code == 200
    rows = response.data
    assert len(rows) == 16
    held = [r for r in rows if r["by_deployment"]]
    assert len(held) == 1
    (row,) = held
    assert row["gpu"] == instance.gpus.get().pk
    assert row["by_deployment"][0]["name"] == deployment.name
    assert row["by_tenant"][0]["slug"] == "acme"
    assert row["reserved_fraction"] == instance.gpu_memory_fraction
    assert row["free_fraction"] == pytest.approx(0.90 - instance.gpu_memory_fraction)
    idle = next(r for r in rows if not r["by_deployment"])
    assert idle["reserved_bytes"] == 0 and idle["free_fraction"] == pytest.approx(0.90)


def test_gpu_samples_over_the_last_hours(platform_admin, gpu_cluster):
    gpu = Gpu.objects.get(node__name="node-a", index=0)
    now = timezone.now()
    GpuSample.objects.create(gpu=gpu, at=now - timedelta(hours=5), utilization_percent=1)
    GpuSample.objects.create(gpu=gpu, at=now - timedelta(hours=2), utilization_percent=2)
    response = as_user(platform_admin).get(f"/api/v1/gpus/{gpu.pk}/samples/?hours=3")
    assert response.status_code == 200
    assert response.data["hours"] == 3
    # The sample written by store_inventory, and the one two hours old; oldest first.
    assert [s["utilization_percent"] for s in response.data["samples"]] == [2.0, None]
    assert as_user(platform_admin).get(
        f"/api/v1/gpus/{gpu.pk}/samples/?hours=-1"
    ).status_code == 400
    assert as_user(platform_admin).get("/api/v1/gpus/999999/samples/").status_code == 404


def test_tenant_users_are_refused_every_placement_endpoint(acme, outsider, model_7b,
                                                           gpu_cluster):
    deployment = make_deployment(model_7b, [acme.tenant])
    gpu = Gpu.objects.first()
    users = [*tenant_users(acme), outsider]
    assert_forbidden_for(users, "get", f"/api/v1/deployments/{deployment.pk}/plan/")
    assert_forbidden_for(users, "post", "/api/v1/plan/", {"name": "x"})
    assert_forbidden_for(users, "get", "/api/v1/gpu-allocation/")
    assert_forbidden_for(users, "get", f"/api/v1/gpus/{gpu.pk}/samples/")
