"""What each dashboard's data endpoint answers: its figures and the rows of its tables.

Shared by the admin console (`Tenant.objects.all()`) and the tenant portal (its one tenant, read
through `Tenant.objects.for_user()`): `tenants` is an already-scoped Tenant queryset and has no
default. The views only parse the query string and render the table template.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from django.db.models import QuerySet

from serving_app.deployments import sharing
from serving_app.fleet import plans as fleetplans
from serving_app.fleet.accounting import Period, period_ending_now
from serving_app.fleet.report import accounting
from serving_app.metering import figures, queries
from serving_app.models import Deployment, FleetPlan
from tenants_app.models import Tenant


def usage_panel(trange: queries.TimeRange, tenants: QuerySet[Tenant]) -> dict:
    names = queries.tenant_names(tenants)
    series = queries.usage_series(trange, tenants)
    totals = queries.usage_totals(trange, tenants)
    guardrails = queries.guardrail_counts(trange, tenants)
    return {
        "figures": {
            "requests": figures.requests_figure(series, names, trange.bin_label),
            "tokens": figures.tokens_figure(series, names, trange.bin_label),
            "guardrails": figures.guardrails_figure(guardrails, names, trange),
        },
        "rows": totals,
        "guardrails": guardrails,
        "total_requests": sum(r["requests"] for r in totals),
        "total_tokens": sum(r["total_tokens"] for r in totals),
    }


def latency_panel(
    trange: queries.TimeRange,
    tenants: QuerySet[Tenant],
    model: str | None = None,
    *,
    portal: bool = False,
) -> dict:
    names = queries.tenant_names(tenants)
    series = queries.latency_series(trange, tenants, model)
    rows = queries.latency_table(trange, tenants)
    if model:
        rows = [r for r in rows if r["model"] == model]
    flow = flow_panel(trange, tenants, portal=portal)
    return {
        "figures": {
            "percentiles": figures.percentiles_figure(series, names),
            "p95": figures.p95_by_tenant_figure(series, names),
            "ttft": figures.ttft_figure(series, names),
            "errors": figures.error_rates_figure(series, names),
            "queue_wait": figures.queue_wait_figure(flow["waits"]),
        },
        "rows": rows,
        "flow": flow,
    }


def flow_panel(trange: queries.TimeRange, tenants: QuerySet[Tenant], *,
               portal: bool = False) -> dict[str, Any]:
    """The gateway's flow control on the running deployments that serve `tenants` and use it:
    each minute's mean queue wait per tenant and deployment over the range (at most the two
    hours the gateway keeps), and, for the console, each deployment's report over the same
    minutes (queues, waits, served against entitled share, Jain's index). The portal's tenant
    gets only its own waits, labelled by model. `error` when Redis cannot be read."""
    minutes = max(1, min(int(trange.span.total_seconds()) // 60,
                         sharing.STATS_KEPT_SECONDS // 60))
    deployments = [d for d in Deployment.objects.filter(
        tenants__in=tenants, desired_state=Deployment.DesiredState.RUNNING
    ).distinct().select_related("base_model").order_by("name") if d.flow_controlled]
    names = {t.pk: t.slug for t in tenants}
    out: dict[str, Any] = {"minutes": minutes, "deployments": deployments, "reports": [],
                           "waits": {}, "error": False}
    try:
        waits = sharing.wait_series([d.pk for d in deployments], time.time(), minutes,
                                    tenant_ids=list(names))
        if not portal:
            out["reports"] = [(d, sharing.report(d, minutes)) for d in deployments]
    except redis.RedisError:
        out["error"] = True
        return out
    by_pk = {d.pk: d for d in deployments}
    for (deployment_id, tenant_id), points in waits.items():
        deployment = by_pk[deployment_id]
        label = (deployment.base_model.name if portal
                 else f"{names[tenant_id]} on {deployment.name}")
        while label in out["waits"]:  # two deployments of one model serve the tenant
            label += "'"
        out["waits"][label] = points
    return out


def accounting_period(trange: queries.TimeRange) -> Period:
    """The period a dashboard range charges shared deployments over (the range's own rollup)."""
    return period_ending_now(trange.span, trange.rollup, trange.key)


def plan_panel(plan: FleetPlan) -> dict[str, Any]:
    """A what-if plan's placement and its two allocation charts, titled as a plan."""
    result = fleetplans.plan_result(plan)
    label = f"PLAN {plan.name}, not running: per"
    return {
        "plan": result,
        "figures": {
            "plan_by_deployment": figures.allocation_figure(
                result["gpus"], by="deployment", title=f"{label} deployment"),
            "plan_by_tenant": figures.allocation_figure(
                result["gpus"], by="tenant", title=f"{label} tenant"),
        },
    }


def gpu_panel(trange: queries.TimeRange, plan: FleetPlan | None = None) -> dict[str, Any]:
    """Live GPU allocation, shared deployments charged to their tenants over the range; beside
    it, when given, a what-if plan's (``plan_panel``)."""
    report = accounting(accounting_period(trange))
    allocation = report["gpus"]
    for row in allocation:
        owned = sum(p["reserved_bytes"] for p in row["by_deployment"])
        row["console_reserved_bytes"] = owned
        row["other_bytes"] = min(row["unmanaged_bytes"], max(row["memory_total_bytes"] - owned, 0))
    for row in [*report["deployments"], *report["tenants"],
                *(t for d in report["deployments"] for t in d["tenants"])]:
        row["gpu_hours"] = (row["gpu_seconds"] or 0.0) / 3600
    series = queries.gpu_series(trange)
    planned = plan_panel(plan) if plan is not None else {"plan": None, "figures": {}}
    return {
        "figures": {
            "by_deployment": figures.allocation_figure(allocation, by="deployment"),
            "by_tenant": figures.allocation_figure(allocation, by="tenant"),
            "utilization": figures.gpu_utilization_figure(series),
            "memory": figures.gpu_memory_figure(series),
            **planned["figures"],
        },
        "rows": allocation,
        "deployments": report["deployments"],
        "tenants": report["tenants"],
        "period": report["period"],
        "plan": planned["plan"],
    }
