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

from serving_app.metering.queries import GpuSeries, LatencySeries, Series, TimeRange
from serving_app.units import GIB, format_gib
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

    def add_shape(self, **shape: Any) -> None:
        self.layout.setdefault("shapes", []).append(shape)

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
    """Without data: the reason in the middle, and no axes (a bare 0 to 4 scale reads as data)."""
    if not has_data:
        fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                           font={"size": 14, "color": GREY})
        for axis in ("xaxis", "yaxis"):
            fig.layout.setdefault(axis, {})["visible"] = False
        fig.layout["showlegend"] = False
    return fig


def _plain(fig: Figure) -> dict[str, Any]:
    return fig.to_plotly_json()


def isolated(values: list[float | None]) -> bool:
    """Whether some value has no value beside it: a line draws nothing for such a point."""
    last = len(values) - 1
    return any(
        v is not None and (i == 0 or values[i - 1] is None) and (i == last or values[i + 1] is None)
        for i, v in enumerate(values)
    )


def add_series(fig: Figure, x: list[str], y: list[float | None], name: str, colour: str,
               *, width: float = 2, dash: str | None = None, **extra: Any) -> None:
    """A time series as every chart draws one: a line with a marker on every point, so a bin
    with data between bins without any still shows (a lone point draws no line); larger
    markers where the series is sparse. Gaps stay gaps (no line across a bin without data)."""
    line: dict[str, Any] = {"color": colour, "width": width}
    if dash:
        line["dash"] = dash
    size = 7 if isolated(y) else 4
    fig.add_scatter(x=x, y=y, name=name, mode="lines+markers", line=line,
                    marker={"color": colour, "size": size}, connectgaps=False,
                    cliponaxis=False, **extra)


def scale_to_data(layout: dict[str, Any], values: Iterable[float | None], *,
                  references: Iterable[float] = (), headroom: float = 1.15) -> float | None:
    """Set the y-axis to [0, the largest value plus headroom], so that reference lines (which
    plotly counts in its autorange) do not stretch it; a reference up to three times the data's top
    is kept in view, a higher one is named at the top edge (`reference_line`). Returns the
    top, or None without data (then plotly's autorange stays)."""
    top = max((v for v in values if v is not None), default=None)
    if top is None or top <= 0:
        return None
    near = [r for r in references if r <= 3 * top]
    top = max([top, *near]) * headroom
    layout["yaxis"]["range"] = [0, top]
    layout["yaxis"].pop("rangemode", None)
    return top


def reference_line(fig: Figure, value: float, label: str, colour: str,
                   top: float | None) -> None:
    """A horizontal reference (an objective, a total) across the whole chart, as a shape: it
    does not stretch the y-axis. Above the data's range it is named at the top edge instead."""
    if top is not None and value > top:
        annotations = fig.layout.setdefault("annotations", [])
        above = next((a for a in annotations if a.get("name") == "above"), None)
        if above is None:
            fig.add_annotation(name="above", text=f"{label} above ↑", showarrow=False,
                               xref="paper", yref="paper", x=1, y=1, xanchor="right",
                               yanchor="bottom", font={"size": 11, "color": GREY})
        else:
            above["text"] = f"{above['text'][:-len(' above ↑')]}, {label} above ↑"
        return
    fig.add_shape(type="line", xref="paper", x0=0, x1=1, yref="y", y0=value, y1=value,
                  line={"color": colour, "width": 1.5, "dash": "dash"}, layer="below",
                  label={"text": label, "textposition": "end", "yanchor": "bottom",
                         "font": {"size": 11, "color": colour}})


# ----------------------------------------------------------------------------- usage


