"""The tenant portal (`/portal/`): one tenant's own view for its users.

Every page under `/portal/<slug>/` finds the tenant through `Tenant.objects.for_user()`, so
another tenant's pages answer 404; changes need the owner or admin role (403 otherwise), and an
owner is made, demoted or removed only by an owner, as in the management API. The audit log
records each change on its own (source "portal").
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import redis
from django.contrib import messages
from django.contrib.auth.mixins import AccessMixin
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse, reverse_lazy
from django.utils import timezone
from django.views import View
from django.views.generic import TemplateView

from serving_app import storage
from serving_app.catalog import engine_shares, served_models
from serving_app.dashboards import queries
from serving_app.models import Deployment, Instance, LoraAdapter
from serving_app.redaction import is_platform_admin, redact_paths
from serving_app.views import CHARTS, dashboard_payload
from tenants_app.forms import (
    AdapterPathForm,
    AdapterUploadForm,
    ApiKeyForm,
    InviteForm,
    MemberRoleForm,
)
from tenants_app.models import MANAGER_ROLES, ApiKey, Invitation, Membership, Role, Tenant

PLAYGROUND_KEY_LIFETIME = timedelta(hours=1)


class PortalAccessMixin(AccessMixin):
    login_url = reverse_lazy("console:login")

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        return super().dispatch(request, *args, **kwargs)


class PortalHomeView(PortalAccessMixin, TemplateView):
    """Pick a tenant (a user in one tenant with no open invitation goes straight to it), and
    answer the invitations addressed to you."""

    template_name = "tenants_app/pick.html"

    def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        tenants = list(Tenant.objects.for_user(request.user).order_by("name"))
        invitations = list(Invitation.objects.addressed_to(request.user)
                           .select_related("tenant", "invited_by").order_by("-created_at"))
        if len(tenants) == 1 and not invitations:
            return redirect("portal:tenant-home", slug=tenants[0].slug)
        roles = dict(request.user.memberships.values_list("tenant_id", "role"))
        return render(request, self.template_name,
                      {"choices": [(t, roles.get(t.pk, "platform")) for t in tenants],
                       "invitations": invitations})


class InvitationAnswerView(PortalAccessMixin, View):
    """Accept or decline an invitation addressed to you (anyone else's is a 404)."""

    def post(self, request: HttpRequest, pk: int, answer: str) -> HttpResponse:
        invitation = get_object_or_404(
            Invitation.objects.addressed_to(request.user).select_related("tenant"), pk=pk
        )
        if answer == "decline":
            invitation.decline(request.user)
            messages.success(request, f"Invitation to {invitation.tenant.name} declined.")
            return redirect("portal:home")
        try:
            membership = invitation.accept(request.user)
        except ValidationError as exc:
            messages.error(request, exc.messages[0])
            return redirect("portal:home")
        messages.success(request, f"You joined {invitation.tenant.name} as {membership.role}.")
        return redirect("portal:tenant-home", slug=invitation.tenant.slug)


class TenantMixin(PortalAccessMixin):
    """Resolves `slug` among the user's tenants (404 for any other) and the user's role."""

    section = ""

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        self.tenant = get_object_or_404(Tenant.objects.for_user(request.user), slug=kwargs["slug"])
        self.role = self.tenant.role_of(request.user)
        return super().dispatch(request, *args, **kwargs)

    @property
    def scope(self) -> QuerySet[Tenant]:
        """This page's tenant as the scope of usage queries: the one tenant, as the user sees
        it (a dashboard never reads "every tenant" here)."""
        return Tenant.objects.for_user(self.request.user).for_tenant(self.tenant)

    @property
    def can_manage(self) -> bool:
        return self.role in ("platform", *MANAGER_ROLES)

    def require_manager(self) -> None:
        if not self.can_manage:
            raise PermissionDenied("Your role in this tenant does not allow this change.")

    def portal_context(self, **extra: Any) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "role": self.role,
            "can_manage": self.can_manage,
            "section": self.section,
            "other_tenants": Tenant.objects.for_user(self.request.user).exclude(pk=self.tenant.pk)
            .count(),
            **extra,
        }

    def render(self, template: str, status: int = 200, **extra: Any) -> HttpResponse:
        return render(self.request, template, self.portal_context(**extra), status=status)


