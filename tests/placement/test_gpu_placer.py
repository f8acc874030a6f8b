"""Placement on inventories of several shapes: filters, fit, isolation modes, policies, refusals."""

from __future__ import annotations

import copy
import json
import random
import re
import time
from pathlib import Path

import pytest

from serving_app.placement.cluster import (
    Allocation,
    GpuSlot,
    MigSlot,
    Node,
    allocation_view,
    gpu_slot_from_info,
)
from serving_app.placement.inventory import GIB, declared_inventory, parse_snapshot
from serving_app.placement.placer import Placer
from serving_app.placement.request import PlacementRequest

GB80 = 81920 * 1024**2
L4 = 23034 * 1024**2  # what NVML reports for an NVIDIA L4 ("24GB")


def gpus(node: str, count: int, size: int = GB80, name: str = "NVIDIA A100-SXM4-80GB"):
    return [
        GpuSlot(index=i, uuid=f"GPU-{node}-{i}", name=name, memory_total_bytes=size)
        for i in range(count)
    ]


def node(name: str, count: int = 8, size: int = GB80, **kwargs) -> Node:
    return Node(name=name, gpus=gpus(name, count, size), **kwargs)


def request(dep, gib: float, tenant="t1", **kwargs) -> PlacementRequest:
    return PlacementRequest(
        deployment_id=dep, tenant_id=tenant, memory_bytes_per_gpu=int(gib * GIB), **kwargs
    )


def snapshot(placer: Placer) -> list:
    return [(v.node, v.gpu_index, v.reserved_bytes, v.entries) for v in placer.allocation_view()]


# ---------------------------------------------------------------- 8 x 80 GB


def test_shared_binpack_packs_two_30gib_instances_on_one_80gb_gpu():
    placer = Placer([node("node-a")])
    first = placer.place(request("d1", 30))
    second = placer.place(request("d2", 30))
    third = placer.place(request("d3", 30))

    assert first.ok and second.ok and third.ok
    # 30 GiB / 80 GiB = 0.375 -> 0.38; two fit under 0.90, the third goes to the next GPU.
    assert first.instances[0].gpu_memory_utilization == 0.38
    assert first.instances[0].gpu_indexes == second.instances[0].gpu_indexes == (0,)
    assert third.instances[0].gpu_indexes == (1,)
    assert first.instances[0].env == {"CUDA_VISIBLE_DEVICES": "GPU-node-a-0"}
    gpu0 = placer.allocation_view()[0]
    assert gpu0.reserved_fraction == pytest.approx(0.76)
    assert gpu0.free_fraction == pytest.approx(0.14)


def test_replicas_of_one_deployment_never_share_a_gpu():
    placer = Placer([node("node-a")])
    result = placer.place(request("d1", 10, replicas=3))
    assert result.ok
    assert sorted(i.gpu_indexes[0] for i in result.instances) == [0, 1, 2]
    assert [i.replica for i in result.instances] == [0, 1, 2]


def test_spread_puts_each_deployment_on_the_emptiest_gpu():
    placer = Placer([node("node-a", 2), node("node-b", 2)], policy="spread")
    placed = [placer.place(request(f"d{i}", 20)).instances[0] for i in range(4)]
    assert len({(p.node, p.gpu_indexes) for p in placed}) == 4

    packed = Placer([node("node-a", 2), node("node-b", 2)])
    placed = [packed.place(request(f"d{i}", 20)).instances[0] for i in range(4)]
    # 20 GiB = 0.25 of 80 GiB: binpack stacks three on GPU 0 (0.75 <= 0.90), the fourth next.
    assert [(p.node, p.gpu_indexes) for p in placed] == [
        ("node-a", (0,)),
        ("node-a", (0,)),
        ("node-a", (0,)),
        ("node-a", (1,)),
    ]


