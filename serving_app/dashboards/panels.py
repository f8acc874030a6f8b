"""What each dashboard's data endpoint answers: its figures and the rows of its tables.

Shared by the admin console (all tenants) and the tenant portal (one tenant: pass its id in
`tenant_ids`); the views only parse the query string and render the table template.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from serving_app.dashboards import figures, queries
from serving_app.placement import service


def usage_panel(trange: queries.TimeRange, tenant_ids: Iterable[int] | None = None) -> dict:
    ids = None if tenant_ids is None else list(tenant_ids)
    tenants = queries.tenant_names(ids)
    series = queries.usage_series(trange, ids)
    totals = queries.usage_totals(trange, ids)
    return {
        "figures": {
            "requests": figures.requests_figure(series, tenants),
            "tokens": figures.tokens_figure(series, tenants),
        },
        "rows": totals,
        "total_requests": sum(r["requests"] for r in totals),
        "total_tokens": sum(r["total_tokens"] for r in totals),
    }


def latency_panel(
    trange: queries.TimeRange,
    tenant_ids: Iterable[int] | None = None,
    model: str | None = None,
) -> dict:
    ids = None if tenant_ids is None else list(tenant_ids)
    tenants = queries.tenant_names(ids)
    series = queries.latency_series(trange, ids, model)
    rows = queries.latency_table(trange, ids)
    if model:
        rows = [r for r in rows if r["model"] == model]
    return {
        "figures": {
            "percentiles": figures.percentiles_figure(series, tenants),
            "p95": figures.p95_by_tenant_figure(series, tenants),
            "ttft": figures.ttft_figure(series, tenants),
            "errors": figures.error_rates_figure(series, tenants),
        },
        "rows": rows,
    }


def gpu_panel(trange: queries.TimeRange) -> dict[str, Any]:
    allocation = service.allocation()
    for row in allocation:
        owned = sum(p["reserved_bytes"] for p in row["by_deployment"])
        row["console_reserved_bytes"] = owned
        row["other_bytes"] = min(row["unmanaged_bytes"], max(row["memory_total_bytes"] - owned, 0))
    series = queries.gpu_series(trange)
    return {
        "figures": {
            "by_deployment": figures.allocation_figure(allocation, by="deployment"),
            "by_tenant": figures.allocation_figure(allocation, by="tenant"),
            "utilization": figures.gpu_utilization_figure(series),
            "memory": figures.gpu_memory_figure(series),
        },
        "rows": allocation,
    }
