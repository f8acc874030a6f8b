"""What the placer is asked and what it answers: a deployment's ``PlacementRequest`` (its
replicas, their GPUs and memory, the tenants it is charged to), and a ``PlacementResult`` with an
``InstancePlacement`` per replica, or the refusal's reason.

Plain Python with no Django (``fleet.place`` and ``whatif`` build the requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cluster import Id, Isolation, Shares


class PlacementError(ValueError):
    """A request that cannot be placed; ``str()`` is the human reason."""


@dataclass(frozen=True)
class TenantShare:
    """A tenant a deployment is charged to: its share of the reservation and its GPU memory
    quota (None: unlimited). ``label`` names it in a refusal."""

    tenant_id: Id
    share: float = 1.0
    quota_gib: float | None = None
    label: str = ""

    @property
    def quota_owner(self) -> str:
        """Whose quota a refusal names: "tenant acme's", or "tenant" without a label."""
        return f"tenant {self.label}'s" if self.label else "tenant"

    def part_of(self, what: str) -> str:
        """How a refusal names what the tenant is charged: all of ``what``, or its share."""
        if self.share >= 1:
            return f"this {what}"
        return f"its share ({self.share:.0%}) of this {what}"


@dataclass(frozen=True)
class PlacementRequest:
    """One deployment to place: ``replicas`` instances of ``tensor_parallel_size`` x
    ``pipeline_parallel_size`` GPUs each (on one node, or with ``allow_multi_node`` on several).

    ``memory_bytes_per_gpu`` is the planner's ``MemoryPlan.needed_bytes``. ``tenants`` charges
    the deployment to several tenants by share, each quota checked against its share; empty
    charges it all to ``tenant_id`` with ``tenant_quota_gib``. ``tenant_used_gib`` ``None``
    means: count what the placer's own allocations hold for the tenant.
    """

    deployment_id: Id
    tenant_id: Id
    memory_bytes_per_gpu: int
    replicas: int = 1
    tensor_parallel_size: int = 1
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    isolation: str = Isolation.SHARED.value
    pipeline_parallel_size: int = 1
    allow_multi_node: bool = False
    num_layers: int | None = None
    tenant_quota_gib: float | None = None
    tenant_used_gib: float | None = None
    mps_thread_percentage: int | None = None
    tenants: tuple[TenantShare, ...] = ()

    @property
    def world_size(self) -> int:
        """GPUs one instance spans: TP x PP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check(self) -> None:
        """Raise ``PlacementError`` where the request itself cannot be placed, whatever the
        cluster: sizes below 1, more pipeline stages than layers, an unknown isolation mode,
        heads that do not split over the TP size, MIG with more than one GPU."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.replicas < 1:
            raise PlacementError("replicas must be at least 1")
        if tp < 1:
            raise PlacementError("tensor_parallel_size must be at least 1")
        if pp < 1:
            raise PlacementError("pipeline_parallel_size must be at least 1")
        if self.num_layers is not None and pp > self.num_layers:
            raise PlacementError(
                f"{self.num_layers} layers cannot make {pp} pipeline stages"
            )
        if self.memory_bytes_per_gpu <= 0:
            raise PlacementError("memory_bytes_per_gpu must be positive")
        try:
            isolation = Isolation(self.isolation)
        except ValueError:
            known = ", ".join(m.value for m in Isolation)
            raise PlacementError(
                f"unknown isolation mode {self.isolation!r}; use one of {known}"
            ) from None
        heads = self.num_attention_heads
        if heads is not None and heads % tp:
            raise PlacementError(
                f"{heads} attention heads are not divisible by tensor_parallel_size {tp}"
            )
        kv = self.num_kv_heads
        if kv is not None and (kv % tp if kv >= tp else tp % kv):
            raise PlacementError(
                f"{kv} KV heads do not split evenly over tensor_parallel_size {tp}"
            )
        world = self.world_size
        if isolation is Isolation.MIG and world > 1:
            raise PlacementError(
                "MIG isolation needs tensor_parallel_size 1 and pipeline_parallel_size 1: a "
                "CUDA process sees one MIG device"
            )

    def charged(self) -> tuple[TenantShare, ...]:
        """The tenants the deployment is charged to, with their shares and quotas."""
        if self.tenants:
            return self.tenants
        return (TenantShare(self.tenant_id, 1.0, self.tenant_quota_gib),)

    def allocation_shares(self) -> Shares:
        """What each of its allocations records (empty: all to ``tenant_id``)."""
        return tuple((t.tenant_id, t.share) for t in self.tenants)


@dataclass(frozen=True)
class NodePart:
    """The GPUs of a multi-node instance on one of its other nodes (a headless worker there)."""

    node: str
    gpu_indexes: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class InstancePlacement:
    """Where one replica goes and how to start it: ``node`` and its GPUs are the leader's (node
    rank 0, which serves the API); ``workers`` the other nodes of a group that spans several,
    in node-rank order (empty: all on one node)."""

    replica: int
    node: str
    gpu_indexes: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    gpu_memory_utilization: float
    reserved_bytes_per_gpu: int
    isolation: str
    mig_uuid: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    workers: tuple[NodePart, ...] = ()

    @property
    def gpu_count(self) -> int:
        """GPUs of the whole group, on every node."""
        return len(self.gpu_indexes) + sum(len(w.gpu_indexes) for w in self.workers)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The group's nodes, the leader's first."""
        return (self.node, *(w.node for w in self.workers))


@dataclass(frozen=True)
class PlacementResult:
    """All replicas placed (``ok``) or a refusal with a human ``reason`` and nothing placed."""

    ok: bool
    deployment_id: Id
    tenant_id: Id
    instances: tuple[InstancePlacement, ...] = ()
    reason: str | None = None

    @property
    def reserved_bytes(self) -> int:
        """Total memory the placement reserves (what counts against the tenant's quota)."""
        return sum(i.reserved_bytes_per_gpu * i.gpu_count for i in self.instances)


__all__ = ["InstancePlacement", "NodePart", "PlacementError", "PlacementRequest",
           "PlacementResult", "TenantShare"]
