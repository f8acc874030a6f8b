"""The admin console's pages (platform admins only): overview, tenants, models, adapters,
deployments with their plan and actions, instances and their logs, the audit log, dashboards.

Views are thin: they parse input, call one model method (or the placement service) and render;
the audit log records each change on its own (source "console"). Signing in lives here too;
tenant users land in the portal.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, TypeVar

import redis
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.core.exceptions import ValidationError
from django.db.models import Count, Model, Prefetch, Q, QuerySet
from django.forms import ModelForm
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render, resolve_url
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.views import View
from django.views.generic import CreateView, DetailView, ListView, TemplateView, UpdateView
from django.views.generic.base import TemplateResponseMixin
from django.views.generic.edit import ModelFormMixin

from audit_app.models import AuditLog
from serving_app import storage
from serving_app.deployments import sharing
from serving_app.engine import startup
from serving_app.fleet import plans as fleetplans
from serving_app.fleet import service
from serving_app.forms import (
    AuditFilterForm,
    BaseModelForm,
    DeploymentForm,
    FleetPlanForm,
    LoraAdapterForm,
    NodeCpuBindingForm,
    ScaleForm,
    TenantForm,
)
from serving_app.metering import figures, health, panels, queries
from serving_app.models import (
    Autoscaler,
    BaseModel,
    Deployment,
    FleetPlan,
    Gpu,
    Instance,
    LoraAdapter,
    Node,
)
from serving_app.models.autoscalers import MAX_REPLICAS
from serving_app.models.events import Event, Kind
from serving_app.placement.inventory import GIB
from tenants_app.models import Tenant
from ui_app.scoping import StaffPage

LOG_TAIL_BYTES = 64 * 1024

_M = TypeVar("_M", bound=Model)
_F = TypeVar("_F", bound=ModelForm[Any])


def is_htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true"


# ----------------------------------------------------------------------------- sign in


class LoginView(auth_views.LoginView):
    """One sign-in page: platform admins go to the console, tenant users to the portal."""

    template_name = "console/login.html"
    redirect_authenticated_user = True

    def get_default_redirect_url(self) -> str:
        if self.request.user.is_staff:
            return reverse("console:overview")
        return reverse("portal:home")


class LogoutView(auth_views.LogoutView):
    next_page = "console:login"  # a URL name: LogoutView resolves it


# ----------------------------------------------------------------------------- overview


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


def _deployments_with_instances() -> QuerySet[Deployment]:
    active = (Instance.objects.select_related("node", "revision").prefetch_related("gpus")
              .order_by("ordinal"))
    return (
        Deployment.objects.select_related("base_model")
        .prefetch_related("tenants", Prefetch("instances", queryset=active))
        .order_by("name")
    )


def _state_counts(deployment: Deployment) -> list[tuple[str, int]]:
    counts = Counter(i.state for i in deployment.instances.all())
    return sorted(counts.items())


class OverviewView(StaffPage, TemplateView):
    template_name = "console/overview.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        allocation = service.allocation()
        nodes = list(Node.objects.annotate(gpu_count=Count("gpus")).order_by("name"))
        gpus_by_node: dict[str, list[dict[str, Any]]] = {}
        for row in allocation:
            gpus_by_node.setdefault(row["node"], []).append(gpu_display(row))
        cpu_load = dict(
            Instance.objects.active().filter(node__isnull=False).order_by().values("node_id")
            .annotate(n=Count("id")).values_list("node_id", "n")
        )
        node_rows = [
            {"node": n, "gpus": gpus_by_node.get(n.name, []), "instances": cpu_load.get(n.pk, 0)}
            for n in nodes
        ]
        deployments = list(_deployments_with_instances())
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
                "gpus": len(allocation),
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
        deployments = [(d, _state_counts(d)) for d in _deployments_with_instances()]
        return render(request, "console/_overview_deployments.html",
                      {"deployments": deployments})


# ----------------------------------------------------------------------------- generic CRUD


class ObjectCreateView(StaffPage, CreateView[_M, _F]):
    template_name = "console/object_form.html"
    noun = ""

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context.update(noun=self.noun, cancel_url=self.cancel_url())
        return context

    def cancel_url(self) -> str:
        return reverse(f"console:{self.model._meta.model_name}-list")

    def extra_fields(self) -> dict[str, Any]:
        return {}

    def form_valid(self, form: _F) -> HttpResponse:
        for name, value in self.extra_fields().items():
            setattr(form.instance, name, value)
        self.object = form.save()
        messages.success(self.request, f"{self.noun.capitalize()} {self.object} created.")
        return redirect(self.get_success_url())


class ObjectUpdateView(StaffPage, UpdateView[_M, _F]):
    template_name = "console/object_form.html"
    noun = ""

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context.update(noun=self.noun, cancel_url=resolve_url(self.object))
        return context

    def form_valid(self, form: _F) -> HttpResponse:
        self.object = form.save()
        messages.success(self.request, f"{self.noun.capitalize()} {self.object} saved.")
        return redirect(self.get_success_url())


# ----------------------------------------------------------------------------- tenants


class TenantListView(StaffPage, ListView[Tenant]):
    template_name = "console/tenant_list.html"

    def get_queryset(self) -> QuerySet[Tenant]:
        return Tenant.objects.annotate(
            n_members=Count("memberships", distinct=True),
            n_deployments=Count("deployments", distinct=True),
        ).order_by("slug")

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["month"] = queries.month_used_tokens(Tenant.objects.for_user(self.request.user))
        return context


class TenantDetailView(StaffPage, DetailView[Tenant]):
    template_name = "console/tenant_detail.html"
    slug_field = "slug"
    queryset = Tenant.objects.all()

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        tenant = self.object
        scope = Tenant.objects.for_tenant(tenant)
        used = queries.month_used_tokens(scope).get(tenant.pk, 0)
        context.update(
            memberships=tenant.memberships.select_related("user").order_by("role"),
            keys=tenant.api_keys.all()[:20],
            adapters=tenant.adapters.select_related("base_model"),
            deployments=tenant.deployments.select_related("base_model"),
            month_tokens=used,
            budget_pct=round(100 * used / tenant.monthly_token_budget, 1)
            if tenant.monthly_token_budget else None,
            load=queries.current_load(scope).get(tenant.pk, {}),
            storage_used=LoraAdapter.objects.storage_used(tenant),
            storage_quota=storage.quota_bytes(tenant),
        )
        return context


class TenantCreateView(ObjectCreateView[Tenant, TenantForm]):
    model = Tenant
    form_class = TenantForm
    noun = "tenant"


class TenantUpdateView(ObjectUpdateView[Tenant, TenantForm]):
    model = Tenant
    form_class = TenantForm
    noun = "tenant"
    slug_field = "slug"


# ----------------------------------------------------------------------------- base models


class BaseModelListView(StaffPage, ListView[BaseModel]):
    template_name = "console/basemodel_list.html"

    def get_queryset(self) -> QuerySet[BaseModel]:
        return BaseModel.objects.annotate(
            n_adapters=Count("adapters", distinct=True),
            n_deployments=Count("deployments", distinct=True),
        )


class BaseModelDetailView(StaffPage, DetailView[BaseModel]):
    template_name = "console/basemodel_detail.html"
    queryset = BaseModel.objects.all()


class BaseModelCreateView(ObjectCreateView[BaseModel, BaseModelForm]):
    model = BaseModel
    form_class = BaseModelForm
    noun = "base model"


class BaseModelUpdateView(ObjectUpdateView[BaseModel, BaseModelForm]):
    model = BaseModel
    form_class = BaseModelForm
    noun = "base model"


# ----------------------------------------------------------------------------- adapters


class AdapterListView(StaffPage, ListView[LoraAdapter]):
    template_name = "console/adapter_list.html"

    def get_queryset(self) -> QuerySet[LoraAdapter]:
        return LoraAdapter.objects.select_related("tenant", "base_model").annotate(
            n_deployments=Count("deployments")
        )


class AdapterDetailView(StaffPage, DetailView[LoraAdapter]):
    template_name = "console/adapter_detail.html"
    queryset = LoraAdapter.objects.select_related("tenant", "base_model")


class AdapterCreateView(ObjectCreateView[LoraAdapter, LoraAdapterForm]):
    model = LoraAdapter
    form_class = LoraAdapterForm
    noun = "adapter"


class AdapterUpdateView(ObjectUpdateView[LoraAdapter, LoraAdapterForm]):
    model = LoraAdapter
    form_class = LoraAdapterForm
    noun = "adapter"


# ----------------------------------------------------------------------------- deployments


class DeploymentListView(StaffPage, ListView[Deployment]):
    template_name = "console/deployment_list.html"

    def get_queryset(self) -> QuerySet[Deployment]:
        return _deployments_with_instances()


class DeploymentDetailView(StaffPage, DetailView[Deployment]):
    template_name = "console/deployment_detail.html"

    def get_queryset(self) -> QuerySet[Deployment]:
        return _deployments_with_instances().prefetch_related("adapters__tenant")

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        maximum, reason = _scale_bound(self.object)
        context.update(
            scale_form=ScaleForm(initial={"replicas": self.object.replicas}, maximum=maximum),
            scale_max=maximum, scale_max_reason=reason,
            # A jump past this asks first (so does 0): more than doubling, by 4 or more.
            scale_jump=self.object.replicas + max(4, self.object.replicas),
        )
        context["instances"] = list(self.object.instances.all())
        context["deployment"] = self.object
        # Its tenants' settings on this engine, and how its GPUs are charged to them (24 h).
        trange = queries.get_range(queries.DEFAULT_RANGE)
        context["charges"] = service.deployment_charges(
            self.object, panels.accounting_period(trange))
        context["charges_range"] = trange
        try:
            context["flow"] = sharing.report(self.object)
        except redis.RedisError:
            context["flow"] = None
        context["autoscaler"] = Autoscaler.objects.filter(deployment=self.object).first()
        context["autoscale_changes"] = self.object.events.filter(
            kind=Kind.AUTOSCALE)[:10]
        return context


def _scale_bound(deployment: Deployment) -> tuple[int, str]:
    """The most replicas the scale action offers, and why: the top of the autoscaling range
    while the autoscaler is on (it would scale back down to it), else the model's limit."""
    autoscaler = Autoscaler.objects.filter(deployment=deployment, enabled=True).first()
    if autoscaler is not None:
        return autoscaler.max_replicas, "the autoscaling range's maximum"
    return MAX_REPLICAS, ""


