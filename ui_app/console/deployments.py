"""The console's deployment pages: the list, a deployment with its instances, scaling and
charges, its capacity curve (ui_app/console/capacity.py), the form with its memory plan and
placement (a dry run), start, stop, restart and scale; an instance with its command line,
start-up steps and log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import F, Prefetch, QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views import View
from django.views.generic import DetailView, ListView
from django.views.generic.base import TemplateResponseMixin
from django.views.generic.edit import ModelFormMixin

from serving_app.deployments import sharing
from serving_app.engine import startup
from serving_app.enginespec import AUTO_URGENT_BATCH_CAP, MAX_REPLICAS
from serving_app.fleet.report import deployment_charges, dry_run
from serving_app.forms import DeploymentForm
from serving_app.metering import panels, queries
from serving_app.models import Autoscaler, BaseModel, Deployment, Instance, LoraAdapter
from serving_app.models.events import Kind
from serving_app.placement.inventory import GIB
from ui_app.console.base import ObjectCreateView, ObjectUpdateView, is_htmx
from ui_app.console.capacity import capacity_context
from ui_app.console.forms import AttachAdapterForm, CapacityTestForm, ScaleForm
from ui_app.scoping import StaffPage

LOG_TAIL_BYTES = 64 * 1024


def deployments_with_instances() -> QuerySet[Deployment]:
    """Deployments by name with their base model, tenants and instances (node, revision,
    GPUs)."""
    active = (Instance.objects.select_related("node", "revision").prefetch_related("gpus")
              .order_by("ordinal"))
    return (
        Deployment.objects.select_related("base_model")
        .prefetch_related("tenants", Prefetch("instances", queryset=active))
        .order_by("name")
    )


# ----------------------------------------------------------------------------- deployments


class DeploymentListView(StaffPage, ListView[Deployment]):
    template_name = "console/deployment_list.html"

    def get_queryset(self) -> QuerySet[Deployment]:
        return deployments_with_instances()


class DeploymentDetailView(StaffPage, DetailView[Deployment]):
    template_name = "console/deployment_detail.html"
    capacity_form: CapacityTestForm | None = None  # a refused one, with its errors

    def get_queryset(self) -> QuerySet[Deployment]:
        return deployments_with_instances().prefetch_related("adapters__tenant")

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
        context["auto_urgent_batch_cap"] = AUTO_URGENT_BATCH_CAP
        # Its tenants' settings on this engine, and how its GPUs are charged to them (24 h).
        trange = queries.get_range(queries.DEFAULT_RANGE)
        context["charges"] = deployment_charges(
            self.object, panels.accounting_period(trange))
        context["charges_range"] = trange
        try:
            context["flow"] = sharing.report(self.object)
        except redis.RedisError:
            context["flow"] = None
        context["attach_form"] = AttachAdapterForm(choices=attachable_adapters(self.object))
        context["autoscaler"] = Autoscaler.objects.filter(deployment=self.object).first()
        context["autoscale_changes"] = self.object.events.filter(
            kind=Kind.AUTOSCALE)[:10]
        context.update(capacity_context(self.object, self.capacity_form))
        return context


def attachable_adapters(deployment: Deployment) -> QuerySet[LoraAdapter]:
    """Adapters the deployment could serve and does not: its tenants', for its base model."""
    return (LoraAdapter.objects.filter(tenant__in=deployment.tenants.all(),
                                       base_model_id=deployment.base_model_id)
            .exclude(deployments=deployment).select_related("tenant")
            .order_by(F("serving_requested_at").desc(nulls_last=True), "tenant__slug", "name"))


class DeploymentAttachAdapterView(StaffPage, View):
    """Serve one more adapter (`Deployment.attach_adapter()`): loaded without a restart."""

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(Deployment, pk=pk)
        form = AttachAdapterForm(request.POST, choices=attachable_adapters(deployment))
        if not form.is_valid():
            messages.error(request, "Not attached: " + " ".join(
                str(e) for errors in form.errors.values() for e in errors))
            return redirect("console:deployment-detail", pk=pk)
        adapter = form.cleaned_data["adapter"]
        try:
            deployment.attach_adapter(adapter)
        except ValidationError as exc:
            messages.error(request, "Not attached: " + " ".join(exc.messages))
        else:
            messages.success(request, f"{deployment.name} serves {adapter} now: its engines load "
                                      "it at the next reconcile round, without a restart.")
        return redirect("console:deployment-detail", pk=pk)


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

    def get_initial(self) -> dict[str, Any]:
        """`?base_model=<id>`: the model page's "Deploy it" link chose the model."""
        initial = super().get_initial()
        chosen = self.request.GET.get("base_model", "")
        if chosen.isdigit() and BaseModel.objects.filter(pk=chosen).exists():
            initial["base_model"] = int(chosen)
        return initial

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
                dry_run(form.instance, tenants=tenants, adapters=adapters)
            )
        return render(request, "console/_plan.html", context)

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(Deployment.objects.select_related("base_model"), pk=pk)
        return render(request, "console/_plan.html",
                      {"plan": _plan_view(dry_run(deployment)), "saved": True})


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
        deployment = deployments_with_instances().get(pk=deployment.pk)
        return render(request, "console/_instances.html", {
            "deployment": deployment, "instances": list(deployment.instances.all()),
            "note": note, "level": level,
        })
    getattr(messages, level)(request, note)
    return redirect("console:deployment-detail", pk=deployment.pk)


class DeploymentInstancesPartial(StaffPage, View):
    """The instance-state panel, polled by the deployment page while anything moves."""

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(deployments_with_instances(), pk=pk)
        return render(request, "console/_instances.html",
                      {"deployment": deployment, "instances": list(deployment.instances.all())})


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
