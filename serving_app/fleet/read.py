"""Placement's reading of the database: rows turned into the plain dataclasses of ``planner`` and
``placement.cluster``.

- ``plan_deployment(deployment)``: the ``MemoryPlan`` from the Deployment's engine settings
  (its ``EngineSpec``) and its BaseModel.
- ``charged_tenants(deployment)``: the tenants a deployment is charged to at placement, each with
  its entitled share and GPU memory quota.
- ``load_cluster(exclude_deployment=None, period=None)``: a ``Cluster``, a ``Placer`` loaded with
  every GPU node, its GPUs (MIG devices under their parent) and the allocations of active
  instances, with the rows behind its answers; ``build_placer()`` its placer alone.

``place`` places instances on it and ``report`` shows it (dry runs, the allocation and the
accounting). Choices this module makes (docs/placement.md, "Placement against the database"):

- **Charged tenants.** A deployment that serves several tenants is charged to all of them by
  ``shares.charged_shares`` (docs/placement.md, "Charging a shared deployment"). At placement,
  where nothing has run, the split is the entitled one (fair-share weights), and each tenant's
  ``gpu_memory_quota_gib`` is checked for its share. The allocation view with a ``period``
  splits by the weighted tokens each tenant was served over it (``accounting``).
- **Unmanaged memory.** On each GPU, the memory NVML reports as used beyond what the console's
  active instances reserve counts as held by others. This way a foreign process, or the
  driver's own reserve, is never placed over. Process ids are not matched, because vLLM's GPU
  memory is held by a child process whose pid the console does not record.
- **Gone GPUs.** A GPU that is no longer reported, but that an active instance still uses, is
  kept by ``sync.store_inventory``. The placer reads it as full, so nothing new goes there.
  The same holds for a GPU whose node has not reported it for three ``NODE_INVENTORY_SECONDS``
  periods.
- **Lost nodes.** The instances of a node the reconciler declared lost are left out of the
  allocations (they are being replaced), so their replacements fit within the tenant's quota.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Max
from django.utils import timezone

from serving_app.enginespec import EngineSpec
from serving_app.fleet.accounting import (
    DeploymentCharge,
    Period,
    entitled_charges,
    measured_charges,
)
from serving_app.models import BaseModel, Deployment, Gpu, Instance, LoraAdapter, Node
from serving_app.placement import cluster as C
from serving_app.placement.inventory import GIB
from serving_app.placement.placer import Placer
from serving_app.placement.planner import (
    EngineSettings,
    MemoryPlan,
    ModelArchitecture,
    measured_settings,
    plan_memory,
)
from serving_app.placement.profile import MeasuredProfile
from serving_app.placement.request import TenantShare
from serving_app.placement.shares import entitled_shares
from tenants_app.models import Tenant

DEFAULT_POLICY = "binpack"
# Checkpoint formats that exist only as pre-quantized files; other quantizations (fp8,
# bitsandbytes) may also be applied by vLLM when loading a 16-bit checkpoint.
PREQUANTIZED = ("awq", "gptq")
MLP_MODULES = {"gate_proj", "up_proj", "down_proj"}
# Unmanaged memory below this is not counted: an idle GPU reports the driver's own reserve as
# used (615 MiB on the H200 read for tests/placement/fixtures), and counting it would keep every
# GPU from ever being empty for dedicated placement.
UNMANAGED_FLOOR_BYTES = 1 * GIB


class PlanningError(ValueError):
    """The deployment cannot be planned (its model's architecture is unknown, ...)."""


# ----------------------------------------------------------------------------- memory plan


def model_architecture(base: BaseModel) -> ModelArchitecture:
    """The planner's view of a registered base model (fields read from its files)."""
    # A model without attention heads is known by its config (its layout says why it is refused).
    if not (base.num_layers and base.hidden_size
            and (base.num_attention_heads or base.config)):
        raise PlanningError(
            f"{base.name}: its architecture is unknown (layers, hidden size and heads are read "
            "from config.json when the model is registered); save the model again"
        )
    if base.config:
        # The layout as vLLM builds it (experts, latent attention, sliding windows); a layout
        # the planner does not model is refused when the plan is made, with its reason.
        try:
            arch = ModelArchitecture.from_hf_config(base.config, base.weight_bytes)
        except ValueError as exc:
            raise PlanningError(f"{base.name}: {exc}") from exc
        quant = base.quantization if base.quantization in PREQUANTIZED else None
        return replace(arch, max_position_embeddings=base.max_position_embeddings or 2048,
                       torch_dtype=base.torch_dtype or arch.torch_dtype,
                       checkpoint_quantization=quant or arch.checkpoint_quantization,
                       measured=MeasuredProfile.from_dict(base.measured_profile))
    return _flat_architecture(base)


def _flat_architecture(base: BaseModel) -> ModelArchitecture:
    """A model planned as a dense decoder from its fields (no config.json kept)."""
    quant = base.quantization if base.quantization in PREQUANTIZED else None
    return ModelArchitecture(
        num_layers=base.num_layers,
        hidden_size=base.hidden_size,
        num_attention_heads=base.num_attention_heads,
        num_kv_heads=base.num_kv_heads or base.num_attention_heads,
        weight_bytes=base.weight_bytes,
        vocab_size=base.vocab_size,
        max_position_embeddings=base.max_position_embeddings or 2048,
        head_dim=base.head_dim or None,
        torch_dtype=base.torch_dtype or "bfloat16",
        intermediate_size=base.intermediate_size or None,
        checkpoint_quantization=quant,
        measured=MeasuredProfile.from_dict(base.measured_profile),
    )


def record_measured_profile(instance: Instance) -> MeasuredProfile:
    """Store what ``instance``'s engine logged at its start (``Instance.startup``'s figures) as
    its base model's measured profile, with the settings it ran with; the planner uses it for
    engines with the same settings, marked "measured". Raises ``PlanningError`` when the start
    logged none of the figures (it has not sized its KV cache yet)."""
    deployment = instance.deployment
    base = deployment.base_model
    figures = (instance.startup or {}).get("figures") or {}
    # The settings are resolved against the model's dense fields: the profile is for models
    # the layout may not know.
    flat = replace(_flat_architecture(base), measured=None)
    settings = measured_settings(flat, engine_settings(deployment.engine_spec(),
                                                       deployment.adapters.all()))
    node = instance.node.name if instance.node is not None else "a CPU node"
    when = timezone.now().strftime("%Y-%m-%d %H:%M UTC")
    try:
        profile = MeasuredProfile.from_figures(
            figures, settings, source=f"instance {instance.pk} on {node}, {when}")
    except ValueError as exc:
        raise PlanningError(f"{base.name}: {exc}") from exc
    base.measured_profile = profile.to_dict()
    base.save(update_fields=["measured_profile"])
    return profile


def engine_settings(engine: EngineSpec, adapters: Iterable[LoraAdapter] = ()) -> EngineSettings:
    """The planner's inputs for engines started with ``engine`` and ``adapters`` attached."""
    adapters = list(adapters)
    targets = {m for a in adapters for m in (a.target_modules or [])}
    return EngineSettings.of(engine, adapters=bool(adapters),
                             lora_target_mlp=bool(targets & MLP_MODULES))


def plan_deployment(
    deployment: Deployment,
    adapters: Iterable[LoraAdapter] | None = None,
    engine: EngineSpec | None = None,
) -> MemoryPlan:
    """The memory plan of one instance of ``deployment`` (per GPU of its TP group) started with
    ``engine`` (default: its settings as they are now, ``Deployment.engine_spec()``).

    ``adapters`` defaults to the saved deployment's; pass them for an unsaved one. Raises
    ``PlanningError`` when the base model's architecture is unknown.
    """
    engine = engine or deployment.engine_spec()
    adapters = list(deployment.adapters.all() if adapters is None else adapters)
    try:
        return plan_memory(model_architecture(deployment.base_model),
                           engine_settings(engine, adapters))
    except PlanningError:
        raise
    except ValueError as exc:  # an unknown dtype or quantization name
        raise PlanningError(str(exc)) from exc


# ----------------------------------------------------------------------------- tenants


def deployment_tenants(
    deployment: Deployment, tenants: Iterable[Tenant] | None = None
) -> list[Tenant]:
    """The tenants a deployment serves, by pk (``tenants`` for an unsaved one)."""
    if tenants is not None:
        return sorted(tenants, key=lambda t: t.pk)
    if deployment.pk is None:
        return []
    return list(deployment.tenants.order_by("pk"))


def charged_tenants(
    deployment: Deployment, tenants: Iterable[Tenant] | None = None
) -> tuple[TenantShare, ...]:
    """The tenants a deployment is charged to at placement, each with its entitled share
    (nothing has run yet) and its GPU memory quota, which the placer checks for that share."""
    rows = deployment_tenants(deployment, tenants)
    shares = entitled_shares({t.pk: t.fair_share_weight or 1 for t in rows})
    return tuple(
        TenantShare(
            tenant_id=t.pk, share=shares[t.pk], label=t.slug,
            quota_gib=None if t.gpu_memory_quota_gib is None else float(t.gpu_memory_quota_gib),
        )
        for t in rows
    )


# ----------------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    """What the database holds, loaded once: the placer plus what maps its answers to rows."""

    placer: Placer
    nodes: dict[str, Node]
    gpu_rows: dict[tuple[str, str], Gpu]
    cpu_nodes: list[Node] = field(default_factory=list)
    has_gpu_nodes: bool = False
    other_used: dict[int, int] = field(default_factory=dict)
    deployment_names: dict[Any, str] = field(default_factory=dict)
    tenant_slugs: dict[Any, str] = field(default_factory=dict)
    charges: dict[int, DeploymentCharge] = field(default_factory=dict)
    placed_at: dict[tuple[Any, int], datetime] = field(default_factory=dict)
    period: Period | None = None


def _headroom() -> float:
    return float(getattr(settings, "PLACEMENT_HEADROOM", C.DEFAULT_HEADROOM))


def _inventory_seconds() -> float:
    return float(getattr(settings, "NODE_INVENTORY_SECONDS", 60.0))


def _policy() -> str:
    return str(getattr(settings, "PLACEMENT_POLICY", DEFAULT_POLICY))


@dataclass
class _GpuRows:
    """Every node's GPU rows, read at once: its physical GPUs, each GPU's MIG devices, and when
    each node last reported its GPUs."""

    by_node: dict[int, list[Gpu]]
    migs: dict[int, list[Gpu]]
    newest: dict[int, datetime]
    too_old: datetime

    @classmethod
    def read(cls, nodes: Sequence[Node]) -> _GpuRows:
        rows = list(Gpu.objects.filter(node__in=nodes).order_by("node_id", "index", "pk"))
        newest = {
            row["node_id"]: row["newest"]
            for row in Gpu.objects.values("node_id").annotate(newest=Max("updated_at"))
        }
        by_node: dict[int, list[Gpu]] = {}
        migs: dict[int, list[Gpu]] = {}
        for row in rows:
            if row.parent_id is None:
                by_node.setdefault(row.node_id, []).append(row)
            else:
                migs.setdefault(row.parent_id, []).append(row)
        too_old = timezone.now() - timedelta(seconds=3 * _inventory_seconds())
        return cls(by_node, migs, newest, too_old)

    @property
    def pks(self) -> set[int]:
        return {row.pk for rows in (*self.by_node.values(), *self.migs.values()) for row in rows}

    def is_stale(self, gpu: Gpu, node: Node, lost: bool) -> bool:
        """Whether the node's last report left the row out (sync keeps a GPU an active
        instance uses), or a live agent has not reported it for three inventory periods."""
        newer = self.newest.get(node.pk)
        left_out = newer is not None and gpu.updated_at < newer
        return left_out or (not lost and gpu.updated_at < self.too_old)


def _active_instances(exclude_id: Any) -> list[Instance]:
    """The active instances that hold GPUs, but those of a node declared lost: they are being
    replaced and no longer hold GPU memory against their tenant's quota (the node itself takes
    nothing new while it is lost)."""
    active = (Instance.objects.active().filter(gpus__isnull=False)
              .exclude(node__lost_at__isnull=False))
    if exclude_id is not None:
        active = active.exclude(deployment_id=exclude_id)
    return list(active.select_related("deployment__base_model", "revision")
                .prefetch_related("gpus").distinct())


def _held_since(
    instances: list[Instance],
) -> tuple[dict[tuple[Any, int], datetime], dict[int, datetime]]:
    """When each replica (deployment, ordinal) was first placed, and each deployment."""
    placed_at: dict[tuple[Any, int], datetime] = {}
    held_since: dict[int, datetime] = {}
    for inst in instances:
        key = (inst.deployment_id, inst.ordinal)
        placed_at[key] = min(placed_at.get(key, inst.created_at), inst.created_at)
        dep_since = held_since.get(inst.deployment_id, inst.created_at)
        held_since[inst.deployment_id] = min(dep_since, inst.created_at)
    return placed_at, held_since


def _allocations(
    instances: list[Instance], gpu_pks: set[int], charges: dict[int, DeploymentCharge],
    cap: float,
) -> tuple[dict[int, list[C.Allocation]], dict[int, int]]:
    """Per physical GPU (by pk): the allocations of ``instances`` (a MIG device's under its
    parent) and the bytes they reserve of its shared memory."""
    first_tenant = {dep: min(c.weights) for dep, c in charges.items()}
    pairs = {dep: c.as_pairs() for dep, c in charges.items()}
    allocs: dict[int, list[C.Allocation]] = {}
    reserved: dict[int, int] = {}
    for inst in instances:
        dep = inst.deployment
        engine = inst.engine_spec()  # what it runs, whatever was edited since
        isolation = engine.isolation_mode
        for gpu in inst.gpus.all():
            if gpu.pk not in gpu_pks:
                continue
            if gpu.parent_id is not None:
                alloc = C.Allocation(
                    deployment_id=dep.pk, tenant_id=first_tenant.get(dep.pk), fraction=cap,
                    isolation=C.Isolation.MIG.value, replica=inst.ordinal, mig_uuid=gpu.uuid,
                    exclusive=True, shares=pairs.get(dep.pk, ()),
                )
                allocs.setdefault(gpu.parent_id, []).append(alloc)
                continue
            fraction = inst.gpu_memory_fraction or engine.gpu_memory_utilization
            exclusive = isolation == Deployment.Isolation.DEDICATED
            allocs.setdefault(gpu.pk, []).append(
                C.Allocation(
                    deployment_id=dep.pk, tenant_id=first_tenant.get(dep.pk), fraction=fraction,
                    isolation=isolation, replica=inst.ordinal, exclusive=exclusive,
                    shares=pairs.get(dep.pk, ()),
                )
            )
            share = gpu.memory_total_bytes if exclusive else math.ceil(
                gpu.memory_total_bytes * fraction
            )
            reserved[gpu.pk] = reserved.get(gpu.pk, 0) + share
    return allocs, reserved


@dataclass
class _PlacerNodes:
    """The placer's nodes, built node by node from the rows: with the row behind each GPU and
    MIG device (by node name and UUID) and the memory others hold on each GPU (by pk)."""

    gpus: _GpuRows
    allocs: dict[int, list[C.Allocation]]
    reserved: dict[int, int]
    nodes: list[C.Node] = field(default_factory=list)
    rows: dict[tuple[str, str], Gpu] = field(default_factory=dict)
    other_used: dict[int, int] = field(default_factory=dict)

    def add(self, node: Node) -> None:
        rows = self.gpus.by_node.get(node.pk, [])
        if not rows:
            return
        lost = node.is_lost
        slots = [self._slot(node, row, lost) for row in rows]
        self.nodes.append(C.Node(name=node.name, gpus=slots, ready=not node.cordoned, lost=lost))

    def _slot(self, node: Node, row: Gpu, lost: bool) -> C.GpuSlot:
        self.rows[(node.name, row.uuid)] = row
        stale = self.gpus.is_stale(row, node, lost)
        own = self.allocs.get(row.pk, [])
        taken = {a.mig_uuid for a in own if a.mig_uuid}
        mig_slots = []
        for mig in self.gpus.migs.get(row.pk, []):
            self.rows[(node.name, mig.uuid)] = mig
            # A MIG device running a process the console did not place is not free.
            foreign = bool(mig.processes) and mig.uuid not in taken
            if mig.uuid in taken or not (stale or foreign or self.gpus.is_stale(mig, node, lost)):
                mig_slots.append(
                    C.MigSlot(uuid=mig.uuid, memory_total_bytes=mig.memory_total_bytes,
                              profile=mig.mig_profile or None)
                )
        other = self._held_by_others(row, stale)
        if other:
            self.other_used[row.pk] = other
        return C.GpuSlot(
            index=row.index, uuid=row.uuid, name=row.name,
            memory_total_bytes=row.memory_total_bytes, mig_enabled=row.mig_mode,
            mig_devices=mig_slots, allocations=list(own), other_used_bytes=other,
            declared=row.declared,
        )

    def _held_by_others(self, row: Gpu, stale: bool) -> int:
        """Memory of a GPU the console's instances do not hold: all of a stale one's."""
        if stale:
            return row.memory_total_bytes
        used = row.memory_used_bytes or 0
        other = max(0, used - self.reserved.get(row.pk, 0))
        return 0 if other < UNMANAGED_FLOOR_BYTES else other


def load_cluster(
    exclude_deployment: Deployment | int | None = None, period: Period | None = None
) -> Cluster:
    """Read nodes, GPUs and active instances into a ``Cluster`` (a handful of queries).

    Each instance's reservation is charged to its deployment's tenants: by the entitled split,
    or with ``period`` by the split measured over it (``accounting``).
    """
    exclude_id = (exclude_deployment.pk if isinstance(exclude_deployment, Deployment)
                  else exclude_deployment)
    nodes = list(Node.objects.annotate(gpu_count=Count("gpus")).order_by("name"))
    gpus = _GpuRows.read(nodes)
    instances = _active_instances(exclude_id)
    placed_at, held_since = _held_since(instances)
    deployment_ids = list(held_since)
    charges = (
        measured_charges(deployment_ids, period, held_since)
        if period is not None
        else entitled_charges(deployment_ids)
    )
    headroom = _headroom()
    allocs, reserved = _allocations(instances, gpus.pks, charges,
                                    cap=1 - round(headroom * 100) / 100)
    built = _PlacerNodes(gpus, allocs, reserved)
    for node in nodes:
        built.add(node)
    tenant_ids = {t for c in charges.values() for t in c.weights}
    return Cluster(
        placer=Placer(built.nodes, headroom=headroom, policy=_policy()),
        nodes={n.name: n for n in nodes},
        gpu_rows=built.rows,
        cpu_nodes=[n for n in nodes if n.gpu_count == 0],
        has_gpu_nodes=bool(built.nodes),
        other_used=built.other_used,
        deployment_names={i.deployment_id: i.deployment.name for i in instances},
        tenant_slugs=dict(Tenant.objects.filter(pk__in=tenant_ids).values_list("pk", "slug")),
        charges=charges,
        placed_at=placed_at,
        period=period,
    )


def build_placer(exclude_deployment: Deployment | int | None = None) -> Placer:
    """A ``Placer`` holding every GPU node and the allocations of active instances.

    A node is ready unless it is cordoned, and lost when its heartbeat is older than
    ``NODE_LOST_SECONDS``. The instances of ``exclude_deployment`` are left out, which is
    how ``report.dry_run`` plans a deployment as if it were placed afresh. Headroom and policy
    come from the ``PLACEMENT_HEADROOM`` and ``PLACEMENT_POLICY`` settings.
    """
    return load_cluster(exclude_deployment).placer


__all__ = [
    "Cluster",
    "PlanningError",
    "build_placer",
    "charged_tenants",
    "deployment_tenants",
    "engine_settings",
    "load_cluster",
    "model_architecture",
    "plan_deployment",
    "record_measured_profile",
]
