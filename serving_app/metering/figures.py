"""Plotly figures for the dashboards, built server-side from `queries` series.

Each builder returns a plotly figure (`{"data": [...], "layout": {...}}`, plotly's figure
schema) that the page draws with the vendored plotly.js; `to_json()` encodes a payload of them.
`Figure` below is built with the calls of `plotly.graph_objects.Figure` but does not run its
per-property validation and deep copies, which cost about 4 ms a trace (a 30-day latency page
has 50 traces): tests/ui validates every figure the dashboards build with
`plotly.graph_objects.Figure(figure)`. Times are UTC strings, so encoding is plain JSON.
A tenant keeps its colour on every chart (the palette follows the tenant's place in slug order).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

from serving_app.metering.queries import GpuSeries, LatencySeries, Series
from serving_app.placement.inventory import GIB
from tenants_app.models import Tenant

PALETTE = (
    "#4f46e5", "#0ea5e9", "#10b981", "#f59e0b", "#ef4444", "#8b5cf6",
    "#14b8a6", "#ec4899", "#84cc16", "#f97316", "#6366f1", "#06b6d4",
)
GREY = "#94a3b8"


def colour_for(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def tenant_colours(tenants: Iterable[Tenant]) -> dict[int, str]:
    return {t.pk: colour_for(i) for i, t in enumerate(sorted(tenants, key=lambda t: t.slug))}


class Figure:
    """A plotly figure as the dict plotly.js draws, built like `go.Figure` (see the module)."""

    def __init__(self, layout: dict[str, Any]) -> None:
        self.data: list[dict[str, Any]] = []
        self.layout = layout

    def add_bar(self, **trace: Any) -> None:
        self.data.append({"type": "bar", **trace})

    def add_scatter(self, **trace: Any) -> None:
        self.data.append({"type": "scatter", **trace})

    def add_annotation(self, **annotation: Any) -> None:
        self.layout.setdefault("annotations", []).append(annotation)

    def to_plotly_json(self) -> dict[str, Any]:
        return {"data": self.data, "layout": self.layout}


def _figure(layout: dict[str, Any]) -> Figure:
    return Figure(layout)


def times(bins: Iterable[datetime]) -> list[str]:
    """Bin starts as plotly date strings (UTC)."""
    return [b.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") for b in bins]


def _layout(title: str, yaxis: str, **extra: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "title": {"text": title, "x": 0.01, "font": {"size": 15}},
        "margin": {"l": 60, "r": 20, "t": 48, "b": 40},
        "height": 320,
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"family": "Inter, system-ui, -apple-system, Segoe UI, sans-serif",
                 "color": "#334155", "size": 12},
        "legend": {"orientation": "h", "y": -0.18},
        "hovermode": "x unified",
        "xaxis": {"gridcolor": "#e2e8f0", "zeroline": False},
        "yaxis": {"title": {"text": yaxis}, "gridcolor": "#e2e8f0", "zeroline": False,
                  "rangemode": "tozero"},
        "template": "none",
    }
    layout.update(extra)
    return layout


def _empty(fig: Figure, has_data: bool, text: str = "No requests in this range") -> Figure:
    if not has_data:
        fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                           font={"size": 14, "color": GREY})
    return fig


def _plain(fig: Figure) -> dict[str, Any]:
    return fig.to_plotly_json()


# ----------------------------------------------------------------------------- usage


def requests_figure(series: Series, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    fig = _figure(layout=_layout("Requests", "requests per bin", barmode="stack"))
    has_data = False
    for tenant in sorted(tenants.values(), key=lambda t: t.slug):
        per_bin = series.by_tenant.get(tenant.pk)
        if not per_bin:
            continue
        has_data = True
        fig.add_bar(x=x, y=[int(c["requests"]) for c in per_bin], name=tenant.slug,
                    marker={"color": colours[tenant.pk]})
    return _plain(_empty(fig, has_data))


def tokens_figure(series: Series, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    fig = _figure(
        layout=_layout("Prompt and completion tokens", "tokens per bin", barmode="stack")
    )
    has_data = False
    for tenant in sorted(tenants.values(), key=lambda t: t.slug):
        per_bin = series.by_tenant.get(tenant.pk)
        if not per_bin:
            continue
        has_data = True
        colour = colours[tenant.pk]
        fig.add_bar(x=x, y=[int(c["prompt_tokens"]) for c in per_bin],
                    name=f"{tenant.slug} prompt", legendgroup=tenant.slug,
                    marker={"color": colour})
        fig.add_bar(x=x, y=[int(c["completion_tokens"]) for c in per_bin],
                    name=f"{tenant.slug} completion", legendgroup=tenant.slug,
                    marker={"color": colour, "opacity": 0.55, "pattern": {"shape": "/"}})
    return _plain(_empty(fig, has_data))


# ----------------------------------------------------------------------------- latency


def _objective_lines(
    fig: Figure, bins: list[str], tenants: Iterable[Tenant], colours: dict[int, str]
) -> None:
    if not bins:
        return
    for tenant in tenants:
        if tenant.latency_objective_ms:
            fig.add_scatter(
                x=[bins[0], bins[-1]], y=[tenant.latency_objective_ms] * 2, mode="lines",
                name=f"{tenant.slug} objective ({tenant.latency_objective_ms} ms)",
                line={"color": colours[tenant.pk], "dash": "dash", "width": 1.5},
                hoverinfo="skip",
            )


def percentiles_figure(series: LatencySeries, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    fig = _figure(layout=_layout("Total latency, all selected traffic", "ms"))
    has_data = any(p.requests for p in series.overall)
    styles = (("p50", "#10b981"), ("p95", "#f59e0b"), ("p99", "#ef4444"))
    for name, colour in styles:
        fig.add_scatter(x=x, y=[getattr(p, name) for p in series.overall],
                        name=name, mode="lines+markers", line={"color": colour, "width": 2},
                        marker={"size": 4}, connectgaps=False)
    shown = [t for t in tenants.values() if t.pk in series.by_tenant]
    _objective_lines(fig, x, sorted(shown, key=lambda t: t.slug), colours)
    return _plain(_empty(fig, has_data))


def p95_by_tenant_figure(series: LatencySeries, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    fig = _figure(layout=_layout("p95 latency per tenant, against its objective", "ms"))
    shown = sorted((t for t in tenants.values() if t.pk in series.by_tenant), key=lambda t: t.slug)
    for tenant in shown:
        points = series.by_tenant[tenant.pk]
        fig.add_scatter(x=x, y=[p.p95 for p in points], name=f"{tenant.slug} p95",
                        mode="lines+markers", marker={"size": 4},
                        line={"color": colours[tenant.pk], "width": 2})
    _objective_lines(fig, x, shown, colours)
    return _plain(_empty(fig, bool(shown)))


def ttft_figure(series: LatencySeries, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    fig = _figure(layout=_layout("Time to first token (mean of streamed requests)", "ms"))
    shown = sorted((t for t in tenants.values() if t.pk in series.by_tenant), key=lambda t: t.slug)
    has_data = False
    for tenant in shown:
        values = [p.ttft_mean for p in series.by_tenant[tenant.pk]]
        has_data = has_data or any(v is not None for v in values)
        fig.add_scatter(x=x, y=values, name=tenant.slug, mode="lines+markers",
                        marker={"size": 4}, line={"color": colours[tenant.pk], "width": 2})
    return _plain(_empty(fig, has_data, "No streamed requests in this range"))


def queue_wait_figure(series: dict[str, list[tuple[int, float | None]]]) -> dict[str, Any]:
    """The mean wait per minute in the gateway's flow-control queue, one line per label (a
    tenant on a deployment; a model on the portal)."""
    fig = _figure(layout=_layout("Wait in the gateway's queue (mean per minute)", "ms"))
    has_data = False
    for index, (label, points) in enumerate(sorted(series.items())):
        values = [v for _, v in points]
        has_data = has_data or any(v is not None for v in values)
        fig.add_scatter(x=times(datetime.fromtimestamp(at, UTC) for at, _ in points), y=values,
                        name=label, mode="lines+markers", marker={"size": 4},
                        line={"color": colour_for(index), "width": 2})
    return _plain(_empty(fig, has_data, "No request went through a flow-control queue"))


def error_rates_figure(series: LatencySeries, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    layout = _layout("Error and 429 rates", "share of requests")
    layout["yaxis"]["tickformat"] = ".0%"
    fig = _figure(layout=layout)
    shown = sorted((t for t in tenants.values() if t.pk in series.by_tenant), key=lambda t: t.slug)
    for tenant in shown:
        points = series.by_tenant[tenant.pk]
        colour = colours[tenant.pk]
        fig.add_scatter(x=x, y=[p.error_rate for p in points],
                        name=f"{tenant.slug} errors", legendgroup=tenant.slug, mode="lines",
                        line={"color": colour, "width": 2})
        fig.add_scatter(x=x, y=[p.rate_limited_rate for p in points],
                        name=f"{tenant.slug} 429", legendgroup=tenant.slug, mode="lines",
                        line={"color": colour, "width": 1.5, "dash": "dot"})
    return _plain(_empty(fig, bool(shown)))


# ----------------------------------------------------------------------------- GPUs


def _gpu_label(row: dict[str, Any]) -> str:
    return f"{row['node']} · GPU {row['index']}"


def allocation_figure(rows: list[dict[str, Any]], by: str = "deployment",
                      title: str | None = None) -> dict[str, Any]:
    """Per GPU, reserved GiB per deployment (or tenant), other processes and free, vs total."""
    title = title or f"Reserved GPU memory per {by}"
    layout = _layout(title, "", barmode="stack", hovermode="closest",
                     height=max(240, 110 + 46 * len(rows)))
    layout["margin"]["l"] = 120
    layout["legend"] = {"orientation": "h", "y": -0.3}
    layout["xaxis"]["ticksuffix"] = " GiB"
    layout["yaxis"] = {"autorange": "reversed", "gridcolor": "#e2e8f0"}
    fig = _figure(layout=layout)
    labels = [_gpu_label(r) for r in rows]
    key = "by_deployment" if by == "deployment" else "by_tenant"
    name_key = "name" if by == "deployment" else "slug"
    owners: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        for part in row[key]:
            name = str(part.get(name_key) or part.get("id"))
            owners.setdefault(name, [0.0] * len(rows))[i] += part["reserved_bytes"] / GIB
    for n, (name, values) in enumerate(sorted(owners.items())):
        fig.add_bar(y=labels, x=values, name=name, orientation="h",
                    marker={"color": colour_for(n)})
    # `reserved_bytes` counts memory held by processes the console did not place (or a whole
    # GPU its node stopped reporting); draw that apart from the console's own reservations.
    owned = [sum(p["reserved_bytes"] for p in r["by_deployment"]) for r in rows]
    other = [
        min(r["unmanaged_bytes"], max(r["memory_total_bytes"] - o, 0)) for r, o in zip(
            rows, owned, strict=True)
    ]
    fig.add_bar(y=labels, x=[o / GIB for o in other], name="other processes",
                orientation="h", marker={"color": "#cbd5e1"})
    free = [
        max(r["memory_total_bytes"] - o - u, 0) / GIB
        for r, o, u in zip(rows, owned, other, strict=True)
    ]
    fig.add_bar(y=labels, x=free, name="unreserved", orientation="h",
                marker={"color": "rgba(148,163,184,0.15)", "line": {"color": GREY, "width": 1}},
                customdata=[r["memory_total_bytes"] / GIB for r in rows],
                hovertemplate="%{x:.1f} GiB unreserved of %{customdata:.1f} GiB<extra></extra>")
    return _plain(_empty(fig, bool(rows), "No GPUs registered (CPU engines only)"))


def gpu_utilization_figure(series: list[GpuSeries]) -> dict[str, Any]:
    layout = _layout("GPU utilization", "%")
    layout["yaxis"]["range"] = [0, 100]
    fig = _figure(layout=layout)
    for n, s in enumerate(series):
        x = times(s.bins)
        fig.add_scatter(x=x, y=s.utilization, name=f"{s.gpu.node.name} · GPU {s.gpu.index}",
                        mode="lines", line={"color": colour_for(n), "width": 2})
    has_data = any(v is not None for s in series for v in s.utilization)
    return _plain(_empty(fig, has_data, "No GPU samples in this range"))


def gpu_memory_figure(series: list[GpuSeries]) -> dict[str, Any]:
    fig = _figure(layout=_layout("GPU memory used", "GiB"))
    for n, s in enumerate(series):
        x = times(s.bins)
        colour = colour_for(n)
        label = f"{s.gpu.node.name} · GPU {s.gpu.index}"
        fig.add_scatter(x=x, y=s.memory_used_gib, name=label, legendgroup=label,
                        mode="lines", line={"color": colour, "width": 2})
        if x:
            total = s.gpu.memory_total_bytes / GIB
            fig.add_scatter(x=[x[0], x[-1]], y=[total, total], legendgroup=label,
                            name=f"{label} total", mode="lines", hoverinfo="skip",
                            line={"color": colour, "width": 1, "dash": "dash"})
    has_data = any(v is not None for s in series for v in s.memory_used_gib)
    return _plain(_empty(fig, has_data, "No GPU samples in this range"))


def _encode(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def to_json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, default=_encode, separators=(",", ":"))
