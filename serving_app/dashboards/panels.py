"""What each dashboard's data endpoint answers: its figures and the rows of its tables.

Shared by the admin console (`Tenant.objects.all()`) and the tenant portal (its one tenant, read
through `Tenant.objects.for_user()`): `tenants` is an already-scoped Tenant queryset and has no
default. The views only parse the query string and render the table template.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from serving_app.dashboards import figures, queries
from serving_app.models import FleetPlan
from serving_app.placement import fleetplans, service
from serving_app.placement.accounting import Period, period_ending_now
from tenants_app.models import Tenant


def usage_panel(trange: queries.TimeRange, tenants: QuerySet[Tenant]) -> dict:
    names = queries.tenant_names(tenants)
    series = queries.usage_series(trange, tenants)
    totals = queries.usage_totals(trange, tenants)
    return {
        "figures": {
            "requests": figures.requests_figure(series, names),
            "tokens": figures.tokens_figure(series, names),
        },
        "rows": totals,
        "total_requests": sum(r["requests"] for r in totals),
        "total_tokens": sum(r["total_tokens"] for r in totals),
    }


def latency_panel(
    trange: queries.TimeRange,
    tenants: QuerySet[Tenant],
    model: str | None = None,
) -> dict:
    names = queries.tenant_names(tenants)
    series = queries.latency_series(trange, tenants, model)
    rows = queries.latency_table(trange, tenants)
    if model:
        rows = [r for r in rows if r["model"] == model]
    return {
        "figures": {
            "percentiles": figures.percentiles_figure(series, names),
            "p95": figures.p95_by_tenant_figure(series, names),
            "ttft": figures.ttft_figure(series, names),
            "errors": figures.error_rates_figure(series, names),
        },
        "rows": rows,
    }


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
    report = service.accounting(accounting_period(trange))
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
