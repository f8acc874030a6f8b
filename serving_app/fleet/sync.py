"""Store a node's GPU inventory (``GpuInfo`` from NVML or a declaration) as ``Gpu`` rows.

``store_inventory()`` is what the node agent calls at registration and every
``NODE_INVENTORY_SECONDS``. In one transaction, with the node's row locked so two reports of one
node never interleave, it:

- upserts one ``Gpu`` row per physical GPU, keyed by ``(node, uuid)``, and one per MIG device
  with ``parent`` set to its GPU, its profile and its own UUID. A MIG row takes its parent's
  ``index``, because operators name MIG devices by their physical GPU;
- refreshes the readings (memory used, utilization, temperature, power, processes, declared).
  A MIG device gets the processes whose GPU instance id is its own;
- removes the rows of GPUs that are no longer reported. A row that an active instance still uses
  is kept, and so is its parent, so the instance's record stays whole. It is marked stale: its
  ``updated_at`` stays behind the node's newest one, and the placer reads it as full
  (``serving_app.fleet.read``);
- appends a ``GpuSample`` per row and deletes that node's samples older than
  ``GPU_SAMPLE_RETENTION_HOURS`` (default 24). The delete is one indexed statement.

A GPU that NVML could not read (no UUID or no total memory) is skipped. The rows at its index are
neither updated nor removed, because one unreadable query must not look like a removed GPU.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from serving_app.models import Gpu, GpuSample, Instance, Node
from serving_app.placement.inventory import GpuInfo, GpuProcessInfo, MigDeviceInfo, cpulist_text

log = logging.getLogger(__name__)

DEFAULT_SAMPLE_RETENTION_HOURS = 24.0

_READINGS = (
    "index",
    "name",
    "memory_total_bytes",
    "mig_mode",
    "mig_profile",
    "parent",
    "memory_used_bytes",
    "utilization_percent",
    "temperature_c",
    "power_w",
    "processes",
    "declared",
)


def sample_retention() -> timedelta:
    """How long GPU samples are kept (the ``GPU_SAMPLE_RETENTION_HOURS`` setting)."""
    hours = float(getattr(settings, "GPU_SAMPLE_RETENTION_HOURS", DEFAULT_SAMPLE_RETENTION_HOURS))
    return timedelta(hours=hours)


def _process_dicts(processes: list[GpuProcessInfo]) -> list[dict[str, Any]]:
    return [
        {
            "pid": p.pid,
            "used_memory_bytes": p.used_memory_bytes,
            "gpu_instance_id": p.gpu_instance_id,
            "compute_instance_id": p.compute_instance_id,
        }
        for p in processes
    ]


def _gpu_values(info: GpuInfo) -> dict[str, Any]:
    return {
        "index": info.index,
        "name": (info.name or "")[:100],
        "memory_total_bytes": info.memory_total_bytes,
        "mig_mode": bool(info.mig_mode_current),
        "mig_profile": "",
        "parent": None,
        "memory_used_bytes": info.memory_used_bytes,
        "utilization_percent": _float(info.utilization_gpu_pct),
        "temperature_c": _float(info.temperature_c),
        "power_w": _float(info.power_w),
        "processes": _process_dicts(info.processes),
        "cpu_affinity": cpulist_text(info.cpu_affinity) if info.cpu_affinity else "",
        "declared": info.declared,
    }


def _mig_values(info: GpuInfo, mig: MigDeviceInfo, parent: Gpu) -> dict[str, Any]:
    profile = mig.profile or ""
    own = [
        p
        for p in info.processes
        if p.gpu_instance_id is not None and p.gpu_instance_id == mig.gpu_instance_id
    ]
    return {
        "index": info.index,
        "name": f"{info.name or 'GPU'} MIG {profile}".strip()[:100],
        "memory_total_bytes": mig.memory_total_bytes,
        "mig_mode": False,
        "mig_profile": profile[:50],
        "parent": parent,
        "memory_used_bytes": mig.memory_used_bytes,
        "utilization_percent": None,
        "temperature_c": None,
        "power_w": None,
        "processes": _process_dicts(own),
        "cpu_affinity": cpulist_text(info.cpu_affinity) if info.cpu_affinity else "",
        "declared": info.declared,
    }


def _float(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def _upsert(node: Node, existing: dict[str, Gpu], uuid: str, values: dict[str, Any]) -> Gpu:
    row = existing.get(uuid)
    if row is None:
        row = Gpu.objects.create(node=node, uuid=uuid, **values)
        existing[uuid] = row
        return row
    changed = [
        name
        for name in _READINGS
        if (
            row.parent_id != getattr(values["parent"], "pk", None)
            if name == "parent"
            else getattr(row, name) != values[name]
        )
    ]
    for name in changed:
        setattr(row, name, values[name])
    if changed:
        row.save(update_fields=changed)
    return row




def store_inventory(node: Node, gpus: list[GpuInfo], source: str) -> None:
    """Make the node's ``Gpu`` rows match ``gpus``, record ``source``, append samples.

    ``source`` is a ``Node.InventorySource`` value. An empty ``gpus`` list makes the node a
    CPU host (rows that active instances use are kept). The function is idempotent: reporting
    the same inventory twice changes only the samples.
    """
    now = timezone.now()
    with transaction.atomic():
        # The lock serializes concurrent reports of one node (registration and the timer).
        Node.objects.select_for_update().filter(pk=node.pk).update(inventory_source=source)
        node.inventory_source = source
        existing = {g.uuid: g for g in Gpu.objects.filter(node=node)}
        reported: list[Gpu] = []
        unreadable: set[int] = set()
        for info in gpus:
            if not info.uuid or not info.memory_total_bytes:
                unreadable.add(info.index)
                log.warning(
                    "node %s: GPU %s could not be read (%s); its rows are left as they were",
                    node.name,
                    info.index,
                    "; ".join(f"{k}: {v}" for k, v in info.errors.items()) or "no UUID or memory",
                )
                continue
            parent = _upsert(node, existing, info.uuid, _gpu_values(info))
            reported.append(parent)
            for mig in info.mig_devices:
                if not mig.uuid or not mig.memory_total_bytes:
                    continue
                reported.append(_upsert(node, existing, mig.uuid, _mig_values(info, mig, parent)))

        _remove_missing(node, existing, reported, unreadable)
        reported_ids = [g.pk for g in reported]
        # One stamp for every reported row; a kept, unreported row stays behind it (stale).
        Gpu.objects.filter(pk__in=reported_ids).update(updated_at=now)
        GpuSample.objects.bulk_create(
            GpuSample(
                gpu=g,
                at=now,
                memory_used_bytes=g.memory_used_bytes,
                utilization_percent=g.utilization_percent,
                temperature_c=g.temperature_c,
                power_w=g.power_w,
            )
            for g in reported
        )
        node_gpu_ids = list(Gpu.objects.filter(node=node).values_list("pk", flat=True))
        GpuSample.objects.filter(gpu_id__in=node_gpu_ids, at__lt=now - sample_retention()).delete()


def _remove_missing(
    node: Node, existing: dict[str, Gpu], reported: list[Gpu], unreadable: set[int]
) -> None:
    reported_ids = {g.pk for g in reported}
    by_pk = {g.pk: g for g in existing.values()}
    missing = {
        pk for pk, g in by_pk.items() if pk not in reported_ids and g.index not in unreadable
    }
    if not missing:
        return
    in_use = set(
        Instance.gpus.through.objects.filter(
            gpu_id__in=missing, instance__in=Instance.objects.active()
        ).values_list("gpu_id", flat=True)
    )
    keep = in_use | {p for pk in in_use if (p := by_pk[pk].parent_id) is not None}
    for pk in sorted(keep & missing):
        log.warning(
            "node %s: %s is no longer reported but an active instance uses it; kept as full",
            node.name,
            by_pk[pk],
        )
    doomed = missing - keep
    if doomed:
        Gpu.objects.filter(pk__in=doomed).delete()
