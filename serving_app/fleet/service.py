"""Placement against the database: the memory plan, node and GPUs for instances, the allocation.

This module turns rows into the plain dataclasses of ``planner`` and ``placer`` and back:

- ``plan_deployment(deployment)``: the ``MemoryPlan`` from the Deployment's engine settings
  (its ``EngineSpec``) and its BaseModel.
- ``build_placer(exclude_deployment=None)``: a ``Placer`` loaded with every GPU node, its GPUs (MIG
  devices under their parent) and the allocations of active instances.
- ``place_replicas(deployment, ordinals, revision)``: creates the Instance rows of ``revision``
  (default the applied one) for all ordinals, or none.
- ``place_instance(deployment, instance)``: places one Instance the reconciler already created.
- ``can_place(deployment, count, revision)``: whether that many more instances of ``revision``
  fit now, nothing written.
- ``dry_run(deployment)``: what the plan endpoint shows, with nothing written.
- ``allocation(period=None)``: per GPU, what is reserved for which deployment and tenant.
- ``accounting(period)``: per deployment and per tenant, the reservation charged to each tenant.

Choices this module makes (docs/placement.md, "Placement against the database"):

- **GPU or CPU.** A node with no ``Gpu`` row is a CPU host. If any node has a ``Gpu`` row, in
  any state, deployments go to GPU nodes only; CPU hosts are used only when no GPU node is
  registered at all. A GPU deployment never lands on a CPU host because its GPU nodes are full
  or lost. CPU hosts take up to ``Node.max_instances`` active instances each, fewest first.
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
- **Multi-node groups.** An instance whose TP x PP GPUs span nodes (``allow_multi_node``) is one
  Instance row on its leader's node (node rank 0, the API server) with an ``InstanceWorker`` row
  per other node (ranks 1 and up, headless). ``Instance.gpus`` holds the GPUs of every node, so
  the group's whole reservation is accounted for; each worker's ``gpus`` its own node's. The
  rendezvous (``master_addr``, the leader node's address, and ``master_port``) is chosen here,
  a port of ``ENGINE_RENDEZVOUS_PORT_RANGE`` that no active group led from that node holds. On
  CPU hosts (no GPUs to count) such a group takes ``world_size`` hosts, one rank on each, each
  counting as one of the host's ``max_instances`` engines.
- **Serialization.** ``place_replicas`` and ``place_instance`` lock every Node row (in pk order)
  for their transaction. Two placements can then never take the same free slot.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Max, Min
from django.utils import timezone

from serving_app.enginespec import EngineSpec
from serving_app.fleet.accounting import (
    DeploymentCharge,
    Period,
    entitled_charges,
    measured_charges,
)
from serving_app.models import (
    BaseModel,
    Deployment,
    Gpu,
    Instance,
    InstanceWorker,
    LoraAdapter,
    Node,
)
from serving_app.models.revisions import DeploymentRevision
from serving_app.placement import placer as P
from serving_app.placement.fleetspec import GPU_COMPUTE_SLICES, mig_slices
from serving_app.placement.inventory import GIB
from serving_app.placement.planner import (
    EngineSettings,
    MemoryPlan,
    ModelArchitecture,
    plan_memory,
)
from serving_app.placement.shares import entitled_shares, split_amount
from tenants_app.models import Tenant

State = Instance.State

DEFAULT_POLICY = "binpack"
CPU_BLOCK_SIZE = 128  # the vLLM CPU backend's block size
UNSAVED = "unsaved"  # the placer's id for a deployment that has no row yet
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
    if not (base.num_layers and base.hidden_size and base.num_attention_heads):
        raise PlanningError(
            f"{base.name}: its architecture is unknown (layers, hidden size and heads are read "
            "from config.json when the model is registered); save the model again"
        )
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
    )


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


# ----------------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    """What the database holds, loaded once: the placer plus what maps its answers to rows."""

    placer: P.Placer
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
    return float(getattr(settings, "PLACEMENT_HEADROOM", 0.10))


def _inventory_seconds() -> float:
    return float(getattr(settings, "NODE_INVENTORY_SECONDS", 60.0))


def _policy() -> str:
    return str(getattr(settings, "PLACEMENT_POLICY", DEFAULT_POLICY))


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
) -> tuple[P.TenantShare, ...]:
    """The tenants a deployment is charged to at placement, each with its entitled share
    (nothing has run yet) and its GPU memory quota, which the placer checks for that share."""
    rows = deployment_tenants(deployment, tenants)
    shares = entitled_shares({t.pk: t.fair_share_weight or 1 for t in rows})
    return tuple(
        P.TenantShare(
            tenant_id=t.pk, share=shares[t.pk], label=t.slug,
            quota_gib=None if t.gpu_memory_quota_gib is None else float(t.gpu_memory_quota_gib),
        )
        for t in rows
    )


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
    by_name: dict[str, Node] = {n.name: n for n in nodes}
    gpu_rows = list(Gpu.objects.filter(node__in=nodes).order_by("node_id", "index", "pk"))
    newest = {
        row["node_id"]: row["newest"]
        for row in Gpu.objects.values("node_id").annotate(newest=Max("updated_at"))
    }
    # The instances of a node declared lost are being replaced: they no longer hold GPU memory
    # against their tenant's quota (the node itself takes nothing new while it is lost).
    active = (Instance.objects.active().filter(gpus__isnull=False)
              .exclude(node__lost_at__isnull=False))
    if exclude_id is not None:
        active = active.exclude(deployment_id=exclude_id)
    instances = list(active.select_related("deployment__base_model", "revision")
                     .prefetch_related("gpus").distinct())
    placed_at: dict[tuple[Any, int], datetime] = {}
    held_since: dict[int, datetime] = {}
    for inst in instances:
        key = (inst.deployment_id, inst.ordinal)
        placed_at[key] = min(placed_at.get(key, inst.created_at), inst.created_at)
        dep_since = held_since.get(inst.deployment_id, inst.created_at)
        held_since[inst.deployment_id] = min(dep_since, inst.created_at)
    deployment_ids = list(held_since)
    charges = (
        measured_charges(deployment_ids, period, held_since)
        if period is not None
        else entitled_charges(deployment_ids)
    )
    first_tenant = {dep: min(c.weights) for dep, c in charges.items()}
    pairs = {dep: c.as_pairs() for dep, c in charges.items()}
    headroom = _headroom()
    cap = 1 - round(headroom * 100) / 100

    allocs: dict[int, list[P.Allocation]] = {}
    reserved: dict[int, int] = {}
    rows_by_pk = {g.pk: g for g in gpu_rows}
    for inst in instances:
        dep = inst.deployment
        engine = inst.engine_spec()  # what it runs, whatever was edited since
        isolation = engine.isolation_mode
        for gpu in inst.gpus.all():
            if gpu.pk not in rows_by_pk:
                continue
            if gpu.parent_id is not None:
                alloc = P.Allocation(
                    deployment_id=dep.pk, tenant_id=first_tenant.get(dep.pk), fraction=cap,
                    isolation=P.Isolation.MIG.value, replica=inst.ordinal, mig_uuid=gpu.uuid,
                    exclusive=True, shares=pairs.get(dep.pk, ()),
                )
                allocs.setdefault(gpu.parent_id, []).append(alloc)
                continue
            fraction = inst.gpu_memory_fraction or engine.gpu_memory_utilization
            exclusive = isolation == Deployment.Isolation.DEDICATED
            allocs.setdefault(gpu.pk, []).append(
                P.Allocation(
                    deployment_id=dep.pk, tenant_id=first_tenant.get(dep.pk), fraction=fraction,
                    isolation=isolation, replica=inst.ordinal, exclusive=exclusive,
                    shares=pairs.get(dep.pk, ()),
                )
            )
            share = gpu.memory_total_bytes if exclusive else math.ceil(
                gpu.memory_total_bytes * fraction
            )
            reserved[gpu.pk] = reserved.get(gpu.pk, 0) + share

    placer_nodes: list[P.Node] = []
    mapping: dict[tuple[str, str], Gpu] = {}
    other_used: dict[int, int] = {}
    migs: dict[int, list[Gpu]] = {}
    for row in gpu_rows:
        if row.parent_id is not None:
            migs.setdefault(row.parent_id, []).append(row)
    by_node: dict[int, list[Gpu]] = {}
    for row in gpu_rows:
        if row.parent_id is None:
            by_node.setdefault(row.node_id, []).append(row)
    # A row is stale when the node's last report left it out (sync keeps a GPU an active
    # instance uses), or when a live agent has not reported it for three inventory periods.
    too_old = timezone.now() - timedelta(seconds=3 * _inventory_seconds())

    for node in nodes:
        rows = by_node.get(node.pk, [])
        if not rows:
            continue
        lost = node.is_lost
        newer = newest.get(node.pk)

        def is_stale(gpu: Gpu, lost: bool = lost, newer: Any = newer) -> bool:
            left_out = newer is not None and gpu.updated_at < newer
            return left_out or (not lost and gpu.updated_at < too_old)

        slots = []
        for row in rows:
            mapping[(node.name, row.uuid)] = row
            stale = is_stale(row)
            own = allocs.get(row.pk, [])
            taken = {a.mig_uuid for a in own if a.mig_uuid}
            mig_slots = []
            for mig in migs.get(row.pk, []):
                mapping[(node.name, mig.uuid)] = mig
                # A MIG device running a process the console did not place is not free.
                foreign = bool(mig.processes) and mig.uuid not in taken
                if mig.uuid in taken or not (stale or foreign or is_stale(mig)):
                    mig_slots.append(
                        P.MigSlot(uuid=mig.uuid, memory_total_bytes=mig.memory_total_bytes,
                                  profile=mig.mig_profile or None)
                    )
            if stale:
                other = row.memory_total_bytes
            else:
                used = row.memory_used_bytes or 0
                other = max(0, used - reserved.get(row.pk, 0))
                if other < UNMANAGED_FLOOR_BYTES:
                    other = 0
            if other:
                other_used[row.pk] = other
            slots.append(
                P.GpuSlot(
                    index=row.index, uuid=row.uuid, name=row.name,
                    memory_total_bytes=row.memory_total_bytes, mig_enabled=row.mig_mode,
                    mig_devices=mig_slots, allocations=list(own), other_used_bytes=other,
                    declared=row.declared,
                )
            )
        placer_nodes.append(
            P.Node(name=node.name, gpus=slots, ready=not node.cordoned, lost=lost)
        )
    placer = P.Placer(placer_nodes, headroom=headroom, policy=_policy())
    cpu_nodes: list[Node] = [n for n in nodes if n.gpu_count == 0]
    tenant_ids = {t for c in charges.values() for t in c.weights}
    slugs = dict(Tenant.objects.filter(pk__in=tenant_ids).values_list("pk", "slug"))
    return Cluster(
        placer=placer,
        nodes=by_name,
        gpu_rows=mapping,
        cpu_nodes=cpu_nodes,
        has_gpu_nodes=bool(placer_nodes),
        other_used=other_used,
        deployment_names={i.deployment_id: i.deployment.name for i in instances},
        tenant_slugs=slugs,
        charges=charges,
        placed_at=placed_at,
        period=period,
    )


def build_placer(exclude_deployment: Deployment | int | None = None) -> P.Placer:
    """A ``Placer`` holding every GPU node and the allocations of active instances.

    A node is ready unless it is cordoned, and lost when its heartbeat is older than
    ``NODE_LOST_SECONDS``. The instances of ``exclude_deployment`` are left out, which is
    how ``dry_run`` plans a deployment as if it were placed afresh. Headroom and policy come
    from the ``PLACEMENT_HEADROOM`` and ``PLACEMENT_POLICY`` settings.
    """
    return load_cluster(exclude_deployment).placer


# ----------------------------------------------------------------------------- placing


def placement_request(
    deployment: Deployment,
    engine: EngineSpec,
    plan: MemoryPlan,
    replicas: int,
    tenants: Sequence[P.TenantShare],
) -> P.PlacementRequest:
    """The placer's request for ``replicas`` instances of ``deployment`` started with
    ``engine``, charged to ``tenants`` (``charged_tenants()``)."""
    base = deployment.base_model
    return P.PlacementRequest(
        deployment_id=deployment.pk if deployment.pk is not None else UNSAVED,
        tenant_id=tenants[0].tenant_id if tenants else None,
        memory_bytes_per_gpu=plan.needed_bytes,
        replicas=replicas,
        tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        allow_multi_node=engine.allow_multi_node,
        num_layers=base.num_layers or None,
        num_attention_heads=base.num_attention_heads or None,
        num_kv_heads=base.num_kv_heads or None,
        isolation=engine.isolation_mode,
        mps_thread_percentage=engine.mps_thread_percentage,
        tenants=tuple(tenants),
    )


def _active_counts(nodes: Sequence[Node], exclude_deployment_id: Any = None) -> dict[int, int]:
    """Engines per node: active instances (their leaders) and the workers of active groups."""
    active = Instance.objects.active().filter(node__in=list(nodes))
    workers = InstanceWorker.objects.filter(node__in=list(nodes),
                                            instance__in=Instance.objects.active())
    if exclude_deployment_id is not None:
        active = active.exclude(deployment_id=exclude_deployment_id)
        workers = workers.exclude(instance__deployment_id=exclude_deployment_id)
    counts: dict[int, int] = {}
    for rows in (active.values("node_id").annotate(n=Count("pk")),
                 workers.values("node_id").annotate(n=Count("pk"))):
        for row in rows:
            counts[row["node_id"]] = counts.get(row["node_id"], 0) + row["n"]
    return counts


def choose_cpu_nodes(
    cpu_nodes: Sequence[Node], count: int, exclude_deployment_id: Any = None
) -> tuple[list[Node], str]:
    """``count`` CPU hosts for new instances (fewest active first), or none and the reason.

    A host takes up to ``max_instances`` active instances. Cordoned and lost hosts take none.
    """
    online = [n for n in cpu_nodes if not n.cordoned and not n.is_lost]
    if not online:
        return [], "No node agent is online: start one (a Celery worker on queue node.<host>)."
    active = _active_counts(online, exclude_deployment_id)
    load = {n.pk: active.get(n.pk, 0) for n in online}
    chosen: list[Node] = []
    for _ in range(count):
        free = [n for n in online if load[n.pk] < n.max_instances]
        if not free:
            detail = ", ".join(
                f"{n.name} runs {active.get(n.pk, 0)} of {n.max_instances}" for n in online
            )
            if count > 1:
                return [], f"{count} instances do not fit on the online nodes: {detail}"
            return [], f"Every online node is full: {detail}"
        node = min(free, key=lambda n: (load[n.pk], n.name))
        load[node.pk] += 1
        chosen.append(node)
    return chosen, ""


def choose_cpu_groups(
    cpu_nodes: Sequence[Node], count: int, world_size: int, exclude_deployment_id: Any = None
) -> tuple[list[list[Node]], str]:
    """``count`` groups of ``world_size`` distinct CPU hosts (the leader's first), one rank on
    each, fewest engines first; or none and the reason."""
    online = [n for n in cpu_nodes if not n.cordoned and not n.is_lost]
    active = _active_counts(online, exclude_deployment_id)
    load = {n.pk: active.get(n.pk, 0) for n in online}
    groups: list[list[Node]] = []
    for _ in range(count):
        free = sorted((n for n in online if load[n.pk] < n.max_instances),
                      key=lambda n: (load[n.pk], n.name))
        if len(free) < world_size:
            return [], (f"A group of {world_size} ranks across nodes needs {world_size} online "
                        f"CPU hosts with a free engine slot; {len(free)} have one.")
        group = free[:world_size]
        for node in group:
            load[node.pk] += 1
        groups.append(group)
    return groups, ""


Part = tuple[Node, list[Gpu], dict[str, str]]


@dataclass
class _Choice:
    """Where new instances go: a CPU host each, or the placer's answer per replica; and for a
    group that spans nodes, its other nodes (node ranks 1 and up) with their GPUs and
    environment."""

    nodes: list[Node]
    gpus: list[list[Gpu]]
    placements: list[P.InstancePlacement | None]
    workers: list[list[Part]] = field(default_factory=list)

    def workers_of(self, number: int) -> list[Part]:
        return self.workers[number] if self.workers else []


def _lock_nodes() -> None:
    list(Node.objects.select_for_update().order_by("pk").values_list("pk", flat=True))


def _choose(deployment: Deployment, engine: EngineSpec,
            count: int) -> tuple[_Choice | None, str]:
    cluster = load_cluster()
    if not cluster.has_gpu_nodes:
        if engine.allow_multi_node and engine.world_size > 1:
            groups, reason = choose_cpu_groups(cluster.cpu_nodes, count, engine.world_size)
            if not groups:
                return None, reason
            return _Choice([g[0] for g in groups], [[] for _ in groups], [None] * len(groups),
                           [[(node, [], {}) for node in g[1:]] for g in groups]), ""
        nodes, reason = choose_cpu_nodes(cluster.cpu_nodes, count)
        if not nodes:
            return None, reason
        return _Choice(nodes, [[] for _ in nodes], [None] * len(nodes)), ""
    try:
        plan = plan_deployment(deployment, engine=engine)
    except PlanningError as exc:
        return None, str(exc)
    request = placement_request(deployment, engine, plan, count, charged_tenants(deployment))
    result = cluster.placer.place(request, commit=False)
    if not result.ok:
        return None, result.reason or "refused"
    nodes, gpus, workers = [], [], []
    for ip in result.instances:
        nodes.append(cluster.nodes[ip.node])
        uuids = [ip.mig_uuid] if ip.mig_uuid else list(ip.gpu_uuids)
        gpus.append([cluster.gpu_rows[(ip.node, uuid)] for uuid in uuids])
        workers.append([(cluster.nodes[w.node], [cluster.gpu_rows[(w.node, u)]
                                                 for u in w.gpu_uuids], dict(w.env))
                        for w in ip.workers])
    return _Choice(nodes, gpus, list(result.instances), workers), ""


def rendezvous_port(leader: Node) -> int:
    """A ``--master-port`` for a new group led from ``leader``: the lowest port of
    ``ENGINE_RENDEZVOUS_PORT_RANGE`` that no active group led from that node holds, nor any
    engine there serves on (callers hold the node locks, so two placements never pick one)."""
    taken = set(Instance.objects.active().filter(node=leader, master_port__isnull=False)
                .values_list("master_port", flat=True))
    taken |= set(Instance.objects.active().filter(node=leader, port__isnull=False)
                 .values_list("port", flat=True))
    low, high = settings.ENGINE_RENDEZVOUS_PORT_RANGE
    for port in range(low, high + 1):
        if port not in taken:
            return port
    raise PlanningError(f"No free rendezvous port in {low}-{high} on {leader.name}.")


def set_group(instance: Instance, node: Node, gpus: list[Gpu], parts: list[Part]) -> None:
    """Record the instance's group: all its GPUs on the instance, a worker row per other node,
    and the rendezvous on the leader's node; a single-node instance keeps none of these."""
    instance.gpus.set([*gpus, *(g for _, part_gpus, _ in parts for g in part_gpus)])
    instance.workers.all().delete()
    if not parts:
        Instance.objects.filter(pk=instance.pk).update(master_addr="", master_port=None)
        instance.master_addr, instance.master_port = "", None
        return
    port = rendezvous_port(node)
    Instance.objects.filter(pk=instance.pk).update(master_addr=node.address, master_port=port)
    instance.master_addr, instance.master_port = node.address, port
    for rank, (worker_node, worker_gpus, env) in enumerate(parts, start=1):
        worker = InstanceWorker.objects.create(instance=instance, node_rank=rank,
                                               node=worker_node, environment=env)
        if worker_gpus:
            worker.gpus.set(worker_gpus)


def _record(deployment: Deployment, reason: str) -> None:
    if deployment.pk is not None and deployment.placement_error != reason:
        Deployment.objects.filter(pk=deployment.pk).update(placement_error=reason)
    deployment.placement_error = reason


def can_place(deployment: Deployment, count: int,
              revision: DeploymentRevision | None = None) -> str:
    """Whether ``count`` more instances of ``revision`` (default the applied one) of
    ``deployment`` fit beside everything that runs now (its own instances included): ``""`` if
    they do, else the reason. Nothing is written."""
    engine = deployment.engine_spec(revision or deployment.applied_revision)
    choice, reason = _choose(deployment, engine, count)
    return "" if choice is not None else reason or "refused"


def place_replicas(
    deployment: Deployment, ordinals: list[int], revision: DeploymentRevision | None = None
) -> tuple[list[Instance], str]:
    """Create and place an Instance for every ordinal, or none, each running ``revision`` (default
    the deployment's applied one) and planned by its engine settings.

    On success: the instances (node, GPUs, ``gpu_memory_fraction``, ``environment`` set,
    ``generation`` the deployment's, ``revision``) and ``""``. ``deployment.placement_error``
    is cleared.
    On refusal: ``[]`` and the reason, which is also stored on ``deployment.placement_error``.
    """
    if not ordinals:
        return [], ""
    revision = revision or deployment.applied_revision
    engine = deployment.engine_spec(revision)
    with transaction.atomic():
        _lock_nodes()
        choice, reason = _choose(deployment, engine, len(ordinals))
        if choice is None:
            _record(deployment, reason)
            return [], reason
        created = []
        for number, (ordinal, node, gpus, ip) in enumerate(zip(
            ordinals, choice.nodes, choice.gpus, choice.placements, strict=True
        )):
            instance = Instance.objects.create(
                deployment=deployment,
                ordinal=ordinal,
                generation=deployment.generation,
                revision=revision,
                node=node,
                gpu_memory_fraction=ip.gpu_memory_utilization if ip else None,
                environment=dict(ip.env) if ip else {},
            )
            set_group(instance, node, gpus, choice.workers_of(number))
            created.append(instance)
        _record(deployment, "")
    return created, ""


def place_instance(deployment: Deployment, instance: Instance) -> Node | None:
    """Place one Instance row that already exists (the reconciler's path); None if refused.

    The reason of a refusal goes to ``instance.last_error`` and ``deployment.placement_error``.
    """
    with transaction.atomic():
        _lock_nodes()
        choice, reason = _choose(deployment, instance.engine_spec(), 1)
        if choice is None:
            Instance.objects.filter(pk=instance.pk).update(last_error=reason)
            instance.last_error = reason
            _record(deployment, reason)
            return None
        node, gpus, ip = choice.nodes[0], choice.gpus[0], choice.placements[0]
        fields = {
            "node": node,
            "last_error": "",
            "gpu_memory_fraction": ip.gpu_memory_utilization if ip else None,
            "environment": dict(ip.env) if ip else {},
        }
        Instance.objects.filter(pk=instance.pk).update(**fields)
        for name, value in fields.items():
            setattr(instance, name, value)
        set_group(instance, node, gpus, choice.workers_of(0))
        _record(deployment, "")
    return node


# ----------------------------------------------------------------------------- dry run


def _plan_figures(plan: MemoryPlan) -> dict[str, Any]:
    return {
        "needed_bytes": plan.needed_bytes,
        "needed_gib": round(plan.needed_gib, 2),
        "parameters": plan.parameters,
        "dtype": plan.dtype,
        "kv_cache_dtype": plan.kv_cache_dtype,
        "tensor_parallel_size": plan.tensor_parallel_size,
        "pipeline_parallel_size": plan.pipeline_parallel_size,
        "gpus_per_instance": plan.gpus,
        "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        "weight_bytes": plan.weight_bytes,
        "weight_bytes_total": plan.weight_bytes_total,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_tokens": plan.kv_tokens,
        "kv_cache_bytes": plan.kv_cache_bytes,
        "lora_bytes": plan.lora_bytes,
        "activation_bytes": plan.activation_bytes,
        "runtime_overhead_bytes": plan.runtime_overhead_bytes,
    }


def _current(deployment: Deployment) -> list[dict[str, Any]]:
    if deployment.pk is None:
        return []
    return [
        {
            "instance": i.pk,
            "replica": i.ordinal,
            "state": i.state,
            "node": i.node.name if i.node is not None else None,
            "gpus": [g.pk for g in i.gpus.all()],
            "gpu_memory_fraction": i.gpu_memory_fraction,
        }
        for i in deployment.instances.active().select_related("node").prefetch_related("gpus")
    ]


def dry_run(
    deployment: Deployment,
    *,
    tenants: Iterable[Tenant] | None = None,
    adapters: Iterable[LoraAdapter] | None = None,
) -> dict[str, Any]:
    """Where every replica of ``deployment`` would go, or why it cannot. Nothing is written.

    The plan treats the deployment as placed afresh: its own active instances are left out of
    the cluster, and ``current`` lists where they run now. For an unsaved deployment pass its
    ``tenants`` and ``adapters``, which a row without a pk cannot hold.
    """
    replicas = max(1, deployment.replicas)
    engine = deployment.engine_spec()
    served = deployment_tenants(deployment, tenants)
    charged = charged_tenants(deployment, served)
    cluster = load_cluster(exclude_deployment=deployment.pk)
    out: dict[str, Any] = {
        "deployment": deployment.pk,
        "name": deployment.name,
        "replicas": replicas,
        "isolation_mode": engine.isolation_mode,
        "target": "gpu" if cluster.has_gpu_nodes else "cpu",
        "headroom": cluster.placer.headroom,
        "policy": cluster.placer.policy.value,
        "tenants": [],
        "ok": False,
        "reason": None,
        "memory": None,
        "explain": [],
        "placements": [],
        "current": _current(deployment),
    }
    # Each tenant's entitled share of this deployment, its quota and what it already reserves.
    out["tenants"] = [
        {
            "id": share.tenant_id,
            "slug": share.label,
            "fair_share_weight": tenant.fair_share_weight,
            "share": round(share.share, 6),
            "gpu_memory_quota_gib": share.quota_gib,
            "reserved_bytes": cluster.placer.tenant_reserved_bytes(share.tenant_id),
            "charged_bytes": None,
        }
        for tenant, share in zip(served, charged, strict=True)
    ]
    try:
        plan = plan_deployment(deployment, adapters, engine)
    except PlanningError as exc:
        out["reason"] = str(exc)
        return out
    out["memory"] = _plan_figures(plan)

    if not cluster.has_gpu_nodes:
        return _cpu_dry_run(out, plan, cluster, replicas, deployment.pk)

    result = cluster.placer.plan(placement_request(deployment, engine, plan, replicas, charged))
    if result.ok:
        parts = split_amount(result.reserved_bytes, {t.tenant_id: t.share for t in charged})
        for row in out["tenants"]:
            row["charged_bytes"] = parts.get(row["id"], 0)
    sizes = [g.memory_total_bytes for g in cluster.gpu_rows.values() if g.parent_id is None]
    explain_total = max(sizes) if sizes else None
    for number, ip in enumerate(result.instances):
        uuids = [ip.mig_uuid] if ip.mig_uuid else list(ip.gpu_uuids)
        rows = [cluster.gpu_rows[(ip.node, u)] for u in uuids]
        total = min(r.memory_total_bytes for r in rows)
        if number == 0:
            explain_total = total  # the explanation speaks of the first replica's GPU
        out["placements"].append(
            {
                "replica": ip.replica,
                "node": ip.node,
                "gpus": [r.pk for r in rows],
                "gpu_indexes": list(ip.gpu_indexes),
                "gpu_uuids": list(ip.gpu_uuids),
                "mig_uuid": ip.mig_uuid,
                "isolation": ip.isolation,
                "gpu_memory_utilization": ip.gpu_memory_utilization,
                "reserved_bytes_per_gpu": ip.reserved_bytes_per_gpu,
                "concurrent_sequences": plan.concurrent_sequences(
                    total, ip.gpu_memory_utilization
                ),
                "environment": dict(ip.env),
                "workers": [
                    {"node": w.node, "gpus": [cluster.gpu_rows[(w.node, u)].pk
                                              for u in w.gpu_uuids],
                     "gpu_indexes": list(w.gpu_indexes), "gpu_uuids": list(w.gpu_uuids)}
                    for w in ip.workers
                ],
            }
        )
    out["ok"] = result.ok
    out["reason"] = result.reason
    out["explain"] = plan.explain(explain_total)
    return out


def _cpu_dry_run(
    out: dict[str, Any], plan: MemoryPlan, cluster: Cluster, replicas: int, dep_id: Any
) -> dict[str, Any]:
    kv_gib = float(getattr(settings, "ENGINE_CPU_KVCACHE_GIB", 1))
    tokens = plan.kv_capacity_tokens(int(kv_gib * GIB), block_size=CPU_BLOCK_SIZE)
    nodes, reason = choose_cpu_nodes(cluster.cpu_nodes, replicas, dep_id)
    out["ok"] = bool(nodes)
    out["reason"] = reason or None
    out["placements"] = [
        {"replica": i, "node": n.name, "gpus": [], "cpu_kv_cache_tokens": tokens}
        for i, n in enumerate(nodes)
    ]
    out["explain"] = [
        *plan.explain(),
        "No GPU node is registered: the instances run as CPU engines, which size their KV "
        f"cache from ENGINE_CPU_KVCACHE_GIB ({kv_gib:g} GiB = {tokens:,} tokens at block size "
        f"{CPU_BLOCK_SIZE}); the GPU figures above do not apply.",
    ]
    return out


# ----------------------------------------------------------------------------- allocation


def allocation(period: Period | None = None) -> list[dict[str, Any]]:
    """Per GPU: total memory, what is reserved per deployment and per tenant, and what is free.

    ``free_bytes`` is what a new instance could still reserve there (below the headroom cap);
    ``unmanaged_bytes`` is memory NVML reports as used beyond the console's reservations. A
    shared deployment's reservations are split among its tenants: by entitlement, or with
    ``period`` by the split measured over it, which also gives each entry its GPU-seconds.
    """
    gpus: list[dict[str, Any]] = _report(load_cluster(period=period))["gpus"]
    return gpus


def accounting(period: Period) -> dict[str, Any]:
    """The reservation charged to each tenant over ``period``: per GPU (as ``allocation``), per
    deployment (its split, measured or entitled, and each tenant's part) and per tenant (GiB
    reserved now, GPU-seconds over the period, MIG slices)."""
    return _report(load_cluster(period=period))


def deployment_charges(deployment: Deployment, period: Period) -> dict[str, Any]:
    """How one deployment is charged to its tenants over ``period``, for its page: per tenant its
    band, weight and limits, its entitled and charged share, and its part of the GPUs."""
    report = accounting(period)
    row = next((d for d in report["deployments"] if d["id"] == deployment.pk), None)
    if row is not None:
        measured = row["measured"]
        split = {t["id"]: t for t in row["tenants"]}
    else:  # no GPU reservation (CPU engines, or stopped): the split of its usage alone
        since = deployment.instances.active().aggregate(first=Min("created_at"))["first"]
        held = {deployment.pk: since} if since else {}
        charge = measured_charges([deployment.pk], period, held).get(deployment.pk)
        measured = bool(charge and charge.measured)
        split = {} if charge is None else {
            t: {"entitled_share": charge.entitled[t], "share": charge.shares[t],
                "weighted_tokens": charge.weighted_tokens.get(t, 0.0)}
            for t in charge.weights
        }
    tenants = []
    for tenant in deployment.tenants.order_by("pk"):
        part = split.get(tenant.pk, {})
        tenants.append({
            "tenant": tenant,
            "entitled_share": part.get("entitled_share"),
            "share": part.get("share"),
            "weighted_tokens": part.get("weighted_tokens", 0.0),
            "reserved_bytes": part.get("reserved_bytes", 0),
            "gpu_seconds": part.get("gpu_seconds"),
            "mig_slices": part.get("mig_slices", 0.0),
        })
    return {"tenants": tenants, "measured": measured, "on_gpus": row is not None}


def _gpu_share(view: P.GpuAllocationView, entry: P.AllocationEntry, profile: str) -> float:
    """The part of a physical GPU an entry holds: a MIG device its compute slices, a dedicated
    GPU all of it, a shared reservation its memory fraction."""
    if entry.mig_uuid is not None:
        slices = mig_slices(profile)
        if slices is not None:
            return slices / GPU_COMPUTE_SLICES
        return entry.reserved_bytes / view.memory_total_bytes
    if entry.reserved_bytes >= view.memory_total_bytes:
        return 1.0
    return entry.reserved_bytes / view.memory_total_bytes


def _report(cluster: Cluster) -> dict[str, Any]:
    names = cluster.deployment_names
    slugs = cluster.tenant_slugs
    period = cluster.period
    states = {n.name: n.state for n in cluster.nodes.values()}
    deployments: dict[Any, dict[str, Any]] = {}
    tenants: dict[Any, dict[str, Any]] = {}
    no_seconds = None if period is None else 0.0  # GPU-seconds need a period

    def add(into: dict[str, Any], size: int, seconds: float | None, slices: float) -> None:
        into["reserved_bytes"] += size
        into["mig_slices"] += slices
        if seconds is not None:
            into["gpu_seconds"] += seconds

    gpus = []
    for view in cluster.placer.allocation_view():
        row = cluster.gpu_rows[(view.node, view.gpu_uuid)]
        entries = []
        per_tenant: dict[Any, dict[str, Any]] = {}
        for e in view.entries:
            mig_row = cluster.gpu_rows.get((view.node, e.mig_uuid)) if e.mig_uuid else None
            profile = mig_row.mig_profile if mig_row is not None else ""
            slices = float(mig_slices(profile) or 0) if e.mig_uuid else 0.0
            held = None
            if period is not None:
                since = cluster.placed_at.get((e.deployment_id, e.replica or 0))
                held = _gpu_share(view, e, profile) * period.seconds_from(since)
            shares = dict(e.shares)
            parts = split_amount(e.reserved_bytes, shares)
            charged: list[dict[str, Any]] = [
                {
                    "id": t,
                    "slug": slugs.get(t),
                    "share": round(share, 6),
                    "reserved_bytes": parts[t],
                    "gpu_seconds": None if held is None else held * share,
                    "mig_slices": slices * share,
                }
                for t, share in shares.items()
            ]
            entries.append({
                "deployment": e.deployment_id,
                "tenant": e.tenant_id,
                "replica": e.replica,
                "isolation": e.isolation,
                "fraction": e.fraction,
                "reserved_bytes": e.reserved_bytes,
                "mig_uuid": e.mig_uuid,
                "mig_profile": profile or None,
                "gpu_seconds": held,
                "mig_slices": slices,
                "tenants": charged,
            })
            dep = deployments.setdefault(e.deployment_id, {
                "id": e.deployment_id, "name": names.get(e.deployment_id, str(e.deployment_id)),
                "reserved_bytes": 0, "gpu_seconds": no_seconds, "mig_slices": 0.0,
                "tenants": {},
            })
            add(dep, e.reserved_bytes, held, slices)
            for part in charged:
                t = part["id"]
                blank = {"id": t, "slug": part["slug"], "reserved_bytes": 0,
                         "gpu_seconds": no_seconds, "mig_slices": 0.0}
                for into in (
                    per_tenant.setdefault(t, dict(blank)),
                    dep["tenants"].setdefault(t, dict(blank)),
                    tenants.setdefault(t, dict(blank)),
                ):
                    add(into, part["reserved_bytes"], part["gpu_seconds"], part["mig_slices"])
        gpus.append(
            {
                "gpu": row.pk,
                "node": view.node,
                "node_state": states.get(view.node),
                "index": view.gpu_index,
                "uuid": view.gpu_uuid,
                "name": view.gpu_name,
                "declared": row.declared,
                "mig_mode": row.mig_mode,
                "memory_total_bytes": view.memory_total_bytes,
                "reserved_bytes": view.reserved_bytes,
                "reserved_fraction": round(view.reserved_fraction, 4),
                "unmanaged_bytes": cluster.other_used.get(row.pk, 0),
                "free_fraction": round(view.free_fraction, 4),
                "free_bytes": int(view.free_fraction * view.memory_total_bytes),
                "by_deployment": [
                    {"id": dep, "name": names.get(dep, str(dep)), "reserved_bytes": size}
                    for dep, size in view.by_deployment.items()
                ],
                "by_tenant": [
                    {**per_tenant.get(t, {}), "id": t, "slug": slugs.get(t),
                     "reserved_bytes": size}
                    for t, size in view.by_tenant.items()
                ],
                "entries": entries,
            }
        )
    for dep in deployments.values():
        charge = cluster.charges.get(dep["id"])
        dep["measured"] = bool(charge and charge.measured)
        dep["busy_buckets"] = charge.busy_buckets if charge else 0
        dep["buckets"] = charge.buckets if charge else 0
        rows = []
        for t, part in dep["tenants"].items():
            rows.append({
                **part,
                "fair_share_weight": charge.weights.get(t) if charge else None,
                "entitled_share": round(charge.entitled.get(t, 0.0), 6) if charge else None,
                "share": round(charge.shares.get(t, 0.0), 6) if charge else None,
                "weighted_tokens": charge.weighted_tokens.get(t, 0.0) if charge else 0.0,
            })
        dep["tenants"] = sorted(rows, key=lambda r: -r["reserved_bytes"])
    return {
        "period": None if period is None else {
            "key": period.key, "start": period.start, "end": period.end,
            "bucket_seconds": period.bucket_seconds,
        },
        "gpus": gpus,
        "deployments": sorted(deployments.values(), key=lambda d: d["name"]),
        "tenants": sorted(tenants.values(), key=lambda t: str(t["slug"])),
    }


__all__ = [
    "Cluster",
    "Period",
    "PlanningError",
    "allocation",
    "build_placer",
    "can_place",
    "choose_cpu_nodes",
    "dry_run",
    "engine_settings",
    "load_cluster",
    "model_architecture",
    "place_instance",
    "place_replicas",
    "placement_request",
    "plan_deployment",
    "accounting",
    "charged_tenants",
    "deployment_charges",
    "deployment_tenants",
]
