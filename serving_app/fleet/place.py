"""Placement against the database: the node and GPUs for new instances, written to their rows.

- ``place_replicas(deployment, ordinals, revision)``: creates the Instance rows of ``revision``
  (default the applied one) for all ordinals, or none.
- ``place_instance(deployment, instance)``: places one Instance the reconciler already created.
- ``can_place(deployment, count, revision)``: whether that many more instances of ``revision``
  fit now, nothing written.
- ``placement_request(...)`` and ``choose_cpu_nodes(...)``: the placer's request for a
  deployment, and the CPU hosts for new instances (``report.dry_run`` asks them too).

The cluster is read by ``read.load_cluster``. Choices this module makes (docs/placement.md,
"Placement against the database"):

- **GPU or CPU.** A node with no ``Gpu`` row is a CPU host. If any node has a ``Gpu`` row, in
  any state, deployments go to GPU nodes only; CPU hosts are used only when no GPU node is
  registered at all. A GPU deployment never lands on a CPU host because its GPU nodes are full
  or lost. CPU hosts take up to ``Node.max_instances`` active instances each, fewest first.
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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count

from serving_app.enginespec import EngineSpec
from serving_app.fleet.read import PlanningError, charged_tenants, load_cluster, plan_deployment
from serving_app.models import Deployment, Gpu, Instance, InstanceWorker, Node
from serving_app.models.revisions import DeploymentRevision
from serving_app.placement.planner import MemoryPlan
from serving_app.placement.request import InstancePlacement, PlacementRequest, TenantShare

UNSAVED = "unsaved"  # the placer's id for a deployment that has no row yet


def placement_request(
    deployment: Deployment,
    engine: EngineSpec,
    plan: MemoryPlan,
    replicas: int,
    tenants: Sequence[TenantShare],
) -> PlacementRequest:
    """The placer's request for ``replicas`` instances of ``deployment`` started with
    ``engine``, charged to ``tenants`` (``charged_tenants()``)."""
    base = deployment.base_model
    return PlacementRequest(
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
    placements: list[InstancePlacement | None]
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


__all__ = [
    "can_place",
    "choose_cpu_groups",
    "choose_cpu_nodes",
    "place_instance",
    "place_replicas",
    "placement_request",
    "rendezvous_port",
    "set_group",
]