def requests_figure(series: Series, tenants: dict[int, Tenant], per: str) -> dict[str, Any]:
    """Requests per bar, stacked by tenant; `per`: one bar's width, stated on the axis."""
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    fig = _figure(layout=_layout("Requests", f"requests per {per}", barmode="stack"))
    has_data = False
    for tenant in sorted(tenants.values(), key=lambda t: t.slug):
        per_bin = series.by_tenant.get(tenant.pk)
        if not per_bin:
            continue
        has_data = True
        fig.add_bar(x=x, y=[int(c["requests"]) for c in per_bin], name=tenant.slug,
                    marker={"color": colours[tenant.pk]})
    return _plain(_empty(fig, has_data))


def guardrails_figure(rows: list[dict[str, Any]], tenants: dict[int, Tenant],
                      trange: TimeRange) -> dict[str, Any]:
    """Requests with guardrail findings per category (`queries.guardrail_counts`), a bar per
    tenant side by side, on a log axis: one noisy pattern's thousands of requests do not hide
    another category's ten. The bin is the whole range, stated on the axis."""
    colours = tenant_colours(tenants.values())
    categories = sorted({r["category"] for r in rows})
    fig = _figure(layout=_layout(
        "Requests with guardrail findings, by category",
        f"requests, {trange.label.lower()} (log)", barmode="group"))
    fig.layout["yaxis"].update(type="log", dtick=1, rangemode="normal")
    fig.layout["xaxis"]["title"] = {"text": f"category (one bin: {trange.label.lower()})"}
    fig.layout["hovermode"] = "closest"
    by_tenant: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_tenant.setdefault(row["tenant"].pk, {})[row["category"]] = row
    for tenant in sorted(tenants.values(), key=lambda t: t.slug):
        found = by_tenant.get(tenant.pk)
        if not found:
            continue
        cells = [found.get(c) for c in categories]
        # A zero has no place on a log axis: that bar is left out (None), not drawn at 1.
        fig.add_bar(x=categories, y=[c["requests"] or None if c else None for c in cells],
                    name=tenant.slug, marker={"color": colours[tenant.pk]},
                    customdata=[[c["block_requests"], c["redact_requests"],
                                 c["detect_requests"], c["total"]] if c else [0, 0, 0, 0]
                                for c in cells],
                    hovertemplate=f"{tenant.slug} · %{{x}}: %{{y}} requests (blocked "
                                  "%{customdata[0]}, redacted %{customdata[1]}, detected "
                                  "%{customdata[2]}; %{customdata[3]} findings)<extra></extra>")
    return _plain(_empty(fig, bool(rows), "No guardrail findings in this range"))


