"""What-if plans against the database: a ``FleetPlan`` row's models and tenants resolved, placed
on its declared fleet by ``whatif``, and the result as the API and the GPU allocation page show
it (``plan_result``). Nothing is started or reserved, and the live cluster is not read: the
plan's fleet is all there is.

Models are registered base models (by name, their architecture read from their files when they
were registered) or inline architectures. Tenants are the plan's by slug, charged by their
entitled shares (fair-share weights), each tenant's GPU memory quota checked against what the
plan gives it. A model or tenant removed after the plan was saved makes its deployment refused,
with the reason, rather than the whole plan fail.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from serving_app.fleet.read import PlanningError, model_architecture
from serving_app.models import BaseModel, FleetPlan
from serving_app.placement.cluster import MigSlot
from serving_app.placement.fleetspec import (
    FleetSpecError,
    PlanDeployment,
    mig_slices,
    parse_fleet,
    parse_plan_deployments,
)
from serving_app.placement.inventory import GIB
from serving_app.placement.placer import Placer
from serving_app.placement.planner import ModelArchitecture
from serving_app.placement.request import TenantShare
from serving_app.placement.shares import entitled_shares
from serving_app.placement.whatif import Outcome, PlannedDeployment, place_plan
from tenants_app.models import Tenant

PLAN_LABEL = "What-if plan: nothing runs and nothing is reserved"


def inline_architecture(model: dict[str, Any]) -> ModelArchitecture:
    """An inline model's figures (``fleetspec.ARCHITECTURE_FIELDS``) as the planner takes them."""
    return ModelArchitecture(
        num_layers=model["num_layers"],
        hidden_size=model["hidden_size"],
        num_attention_heads=model["num_attention_heads"],
        num_kv_heads=model.get("num_kv_heads") or model["num_attention_heads"],
        weight_bytes=model["weight_bytes"],
        vocab_size=model["vocab_size"],
        max_position_embeddings=model["max_position_embeddings"],
        head_dim=model.get("head_dim"),
        torch_dtype=model.get("torch_dtype", "bfloat16"),
        intermediate_size=model.get("intermediate_size"),
        tie_word_embeddings=model.get("tie_word_embeddings", False),
        checkpoint_quantization=model.get("quantization") or None,
    )


def _resolve(specs: list[PlanDeployment]) -> list[PlannedDeployment]:
    slugs = {slug for spec in specs for slug in spec.tenants}
    tenants = {t.slug: t for t in Tenant.objects.filter(slug__in=slugs)}
    names = {spec.model for spec in specs if spec.model}
    bases = {b.name: b for b in BaseModel.objects.filter(name__in=names)}
    planned = []
    for spec in specs:
        problem = None
        model: ModelArchitecture | None = None
        base: BaseModel | None = None
        gone = [slug for slug in spec.tenants if slug not in tenants]
        if gone:
            problem = f"there is no tenant {', '.join(gone)} any more"
        elif spec.model is None:
            model = inline_architecture(dict(spec.architecture))
        elif spec.model not in bases:
            problem = f"there is no base model {spec.model} any more"
        else:
            base = bases[spec.model]
            try:
                model = model_architecture(base)
            except PlanningError as exc:
                problem = str(exc)
        rows = [tenants[s] for s in spec.tenants if s in tenants]
        shares = entitled_shares({t.slug: t.fair_share_weight or 1 for t in rows})
        charged = tuple(
            TenantShare(
                tenant_id=t.slug, share=shares[t.slug], label=t.slug,
                quota_gib=None if t.gpu_memory_quota_gib is None else float(t.gpu_memory_quota_gib),
            )
            for t in rows
        )
        planned.append(PlannedDeployment(spec, model, charged, problem, defaults=base))
    return planned


def plan_result(plan: FleetPlan) -> dict[str, Any]:
    """Where the plan's deployments would go on its fleet, per GPU, per deployment and per
    tenant, labelled as a plan (``kind: "plan"``). A plan whose text no longer parses (saved
    before a rule changed) answers ``error`` instead of raising."""
    out: dict[str, Any] = {
        "kind": "plan",
        "label": PLAN_LABEL,
        "plan": {"id": plan.pk, "name": plan.name, "description": plan.description,
                 "updated_at": plan.updated_at},
        "policy": plan.policy,
        "headroom": _headroom(plan),
        "error": None,
        "gpus": [],
        "deployments": [],
        "tenants": [],
        "summary": {},
    }
    try:
        nodes = parse_fleet(plan.fleet)
        specs = parse_plan_deployments(plan.deployments)
    except FleetSpecError as exc:
        out["error"] = str(exc)
        return out
    placer, outcomes = place_plan(nodes, _resolve(specs), headroom=out["headroom"],
                                  policy=plan.policy)
    migs = {(n.name, g.uuid, m.uuid): m for n in placer.nodes for g in n.gpus
            for m in g.mig_devices}
    out["gpus"] = _gpus(placer, outcomes)
    out["deployments"] = [_deployment(o, placer, migs) for o in outcomes]
    out["tenants"] = _tenants(out["deployments"])
    gpus = out["gpus"]
    out["summary"] = {
        "nodes": len(nodes),
        "gpus": len(gpus),
        "mig_devices": sum(len(g["mig_devices"]) for g in gpus),
        "memory_total_bytes": sum(g["memory_total_bytes"] for g in gpus),
        "reserved_bytes": sum(g["reserved_bytes"] for g in gpus),
        "placed": sum(1 for o in outcomes if o.ok),
        "refused": sum(1 for o in outcomes if not o.ok),
    }
    return out


