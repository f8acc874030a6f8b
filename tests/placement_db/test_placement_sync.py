"""store_inventory: GPU rows from a real NVML snapshot, a declaration and MIG devices; samples."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from django.utils import timezone

from serving_app.fleet.read import build_placer
from serving_app.fleet.sync import store_inventory
from serving_app.models import Gpu, GpuSample, Instance, Node
from serving_app.placement.inventory import (
    GIB,
    GpuInfo,
    GpuProcessInfo,
    MigDeviceInfo,
    declared_inventory,
)
from tests.factories import make_base_model, make_deployment, make_tenant
from tests.placement_db.placement_helpers import h200_gpus, make_node, store

pytestmark = pytest.mark.django_db

H200_UUID = "GPU-4e1159e8-f3d6-41be-8b16-6125942d04c8"


def test_h200_snapshot_becomes_one_gpu_row_with_its_readings():
    node = make_node("h200")
    store(node, h200_gpus())

    node.refresh_from_db()
    assert node.inventory_source == Node.InventorySource.NVML
    gpu = Gpu.objects.get(node=node)
    assert (gpu.index, gpu.uuid, gpu.name) == (0, H200_UUID, "NVIDIA H200")
    assert gpu.memory_total_bytes == 150_754_820_096
    assert gpu.memory_used_bytes == 5_588_779_008
    assert (gpu.utilization_percent, gpu.temperature_c) == (0.0, 30.0)
    assert gpu.power_w == pytest.approx(108.325)
    assert gpu.processes == [
        {
            "pid": 425,
            "used_memory_bytes": 4_934_598_656,
            "gpu_instance_id": None,
            "compute_instance_id": None,
        }
    ]
    assert not gpu.declared and not gpu.mig_mode and gpu.parent is None
    sample = GpuSample.objects.get(gpu=gpu)
    assert sample.memory_used_bytes == 5_588_779_008
    assert sample.power_w == pytest.approx(108.325)


def test_reporting_again_updates_in_place_and_appends_a_sample():
    node = make_node("h200")
    store(node, h200_gpus("h200_nvml_idle.json"))
    first = Gpu.objects.get(node=node)
    store(node, h200_gpus())

    gpu = Gpu.objects.get(node=node)
    assert gpu.pk == first.pk
    assert gpu.memory_used_bytes == 5_588_779_008
    assert GpuSample.objects.filter(gpu=gpu).count() == 2


def test_memory_held_by_a_foreign_process_is_not_placed_over():
    """The H200 read held a 4.7 GiB PyTorch process that no instance accounts for."""
    node = make_node("h200")
    store(node, h200_gpus())
    (slot,) = build_placer().nodes[0].gpus
    assert slot.other_used_bytes == 5_588_779_008


def test_idle_driver_reserve_does_not_block_a_dedicated_gpu():
    node = make_node("h200")
    store(node, h200_gpus("h200_nvml_idle.json"))
    (slot,) = build_placer().nodes[0].gpus
    assert slot.other_used_bytes == 0


def test_declared_spec_makes_declared_rows():
    node = make_node("dev", "2xNVIDIA L4:24GiB")
    node.refresh_from_db()
    assert node.inventory_source == Node.InventorySource.DECLARED
    rows = list(Gpu.objects.filter(node=node).order_by("index"))
    assert [(g.index, g.uuid, g.name, g.declared) for g in rows] == [
        (0, "declared-dev-0", "NVIDIA L4", True),
        (1, "declared-dev-1", "NVIDIA L4", True),
    ]
    assert all(g.memory_total_bytes == 24 * GIB for g in rows)
    assert GpuSample.objects.filter(gpu__node=node).count() == 2


def a100_with_mig() -> GpuInfo:
    """An A100 in MIG mode with two 3g.40gb devices; one runs a process (GPU instance 1)."""
    return GpuInfo(
        index=0,
        uuid="GPU-a100",
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=80 * GIB,
        memory_used_bytes=3 * GIB,
        mig_mode_current=True,
        mig_devices=[
            MigDeviceInfo(index=0, uuid="MIG-aaaa", profile="3g.40gb",
                          memory_total_bytes=40 * GIB, memory_used_bytes=2 * GIB,
                          gpu_instance_id=1),
            MigDeviceInfo(index=1, uuid="MIG-bbbb", profile="3g.40gb",
                          memory_total_bytes=40 * GIB, memory_used_bytes=0, gpu_instance_id=2),
        ],
        processes=[GpuProcessInfo(pid=77, used_memory_bytes=2 * GIB, gpu_instance_id=1)],
    )


def test_mig_devices_become_rows_under_their_gpu():
    node = make_node("mig")
    store(node, [a100_with_mig()])

    parent = Gpu.objects.get(node=node, parent=None)
    assert parent.mig_mode
    migs = list(parent.mig_devices.order_by("uuid"))
    assert [(m.uuid, m.mig_profile, m.index, m.memory_total_bytes) for m in migs] == [
        ("MIG-aaaa", "3g.40gb", 0, 40 * GIB),
        ("MIG-bbbb", "3g.40gb", 0, 40 * GIB),
    ]
    assert [p["pid"] for p in migs[0].processes] == [77]
    assert migs[1].processes == []
    assert migs[0].name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    # The MIG device busy with a process the console did not start is not offered.
    (slot,) = build_placer().nodes[0].gpus
    assert [m.uuid for m in slot.mig_devices] == ["MIG-bbbb"]


def test_gone_gpus_are_removed_unless_an_active_instance_uses_them(tmp_path):
    node = make_node("box", "3x24GiB")
    gpu1, gpu2 = (Gpu.objects.get(node=node, index=i) for i in (1, 2))
    deployment = make_deployment(make_base_model(tmp_path), [make_tenant("t")])
    instance = Instance.objects.create(deployment=deployment, node=node, state="ready")
    instance.gpus.set([gpu1])

    store_inventory(node, declared_inventory("1x24GiB", host="box"), "declared")

    assert set(Gpu.objects.filter(node=node).values_list("index", flat=True)) == {0, 1}
    assert not Gpu.objects.filter(pk=gpu2.pk).exists()
    # Kept for the instance's sake, but read as full: nothing new goes there.
    slots = {s.index: s for s in build_placer().nodes[0].gpus}
    assert slots[1].other_used_bytes == 24 * GIB
    assert slots[0].other_used_bytes == 0

    instance.transition(["ready"], Instance.State.STOPPED)
    store_inventory(node, declared_inventory("1x24GiB", host="box"), "declared")
    assert list(Gpu.objects.filter(node=node).values_list("index", flat=True)) == [0]


def test_a_gpu_its_live_agent_stopped_reporting_is_read_as_full(settings):
    settings.NODE_INVENTORY_SECONDS = 60
    node = make_node("box", "2x24GiB")
    make_node("fresh", "1x24GiB")
    # Three inventory periods without a report, while the heartbeat stays fresh.
    Gpu.objects.filter(node=node).update(updated_at=timezone.now() - timedelta(seconds=181))
    slots = {(n.name, s.index): s.other_used_bytes for n in build_placer().nodes for s in n.gpus}
    assert slots == {("box", 0): 24 * GIB, ("box", 1): 24 * GIB, ("fresh", 0): 0}


def test_an_unreadable_gpu_keeps_its_row():
    node = make_node("h200")
    store(node, h200_gpus())
    broken = copy.deepcopy(h200_gpus()[0])
    broken.uuid = None
    broken.errors = {"uuid": "NVMLError_Unknown"}
    store(node, [broken])
    assert Gpu.objects.filter(node=node, uuid=H200_UUID).exists()


def test_an_empty_report_makes_a_cpu_host():
    node = make_node("box", "2x24GiB")
    store_inventory(node, [], Node.InventorySource.DECLARED)
    assert not Gpu.objects.filter(node=node).exists()


def test_samples_older_than_the_retention_are_pruned(settings):
    settings.GPU_SAMPLE_RETENTION_HOURS = 2
    node = make_node("h200")
    store(node, h200_gpus())
    gpu = Gpu.objects.get(node=node)
    now = timezone.now()
    old = GpuSample.objects.create(gpu=gpu, at=now - timedelta(hours=3))
    recent = GpuSample.objects.create(gpu=gpu, at=now - timedelta(hours=1))
    other_node = make_node("other", "1x24GiB")
    elsewhere = GpuSample.objects.create(
        gpu=Gpu.objects.get(node=other_node), at=now - timedelta(hours=3)
    )

    store(node, h200_gpus())

    kept = set(GpuSample.objects.filter(gpu=gpu).values_list("pk", flat=True))
    assert old.pk not in kept and recent.pk in kept and len(kept) == 3
    # Pruning is per reporting node: the other node prunes its own at its next report.
    assert GpuSample.objects.filter(pk=elsewhere.pk).exists()