class DeploymentFormMixin(TemplateResponseMixin, ModelFormMixin[Deployment, DeploymentForm]):
    request: HttpRequest
    template_name = "console/deployment_form.html"
    model = Deployment
    form_class = DeploymentForm
    noun = "deployment"

    def get_form(self, form_class: type[DeploymentForm] | None = None) -> DeploymentForm:
        form = super().get_form(form_class)
        form.editor = self.request.user
        return form


class DeploymentCreateView(DeploymentFormMixin, ObjectCreateView[Deployment, DeploymentForm]):
    def extra_fields(self) -> dict[str, Any]:
        return {"created_by": self.request.user}

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["plan_url"] = reverse("console:deployment-plan-new")
        return context


class DeploymentUpdateView(DeploymentFormMixin, ObjectUpdateView[Deployment, DeploymentForm]):
    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["plan_url"] = reverse("console:deployment-plan-edit", args=[self.object.pk])
        context["cancel_url"] = reverse("console:deployment-detail", args=[self.object.pk])
        return context


class DeploymentPlanView(StaffPage, View):
    """The memory plan and placement of the form's (unsaved) values: `dry_run`, nothing saved."""

    def post(self, request: HttpRequest, pk: int | None = None) -> HttpResponse:
        instance = get_object_or_404(Deployment, pk=pk) if pk else None
        form = DeploymentForm(request.POST, instance=instance)
        context: dict[str, Any] = {"plan": None, **_form_problems(form)}
        if form.is_valid():
            tenants, adapters = form.relations()
            context["plan"] = _plan_view(
                service.dry_run(form.instance, tenants=tenants, adapters=adapters)
            )
        return render(request, "console/_plan.html", context)

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(Deployment.objects.select_related("base_model"), pk=pk)
        return render(request, "console/_plan.html",
                      {"plan": _plan_view(service.dry_run(deployment)), "saved": True})


