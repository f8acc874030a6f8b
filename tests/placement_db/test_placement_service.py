"""place_replicas, plan_deployment and dry_run against a PostgreSQL inventory.

The inventories are declared (as a node agent with NODE_GPUS does) or recorded NVML output; no
GPU is needed. Every refusal is checked to have created nothing.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from serving_app.fleet.place import place_instance, place_replicas
from serving_app.fleet.read import (
    PlanningError,
    charged_tenants,
    engine_settings,
    model_architecture,
    plan_deployment,
)
from serving_app.fleet.report import allocation, dry_run
from serving_app.models import Deployment, Gpu, Instance, LoraAdapter
from serving_app.placement.inventory import GIB
from serving_app.placement.planner import plan_memory
from tests.factories import make_base_model, make_deployment, make_tenant
from tests.placement_db.placement_helpers import A100_80, make_node
from tests.placement_db.test_placement_sync import a100_with_mig

pytestmark = pytest.mark.django_db

# A Qwen2-7B-like architecture: 28 layers, hidden 3584, 28 heads, 4 KV heads (head_dim 128).
QWEN7B = {
    "layers": 28,
    "hidden": 3584,
    "heads": 28,
    "kv_heads": 4,
    "intermediate": 18944,
    "vocab": 152064,
    "max_positions": 32768,
}


@pytest.fixture
def qwen(tmp_path):
    return make_base_model(tmp_path / "models", "qwen7b-like", **QWEN7B)


@pytest.fixture
def tenant():
    return make_tenant("acme-ai")


@pytest.fixture
def cluster():
    """2 nodes x 8 x 80 GiB, declared."""
    return [make_node("node-a", A100_80), make_node("node-b", A100_80)]


def deploy(base, tenant, **fields):
    fields.setdefault("max_num_seqs", 32)
    fields.setdefault("max_model_len", 8192)
    return make_deployment(base, [tenant], **fields)


# ------------------------------------------------------------------------------ memory plan


def test_plan_deployment_matches_hand_computed_figures(qwen, tenant):
    deployment = deploy(qwen, tenant)
    plan = plan_deployment(deployment)

    # The factory writes q, k, v, o and gate projections plus the embedding, in float32.
    per_layer = 3584 * 3584 * 2 + 512 * 3584 * 2 + 18944 * 3584
    params = 152064 * 3584 + 28 * per_layer
    assert qwen.weight_bytes == params * 4
    assert plan.dtype == "bfloat16"  # --dtype auto serves a float32 checkpoint in bf16
    assert plan.parameters == params
    assert plan.weight_bytes == params * 2
    assert plan.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344
    assert plan.kv_tokens == 32 * 8192
    assert plan.kv_cache_bytes == 14 * GIB
    # launch.py always passes --enable-lora --max-loras 4 --max-lora-rank 16 (the defaults).
    lora = 16 * (2 * (3584 + 3584) + 2 * (3584 + 512)) * 2 * 28 * 4
    assert plan.lora_bytes == lora
    # Activations with the H200-calibrated constants (docs/gpu.md "Planner"): vLLM 0.26's default
    # 8192 batched tokens x 2 B (bf16) x (3584 hidden x 0 + 18944 MLP width x 3.125)
    # = 16,384 x 59,200 = 969,932,800, + fp32 logits 32 seqs x 152064 x 4 = 19,464,192
    # -> 989,396,992 B.
    assert plan.max_num_batched_tokens == 8192
    assert plan.activation_bytes == 8192 * 2 * 18944 * 3.125 + 32 * 152064 * 4 == 989_396_992
    # Reserve: 225 MiB non-torch memory + 315 MiB CUDA graphs = 566,231,040 B.
    runtime = 225 * 1024**2 + 315 * 1024**2
    assert plan.runtime_overhead_bytes == runtime == 566_231_040
    # params = 152064 x 3584 + 28 x 97,255,424 = 3,268,149,248 -> weights 6,536,298,496 B;
    # LoRA 16 x (2 x 7168 + 2 x 4096) x 2 B x 28 x 4 = 80,740,352 B; total 6,536,298,496
    # + 15,032,385,536 + 80,740,352 + 989,396,992 + 566,231,040 = 23,205,052,416 B = 21.61 GiB.
    assert plan.needed_bytes == params * 2 + 14 * GIB + lora + plan.activation_bytes + runtime
    assert plan.needed_bytes == 23_205_052_416
    assert plan.needed_gib == pytest.approx(21.61, abs=0.01)
    # 23,205,052,416 / 85,899,345,920 = 0.2701 -> rounded up to 0.28.
    assert plan.gpu_memory_utilization(80 * GIB) == 0.28


def test_plan_follows_tp_dtype_and_mlp_adapters(qwen, tenant, tmp_path):
    tp2 = plan_deployment(deploy(qwen, tenant, tensor_parallel_size=2, dtype="float32"))
    assert tp2.dtype == "float32"
    assert tp2.kv_bytes_per_token == 2 * 28 * 2 * 128 * 4
    assert tp2.weight_bytes == qwen.weight_bytes // 2

    deployment = deploy(qwen, tenant)
    adapter = LoraAdapter(tenant=tenant, base_model=qwen, target_modules=["q_proj", "down_proj"])
    settings = engine_settings(deployment.engine_spec(), [adapter])
    assert settings.lora_target_mlp and settings.enable_lora


def test_unknown_architecture_is_a_planning_error(qwen, tenant):
    deployment = deploy(qwen, tenant)
    qwen.num_layers = 0
    with pytest.raises(PlanningError, match="architecture is unknown"):
        plan_deployment(deployment)


# ------------------------------------------------------------------------------ placing


def test_replicas_land_on_separate_gpus_with_their_fraction(qwen, tenant, cluster):
    deployment = deploy(qwen, tenant)
    deployment.placement_error = "old reason"
    Deployment.objects.filter(pk=deployment.pk).update(placement_error="old reason")

    instances, reason = place_replicas(deployment, [0, 1, 2])

    assert reason == ""
    assert [i.ordinal for i in instances] == [0, 1, 2]
    gpus = [list(i.gpus.all()) for i in instances]
    assert all(len(g) == 1 for g in gpus)
    assert len({g[0].pk for g in gpus}) == 3
    need = plan_deployment(deployment).gpu_memory_utilization(80 * GIB)
    for instance in instances:
        instance.refresh_from_db()
        assert instance.gpu_memory_fraction == need
        assert instance.generation == deployment.generation
        assert instance.node.name in ("node-a", "node-b")
        assert instance.environment == {}  # declared GPUs: no CUDA_VISIBLE_DEVICES
    deployment.refresh_from_db()
    assert deployment.placement_error == ""


def test_new_replicas_respect_existing_allocations(qwen, tenant, cluster):
    first = deploy(qwen, tenant)
    place_replicas(first, [0])
    second = deploy(qwen, tenant, max_num_seqs=64)  # 35.6 GiB: 0.45 of a GPU
    (instance,), _ = place_replicas(second, [0])
    # Bin-packing puts it beside the first deployment's instance.
    assert list(instance.gpus.all()) == list(first.instances.get().gpus.all())

    view = {(g["node"], g["index"]): g for g in allocation()}
    gpu = instance.gpus.get()
    row = view[(gpu.node.name, gpu.index)]
    assert {d["name"] for d in row["by_deployment"]} == {first.name, second.name}
    assert [(t["id"], t["slug"], t["reserved_bytes"]) for t in row["by_tenant"]] == [
        (tenant.pk, tenant.slug, row["reserved_bytes"])
    ]
    total = row["memory_total_bytes"]
    assert row["free_bytes"] == pytest.approx(row["free_fraction"] * total, rel=1e-3)


def test_a_full_cluster_refuses_whole_and_creates_nothing(qwen, tenant, cluster):
    filler = deploy(qwen, tenant, isolation_mode="dedicated", replicas=16)
    placed, reason = place_replicas(filler, list(range(16)))
    assert reason == "" and len(placed) == 16
    assert Gpu.objects.filter(instances__isnull=False).distinct().count() == 16

    late = deploy(qwen, tenant)
    instances, reason = place_replicas(late, [0, 1])
    assert instances == []
    assert "no GPU has free memory" in reason
    late.refresh_from_db()
    assert late.placement_error == reason
    assert not late.instances.exists()


def test_the_last_replica_that_does_not_fit_places_none(qwen, tenant, cluster):
    deployment = deploy(qwen, tenant, isolation_mode="dedicated")
    before = Instance.objects.count()
    instances, reason = place_replicas(deployment, list(range(17)))
    assert instances == []
    assert reason.startswith("replica 17 of 17: needs an empty GPU")
    assert Instance.objects.count() == before


def test_refusal_names_the_largest_free_slot(qwen, tenant):
    make_node("node-a", "2xNVIDIA A100-SXM4-80GB:80GiB")
    # With the calibrated constants (test_plan_deployment_matches_hand_computed_figures), n
    # sequences of 8192 need 6,536,298,496 weights + 80,740,352 LoRA + 969,932,800 activations
    # + 566,231,040 reserve = 8,153,202,688 B, plus n x (8192 x 57,344 KV + 152064 x 4 logits)
    # = n x 470,370,304 B.
    # blocker: 8,153,202,688 + 90 x 470,370,304 = 50,486,530,048 B = 47.0 GiB: 0.5877 -> 0.59
    # of each GPU, leaving 1 - 0.59 - 0.10 headroom = 0.31 = 24.8 GiB.
    blocker = deploy(qwen, tenant, max_num_seqs=90)
    assert plan_deployment(blocker).needed_bytes == 50_486_530_048
    assert place_replicas(blocker, [0, 1])[1] == ""
    # big: 8,153,202,688 + 48 x 470,370,304 = 30,730,977,280 B = 28.6 GiB: 0.36 > the 0.31 left.
    big = deploy(qwen, tenant, max_num_seqs=48)
    assert plan_deployment(big).needed_bytes == 30_730_977_280
    instances, reason = place_replicas(big, [0])
    assert instances == []
    assert reason == "needs 28.6 GiB; the largest free slot is 24.8 GiB on node-a GPU 0"


def test_quota_refusal_counts_what_the_tenant_already_holds(qwen, cluster):
    tenant = make_tenant("quota", gpu_memory_quota_gib=Decimal("40"))
    # 21.6 GiB needed (23,205,052,416 B, test_plan_deployment_matches_hand_computed_figures):
    # 22.4 GiB reserved at 0.28 of 80 GiB; 22.4 + 21.6 = 44.0 > the 40 GiB quota.
    first = deploy(qwen, tenant)
    assert place_replicas(first, [0])[1] == ""
    second = deploy(qwen, tenant)
    instances, reason = place_replicas(second, [0])
    assert instances == []
    assert reason == (
        "tenant quota's GPU memory quota is 40.0 GiB; it already uses 22.4 GiB and this "
        "deployment needs 21.6 GiB more"
    )
    second.refresh_from_db()
    assert second.placement_error == reason


def test_a_replacement_for_a_lost_nodes_instance_fits_within_the_quota(qwen, cluster):
    """The instance of a node declared lost is being replaced: its memory no longer counts
    against the quota, which would otherwise refuse its replacement."""
    tenant = make_tenant("quota", gpu_memory_quota_gib=Decimal("40"))
    deployment = deploy(qwen, tenant)
    [instance], _ = place_replicas(deployment, [0])
    lost = instance.node
    lost.__class__.objects.filter(pk=lost.pk).update(
        last_heartbeat=timezone.now() - timedelta(hours=1), lost_at=timezone.now())
    Instance.objects.filter(pk=instance.pk).update(state=Instance.State.STOPPING)
    [replacement], reason = place_replicas(deployment, [0])
    assert reason == "" and replacement.node != lost



def test_a_shared_deployment_checks_each_tenants_quota_for_its_entitled_share(qwen, cluster):
    # 21.6 GiB needed (23,205,052,416 B), reserved as 0.28 of an 80 GiB GPU (22.4 GiB): weights
    # 3 and 1 charge 16.8 and 5.6 GiB (21.61 x 0.25 = 5.4 of the 21.6 needed: over small's 5 GiB
    # quota, within 6). Nothing has run: the split is the entitled one.
    big = make_tenant("big", fair_share_weight=3, gpu_memory_quota_gib=Decimal("20"))
    small = make_tenant("small", fair_share_weight=1, gpu_memory_quota_gib=Decimal("5"))
    deployment = make_deployment(qwen, [big, small], max_num_seqs=32, max_model_len=8192)
    assert [(t.label, t.share) for t in charged_tenants(deployment)] == [
        ("big", 0.75), ("small", 0.25)]
    _, reason = place_replicas(deployment, [0])
    assert reason == (
        "tenant small's GPU memory quota is 5.0 GiB; it already uses 0.0 GiB and its share (25%) "
        "of this deployment needs 5.4 GiB more"
    )
    small.gpu_memory_quota_gib = Decimal("6")
    small.save()
    (instance,), reason = place_replicas(deployment, [0])
    assert reason == ""
    (gpu,) = [g for g in allocation() if g["entries"]]
    assert {t["slug"]: t["reserved_bytes"] for t in gpu["by_tenant"]} == {
        "big": int(0.28 * 80 * GIB * 0.75), "small": int(0.28 * 80 * GIB * 0.25)}


def test_tensor_parallel_group_stays_on_one_node(qwen, tenant, cluster):
    deployment = deploy(qwen, tenant, tensor_parallel_size=4)
    (instance,), reason = place_replicas(deployment, [0])
    assert reason == ""
    gpus = list(instance.gpus.all())
    assert len(gpus) == 4 and len({g.node_id for g in gpus}) == 1


def test_tp_wider_than_a_node_is_refused(tmp_path, tenant, cluster):
    base = make_base_model(tmp_path, "wide", layers=2, hidden=4096, heads=32, kv_heads=8)
    deployment = deploy(base, tenant, tensor_parallel_size=16, max_model_len=2048)
    instances, reason = place_replicas(deployment, [0])
    assert instances == []
    assert reason == (
        "needs 16 GPUs on one node for tensor parallelism; the most on a ready node is 8 "
        "(allow_multi_node lets an instance span nodes)"
    )


def test_kv_heads_that_do_not_split_over_tp_are_refused(tmp_path, tenant, cluster):
    base = make_base_model(tmp_path, "odd-kv", layers=2, hidden=3072, heads=24, kv_heads=6)
    deployment = deploy(base, tenant, tensor_parallel_size=4, max_model_len=2048)
    instances, reason = place_replicas(deployment, [0])
    assert instances == []
    assert reason == "6 KV heads do not split evenly over tensor_parallel_size 4"


def test_cordoned_and_lost_nodes_take_nothing(qwen, tenant):
    make_node("cordoned", "1x80GiB", cordoned=True)
    make_node("lost", "1x80GiB", last_heartbeat=None)
    instances, reason = place_replicas(deploy(qwen, tenant), [0])
    assert instances == []
    assert reason == "no node is ready (all are not ready or lost)"


def test_mig_isolation_gets_a_free_mig_device(qwen, tenant):
    node = make_node("mig")
    from serving_app.fleet.sync import store_inventory

    store_inventory(node, [a100_with_mig()], "nvml")
    deployment = deploy(qwen, tenant, isolation_mode="mig")
    (instance,), reason = place_replicas(deployment, [0])
    assert reason == ""
    (gpu,) = instance.gpus.all()
    assert gpu.uuid == "MIG-bbbb" and gpu.parent is not None
    assert instance.environment == {"CUDA_VISIBLE_DEVICES": "MIG-bbbb"}
    # The only free MIG device is now taken (21.6 GiB needed: 23,205,052,416 B,
    # test_plan_deployment_matches_hand_computed_figures; it would fit a 40 GiB device).
    _, reason = place_replicas(deploy(qwen, tenant, isolation_mode="mig"), [0])
    assert reason == "needs 21.6 GiB on a MIG device; no MIG device is free"


def test_mps_sets_thread_percentage_and_memory_limit(qwen, tenant):
    node = make_node("mps")
    from tests.placement_db.placement_helpers import h200_gpus, store

    store(node, h200_gpus("h200_nvml_idle.json"))
    deployment = deploy(qwen, tenant, isolation_mode="mps", mps_thread_percentage=30)
    (instance,), _ = place_replicas(deployment, [0])
    env = instance.environment
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-4e1159e8-f3d6-41be-8b16-6125942d04c8"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].startswith("0=")


def test_place_instance_places_an_existing_row(qwen, tenant, cluster):
    """The reconciler's path: it creates the row, then asks for a node."""
    deployment = deploy(qwen, tenant)
    instance = Instance.objects.create(deployment=deployment, ordinal=0)
    node = place_instance(deployment, instance)
    instance.refresh_from_db()
    assert node is not None and instance.node == node
    assert instance.gpus.count() == 1 and instance.gpu_memory_fraction == 0.28


