"""The console's overview: nodes and their GPUs, deployments and their instances, tenants'
load and month's tokens, the platform's health; its deployment table polled alone.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views import View
from django.views.generic import TemplateView

from serving_app.fleet.report import allocation
from serving_app.metering import health, queries
from serving_app.models import Deployment, Instance, Node
from serving_app.placement.inventory import GIB
from tenants_app.models import Tenant
from ui_app.console.deployments import deployments_with_instances
from ui_app.scoping import StaffPage


def gpu_display(row: dict[str, Any]) -> dict[str, Any]:
    """An `allocation()` row with the GiB figures and bar widths the templates show."""
    total = row["memory_total_bytes"] or 1
    owned = sum(p["reserved_bytes"] for p in row["by_deployment"])
    other = min(row["unmanaged_bytes"], max(total - owned, 0))
    row.update(
        total_gib=row["memory_total_bytes"] / GIB,
        reserved_gib=owned / GIB,
        free_gib=row["free_bytes"] / GIB,
        unmanaged_gib=other / GIB,
        reserved_pct=round(100 * owned / total, 1),
        unmanaged_pct=round(100 * other / total, 1),
    )
    for part in (*row["by_deployment"], *row["by_tenant"]):
        part["reserved_gib"] = part["reserved_bytes"] / GIB
    return row


def _state_counts(deployment: Deployment) -> list[tuple[str, int]]:
    counts = Counter(i.state for i in deployment.instances.all())
    return sorted(counts.items())


class OverviewView(StaffPage, TemplateView):
    template_name = "console/overview.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        gpus = allocation()
        nodes = list(Node.objects.annotate(gpu_count=Count("gpus")).order_by("name"))
        gpus_by_node: dict[str, list[dict[str, Any]]] = {}
        for row in gpus:
            gpus_by_node.setdefault(row["node"], []).append(gpu_display(row))
        cpu_load = dict(
            Instance.objects.active().filter(node__isnull=False).order_by().values("node_id")
            .annotate(n=Count("id")).values_list("node_id", "n")
        )
        node_rows = [
            {"node": n, "gpus": gpus_by_node.get(n.name, []), "instances": cpu_load.get(n.pk, 0)}
            for n in nodes
        ]
        deployments = list(deployments_with_instances())
        everyone = Tenant.objects.for_user(self.request.user)  # a platform admin: all tenants
        load = queries.current_load(everyone)
        month = queries.month_used_tokens(everyone)
        tenants = list(Tenant.objects.annotate(n_deployments=Count("deployments")))
        tenant_rows = []
        for tenant in tenants:
            used = month.get(tenant.pk, 0)
            budget = tenant.monthly_token_budget
            pct = round(100 * used / budget, 1) if budget else None
            tenant_rows.append({
                "tenant": tenant,
                "load": load.get(tenant.pk, {}),
                "month_tokens": used,
                "budget_pct": pct,
                "budget_bar": min(pct, 100) if pct is not None else None,
            })
        instances = [i for d in deployments for i in d.instances.all()]
        context.update(
            health=health.cached_report(),
            nodes=node_rows,
            deployments=[(d, _state_counts(d)) for d in deployments],
            tenants=tenant_rows,
            summary={
                "nodes_ready": sum(1 for n in nodes if n.state == "ready"),
                "nodes": len(nodes),
                "gpus": len(gpus),
                "running": sum(1 for d in deployments if d.desired_state == "running"),
                "deployments": len(deployments),
                "instances_ready": sum(1 for i in instances if i.state == Instance.State.READY),
                "instances": sum(1 for i in instances if i.state != Instance.State.STOPPED),
                "rpm": round(sum(v.get("rpm", 0) for v in load.values()), 1),
            },
        )
        return context


class OverviewDeploymentsPartial(StaffPage, View):
    """The overview's deployment table, re-fetched by HTMX polling."""

    def get(self, request: HttpRequest) -> HttpResponse:
        deployments = [(d, _state_counts(d)) for d in deployments_with_instances()]
        return render(request, "console/_overview_deployments.html",
                      {"deployments": deployments})
