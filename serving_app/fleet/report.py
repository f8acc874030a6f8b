"""What placement shows, with nothing written: a deployment's dry run, and per GPU, deployment and
tenant what the cluster reserves and for whom.

- ``dry_run(deployment)``: what the plan endpoint and the deployment form show: its memory plan,
  where every replica would go or why not, and what each of its tenants would be charged.
- ``allocation(period=None)``: per GPU, what is reserved for which deployment and tenant.
- ``accounting(period)``: per deployment and per tenant, the reservation charged to each tenant.
- ``deployment_charges(deployment, period)``: one deployment's split, for its page.

The cluster is read by ``read.load_cluster``; a shared deployment's reservations are split among
its tenants as ``read`` describes (by entitlement, or measured over ``period``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db.models import Min

from serving_app.enginespec import EngineSpec
from serving_app.fleet.accounting import Period, measured_charges
from serving_app.fleet.place import choose_cpu_nodes, placement_request
from serving_app.fleet.read import (
    Cluster,
    PlanningError,
    charged_tenants,
    deployment_tenants,
    load_cluster,
    plan_deployment,
)
from serving_app.models import Deployment, Gpu, LoraAdapter
from serving_app.placement.cluster import AllocationEntry, GpuAllocationView
from serving_app.placement.fleetspec import GPU_COMPUTE_SLICES, mig_slices
from serving_app.placement.inventory import GIB
from serving_app.placement.planner import MemoryPlan
from serving_app.placement.request import InstancePlacement, TenantShare
from serving_app.placement.shares import split_amount
from tenants_app.models import Tenant

CPU_BLOCK_SIZE = 128  # the vLLM CPU backend's block size


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
        "source": plan.source,
        "rules": [{"term": term, "rule": rule} for term, rule in plan.rules],
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


def _dry_run_head(
    deployment: Deployment, engine: EngineSpec, replicas: int, cluster: Cluster
) -> dict[str, Any]:
    """A dry run's answer before anything is planned: nothing fits yet."""
    return {
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


def _tenant_rows(
    served: list[Tenant], charged: Sequence[TenantShare], cluster: Cluster
) -> list[dict[str, Any]]:
    """Each tenant's entitled share of the deployment, its quota and what it already reserves."""
    return [
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


def _placed_rows(cluster: Cluster, ip: InstancePlacement) -> list[Gpu]:
    """The rows of the GPUs (or the MIG device) a replica's leader would take."""
    uuids = [ip.mig_uuid] if ip.mig_uuid else list(ip.gpu_uuids)
    return [cluster.gpu_rows[(ip.node, u)] for u in uuids]


def _placement(cluster: Cluster, plan: MemoryPlan, ip: InstancePlacement) -> dict[str, Any]:
    rows = _placed_rows(cluster, ip)
    total = min(r.memory_total_bytes for r in rows)
    return {
        "replica": ip.replica,
        "node": ip.node,
        "gpus": [r.pk for r in rows],
        "gpu_indexes": list(ip.gpu_indexes),
        "gpu_uuids": list(ip.gpu_uuids),
        "mig_uuid": ip.mig_uuid,
        "isolation": ip.isolation,
        "gpu_memory_utilization": ip.gpu_memory_utilization,
        "reserved_bytes_per_gpu": ip.reserved_bytes_per_gpu,
        "concurrent_sequences": plan.concurrent_sequences(total, ip.gpu_memory_utilization),
        "environment": dict(ip.env),
        "workers": [
            {"node": w.node, "gpus": [cluster.gpu_rows[(w.node, u)].pk for u in w.gpu_uuids],
             "gpu_indexes": list(w.gpu_indexes), "gpu_uuids": list(w.gpu_uuids)}
            for w in ip.workers
        ],
    }


def _explained_gpu_bytes(cluster: Cluster, placed: Sequence[InstancePlacement]) -> int | None:
    """The GPU the explanation speaks of: the first replica's (its smallest), else the cluster's
    largest."""
    if placed:
        return min(r.memory_total_bytes for r in _placed_rows(cluster, placed[0]))
    sizes = [g.memory_total_bytes for g in cluster.gpu_rows.values() if g.parent_id is None]
    return max(sizes) if sizes else None


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
    out = _dry_run_head(deployment, engine, replicas, cluster)
    out["tenants"] = _tenant_rows(served, charged, cluster)
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
    out["placements"] = [_placement(cluster, plan, ip) for ip in result.instances]
    out["ok"] = result.ok
    out["reason"] = result.reason
    out["explain"] = plan.explain(_explained_gpu_bytes(cluster, result.instances))
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


def _gpu_share(view: GpuAllocationView, entry: AllocationEntry, profile: str) -> float:
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


def _add(into: dict[str, Any], size: int, seconds: float | None, slices: float) -> None:
    into["reserved_bytes"] += size
    into["mig_slices"] += slices
    if seconds is not None:
        into["gpu_seconds"] += seconds


@dataclass
class _Report:
    """The allocation report of one cluster, gathered GPU by GPU: each GPU's row (``gpu()``),
    and the sums per deployment and per tenant across all of them."""

    cluster: Cluster
    deployments: dict[Any, dict[str, Any]] = field(default_factory=dict)
    tenants: dict[Any, dict[str, Any]] = field(default_factory=dict)

    @property
    def no_seconds(self) -> float | None:
        """A sum's GPU-seconds before any is added: None without a period (they need one)."""
        return None if self.cluster.period is None else 0.0

    def gpu(self, view: GpuAllocationView, node_state: str | None) -> dict[str, Any]:
        names, slugs = self.cluster.deployment_names, self.cluster.tenant_slugs
        row = self.cluster.gpu_rows[(view.node, view.gpu_uuid)]
        per_tenant: dict[Any, dict[str, Any]] = {}
        entries = [self._entry(view, e, per_tenant) for e in view.entries]
        return {
            "gpu": row.pk,
            "node": view.node,
            "node_state": node_state,
            "index": view.gpu_index,
            "uuid": view.gpu_uuid,
            "name": view.gpu_name,
            "declared": row.declared,
            "mig_mode": row.mig_mode,
            "memory_total_bytes": view.memory_total_bytes,
            "reserved_bytes": view.reserved_bytes,
            "reserved_fraction": round(view.reserved_fraction, 4),
            "unmanaged_bytes": self.cluster.other_used.get(row.pk, 0),
            "free_fraction": round(view.free_fraction, 4),
            "free_bytes": int(view.free_fraction * view.memory_total_bytes),
            "by_deployment": [
                {"id": dep, "name": names.get(dep, str(dep)), "reserved_bytes": size}
                for dep, size in view.by_deployment.items()
            ],
            "by_tenant": [
                {**per_tenant.get(t, {}), "id": t, "slug": slugs.get(t), "reserved_bytes": size}
                for t, size in view.by_tenant.items()
            ],
            "entries": entries,
        }

    def _entry(
        self, view: GpuAllocationView, e: AllocationEntry, per_tenant: dict[Any, dict[str, Any]]
    ) -> dict[str, Any]:
        """One reservation of the GPU with its tenants' parts, added to the sums."""
        period = self.cluster.period
        mig_row = self.cluster.gpu_rows.get((view.node, e.mig_uuid)) if e.mig_uuid else None
        profile = mig_row.mig_profile if mig_row is not None else ""
        slices = float(mig_slices(profile) or 0) if e.mig_uuid else 0.0
        held = None
        if period is not None:
            since = self.cluster.placed_at.get((e.deployment_id, e.replica or 0))
            held = _gpu_share(view, e, profile) * period.seconds_from(since)
        shares = dict(e.shares)
        parts = split_amount(e.reserved_bytes, shares)
        charged: list[dict[str, Any]] = [
            {
                "id": t,
                "slug": self.cluster.tenant_slugs.get(t),
                "share": round(share, 6),
                "reserved_bytes": parts[t],
                "gpu_seconds": None if held is None else held * share,
                "mig_slices": slices * share,
            }
            for t, share in shares.items()
        ]
        self._add_to_sums(e, held, slices, charged, per_tenant)
        return {
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
        }

    def _add_to_sums(
        self, e: AllocationEntry, held: float | None, slices: float,
        charged: list[dict[str, Any]], per_tenant: dict[Any, dict[str, Any]],
    ) -> None:
        """An entry counted for its deployment, and each tenant's part for the tenant: on this
        GPU, within the deployment and across the cluster."""
        dep = self.deployments.setdefault(e.deployment_id, {
            "id": e.deployment_id,
            "name": self.cluster.deployment_names.get(e.deployment_id, str(e.deployment_id)),
            "reserved_bytes": 0, "gpu_seconds": self.no_seconds, "mig_slices": 0.0,
            "tenants": {},
        })
        _add(dep, e.reserved_bytes, held, slices)
        for part in charged:
            t = part["id"]
            blank = {"id": t, "slug": part["slug"], "reserved_bytes": 0,
                     "gpu_seconds": self.no_seconds, "mig_slices": 0.0}
            for into in (
                per_tenant.setdefault(t, dict(blank)),
                dep["tenants"].setdefault(t, dict(blank)),
                self.tenants.setdefault(t, dict(blank)),
            ):
                _add(into, part["reserved_bytes"], part["gpu_seconds"], part["mig_slices"])

    def deployment_rows(self) -> list[dict[str, Any]]:
        """The deployments by name, each with its sums, its split (measured or entitled) and its
        tenants' parts, the largest first."""
        for dep in self.deployments.values():
            charge = self.cluster.charges.get(dep["id"])
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
        return sorted(self.deployments.values(), key=lambda d: d["name"])


def _report(cluster: Cluster) -> dict[str, Any]:
    period = cluster.period
    states = {n.name: n.state for n in cluster.nodes.values()}
    report = _Report(cluster)
    gpus = [report.gpu(view, states.get(view.node)) for view in cluster.placer.allocation_view()]
    return {
        "period": None if period is None else {
            "key": period.key, "start": period.start, "end": period.end,
            "bucket_seconds": period.bucket_seconds,
        },
        "gpus": gpus,
        "deployments": report.deployment_rows(),
        "tenants": sorted(report.tenants.values(), key=lambda t: str(t["slug"])),
    }


__all__ = ["accounting", "allocation", "deployment_charges", "dry_run"]
