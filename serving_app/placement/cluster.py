"""The cluster as the placer sees it: nodes, their GPUs and MIG devices, the allocations
reserved on them (``Allocation``), and what each GPU holds as the dashboards show it
(``allocation_view``).

Plain Python with no Django: ``fleet.read`` builds these from the database rows, ``whatif`` from
a declared fleet (``gpu_slot_from_info``), and ``placer.Placer`` places requests on them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from .inventory import GpuInfo
from .shares import split_amount

# The share of each GPU's memory kept free when placing (`PLACEMENT_HEADROOM`'s default).
DEFAULT_HEADROOM = 0.10

Id = Hashable


class Isolation(StrEnum):
    """How an instance shares its GPU."""

    DEDICATED = "dedicated"
    SHARED = "shared"
    MIG = "mig"
    MPS = "mps"


class Policy(StrEnum):
    """Scoring policy among the GPUs that fit."""

    BINPACK = "binpack"
    SPREAD = "spread"


Shares = tuple[tuple[Id, float], ...]


@dataclass
class Allocation:
    """A share of a GPU (or a whole MIG device) reserved for one instance of a deployment.

    ``shares`` charges the reservation to several tenants, (tenant, share) pairs summing to 1
    (``shares.charged_shares``); empty charges all of it to ``tenant_id``.
    """

    deployment_id: Id
    tenant_id: Id
    fraction: float
    isolation: str = Isolation.SHARED.value
    replica: int | None = None
    mig_uuid: str | None = None
    exclusive: bool = False
    shares: Shares = ()

    def charged(self) -> Shares:
        """The tenants this reservation is charged to, with their shares."""
        return self.shares or ((self.tenant_id, 1.0),)


@dataclass
class MigSlot:
    """A MIG device of a GPU; it holds at most one instance."""

    uuid: str
    memory_total_bytes: int
    profile: str | None = None


@dataclass
class GpuSlot:
    """A GPU as the placer sees it: its size, its MIG devices and what is reserved on it."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    mig_enabled: bool = False
    mig_devices: list[MigSlot] = field(default_factory=list)
    allocations: list[Allocation] = field(default_factory=list)
    other_used_bytes: int = 0
    declared: bool = False


@dataclass
class Node:
    """A GPU host (one node agent)."""

    name: str
    gpus: list[GpuSlot] = field(default_factory=list)
    ready: bool = True
    lost: bool = False


def charged_bytes(alloc: Allocation, size: int) -> dict[Id, int]:
    """An allocation's reserved bytes per tenant it is charged to (parts add up to ``size``)."""
    if not alloc.shares:
        return {alloc.tenant_id: size}
    return split_amount(size, dict(alloc.shares))


def fraction_pct(fraction: float) -> int:
    """A reserved fraction of a GPU as whole hundredths, rounded up (as vLLM is given it)."""
    return math.ceil(fraction * 100 - 1e-9)


def gpu_slot_from_info(
    info: GpuInfo,
    allocations: Iterable[Allocation] = (),
    other_used_bytes: int = 0,
) -> GpuSlot:
    """Turn an inventory ``GpuInfo`` into a ``GpuSlot`` (its MIG devices included).

    ``other_used_bytes`` is memory held by processes the console does not manage; the caller
    knows which of ``info.processes`` are its own engines, so it computes this.
    """
    if info.uuid is None or info.memory_total_bytes is None:
        raise ValueError(f"GPU {info.index} has no UUID or total memory; it cannot be placed on")
    migs = [
        MigSlot(uuid=m.uuid, memory_total_bytes=m.memory_total_bytes, profile=m.profile)
        for m in info.mig_devices
        if m.uuid and m.memory_total_bytes
    ]
    return GpuSlot(
        index=info.index,
        uuid=info.uuid,
        name=info.name or "",
        memory_total_bytes=info.memory_total_bytes,
        mig_enabled=bool(info.mig_mode_current),
        mig_devices=migs,
        allocations=list(allocations),
        other_used_bytes=other_used_bytes,
        declared=info.declared,
    )


@dataclass(frozen=True)
class AllocationEntry:
    """One reservation on a GPU, as the dashboards show it (``shares``: see ``Allocation``)."""

    deployment_id: Id
    tenant_id: Id
    fraction: float
    reserved_bytes: int
    isolation: str
    replica: int | None = None
    mig_uuid: str | None = None
    shares: Shares = ()


@dataclass(frozen=True)
class GpuAllocationView:
    """What one GPU holds: its total, the reservations, and their sums per deployment/tenant."""

    node: str
    gpu_index: int
    gpu_uuid: str
    gpu_name: str
    memory_total_bytes: int
    reserved_fraction: float
    reserved_bytes: int
    free_fraction: float
    entries: tuple[AllocationEntry, ...]
    by_deployment: dict[Id, int]
    by_tenant: dict[Id, int]


def allocation_view(nodes: Iterable[Node], *, headroom: float = DEFAULT_HEADROOM,
                    ) -> list[GpuAllocationView]:
    """Per GPU: total memory, reservations per deployment and tenant, free share below the cap.

    ``reserved_fraction`` counts a dedicated GPU as 1.0, a MIG device as its share of the GPU, and
    memory of unmanaged processes (``other_used_bytes``) as reserved.
    """
    cap = 100 - round(headroom * 100)
    views = []
    for node in nodes:
        for gpu in node.gpus:
            total = gpu.memory_total_bytes
            entries = []
            by_dep: dict[Id, int] = {}
            by_tenant: dict[Id, int] = {}
            reserved_bytes = gpu.other_used_bytes
            exclusive = False
            for alloc in gpu.allocations:
                if alloc.mig_uuid is not None:
                    size = next(
                        (m.memory_total_bytes for m in gpu.mig_devices if m.uuid == alloc.mig_uuid),
                        0,
                    )
                elif alloc.exclusive:
                    size, exclusive = total, True
                else:
                    size = total * fraction_pct(alloc.fraction) // 100
                reserved_bytes += size
                by_dep[alloc.deployment_id] = by_dep.get(alloc.deployment_id, 0) + size
                for tenant, part in charged_bytes(alloc, size).items():
                    by_tenant[tenant] = by_tenant.get(tenant, 0) + part
                entries.append(
                    AllocationEntry(
                        deployment_id=alloc.deployment_id,
                        tenant_id=alloc.tenant_id,
                        fraction=alloc.fraction,
                        reserved_bytes=size,
                        isolation=alloc.isolation,
                        replica=alloc.replica,
                        mig_uuid=alloc.mig_uuid,
                        shares=alloc.charged(),
                    )
                )
            reserved_bytes = min(reserved_bytes, total)
            reserved_fraction = 1.0 if exclusive else reserved_bytes / total
            free = 0.0 if exclusive or gpu.mig_enabled else max(0.0, cap / 100 - reserved_fraction)
            views.append(
                GpuAllocationView(
                    node=node.name,
                    gpu_index=gpu.index,
                    gpu_uuid=gpu.uuid,
                    gpu_name=gpu.name,
                    memory_total_bytes=total,
                    reserved_fraction=reserved_fraction,
                    reserved_bytes=reserved_bytes,
                    free_fraction=free,
                    entries=tuple(entries),
                    by_deployment=by_dep,
                    by_tenant=by_tenant,
                )
            )
    return views


__all__ = ["Allocation", "AllocationEntry", "GpuAllocationView", "GpuSlot", "Id", "Isolation",
           "MigSlot", "Node", "Policy", "Shares", "allocation_view", "charged_bytes",
           "fraction_pct", "gpu_slot_from_info"]
