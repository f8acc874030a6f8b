"""The console's engine metric charts: the JSON the deployment and instance pages poll (their
figures, and the table of each engine's newest sample as HTML), drawn by the dashboards'
script (static/console/dashboard.js). Platform admins only, like the rest of the console."""

from __future__ import annotations

from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.template.loader import render_to_string
from django.views import View

from serving_app.metering import engine_charts as engine
from serving_app.metering import figures
from serving_app.models import Deployment, Instance
from ui_app.scoping import StaffPage


def engine_payload(request: HttpRequest, scope: QuerySet[Instance]) -> HttpResponse:
    erange = engine.get_range(request.GET.get("range"))
    panel = engine.panel(scope, erange)
    tables = render_to_string("console/_engine_tables.html", {**panel, "range": erange},
                              request=request)
    body = figures.to_json({"figures": panel["figures"], "tables": tables, "range": erange.key})
    return HttpResponse(body, content_type="application/json")


class DeploymentMetricsData(StaffPage, View):
    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(Deployment, pk=pk)
        return engine_payload(request, engine.scope_of(deployment=deployment))


class InstanceMetricsData(StaffPage, View):
    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        instance = get_object_or_404(Instance, pk=pk)
        return engine_payload(request, engine.scope_of(instance=instance))