def _headroom(plan: FleetPlan) -> float:
    if plan.headroom is not None:
        return float(plan.headroom)
    return float(getattr(settings, "PLACEMENT_HEADROOM", 0.10))


def _gpus(placer: Placer, outcomes: list[Outcome]) -> list[dict[str, Any]]:
    held = {(i.node, i.mig_uuid): o.deployment.spec.name for o in outcomes
            for i in o.placements if i.mig_uuid}
    slots = {(n.name, g.uuid): g for n in placer.nodes for g in n.gpus}
    rows = []
    for view in placer.allocation_view():
        gpu = slots[(view.node, view.gpu_uuid)]
        rows.append({
            "node": view.node,
            "index": view.gpu_index,
            "name": view.gpu_name,
            "memory_total_bytes": view.memory_total_bytes,
            "mig_mode": gpu.mig_enabled,
            "mig_devices": [
                {"profile": m.profile, "memory_total_bytes": m.memory_total_bytes,
                 "deployment": held.get((view.node, m.uuid))}
                for m in gpu.mig_devices
            ],
            "reserved_bytes": view.reserved_bytes,
            "reserved_fraction": round(view.reserved_fraction, 4),
            "free_bytes": int(view.free_fraction * view.memory_total_bytes),
            "unmanaged_bytes": 0,
            "by_deployment": [{"id": d, "name": d, "reserved_bytes": size}
                              for d, size in view.by_deployment.items()],
            "by_tenant": [{"id": t, "slug": t, "reserved_bytes": size}
                          for t, size in view.by_tenant.items()],
        })
    return rows


def _deployment(outcome: Outcome, placer: Placer,
                migs: dict[tuple[str, str, str], MigSlot]) -> dict[str, Any]:
    planned = outcome.deployment
    spec = planned.spec
    memory = outcome.memory
    totals = {(n.name, g.index): g.memory_total_bytes for n in placer.nodes for g in n.gpus}
    placements = []
    slices = 0
    for ip in outcome.placements:
        mig = migs.get((ip.node, ip.gpu_uuids[0], ip.mig_uuid or ""))
        total = mig.memory_total_bytes if mig else totals[(ip.node, ip.gpu_indexes[0])]
        if mig is not None:
            slices += mig_slices(mig.profile) or 0
        placements.append({
            "replica": ip.replica,
            "node": ip.node,
            "gpu_indexes": list(ip.gpu_indexes),
            "workers": [{"node": w.node, "gpu_indexes": list(w.gpu_indexes)}
                        for w in ip.workers],
            "mig_profile": mig.profile if mig else None,
            "isolation": ip.isolation,
            "gpu_memory_utilization": ip.gpu_memory_utilization,
            "reserved_bytes_per_gpu": ip.reserved_bytes_per_gpu,
            "concurrent_sequences": memory.concurrent_sequences(total, ip.gpu_memory_utilization)
            if memory else None,
        })
    weights = {t.tenant_id: t for t in planned.tenants}
    return {
        "name": spec.name,
        "model": spec.model_label,
        "isolation": spec.isolation,
        "replicas": spec.replicas,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "pipeline_parallel_size": spec.pipeline_parallel_size,
        "max_num_seqs": spec.max_num_seqs,
        "max_model_len": memory.max_model_len if memory else spec.max_model_len,
        "ok": outcome.ok,
        "reason": outcome.reason,
        "needed_bytes": memory.needed_bytes if memory else None,
        "needed_gib": round(memory.needed_gib, 2) if memory else None,
        "reserved_bytes": outcome.reserved_bytes,
        "mig_slices": slices,
        "placements": placements,
        "tenants": [
            {"slug": slug, "share": round(t.share, 6), "gpu_memory_quota_gib": t.quota_gib,
             "charged_bytes": outcome.charged_bytes.get(str(slug), 0),
             "mig_slices": slices * t.share}
            for slug, t in weights.items()
        ],
    }


def _tenants(deployments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tenants: dict[str, dict[str, Any]] = {}
    for dep in deployments:
        for part in dep["tenants"]:
            row = tenants.setdefault(part["slug"], {
                "slug": part["slug"], "reserved_bytes": 0, "mig_slices": 0.0,
                "gpu_memory_quota_gib": part["gpu_memory_quota_gib"], "deployments": [],
            })
            row["reserved_bytes"] += part["charged_bytes"]
            row["mig_slices"] += part["mig_slices"]
            row["deployments"].append(dep["name"])
    for row in tenants.values():
        quota = row["gpu_memory_quota_gib"]
        row["quota_used"] = None if not quota else row["reserved_bytes"] / (quota * GIB)
    return sorted(tenants.values(), key=lambda r: r["slug"])


__all__ = ["PLAN_LABEL", "inline_architecture", "plan_result"]