# ------------------------------------------------------------------------------ CPU hosts


def test_cpu_hosts_take_max_instances_each_fewest_first(qwen, tenant):
    make_node("cpu-a", max_instances=1)
    make_node("cpu-b", max_instances=2)
    deployment = deploy(qwen, tenant)
    instances, reason = place_replicas(deployment, [0, 1])
    assert reason == ""
    assert sorted(i.node.name for i in instances) == ["cpu-a", "cpu-b"]
    assert all(i.gpu_memory_fraction is None and not i.gpus.exists() for i in instances)

    instances, reason = place_replicas(deploy(qwen, tenant), [0, 1])
    assert instances == []
    assert reason == (
        "2 instances do not fit on the online nodes: cpu-a runs 1 of 1, cpu-b runs 1 of 2"
    )

    (instance,), _ = place_replicas(deploy(qwen, tenant), [0])
    assert instance.node.name == "cpu-b"
    instance_row = Instance.objects.create(deployment=deployment, ordinal=5)
    assert place_instance(deployment, instance_row) is None
    instance_row.refresh_from_db()
    assert instance_row.last_error == (
        "Every online node is full: cpu-a runs 1 of 1, cpu-b runs 2 of 2"
    )


def test_no_online_agent_is_said_so(qwen, tenant):
    make_node("cpu-a", last_heartbeat=None)
    _, reason = place_replicas(deploy(qwen, tenant), [0])
    assert reason.startswith("No node agent is online")