def test_headroom_is_configurable():
    strict = Placer([node("node-a", 1)], headroom=0.25)
    assert strict.place(request("d1", 40)).ok  # 0.50
    refused = strict.place(request("d2", 20.5))  # 0.26 more would exceed 0.75
    assert not refused.ok
    assert "largest free slot is 20.0 GiB on node-a GPU 0" in refused.reason

    none = Placer([node("node-a", 1)], headroom=0.0)
    assert none.place(request("d1", 80)).instances[0].gpu_memory_utilization == 1.0


def test_memory_held_by_unmanaged_processes_counts_as_reserved():
    n = node("node-a", 1)
    n.gpus[0].other_used_bytes = 40 * GIB  # 0.50 held by something the console did not start
    placer = Placer([n])
    assert not placer.place(request("d1", 40)).ok
    assert placer.place(request("d1", 30)).ok


# ---------------------------------------------------------------- mixed GPUs


def test_mixed_gpus_binpack_chooses_the_tightest_gpu_and_sizes_the_fraction_per_gpu():
    mixed = Node(
        name="mixed",
        gpus=[
            GpuSlot(index=0, uuid="GPU-a100-0", name="A100", memory_total_bytes=GB80),
            GpuSlot(index=1, uuid="GPU-l4-1", name="L4", memory_total_bytes=L4),
        ],
    )
    placer = Placer([mixed])
    small = placer.place(request("small", 18)).instances[0]
    # 18 GiB on the 22.5 GiB L4 = 0.80 (leaves 2.25 GiB under the cap) beats the A100.
    assert small.gpu_indexes == (1,)
    assert small.gpu_memory_utilization == 0.81  # 18 / 22.49 = 0.8002 -> 0.81
    big = placer.place(request("big", 30)).instances[0]
    assert big.gpu_indexes == (0,) and big.gpu_memory_utilization == 0.38


def test_tensor_parallel_group_uses_gpus_of_one_size_on_one_node():
    mixed = Node(
        name="mixed",
        gpus=[
            GpuSlot(index=0, uuid="a", name="A100", memory_total_bytes=GB80),
            GpuSlot(index=1, uuid="b", name="L4", memory_total_bytes=L4),
            GpuSlot(index=2, uuid="c", name="A100", memory_total_bytes=GB80),
        ],
    )
    result = Placer([mixed]).place(request("tp2", 15, tensor_parallel_size=2))
    assert result.ok
    (inst,) = result.instances
    assert inst.gpu_indexes == (0, 2)
    assert inst.env["CUDA_VISIBLE_DEVICES"] == "a,c"
    assert inst.gpu_memory_utilization == 0.19  # 15/80 = 0.1875


# ---------------------------------------------------------------- MIG


def mig_node() -> Node:
    gpu = GpuSlot(
        index=0,
        uuid="GPU-mig",
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=GB80,
        mig_enabled=True,
        mig_devices=[
            MigSlot("MIG-40a", 40 * GIB, "3g.40gb"),
            MigSlot("MIG-20a", 20 * GIB, "2g.20gb"),
            MigSlot("MIG-10a", 10 * GIB, "1g.10gb"),
            MigSlot("MIG-10b", 10 * GIB, "1g.10gb"),
        ],
    )
    return Node(name="mig-node", gpus=[gpu])


def test_mig_picks_the_smallest_mig_device_with_enough_memory():
    placer = Placer([mig_node()])
    result = placer.place(request("d1", 15, isolation="mig"))
    assert result.ok
    (inst,) = result.instances
    assert inst.mig_uuid == "MIG-20a"
    assert inst.env == {"CUDA_VISIBLE_DEVICES": "MIG-20a"}
    assert inst.gpu_memory_utilization == 0.90
    assert inst.reserved_bytes_per_gpu == 20 * GIB
    # The next 15 GiB instance cannot use the taken device: it gets the 40 GB one.
    assert placer.place(request("d2", 15, isolation="mig")).instances[0].mig_uuid == "MIG-40a"
    refused = placer.place(request("d3", 15, isolation="mig"))
    assert not refused.ok
    assert "largest free MIG device is 10.0 GiB" in refused.reason


