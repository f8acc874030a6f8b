"""The capacity curve of a deployment's page: each p95 a capacity test measured (time to first
token, time per output token, end-to-end latency) against output tokens per second, one chart
each, with the tenants' objectives on that figure drawn across it (serving_app/frontier.py says
what each costs). Built like the dashboards' figures (`figures.Figure`) and drawn by the page
with the vendored plotly.js.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from serving_app.metering.figures import (
    Figure,
    _empty,
    _layout,
    reference_line,
    scale_to_data,
    tenant_colours,
)
from serving_app.models import CapacityPoint, CapacityTest
from tenants_app.models import Tenant

# Chart name: its title, the point's p95 and p50 fields, the tenant's objective field.
CHARTS = {
    "ttft": ("Time to first token", "ttft_p95_ms", "ttft_p50_ms", "ttft_objective_ms"),
    "tpot": ("Time per output token", "tpot_p95_ms", "tpot_p50_ms", "tpot_objective_ms"),
    "e2e": ("End-to-end latency", "e2e_p95_ms", None, "latency_objective_ms"),
}
P95, P50 = "#4f46e5", "#94a3b8"


def capacity_figures(test: CapacityTest | None, tenants: Iterable[Tenant]) -> dict[str, Any]:
    """One figure per chart of CHARTS for `test`'s points (none yet: the reason instead)."""
    points = list(test.points.all()) if test is not None else []
    tenants = sorted(tenants, key=lambda t: t.slug)
    colours = tenant_colours(tenants)
    return {name: _figure(name, points, tenants, colours) for name in CHARTS}


def _figure(name: str, points: list[CapacityPoint], tenants: list[Tenant],
            colours: dict[int, str]) -> dict[str, Any]:
    title, p95, p50, objective = CHARTS[name]
    layout = _layout(f"{title}, p95", "ms", hovermode="closest")
    layout["xaxis"].update(title={"text": "output tokens/s"}, rangemode="tozero")
    fig = Figure(layout)
    x = [p.tokens_per_s for p in points]
    labels = [f"{p.concurrency} concurrent" for p in points]
    series = [(p95, "p95", P95, None)] + ([(p50, "p50", P50, "dot")] if p50 else [])
    for field, label, colour, dash in series:
        line: dict[str, Any] = {"color": colour, "width": 2}
        if dash:
            line["dash"] = dash
        fig.add_scatter(x=x, y=[getattr(p, field) for p in points], name=label,
                        mode="lines+markers", text=labels, line=line,
                        marker={"color": colour, "size": 7},
                        hovertemplate=f"%{{text}}: %{{x:,.0f}} tok/s, {label} %{{y:,.1f}} ms"
                                      "<extra></extra>")
    wanted = [(t, getattr(t, objective)) for t in tenants if getattr(t, objective)]
    top = scale_to_data(layout, [getattr(p, p95) for p in points],
                        references=[value for _, value in wanted])
    for tenant, value in wanted:
        reference_line(fig, value, f"{tenant.slug} objective ({value:,} ms)",
                       colours[tenant.pk], top)
    return _empty(fig, bool(points), "No capacity test has succeeded yet").to_plotly_json()