def _form_problems(form: DeploymentForm) -> dict[str, Any]:
    """What keeps the plan from being computed: `missing`, the labels of required fields still
    empty (not an error: a new form starts so, and the preview posts it at once), and `errors`,
    (label, message) of values given but refused."""
    missing: list[str] = []
    errors: list[tuple[str, str]] = []
    for name, problems in form.errors.as_data().items():
        label = str(form.fields[name].label) if name in form.fields else ""
        for problem in problems:
            if problem.code == "required":
                missing.append(label)
            else:
                errors.extend((label, message) for message in problem.messages)
    return {"missing": missing, "errors": errors}


def _plan_view(plan: dict[str, Any]) -> dict[str, Any]:
    """Add GiB figures to a dry run for the template."""
    memory = plan.get("memory")
    if memory:
        plan["memory_rows"] = [
            (label, memory[key] / GIB)
            for label, key in (
                ("Weights (per GPU)", "weight_bytes"),
                ("KV cache", "kv_cache_bytes"),
                ("LoRA slots", "lora_bytes"),
                ("Activations", "activation_bytes"),
                ("Runtime overhead", "runtime_overhead_bytes"),
            )
        ]
    for placement in plan.get("placements", []):
        reserved = placement.get("reserved_bytes_per_gpu")
        placement["reserved_gib"] = reserved / GIB if reserved else None
    return plan