def test_mig_device_needs_room_within_the_headroom():
    refused = Placer([mig_node()]).place(request("d1", 38, isolation="mig"))
    # 38 / 40 = 0.95 > 0.90
    assert not refused.ok and "needs 38.0 GiB on a MIG device" in refused.reason


def test_a_mig_gpu_takes_no_shared_or_dedicated_instances_and_mig_needs_tp1():
    placer = Placer([mig_node()])
    assert not placer.place(request("d1", 5)).ok
    assert not placer.place(request("d1", 5, isolation="dedicated")).ok
    tp = placer.place(request("d1", 5, isolation="mig", tensor_parallel_size=2))
    assert not tp.ok and "MIG isolation needs tensor_parallel_size 1" in tp.reason


# ---------------------------------------------------------------- dedicated and MPS


def test_dedicated_takes_whole_empty_gpus_and_gives_vllm_the_cap():
    placer = Placer([node("node-a", 2)])
    assert placer.place(request("shared", 10)).instances[0].gpu_indexes == (0,)
    dedicated = placer.place(request("ded", 10, isolation="dedicated"))
    (inst,) = dedicated.instances
    assert inst.gpu_indexes == (1,)  # GPU 0 is not empty
    assert inst.gpu_memory_utilization == 0.90
    assert inst.reserved_bytes_per_gpu == GB80
    # Nothing else joins a dedicated GPU, and no second empty GPU is left.
    assert not placer.place(request("more", 5, isolation="dedicated")).ok
    assert placer.place(request("more", 5)).instances[0].gpu_indexes == (0,)
    view = placer.allocation_view()[1]
    assert view.reserved_fraction == 1.0 and view.free_fraction == 0.0


def test_dedicated_binpack_keeps_whole_nodes_free():
    placer = Placer([node("node-a", 4), node("node-b", 4)])
    placer.place(request("x", 10, isolation="dedicated"))
    second = placer.place(request("y", 10, isolation="dedicated")).instances[0]
    assert second.node == "node-a"


def test_mps_sets_thread_percentage_and_pinned_memory_limit():
    result = Placer([node("node-a", 2)]).place(
        request("d1", 20, isolation="mps", tensor_parallel_size=2)
    )
    (inst,) = result.instances
    assert inst.gpu_memory_utilization == 0.25
    assert inst.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    # 0.25 x 81,920 MiB = 20,480 MiB on each visible device.
    assert inst.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20992M,1=20992M"
    explicit = Placer([node("node-a", 1)]).place(
        request("d2", 20, isolation="mps", mps_thread_percentage=50)
    )
    assert explicit.instances[0].env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


# ---------------------------------------------------------------- filters


def test_nodes_not_ready_or_lost_are_skipped():
    placer = Placer([node("down", ready=False), node("lost", lost=True), node("up", 1)])
    assert placer.place(request("d1", 10)).instances[0].node == "up"
    only_bad = Placer([node("down", ready=False)]).place(request("d1", 10))
    assert not only_bad.ok and "no node is ready" in only_bad.reason


def test_heads_not_divisible_by_tp_are_refused():
    result = Placer([node("node-a")]).place(
        request("qwen", 10, tensor_parallel_size=8, num_attention_heads=28)
    )
    assert not result.ok
    assert result.reason == "28 attention heads are not divisible by tensor_parallel_size 8"
    kv = Placer([node("node-a")]).place(
        request("odd", 10, tensor_parallel_size=4, num_attention_heads=32, num_kv_heads=6)
    )
    assert not kv.ok and "KV heads" in kv.reason


def test_tp_needs_enough_gpus_on_one_node():
    placer = Placer([node("node-a", 2), node("node-b", 2)])
    result = placer.place(request("big", 30, tensor_parallel_size=4, num_attention_heads=32))
    assert not result.ok
    assert "needs 4 GPUs on one node" in result.reason and "is 2" in result.reason