def tokens_figure(series: Series, tenants: dict[int, Tenant], per: str) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    fig = _figure(
        layout=_layout("Prompt and completion tokens", f"tokens per {per}", barmode="stack")
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


def _objectives(tenants: Iterable[Tenant]) -> list[float]:
    return [t.latency_objective_ms for t in tenants if t.latency_objective_ms]


def _objective_lines(
    fig: Figure, tenants: Iterable[Tenant], colours: dict[int, str], top: float | None
) -> None:
    for tenant in tenants:
        if tenant.latency_objective_ms:
            reference_line(fig, tenant.latency_objective_ms,
                           f"{tenant.slug} objective ({tenant.latency_objective_ms:,} ms)",
                           colours[tenant.pk], top)


def percentiles_figure(series: LatencySeries, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    layout = _layout("Total latency, all selected traffic", "ms")
    fig = _figure(layout=layout)
    has_data = any(p.requests for p in series.overall)
    styles = (("p50", "#10b981"), ("p95", "#f59e0b"), ("p99", "#ef4444"))
    for name, colour in styles:
        add_series(fig, x, [getattr(p, name) for p in series.overall], name, colour)
    shown = sorted((t for t in tenants.values() if t.pk in series.by_tenant),
                   key=lambda t: t.slug)
    top = scale_to_data(layout, (p.p99 for p in series.overall), references=_objectives(shown))
    _objective_lines(fig, shown, colours, top)
    return _plain(_empty(fig, has_data))


def p95_by_tenant_figure(series: LatencySeries, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    layout = _layout("p95 latency per tenant, against its objective", "ms")
    fig = _figure(layout=layout)
    shown = sorted((t for t in tenants.values() if t.pk in series.by_tenant), key=lambda t: t.slug)
    for tenant in shown:
        add_series(fig, x, [p.p95 for p in series.by_tenant[tenant.pk]], f"{tenant.slug} p95",
                   colours[tenant.pk])
    top = scale_to_data(layout, (p.p95 for t in shown for p in series.by_tenant[t.pk]),
                        references=_objectives(shown))
    _objective_lines(fig, shown, colours, top)
    return _plain(_empty(fig, bool(shown)))


def ttft_figure(series: LatencySeries, tenants: dict[int, Tenant]) -> dict[str, Any]:
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    layout = _layout("Time to first token (mean of streamed requests)", "ms")
    fig = _figure(layout=layout)
    shown = sorted((t for t in tenants.values() if t.pk in series.by_tenant), key=lambda t: t.slug)
    has_data = False
    for tenant in shown:
        values = [p.ttft_mean for p in series.by_tenant[tenant.pk]]
        has_data = has_data or any(v is not None for v in values)
        add_series(fig, x, values, tenant.slug, colours[tenant.pk])
    scale_to_data(layout, (p.ttft_mean for t in shown for p in series.by_tenant[t.pk]))
    return _plain(_empty(fig, has_data, "No streamed requests in this range"))


def queue_wait_figure(series: dict[str, list[tuple[int, float | None]]]) -> dict[str, Any]:
    """The mean wait per minute in the gateway's flow-control queue, one line per label (a
    tenant on a deployment; a model on the portal)."""
    layout = _layout("Wait in the gateway's queue (mean per minute)", "ms")
    fig = _figure(layout=layout)
    has_data = False
    for index, (label, points) in enumerate(sorted(series.items())):
        values = [v for _, v in points]
        has_data = has_data or any(v is not None for v in values)
        add_series(fig, times(datetime.fromtimestamp(at, UTC) for at, _ in points), values,
                   label, colour_for(index))
    scale_to_data(layout, (v for points in series.values() for _, v in points))
    return _plain(_empty(fig, has_data, "No request went through a flow-control queue"))


def error_rates_figure(series: LatencySeries, tenants: dict[int, Tenant]) -> dict[str, Any]:
    """Per tenant, the share of its requests that failed (status >= 400, 429 included) and that
    were refused with 429, per bin. A bin without requests has no point; every other bin has a
    marker, so one bin with errors between clean ones shows."""
    colours = tenant_colours(tenants.values())
    x = times(series.bins)
    # `closest`: a click names one tenant's series and bin (the request log it opens).
    layout = _layout("Error and 429 rates", "share of requests", hovermode="closest")
    layout["yaxis"]["tickformat"] = ".0%"
    fig = _figure(layout=layout)
    shown = sorted((t for t in tenants.values() if t.pk in series.by_tenant), key=lambda t: t.slug)
    for tenant in shown:
        points = series.by_tenant[tenant.pk]
        colour = colours[tenant.pk]
        # `meta`: the request log's filters for a point of this series (dashboard.js opens
        # the log on a click, for the point's bin).
        add_series(fig, x, [p.error_rate for p in points], f"{tenant.slug} errors", colour,
                   legendgroup=tenant.slug,
                   customdata=[p.requests for p in points],
                   meta={"tenant": tenant.slug, "status": "error"},
                   hovertemplate="%{y:.1%} of %{customdata:,} requests · click for them")
        add_series(fig, x, [p.rate_limited_rate for p in points], f"{tenant.slug} 429", colour,
                   width=1.5, dash="dot", legendgroup=tenant.slug,
                   meta={"tenant": tenant.slug, "status": "429"})
    rates = [v for t in shown for p in series.by_tenant[t.pk]
             for v in (p.error_rate, p.rate_limited_rate)]
    if not any(rates):
        layout["yaxis"]["range"] = [0, 0.05]  # no errors: a flat line at 0, not in mid-chart
    elif scale_to_data(layout, rates):
        layout["yaxis"]["range"][1] = min(layout["yaxis"]["range"][1], 1.05)
    return _plain(_empty(fig, bool(shown)))


# ----------------------------------------------------------------------------- GPUs


def _gpu_label(row: dict[str, Any]) -> str:
    return f"{row['node']} · GPU {row['index']}"


def _gib_hover(values: list[float], name: str) -> dict[str, Any]:
    """Hover text of GiB bars written by `serving_app.units`, as the tables and planner read."""
    return {"customdata": [format_gib(v * GIB) for v in values],
            "hovertemplate": f"%{{customdata}} {name}<extra></extra>"}


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
                    marker={"color": colour_for(n)}, **_gib_hover(values, name))
    # `reserved_bytes` counts memory held by processes the console did not place (or a whole
    # GPU its node stopped reporting); draw that apart from the console's own reservations.
    owned = [sum(p["reserved_bytes"] for p in r["by_deployment"]) for r in rows]
    other = [
        min(r["unmanaged_bytes"], max(r["memory_total_bytes"] - o, 0)) for r, o in zip(
            rows, owned, strict=True)
    ]
    fig.add_bar(y=labels, x=[o / GIB for o in other], name="other processes",
                orientation="h", marker={"color": "#cbd5e1"},
                **_gib_hover([o / GIB for o in other], "other processes"))
    free = [
        max(r["memory_total_bytes"] - o - u, 0) / GIB
        for r, o, u in zip(rows, owned, other, strict=True)
    ]
    fig.add_bar(y=labels, x=free, name="unreserved", orientation="h",
                marker={"color": "rgba(148,163,184,0.15)", "line": {"color": GREY, "width": 1}},
                customdata=[[format_gib(f * GIB), format_gib(r["memory_total_bytes"])]
                            for f, r in zip(free, rows, strict=True)],
                hovertemplate="%{customdata[0]} unreserved of %{customdata[1]}<extra></extra>")
    return _plain(_empty(fig, bool(rows), "No GPUs registered (CPU engines only)"))


def gpu_utilization_figure(series: list[GpuSeries]) -> dict[str, Any]:
    layout = _layout("GPU utilization", "%")
    layout["yaxis"]["range"] = [0, 100]
    fig = _figure(layout=layout)
    for n, s in enumerate(series):
        add_series(fig, times(s.bins), s.utilization, f"{s.gpu.node.name} · GPU {s.gpu.index}",
                   colour_for(n))
    has_data = any(v is not None for s in series for v in s.utilization)
    return _plain(_empty(fig, has_data, "No GPU samples in this range"))


def gpu_memory_figure(series: list[GpuSeries]) -> dict[str, Any]:
    """Memory used per GPU (GiB, as the planner counts: `serving_app.units`), each GPU's total
    a reference line."""
    layout = _layout("GPU memory used", "GiB")
    fig = _figure(layout=layout)
    for n, s in enumerate(series):
        label = f"{s.gpu.node.name} · GPU {s.gpu.index}"
        add_series(fig, times(s.bins), s.memory_used_gib, label, colour_for(n),
                   customdata=[format_gib(v * GIB) if v is not None else None
                               for v in s.memory_used_gib],
                   hovertemplate="%{customdata}")
    totals = [s.gpu.memory_total_bytes / GIB for s in series if s.gpu.memory_total_bytes]
    top = scale_to_data(layout, (v for s in series for v in s.memory_used_gib),
                        references=totals, headroom=1.08)
    for n, s in enumerate(series):
        if s.gpu.memory_total_bytes:
            reference_line(fig, s.gpu.memory_total_bytes / GIB,
                           f"{s.gpu.node.name} · GPU {s.gpu.index}: "
                           f"{format_gib(s.gpu.memory_total_bytes)}", colour_for(n), top)
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