def test_cpu_hosts_are_not_used_once_a_gpu_node_is_registered(qwen, tenant):
    make_node("cpu-a")
    make_node("gpu-a", "1x80GiB", cordoned=True)
    instances, reason = place_replicas(deploy(qwen, tenant), [0])
    assert instances == []
    assert reason == "no node is ready (all are not ready or lost)"


# ------------------------------------------------------------------------------ dry run


def test_dry_run_says_where_replicas_would_go_and_writes_nothing(qwen, tenant, cluster):
    deployment = deploy(qwen, tenant, replicas=2)
    plan = dry_run(deployment)
    assert plan["ok"] and plan["target"] == "gpu" and plan["reason"] is None
    assert [p["replica"] for p in plan["placements"]] == [0, 1]
    assert plan["placements"][0]["gpu_memory_utilization"] == 0.28
    assert plan["placements"][0]["concurrent_sequences"] >= 32
    expected = plan_memory(
        model_architecture(qwen), engine_settings(deployment.engine_spec())
    ).needed_bytes
    assert plan["memory"]["needed_bytes"] == expected
    assert any(line.startswith("Needed per GPU:") for line in plan["explain"])
    assert any("gpu_memory_utilization 0.28" in line for line in plan["explain"])
    assert not Instance.objects.exists()