def test_tp_goes_to_the_node_that_still_has_enough_free_gpus():
    placer = Placer([node("node-a", 2), node("node-b", 2)])
    placer.place(request("filler", 60))  # node-a GPU 0 is now 0.75 reserved
    result = placer.place(request("tp2", 30, tensor_parallel_size=2))
    assert result.instances[0].node == "node-b"
    # 0.25 more lands on the tightest GPU that takes it: node-b GPU 0 (0.52 free).
    filler2 = placer.place(request("filler2", 20)).instances[0]
    assert (filler2.node, filler2.gpu_indexes) == ("node-b", (0,))
    # Now node-a has one GPU with 0.38 free (GPU 1) and node-b one (GPU 1): no node has two.
    refused = placer.place(request("tp2b", 30, tensor_parallel_size=2))
    assert not refused.ok
    assert "needs 2 GPUs with 30.0 GiB free each on one node; the most on one node is 1" in (
        refused.reason
    )


def test_quota_refusal_names_quota_use_and_need():
    placer = Placer([node("node-a")])
    result = placer.place(request("d1", 30, tenant="acme", tenant_quota_gib=40, tenant_used_gib=20))
    assert not result.ok
    assert result.reason == (
        "tenant GPU memory quota is 40.0 GiB; it already uses 20.0 GiB and this deployment "
        "needs 30.0 GiB more"
    )
    assert all(not v.entries for v in placer.allocation_view())


def test_quota_counts_what_the_placer_already_holds_for_the_tenant():
    placer = Placer([node("node-a")])
    assert placer.place(request("d1", 30, tenant="acme", tenant_quota_gib=60)).ok
    assert placer.tenant_reserved_bytes("acme") == int(0.38 * GB80)
    # 30.4 GiB reserved (0.38 x 80 GiB) + 30 GiB > 60 GiB.
    refused = placer.place(request("d2", 30, tenant="acme", tenant_quota_gib=60))
    assert not refused.ok and "already uses 30.4 GiB" in refused.reason
    # A dedicated GPU reserves all 80 GiB against the quota.
    ded = placer.place(request("d3", 10, tenant="beta", isolation="dedicated", tenant_quota_gib=40))
    assert not ded.ok and "would reserve 80.0 GiB" in ded.reason


# ---------------------------------------------------------------- full cluster, all or none


def test_full_cluster_refuses_with_the_largest_free_slot():
    placer = Placer([node("node-a", 2)])
    assert placer.place(request("a", 50, replicas=2)).ok  # 0.63 on both GPUs
    assert placer.place(request("b", 10)).ok  # GPU 0 -> 0.76
    refused = placer.place(request("c", 38.2))
    assert not refused.ok
    # GPU 1 has 0.90 - 0.63 = 0.27 x 80 GiB = 21.6 GiB free under the cap.
    assert refused.reason == "needs 38.2 GiB; the largest free slot is 21.6 GiB on node-a GPU 1"


def test_a_deployment_that_does_not_fit_is_never_half_placed():
    placer = Placer([node("node-a", 2), node("node-b", 1)])
    placer.place(request("filler", 60))
    before = copy.deepcopy(snapshot(placer))
    result = placer.place(request("d1", 40, replicas=3))
    assert not result.ok
    assert result.instances == ()
    assert result.reason.startswith("replica 3 of 3: needs 40.0 GiB")
    assert snapshot(placer) == before
    # Once released room exists, the same request places all three.
    placer.release("filler")
    assert placer.place(request("d1", 40, replicas=3)).ok


def test_plan_is_a_dry_run():
    placer = Placer([node("node-a", 1)])
    plan = placer.plan(request("d1", 30))
    assert plan.ok and plan.instances[0].gpu_indexes == (0,)
    assert placer.allocation_view()[0].entries == ()


def test_release_frees_the_gpus():
    placer = Placer([node("node-a", 1)])
    placer.place(request("d1", 60))
    assert not placer.place(request("d2", 60)).ok
    assert placer.release("d1") == 1
    assert placer.place(request("d2", 60)).ok