def catalog(tenant: Tenant) -> list[dict[str, Any]]:
    """The public model names a tenant may call (`serving_app.catalog`, the gateway's rule), with
    how many ready instances serve each."""
    served = [s for s in served_models(Deployment.objects.for_tenant(tenant))
              if s.tenant_id == tenant.pk]
    ready = {
        row["deployment_id"]: row["n"]
        for row in Instance.objects.filter(
            deployment__in={s.deployment.pk for s in served}, state=Instance.State.READY)
        .order_by().values("deployment_id").annotate(n=Count("id"))
    }
    names: dict[str, dict[str, Any]] = {}
    for s in served:
        entry = names.setdefault(s.public_name, {
            "name": s.public_name, "kind": "adapter" if s.adapter else "base model",
            "parent": s.parent, "running": True, "ready": 0,
            "context": s.deployment.effective_max_model_len,
        })
        entry["ready"] += ready.get(s.deployment.pk, 0)
    return sorted(names.values(), key=lambda e: (e["kind"] != "base model", e["name"]))


def storage_usage(tenant: Tenant) -> dict[str, Any]:
    """What the tenant's adapters take on disk against its storage quota."""
    used = LoraAdapter.objects.storage_used(tenant)
    quota = storage.quota_bytes(tenant)
    pct = round(100 * used / quota, 1) if quota else 100.0
    return {"used": used, "quota": quota, "pct": pct, "bar": min(pct, 100),
            "left": max(quota - used, 0)}


class TenantHomeView(TenantMixin, View):
    section = "home"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        tenant = self.tenant
        used = queries.month_used_tokens(self.scope).get(tenant.pk, 0)
        budget = tenant.monthly_token_budget
        pct = round(100 * used / budget, 1) if budget else None
        day = queries.usage_totals(queries.RANGES["24h"], self.scope)
        return self.render(
            "tenants_app/home.html",
            month_tokens=used,
            budget_pct=pct,
            budget_bar=min(pct, 100) if pct is not None else None,
            remaining=max(budget - used, 0) if budget else None,
            day=day[0] if day else None,
            load=queries.current_load(self.scope).get(tenant.pk, {}),
            models=catalog(tenant),
            keys=ApiKey.objects.for_tenant(tenant).filter(revoked_at__isnull=True).count(),
            storage=storage_usage(tenant),
        )


# ----------------------------------------------------------------------------- dashboards

PORTAL_DASHBOARDS = {"usage": "Usage", "latency": "Latency"}


class TenantDashboardView(TenantMixin, View):
    def get(self, request: HttpRequest, slug: str, name: str) -> HttpResponse:
        self.section = name
        trange = queries.get_range(request.GET.get("range"))
        return self.render(
            "tenants_app/dashboard.html",
            name=name,
            title=PORTAL_DASHBOARDS[name],
            ranges=queries.RANGES.values(),
            range=trange,
            data_url=reverse("portal:dashboard-data", args=[slug, name]),
            models=queries.models_in_range(trange, self.scope) if name == "latency" else [],
            model=request.GET.get("model", ""),
            charts=CHARTS[name],
        )


class TenantDashboardDataView(TenantMixin, View):
    def get(self, request: HttpRequest, slug: str, name: str) -> HttpResponse:
        return dashboard_payload(request, name, self.scope, portal=True)


# ----------------------------------------------------------------------------- API keys