def test_dry_run_ignores_the_deployments_own_instances(qwen, tenant, cluster):
    deployment = deploy(qwen, tenant, isolation_mode="dedicated", replicas=16)
    place_replicas(deployment, list(range(16)))
    plan = dry_run(deployment)
    assert plan["ok"] and len(plan["placements"]) == 16
    assert len(plan["current"]) == 16


def test_dry_run_of_a_deployment_that_cannot_fit(qwen, tenant):
    make_node("small", "1xNVIDIA L4:24GiB")
    plan = dry_run(deploy(qwen, tenant, max_num_seqs=64))
    assert not plan["ok"] and plan["placements"] == []
    assert plan["reason"].startswith("needs ") and "on small GPU 0" in plan["reason"]
    assert any(line.startswith("Does not fit on a GPU of 24.00 GiB") for line in plan["explain"])


def test_dry_run_on_cpu_hosts_gives_the_cpu_kv_capacity(qwen, tenant, settings):
    settings.ENGINE_CPU_KVCACHE_GIB = 1
    make_node("cpu-a")
    plan = dry_run(deploy(qwen, tenant))
    assert plan["ok"] and plan["target"] == "cpu"
    # 1 GiB / (57,344 B x 128-token blocks) = 146 blocks; vLLM counts 146 / 64 x 8192 tokens.
    assert plan["placements"][0]["cpu_kv_cache_tokens"] == 18_688
    assert "ENGINE_CPU_KVCACHE_GIB" in plan["explain"][-1]
