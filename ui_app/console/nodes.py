"""The console's node pages (state, heartbeat, what runs there, its events and audit entries;
CPU binding; cordon, uncordon, drain) and what-if fleet plans.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Count, Prefetch, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.utils import timezone
from django.views import View
from django.views.generic import DetailView, ListView
from django.views.generic.base import TemplateResponseMixin
from django.views.generic.edit import ModelFormMixin

from audit_app.models import AuditLog
from serving_app.fleet import plans as fleetplans
from serving_app.forms import FleetPlanForm
from serving_app.models import FleetPlan, Gpu, Instance, Node
from serving_app.models.events import Event
from ui_app.console.base import ObjectCreateView, ObjectUpdateView
from ui_app.console.forms import NodeCpuBindingForm
from ui_app.scoping import StaffPage

# ----------------------------------------------------------------------------- nodes


EVENTS_ON_NODE_PAGE = 30
UNHEALTHY_STATES = (Instance.State.UNHEALTHY, Instance.State.FAILED, Instance.State.CRASH_LOOP)


class NodeListView(StaffPage, ListView[Node]):
    """Every node: its state and heartbeat age, its GPUs, how many instances run there and how
    many of them are unwell, with the cordon, uncordon and drain actions of its page."""

    template_name = "console/node_list.html"

    def get_queryset(self) -> QuerySet[Node]:
        terminal = Instance.TERMINAL_STATES
        return Node.objects.prefetch_related(
            Prefetch("gpus", queryset=Gpu.objects.filter(parent=None).order_by("index"))
        ).annotate(
            n_instances=Count("instances", filter=~Q(instances__state__in=terminal)),
            n_unhealthy=Count("instances", filter=Q(instances__state__in=UNHEALTHY_STATES)),
        ).order_by("name")

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        now = timezone.now()
        context["rows"] = [
            {"node": node,
             "heartbeat_age_ms": (now - node.last_heartbeat).total_seconds() * 1000
             if node.last_heartbeat else None}
            for node in context["object_list"]
        ]
        return context


class NodeDetailView(StaffPage, DetailView[Node]):
    """A node: its state and heartbeat, what runs there, what the control plane did there (its
    events) and who acted on it (its audit entries), and the cordon, uncordon and drain
    actions."""

    template_name = "console/node_detail.html"
    queryset = Node.objects.prefetch_related("gpus")

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        node = self.object
        context.setdefault("binding_form", NodeCpuBindingForm(instance=node))
        context.update(
            instances=node.instances.active().select_related("deployment")
            .prefetch_related("gpus").order_by("deployment__name", "ordinal"),
            events=Event.objects.filter(node=node)
            .select_related("deployment", "instance", "node")[:EVENTS_ON_NODE_PAGE],
            entries=AuditLog.objects.filter(object_type=Node._meta.label,
                                            object_id=str(node.pk))[:30],
        )
        return context


class NodeCpuBindingView(NodeDetailView):
    """Change a node's CPU binding: saved through the form (the audit log records the change,
    source "console"); a bad CPU list is shown at the field on the node's page, nothing
    saved."""

    http_method_names = ["post"]

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        self.object = node = self.get_object()
        form = NodeCpuBindingForm(request.POST, instance=node)
        if not form.is_valid():
            node.refresh_from_db()
            return self.render_to_response(
                self.get_context_data(object=node, binding_form=form), status=400)
        form.save()
        messages.success(request, f"CPU binding of {node.name}: "
                                  f"{node.cpu_binding or 'the cores nearest each GPU'}. "
                                  "Engines started from now on use it.")
        return redirect("console:node-detail", pk=node.pk)


class NodeActionView(StaffPage, View):
    """Cordon, uncordon or drain: the node's own method makes the change (a drain refused for
    want of another node says why), then the audit entry is written."""

    ACTIONS = {
        "cordon": (Node.cordon, "Cordoned {}: it gets no new instances."),
        "uncordon": (Node.uncordon, "Uncordoned {}."),
        "drain": (Node.drain, "Draining {}: its instances move to other nodes one at a time."),
    }

    def post(self, request: HttpRequest, pk: int, action: str) -> HttpResponse:
        node = get_object_or_404(Node, pk=pk)
        if action not in self.ACTIONS:
            raise Http404(f"Unknown action {action!r}.")
        method, note = self.ACTIONS[action]
        try:
            method(node)  # records its own audit entry
        except ValidationError as exc:
            messages.error(request, f"Not {action}ed: {' '.join(exc.messages)}")
        else:
            messages.success(request, note.format(node.name))
        return redirect("console:node-detail", pk=node.pk)


# ----------------------------------------------------------------------------- what-if plans


class FleetPlanListView(StaffPage, ListView[FleetPlan]):
    template_name = "console/fleetplan_list.html"

    def get_queryset(self) -> QuerySet[FleetPlan]:
        return FleetPlan.objects.for_user(self.request.user)

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["rows"] = [(p, fleetplans.plan_result(p)) for p in context["object_list"]]
        return context


class FleetPlanDetailView(StaffPage, DetailView[FleetPlan]):
    template_name = "console/fleetplan_detail.html"

    def get_queryset(self) -> QuerySet[FleetPlan]:
        return FleetPlan.objects.for_user(self.request.user)

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["result"] = fleetplans.plan_result(self.object)
        return context


class FleetPlanFormMixin(TemplateResponseMixin, ModelFormMixin[FleetPlan, FleetPlanForm]):
    template_name = "console/fleetplan_form.html"
    model = FleetPlan
    form_class = FleetPlanForm
    noun = "what-if plan"


class FleetPlanCreateView(FleetPlanFormMixin, ObjectCreateView[FleetPlan, FleetPlanForm]):
    def extra_fields(self) -> dict[str, Any]:
        return {"created_by": self.request.user}

    def cancel_url(self) -> str:
        return reverse("console:fleetplan-list")


class FleetPlanUpdateView(FleetPlanFormMixin, ObjectUpdateView[FleetPlan, FleetPlanForm]):
    def get_queryset(self) -> QuerySet[FleetPlan]:
        return FleetPlan.objects.for_user(self.request.user)