class ApiKeysView(TenantMixin, View):
    """List keys; create one (its secret is in this one response only); revoke."""

    section = "keys"

    def keys_page(self, form: ApiKeyForm, status: int = 200, **extra: Any) -> HttpResponse:
        keys = ApiKey.objects.for_tenant(self.tenant).select_related("created_by")
        return self.render("tenants_app/keys.html", status=status, form=form, keys=keys, **extra)

    def model_names(self) -> list[str]:
        return [entry["name"] for entry in catalog(self.tenant)]

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.keys_page(ApiKeyForm(model_names=self.model_names()))

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        form = ApiKeyForm(request.POST, model_names=self.model_names())
        if not form.is_valid():
            return self.keys_page(form, status=400)
        try:
            key, secret = ApiKey.objects.create_key(
                tenant=self.tenant, created_by=request.user, **form.key_fields()
            )
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                for error in errors:
                    form.add_error(field if field in form.fields else None, error)
            return self.keys_page(form, status=400)
        # Rendered, not redirected: the secret must not travel through the session.
        response = self.keys_page(ApiKeyForm(model_names=self.model_names()), new_key=key,
                                  secret=secret)
        response["Cache-Control"] = "no-store"
        return response


class ApiKeyRevokeView(TenantMixin, View):
    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        key = get_object_or_404(ApiKey.objects.for_tenant(self.tenant), pk=pk)
        if key.revoke():
            messages.success(request, f"Key {key.name} revoked.")
        return redirect("portal:keys", slug=slug)


# ----------------------------------------------------------------------------- adapters


class AdaptersView(TenantMixin, View):
    section = "adapters"

    def page(self, status: int = 200, **forms: Any) -> HttpResponse:
        adapters = list(LoraAdapter.objects.for_tenant(self.tenant).select_related("base_model")
                        .prefetch_related("deployments"))
        staff = is_platform_admin(self.request.user)
        for adapter in adapters:
            # An engine's load error may name host paths; tenant users get them redacted.
            adapter.shown_error = adapter.last_error if staff else redact_paths(adapter.last_error)
        # Tenants never name host paths: registering a folder on the hosts is for platform
        # admins (who see the portal as every tenant does).
        if staff:
            forms.setdefault("path_form", AdapterPathForm(tenant=self.tenant))
        forms.setdefault("upload_form", AdapterUploadForm(tenant=self.tenant))
        return self.render("tenants_app/adapters.html", status=status, adapters=adapters,
                           storage=storage_usage(self.tenant), **forms)

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.page()

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        if request.POST.get("source") == "upload":
            form = AdapterUploadForm(request.POST, request.FILES, tenant=self.tenant,
                                     user=request.user)
            if not form.is_valid():
                return self.page(status=400, upload_form=form)
            try:
                adapter = form.save()
            except ValidationError:
                return self.page(status=400, upload_form=form)
        else:
            if not request.user.is_staff:
                raise PermissionDenied("Only platform admins register adapters from a path; "
                                       "upload the adapter's files instead.")
            form = AdapterPathForm(request.POST, tenant=self.tenant)
            if not form.is_valid():
                return self.page(status=400, path_form=form)
            adapter = form.save()
        messages.success(request, f"Adapter {adapter.name} registered (rank {adapter.rank}, "
                                  f"{', '.join(adapter.target_modules)}).")
        return redirect("portal:adapters", slug=slug)


class AdapterDeleteView(TenantMixin, View):
    """Delete one of the tenant's adapters. Its deployments stop offering it at once; the
    engines unload it at the next reconcile round, and its uploaded files go after that
    (`AdapterFileRemoval`)."""

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        adapter = get_object_or_404(LoraAdapter.objects.for_tenant(self.tenant), pk=pk)
        adapter.delete()
        messages.success(request, f"Adapter {adapter.name} deleted; its files are removed once "
                                  "no engine has it loaded.")
        return redirect("portal:adapters", slug=slug)


# ----------------------------------------------------------------------------- models


class ModelsView(TenantMixin, View):
    section = "models"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        models = catalog(self.tenant)
        try:
            shares = engine_shares(self.tenant.pk)
        except redis.RedisError:
            shares = None
        return self.render("tenants_app/models.html", models=models, shares=shares,
                           base_url=request.build_absolute_uri("/v1"),
                           example=models[0]["name"] if models else "MODEL")


