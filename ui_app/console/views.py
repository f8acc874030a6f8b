"""The admin console's pages (platform admins only) that need no module of their own: signing
in (tenant users land in the portal), tenants, base models, adapters, the audit log, and the
probes. The other pages each have a module by area: `overview`, `deployments` (and their
instances), `nodes` (and what-if plans), `dashboards`, `fleet` (revisions, rollouts, events),
`autoscaling`, `artifacts`, `joins`, `guardrails`, `metrics`; `base` holds what they share.

Views are thin: they parse input, call one model method (or the placement service) and render;
the audit log records each change on its own (source "console").
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.db.models import Count, Model, ProtectedError, QuerySet, RestrictedError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views import View
from django.views.generic import DetailView, ListView

from audit_app.models import AuditLog
from serving_app import storage
from serving_app.artifacts import removal
from serving_app.metering import health, queries
from serving_app.models import BaseModel, Deployment, LoraAdapter
from tenants_app.models import Tenant
from ui_app.console.base import ObjectCreateView, ObjectUpdateView
from ui_app.console.capacity import objective_costs_context
from ui_app.console.forms import AuditFilterForm, BaseModelForm, LoraAdapterForm, TenantForm
from ui_app.scoping import StaffPage

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
    """The tenant's form, with what its objectives cost on each deployment it uses: for the
    saved values, and as new ones are typed (ui_app/console/capacity.py)."""

    model = Tenant
    form_class = TenantForm
    noun = "tenant"
    slug_field = "slug"
    template_name = "console/tenant_form.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        typed = self.request.POST if self.request.method == "POST" else None
        context.update(objective_costs_context(self.object, typed))
        return context


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

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        """Where it could be attached: its tenant's deployments of its base model that do not
        serve it yet (each page has the Attach form)."""
        context = super().get_context_data(**kwargs)
        context["attachable_to"] = Deployment.objects.for_tenant(self.object.tenant).filter(
            base_model_id=self.object.base_model_id).exclude(adapters=self.object).distinct()
        return context


class AdapterCreateView(ObjectCreateView[LoraAdapter, LoraAdapterForm]):
    model = LoraAdapter
    form_class = LoraAdapterForm
    noun = "adapter"


class AdapterUpdateView(ObjectUpdateView[LoraAdapter, LoraAdapterForm]):
    model = LoraAdapter
    form_class = LoraAdapterForm
    noun = "adapter"


# ----------------------------------------------------------------------------- deleting


class DeleteObjectView(StaffPage, View):
    """Delete a base model or an adapter after a confirmation page that names what depends on
    it (a GET, or a POST without `confirm=delete`: it works without JavaScript). `dependents()`
    gives, per kind, the objects that must go first (`blocking`: the database protects the
    object while they exist, and the page offers no Delete) or that change with it."""

    model: type[Model]
    noun = ""
    list_url = ""
    consequence = ""

    def dependents(self, obj: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def page(self, obj: Any, status: int = 200) -> HttpResponse:
        dependents = self.dependents(obj)
        return render(self.request, "console/confirm_delete.html", {
            "object": obj, "label": getattr(obj, "name", str(obj)),
            "back_url": obj.get_absolute_url(), "noun": self.noun, "dependents": dependents,
            "blocked": any(d["blocking"] and d["objects"] for d in dependents),
            "affected": any(d["objects"] for d in dependents),
            "consequence": self.consequence, "note": self.note(obj)}, status=status)

    def note(self, obj: Any) -> str:
        """What else deleting it does, said whatever depends on it."""
        return ""

    def target(self, **kwargs: Any) -> Any:
        return get_object_or_404(self.model, pk=kwargs["pk"])

    def remove(self, obj: Any) -> None:
        obj.delete()

    def get(self, request: HttpRequest, **kwargs: Any) -> HttpResponse:
        return self.page(self.target(**kwargs))

    def post(self, request: HttpRequest, **kwargs: Any) -> HttpResponse:
        obj = self.target(**kwargs)
        if request.POST.get("confirm") != "delete":
            return self.page(obj)
        try:
            self.remove(obj)
        except (ProtectedError, RestrictedError, removal.InUse):
            return self.page(obj, status=409)  # what the page named, or what came since
        messages.success(request, f"{self.noun.capitalize()} {obj} deleted.")
        return redirect(self.after_url(obj))

    def after_url(self, obj: Any) -> str:
        return reverse(self.list_url)


def _named(objects: QuerySet[Any]) -> list[Any]:
    return list(objects.order_by("name"))


class BaseModelDeleteView(DeleteObjectView):
    model = BaseModel
    noun = "base model"
    list_url = "console:basemodel-list"

    def dependents(self, obj: Any) -> list[dict[str, Any]]:
        return [
            {"kind": "deployments", "label": "Deployments that run it", "blocking": True,
             "objects": _named(obj.deployments),
             "advice": "delete them, or point them at another model, first."},
            {"kind": "adapters", "label": "Adapters trained for it", "blocking": True,
             "objects": _named(obj.adapters.select_related("tenant")),
             "advice": "delete them first."},
        ]


class AdapterDeleteView(DeleteObjectView):
    model = LoraAdapter
    noun = "adapter"
    list_url = "console:loraadapter-list"
    consequence = ("Deleting it stops these deployments offering it at once: the tenant's "
                   "requests naming it are answered 404 (model_not_found). Their engines unload "
                   "it at the next reconcile round; its files are removed once no engine has "
                   "it loaded.")

    def dependents(self, obj: Any) -> list[dict[str, Any]]:
        return [{"kind": "deployments", "label": "Deployments that serve it", "blocking": False,
                 "objects": _named(obj.deployments), "advice": ""}]


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