class DeploymentActionView(StaffPage, View):
    """Start, stop or restart: the deployment's own method records it and asks the reconciler."""

    ACTIONS = {
        "start": (Deployment.start, "Starting"),
        "stop": (Deployment.stop, "Stopping"),
        "restart": (Deployment.restart, "Restarting"),
    }

    def post(self, request: HttpRequest, pk: int, action: str) -> HttpResponse:
        deployment = get_object_or_404(Deployment, pk=pk)
        if action not in self.ACTIONS:
            raise Http404(f"Unknown action {action!r}.")
        method, note = self.ACTIONS[action]
        method(deployment)
        return _after_action(request, deployment, f"{note} {deployment.name}.")


class DeploymentScaleView(StaffPage, View):
    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(Deployment, pk=pk)
        form = ScaleForm(request.POST, maximum=_scale_bound(deployment)[0])
        if not form.is_valid():
            error = "; ".join(str(e) for errs in form.errors.values() for e in errs)
            return _after_action(request, deployment, f"Not scaled: {error}", level="error")
        try:
            deployment.scale_to(form.cleaned_data["replicas"])
        except ValidationError as exc:
            return _after_action(request, deployment, f"Not scaled: {exc.messages[0]}",
                                 level="error")
        return _after_action(request, deployment,
                             f"Scaling {deployment.name} to {deployment.replicas}.")


def _after_action(
    request: HttpRequest, deployment: Deployment, note: str, level: str = "success"
) -> HttpResponse:
    if is_htmx(request):
        deployment = _deployments_with_instances().get(pk=deployment.pk)
        return render(request, "console/_instances.html", {
            "deployment": deployment, "instances": list(deployment.instances.all()),
            "note": note, "level": level,
        })
    getattr(messages, level)(request, note)
    return redirect("console:deployment-detail", pk=deployment.pk)


class DeploymentInstancesPartial(StaffPage, View):
    """The instance-state panel, polled by the deployment page while anything moves."""

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(_deployments_with_instances(), pk=pk)
        return render(request, "console/_instances.html",
                      {"deployment": deployment, "instances": list(deployment.instances.all())})


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


# ----------------------------------------------------------------------------- instances


def log_tail(instance: Instance, limit: int = LOG_TAIL_BYTES) -> str:
    """The engine's log: the file's last bytes when this host can read it, else the tail the
    node agent stored on the row."""
    if instance.log_path:
        path = Path(instance.log_path)
        try:
            with path.open("rb") as handle:
                handle.seek(0, 2)
                size = handle.tell()
                handle.seek(max(size - limit, 0))
                data = handle.read().decode("utf-8", "replace")
            if size > limit:
                data = data.split("\n", 1)[-1]
            return data
        except OSError:
            pass
    return instance.log_tail


def _startup_end(instance: Instance) -> float | None:
    """Seconds from launch to readiness, or to now while the engine starts; None otherwise."""
    if instance.started_at is None:
        return None
    if instance.ready_at is not None and instance.ready_at >= instance.started_at:
        return (instance.ready_at - instance.started_at).total_seconds()
    if instance.state == Instance.State.STARTING:
        return (timezone.now() - instance.started_at).total_seconds()
    return None


def startup_context(instance: Instance) -> dict[str, Any]:
    return {"object": instance,
            "startup_steps": startup.steps(instance.startup, _startup_end(instance))}