# ----------------------------------------------------------------------------- playground


class PlaygroundView(TenantMixin, View):
    section = "playground"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.render("tenants_app/playground.html", models=catalog(self.tenant),
                           lifetime_minutes=int(PLAYGROUND_KEY_LIFETIME.total_seconds() // 60))


class PlaygroundKeyView(TenantMixin, View):
    """A short-lived key for the playground (owners and admins), returned once as JSON."""

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        now = timezone.now()
        key, secret = ApiKey.objects.create_key(
            tenant=self.tenant,
            name=f"playground {request.user.get_username()} {now:%Y-%m-%d %H:%M:%S.%f}"[:100],
            expires_at=now + PLAYGROUND_KEY_LIFETIME,
            created_by=request.user,
        )
        response = JsonResponse({"secret": secret, "prefix": key.prefix,
                                 "expires_at": key.expires_at.isoformat()})
        response["Cache-Control"] = "no-store"
        return response


# ----------------------------------------------------------------------------- members


class MembersView(TenantMixin, View):
    """The tenant's members and invitations. Owners and admins invite by username or email; the
    page answers the same whether or not that user exists."""

    section = "members"

    def page(self, form: InviteForm | None = None, status: int = 200) -> HttpResponse:
        memberships = Membership.objects.for_tenant(self.tenant).select_related("user") \
            .order_by("user__username")
        invitations = Invitation.objects.for_tenant(self.tenant).select_related("invited_by") \
            .order_by("-created_at")[:50]
        return self.render("tenants_app/members.html", status=status, memberships=memberships,
                           invitations=invitations, form=form or InviteForm(), roles=Role.choices,
                           is_owner=self.role in ("platform", Role.OWNER))

    def check_owner_grant(self, role: str | None) -> None:
        Membership.objects.check_owner_grant(self.request.user, self.tenant, role)

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.page()

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        form = InviteForm(request.POST)
        if not form.is_valid():
            return self.page(form, status=400)
        self.check_owner_grant(form.cleaned_data["role"])
        try:
            invitation = Invitation.objects.invite(
                tenant=self.tenant, invited_as=form.cleaned_data["invited_as"],
                role=form.cleaned_data["role"], invited_by=request.user,
            )
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                for error in errors:
                    form.add_error(field if field in form.fields else None, error)
            return self.page(form, status=400)
        messages.success(request, f"Invitation for {invitation.invited_as} created; it is open "
                                  f"until {invitation.expires_at:%Y-%m-%d %H:%M} UTC.")
        return redirect("portal:members", slug=slug)


class InvitationRevokeView(MembersView):
    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        invitation = get_object_or_404(Invitation.objects.for_tenant(self.tenant), pk=pk)
        self.check_owner_grant(invitation.role)
        if invitation.revoke():
            messages.success(request, f"Invitation for {invitation.invited_as} revoked.")
        return redirect("portal:members", slug=slug)


class MemberChangeView(MembersView):
    """Change a member's role, or remove them (`action=remove`)."""

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        membership = get_object_or_404(Membership.objects.for_tenant(self.tenant), pk=pk)
        Membership.objects.check_change(request.user, membership)
        if request.POST.get("action") == "remove":
            try:
                membership.remove(by=request.user)
            except ValidationError as exc:
                messages.error(request, exc.messages[0])
                return redirect("portal:members", slug=slug)
            messages.success(request, f"{membership.user.username} removed.")
            return redirect("portal:members", slug=slug)
        form = MemberRoleForm(request.POST)
        if not form.is_valid():
            messages.error(request, "Choose a valid role.")
            return redirect("portal:members", slug=slug)
        role = form.cleaned_data["role"]
        try:
            membership.change_role(role, by=request.user)
        except ValidationError as exc:
            messages.error(request, "; ".join(exc.messages))
            return redirect("portal:members", slug=slug)
        messages.success(request, f"{membership.user.username} is now {role}.")
        return redirect("portal:members", slug=slug)