def test_existing_allocations_are_respected():
    n = node("node-a", 1)
    n.gpus[0].allocations.append(Allocation(deployment_id="old", tenant_id="t0", fraction=0.8))
    placer = Placer([n])
    assert not placer.place(request("d1", 10)).ok  # 0.80 + 0.13 > 0.90
    assert placer.place(request("d1", 7)).ok  # 0.80 + 0.09


def test_allocation_view_sums_per_deployment_and_tenant():
    placer = Placer([node("node-a", 1)])
    placer.place(request("d1", 20, tenant="acme"))
    placer.place(request("d2", 20, tenant="acme"))
    placer.place(request("d3", 20, tenant="globex"))
    (view,) = placer.allocation_view()
    quarter = GB80 // 4
    assert view.by_deployment == {"d1": quarter, "d2": quarter, "d3": quarter}
    assert view.by_tenant == {"acme": 2 * quarter, "globex": quarter}
    assert view.memory_total_bytes == GB80
    assert [e.tenant_id for e in view.entries] == ["acme", "acme", "globex"]
    assert allocation_view(placer.nodes) == placer.allocation_view()


# ---------------------------------------------------------------- from inventory


def test_inventory_gpus_become_slots_and_declared_gpus_get_no_cuda_env():
    fixture = Path(__file__).parent / "fixtures" / "h200_nvml.json"
    (h200,) = parse_snapshot(json.loads(fixture.read_text()))
    slot = gpu_slot_from_info(h200)
    assert slot.uuid == h200.uuid and slot.memory_total_bytes == 143771 * 1024**2
    assert not slot.mig_enabled
    result = Placer([Node("h200", [slot])]).place(request("d1", 30))
    assert result.instances[0].env == {"CUDA_VISIBLE_DEVICES": h200.uuid}

    cpu = Node("cpu-dev", [gpu_slot_from_info(g) for g in declared_inventory("1x24GiB", "cpu")])
    inst = Placer([cpu]).place(request("tiny", 1)).instances[0]
    assert inst.env == {} and inst.gpu_uuids == ("declared-cpu-0",)


def test_bad_requests_are_refused_with_a_reason():
    placer = Placer([node("node-a", 1)])
    for bad, message in [
        (request("d", 1, replicas=0), "replicas"),
        (request("d", 1, isolation="vgpu"), "unknown isolation mode"),
        (request("d", 0), "memory_bytes_per_gpu"),
    ]:
        result = placer.place(bad)
        assert not result.ok and message in result.reason


# ---------------------------------------------------------------- speed


def test_500_deployments_on_100_nodes_of_8_gpus_place_in_well_under_a_second():
    rng = random.Random(7)
    nodes = [node(f"node-{i:03d}") for i in range(100)]
    requests = []
    for i in range(500):
        tp = rng.choice([1, 1, 1, 1, 2, 4])
        requests.append(
            request(
                f"d{i}",
                rng.uniform(4, 40),
                tenant=f"t{i % 20}",
                replicas=rng.choice([1, 1, 2]),
                tensor_parallel_size=tp,
                num_attention_heads=32,
                isolation=rng.choice(["shared", "shared", "shared", "mps", "dedicated"]),
            )
        )
    start = time.perf_counter()
    placer = Placer(nodes)
    results = [placer.place(r) for r in requests]
    elapsed = time.perf_counter() - start
    assert sum(r.ok for r in results) > 400
    for view in placer.allocation_view():
        assert view.reserved_fraction <= 0.90 + 1e-9 or view.free_fraction == 0.0
    # Speed is the placement benchmark's business (benchmarks/placement_bench.py), not a test's.
    print(f"500 placements took {elapsed:.3f} s")
    assert all(
        re.match(r"GPU-node-\d{3}-\d", u) for r in results for i in r.instances for u in i.gpu_uuids
    )