class InstanceDetailView(StaffPage, DetailView[Instance]):
    template_name = "console/instance_detail.html"
    queryset = Instance.objects.select_related("deployment", "node").prefetch_related("gpus")

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        instance = self.object
        context.update(command=instance.command_line, log=log_tail(instance),
                       **startup_context(instance))
        return context


class InstanceStartupPartial(StaffPage, View):
    """The start-up panel alone, polled by the instance page while the engine starts."""

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        instance = get_object_or_404(Instance, pk=pk)
        return render(request, "console/_startup.html", startup_context(instance))


class InstanceLogPartial(StaffPage, View):
    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        instance = get_object_or_404(Instance, pk=pk)
        return render(request, "console/_log.html",
                      {"instance": instance, "log": log_tail(instance)})


# ----------------------------------------------------------------------------- audit log


class AuditLogView(StaffPage, ListView[AuditLog]):
    template_name = "console/audit_log.html"
    paginate_by = 50

    def get_queryset(self) -> QuerySet[AuditLog]:
        qs = AuditLog.objects.for_user(self.request.user).select_related("tenant")
        self.filter_form = AuditFilterForm(self.request.GET or None)
        if self.filter_form.is_valid():
            data = self.filter_form.cleaned_data
            if data["action"]:
                qs = qs.filter(action=data["action"])
            if data["object_type"]:
                qs = qs.filter(object_type__icontains=data["object_type"])
            if data["actor"]:
                qs = qs.filter(actor_label=data["actor"])
            if data["tenant"]:
                qs = qs.filter(tenant=data["tenant"])
        return qs

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["filter_form"] = self.filter_form
        query = self.request.GET.copy()
        query.pop("page", None)
        context["query"] = query.urlencode()
        return context


# ----------------------------------------------------------------------------- dashboards

DASHBOARDS = {
    "usage": ("Usage", "console/_usage_tables.html"),
    "latency": ("Latency", "console/_latency_tables.html"),
    "gpus": ("GPU allocation", "console/_gpu_tables.html"),
}


def dashboard_payload(
    request: HttpRequest, name: str, tenants: QuerySet[Tenant], *, portal: bool = False
) -> HttpResponse:
    """The JSON a dashboard page polls: plotly figures plus its tables as HTML, for `tenants`
    (an already-scoped queryset: everyone for the console, the one tenant for its portal)."""
    trange = queries.get_range(request.GET.get("range"), tenants)
    if name == "usage":
        panel = panels.usage_panel(trange, tenants)
    elif name == "latency":
        panel = panels.latency_panel(trange, tenants, selected_model(request, tenants),
                                     portal=portal)
    else:
        panel = panels.gpu_panel(trange, selected_plan(request))
    tables = render_to_string(DASHBOARDS[name][1], {**panel, "range": trange, "portal": portal},
                              request=request)
    body = figures.to_json({"figures": panel["figures"], "tables": tables,
                            "range": trange.key})
    return HttpResponse(body, content_type="application/json")


def selected_model(request: HttpRequest, tenants: QuerySet[Tenant]) -> str | None:
    """`?model=`, when it is one of the filter's entries (`queries.model_names`); else all."""
    model = request.GET.get("model") or None
    return model if model in queries.model_names(tenants) else None


def dashboard_context(
    request: HttpRequest, name: str, tenants: QuerySet[Tenant], data_url: str
) -> dict[str, Any]:
    """What a dashboard page shows around its charts, the console's and the portal's: the
    ranges (none asked for: the smallest holding the latest usage), the model filter (latency),
    the charts; the GPU page without GPUs draws none and says why."""
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
    }


class DashboardView(StaffPage, TemplateView):
    template_name = "console/dashboard.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        name = self.kwargs["name"]
        context.update(
            title=DASHBOARDS[name][0],
            **dashboard_context(self.request, name, Tenant.objects.for_user(self.request.user),
                                reverse("console:dashboard-data", args=[name])),
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
        return dashboard_payload(request, name, Tenant.objects.for_user(request.user))


# ----------------------------------------------------------------------------- probes


def healthz(request: HttpRequest) -> HttpResponse:
    """Liveness: the process answers. Depends on nothing else, so a PostgreSQL or Redis outage
    does not get healthy console processes restarted."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> HttpResponse:
    """Readiness: PostgreSQL and Redis reachable, the usage writer within its lag (503 with the
    failing checks otherwise)."""
    report = health.report()
    return JsonResponse(report.as_dict(), status=200 if report.healthy else 503)
