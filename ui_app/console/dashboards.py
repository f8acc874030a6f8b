"""The dashboards (usage, latency, GPU allocation): the page around the charts and the JSON it
polls, the console's and, through `dashboard_context` and `dashboard_payload`, the portal's.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.urls import reverse
from django.views import View
from django.views.generic import TemplateView

from serving_app.fleet import plans as fleetplans
from serving_app.metering import figures, panels, queries
from serving_app.models import FleetPlan, Gpu
from tenants_app.models import Tenant
from ui_app.scoping import StaffPage

DASHBOARDS = {
    "usage": ("Usage", "console/_usage_tables.html"),
    "latency": ("Latency", "console/_latency_tables.html"),
    "gpus": ("GPU allocation", "console/_gpu_tables.html"),
}


def dashboard_payload(
    request: HttpRequest, name: str, tenants: QuerySet[Tenant], *, portal: bool = False,
    requests_url: str = "",
) -> HttpResponse:
    """The JSON a dashboard page polls: plotly figures plus its tables as HTML, for `tenants`
    (an already-scoped queryset: everyone for the console, the one tenant for its portal);
    `requests_url`: the request log its error rates link to."""
    trange = queries.get_range(request.GET.get("range"), tenants)
    if name == "usage":
        panel = panels.usage_panel(trange, tenants)
    elif name == "latency":
        panel = panels.latency_panel(trange, tenants, selected_model(request, tenants),
                                     portal=portal)
    else:
        panel = panels.gpu_panel(trange, selected_plan(request))
    tables = render_to_string(DASHBOARDS[name][1], {
        **panel, "range": trange, "portal": portal, "requests_url": requests_url,
        "since": trange.bounds()[0],
        "max_error_pct": f"{settings.OBJECTIVE_MAX_ERROR_RATE * 100:g}"}, request=request)
    body = figures.to_json({"figures": panel["figures"], "tables": tables,
                            "range": trange.key})
    return HttpResponse(body, content_type="application/json")


def selected_model(request: HttpRequest, tenants: QuerySet[Tenant]) -> str | None:
    """`?model=`, when it is one of the filter's entries (`queries.model_names`); else all."""
    model = request.GET.get("model") or None
    return model if model in queries.model_names(tenants) else None


def dashboard_context(
    request: HttpRequest, name: str, tenants: QuerySet[Tenant], data_url: str,
    requests_url: str = "",
) -> dict[str, Any]:
    """What a dashboard page shows around its charts, the console's and the portal's: the
    ranges (none asked for: the smallest holding the latest usage), the model filter (latency),
    the charts; the GPU page without GPUs draws none and says why. `requests_url`: the request
    log that a click on an error point opens, filtered to the point's bin and series."""
    trange = queries.get_range(request.GET.get("range"), tenants)
    charts = CHARTS[name]
    gpus = name != "gpus" or Gpu.objects.exists()
    if not gpus:
        charts = []
    return {
        "name": name,
        "ranges": queries.RANGES.values(),
        "range": trange,
        "data_url": data_url,
        "models": queries.model_names(tenants) if name == "latency" else [],
        "model": (selected_model(request, tenants) or "") if name == "latency" else "",
        "charts": charts,
        "no_gpus": not gpus,
        "requests_url": requests_url,
    }


class DashboardView(StaffPage, TemplateView):
    template_name = "console/dashboard.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        name = self.kwargs["name"]
        context.update(
            title=DASHBOARDS[name][0],
            **dashboard_context(self.request, name, Tenant.objects.for_user(self.request.user),
                                reverse("console:dashboard-data", args=[name]),
                                reverse("console:request-log")),
        )
        if name == "gpus":
            # A what-if plan beside the live allocation (platform admins only, as plans are).
            plan = selected_plan(self.request)
            context.update(
                plans=list(FleetPlan.objects.for_user(self.request.user).only("pk", "name")),
                plan=fleetplans.plan_result(plan) if plan is not None else None,
            )
        return context


def selected_plan(request: HttpRequest) -> FleetPlan | None:
    """The plan the GPU allocation page shows: `?plan=<id>`, else the latest changed one."""
    plans = FleetPlan.objects.for_user(request.user)
    chosen = request.GET.get("plan", "")
    if chosen.isdigit():
        return plans.filter(pk=int(chosen)).first()
    return plans.first()


CHARTS = {
    "usage": ["requests", "tokens", "guardrails"],
    "latency": ["percentiles", "p95", "ttft", "errors", "queue_wait"],
    "gpus": ["by_deployment", "by_tenant", "utilization", "memory"],
}


class DashboardDataView(StaffPage, View):
    def get(self, request: HttpRequest, name: str) -> HttpResponse:
        return dashboard_payload(request, name, Tenant.objects.for_user(request.user),
                                 requests_url=reverse("console:request-log"))
