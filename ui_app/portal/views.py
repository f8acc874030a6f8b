"""The tenant portal's pages about serving data: the tenant's home, its dashboards, API keys
scoped to the models it may call, adapters, models and the playground.

They sit here, above tenants_app, because they read serving data (the catalog, usage, adapters);
the portal's own mixin (`ui_app.portal.tenants.TenantPage`: a tenant among the user's, 404 for any
other, and the user's role) and its tenant-only pages (members, invitations, key revocation) stay
in tenants_app. The portal's URLs are `ui_app.portal.urls`.
"""

from __future__ import annotations

import json
import secrets
from datetime import timedelta
from functools import lru_cache
from typing import Any

import redis
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, Prefetch
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect
from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.utils import timezone
from django.views import View

from billing_app.budgets import standings
from serving_app import storage
from serving_app.artifacts import removal
from serving_app.deployments.catalog import engine_shares, served_models
from serving_app.metering import queries
from serving_app.models import Artifact, ArtifactVersion, Deployment, Instance, LoraAdapter
from serving_app.redaction import is_platform_admin, redact_paths
from serving_app.uploads import allowed_base_models
from tenants_app.models import ApiKey, MoneyBudget, Tenant
from ui_app.console.budgets import budget_rows
from ui_app.console.capacity import objective_costs_context
from ui_app.console.dashboards import dashboard_context, dashboard_payload
from ui_app.console.forms import ObjectivesForm
from ui_app.portal.forms import AdapterPathForm, AdapterUploadForm
from ui_app.portal.tenant_forms import ApiKeyForm
from ui_app.scoping import TenantPage

PLAYGROUND_KEY_LIFETIME = timedelta(hours=1)


def catalog(tenant: Tenant) -> list[dict[str, Any]]:
    """The public model names a tenant may call (`serving_app.deployments.catalog`, the gateway's
    rule), with how many ready instances serve each."""
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
            "capacity_test": s.deployment.base_model.capacity_test,
            "noise": s.deployment.base_model.answers_are_noise,
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


class TenantHomeView(TenantPage, View):
    section = "home"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        tenant = self.tenant
        used = queries.month_used_tokens(self.scope).get(tenant.pk, 0)
        budget = tenant.monthly_token_budget
        pct = round(100 * used / budget, 1) if budget else None
        day = queries.usage_totals(queries.RANGES["24h"], self.scope)
        return self.render(
            "portal/home.html",
            month_tokens=used,
            budget_pct=pct,
            budget_bar=min(pct, 100) if pct is not None else None,
            remaining=max(budget - used, 0) if budget else None,
            day=day[0] if day else None,
            load=queries.current_load(self.scope).get(tenant.pk, {}),
            models=catalog(tenant),
            keys=ApiKey.objects.for_tenant(tenant).filter(revoked_at__isnull=True).count(),
            storage=storage_usage(tenant),
            money_budgets=budget_rows(MoneyBudget.objects.for_tenant(tenant)),
            **objective_costs_context(tenant, tried(request)),
        )


def tried(request: HttpRequest) -> Any | None:
    """Objectives typed in the home page's "what would it cost" form (GET), if any: else the
    tenant's saved ones are priced."""
    return request.GET if set(request.GET) & set(ObjectivesForm.base_fields) else None


# ----------------------------------------------------------------------------- dashboards

PORTAL_DASHBOARDS = {"usage": "Usage", "latency": "Latency"}


class TenantDashboardView(TenantPage, View):
    section = "dashboards"  # the one shown: usage or latency

    def get(self, request: HttpRequest, slug: str, name: str) -> HttpResponse:
        self.section = name
        return self.render(
            "portal/dashboard.html",
            title=PORTAL_DASHBOARDS[name],
            budgets=standings(self.tenant) if name == "usage" else None,
            **dashboard_context(request, name, self.scope,
                                reverse("portal:dashboard-data", args=[slug, name]),
                                reverse("portal:requests", args=[slug])),
        )


class TenantDashboardDataView(TenantPage, View):
    section = "dashboards"

    def get(self, request: HttpRequest, slug: str, name: str) -> HttpResponse:
        return dashboard_payload(request, name, self.scope, portal=True,
                                 requests_url=reverse("portal:requests", args=[slug]))


# ----------------------------------------------------------------------------- API keys


# A key just created reaches the page after the redirect through a one-time Redis entry that
# lives NEW_KEY_SECONDS at most and is read once (GETDEL), bound to the tenant and the user: the
# secret is never written to the session table or any other row.
NEW_KEY_SECONDS = 120


@lru_cache(maxsize=4)
def _handoff(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def _new_key_entry(token: str) -> str:
    return f"portal:new-key:{token}"


class ApiKeysView(TenantPage, View):
    """List keys; create one (its secret is in this one response only); revoke."""

    section = "keys"

    def keys_page(self, form: ApiKeyForm, status: int = 200, **extra: Any) -> HttpResponse:
        keys = ApiKey.objects.for_tenant(self.tenant).select_related("created_by")
        return self.render("portal/keys.html", status=status, form=form, keys=keys, **extra)

    def model_names(self) -> list[str]:
        return [entry["name"] for entry in catalog(self.tenant)]

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        extra = self.created_key(request.GET.get("created", ""))
        response = self.keys_page(ApiKeyForm(model_names=self.model_names()), **extra)
        if extra:
            response["Cache-Control"] = "no-store"
        return response

    def created_key(self, token: str) -> dict[str, Any]:
        """The key the redirect names, with its secret, once (nothing when it was read
        already, expired, or is another tenant's or user's)."""
        if not token:
            return {}
        try:
            raw = _handoff(settings.REDIS_URL).getdel(_new_key_entry(token))
        except redis.RedisError:
            return {}
        created = json.loads(raw) if raw else None
        if (not created or created["tenant"] != self.tenant.pk
                or created["user"] != self.request.user.pk):
            return {}
        return {"new_key": ApiKey.objects.for_tenant(self.tenant).filter(pk=created["key"])
                .first(), "secret": created["secret"]}

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
        # Post/redirect/get, so that a reload does not create another key; the secret waits in
        # a one-time Redis entry for the page after the redirect. Without Redis the secret is
        # shown in this response instead (a reload would then ask to send the form again).
        token = secrets.token_urlsafe(16)
        entry = {"tenant": self.tenant.pk, "user": request.user.pk, "key": key.pk,
                 "secret": secret}
        try:
            _handoff(settings.REDIS_URL).set(_new_key_entry(token), json.dumps(entry),
                                             ex=NEW_KEY_SECONDS)
        except redis.RedisError:
            response = self.keys_page(ApiKeyForm(model_names=self.model_names()), new_key=key,
                                      secret=secret)
            response["Cache-Control"] = "no-store"
            return response
        return redirect(f"{reverse('portal:keys', args=[self.tenant.slug])}?created={token}")


# ----------------------------------------------------------------------------- adapters


class AdaptersView(TenantPage, View):
    section = "adapters"

    def page(self, status: int = 200, **forms: Any) -> HttpResponse:
        staff = is_platform_admin(self.request.user)
        # Each adapter with its error as shown: an engine's load error may name host paths,
        # which tenant users get redacted.
        adapters = [
            (adapter, adapter.last_error if staff else redact_paths(adapter.last_error))
            for adapter in LoraAdapter.objects.for_tenant(self.tenant)
            .select_related("base_model").prefetch_related("deployments")
        ]
        # Tenants never name host paths: registering a folder on the hosts is for platform
        # admins (who see the portal as every tenant does).
        if staff:
            forms.setdefault("path_form", AdapterPathForm(tenant=self.tenant))
        forms.setdefault("upload_form", AdapterUploadForm(tenant=self.tenant))
        files = (Artifact.objects.for_tenant(self.tenant)
                 .prefetch_related(Prefetch("versions", queryset=ArtifactVersion.objects
                                            .order_by("-number").prefetch_related("adapters"))))
        return self.render("portal/adapters.html", status=status, adapters=adapters,
                           files=files, storage=storage_usage(self.tenant),
                           artifact_base_models=allowed_base_models(self.tenant),
                           chunk_bytes=settings.ARTIFACT_UPLOAD_CHUNK_BYTES, **forms)

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
            path_form = AdapterPathForm(request.POST, tenant=self.tenant)
            if not path_form.is_valid():
                return self.page(status=400, path_form=path_form)
            adapter = path_form.save()
        messages.success(request, f"Adapter {adapter.name} registered (rank {adapter.rank}, "
                                  f"{', '.join(adapter.target_modules)}).")
        return redirect("portal:adapters", slug=slug)


class AdapterDeleteView(TenantPage, View):
    """Delete one of the tenant's adapters, after a confirmation page that names the
    deployments serving it (a GET, or a POST without `confirm`: it works without JavaScript).
    Its deployments stop offering it at once; the engines unload it at the next reconcile
    round, and its uploaded files go after that (`AdapterFileRemoval`)."""

    section = "adapters"

    def adapter(self, pk: int) -> LoraAdapter:
        self.require_manager()
        return get_object_or_404(LoraAdapter.objects.for_tenant(self.tenant), pk=pk)

    def confirm(self, adapter: LoraAdapter) -> HttpResponse:
        version = adapter.artifact_version
        shared = version is not None and LoraAdapter.objects.filter(
            artifact_version=version).exclude(pk=adapter.pk).exists()
        return self.render("portal/adapter_delete.html", adapter=adapter,
                           deployments=list(adapter.deployments.order_by("name")),
                           version=version, version_shared=shared)

    def get(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        return self.confirm(self.adapter(pk))

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        adapter = self.adapter(pk)
        if request.POST.get("confirm") != "delete":
            return self.confirm(adapter)
        version = adapter.artifact_version
        adapter.delete()
        if version is None:
            messages.success(request, f"Adapter {adapter.name} deleted; its files are removed "
                                      "once no engine has it loaded.")
        elif request.POST.get("delete_files"):
            messages.success(request, f"Adapter {adapter.name} deleted; "
                             + _delete_files(version))
        else:
            messages.success(request, f"Adapter {adapter.name} deleted; its files stay as "
                                      f"{version} (listed under Your files).")
        return redirect("portal:adapters", slug=slug)


def _delete_files(version: ArtifactVersion) -> str:
    """Delete an adapter's files version (and its artifact once it has no version left); what
    happened, as a sentence's end."""
    try:
        freed = removal.delete_version(version, drop_empty_artifact=True)
    except removal.InUse as exc:
        return f"its files stay: {exc}"
    return f"its files ({version}) are deleted, freeing {filesizeformat(freed)}."


class ArtifactVersionDeleteView(TenantPage, View):
    """Delete one version of the tenant's adapter files, after a confirmation page naming the
    adapters that serve it (which must go first) and the storage it frees."""

    section = "adapters"

    def version(self, pk: int, number: int) -> ArtifactVersion:
        self.require_manager()
        return get_object_or_404(
            ArtifactVersion.objects.select_related("artifact").filter(
                artifact__in=Artifact.objects.for_tenant(self.tenant)),
            artifact_id=pk, number=number)

    def confirm(self, version: ArtifactVersion, status: int = 200) -> HttpResponse:
        versions = ArtifactVersion.objects.filter(pk=version.pk)
        return self.render("portal/artifact_version_delete.html", status=status,
                           version=version, needs=removal.needed_by(versions),
                           freed=removal.bytes_only_in(versions))

    def get(self, request: HttpRequest, slug: str, pk: int, number: int) -> HttpResponse:
        return self.confirm(self.version(pk, number))

    def post(self, request: HttpRequest, slug: str, pk: int, number: int) -> HttpResponse:
        version = self.version(pk, number)
        if request.POST.get("confirm") != "delete":
            return self.confirm(version)
        try:
            removal.delete_version(version, drop_empty_artifact=True)
        except removal.InUse:
            return self.confirm(version, status=409)
        messages.success(request, f"{version} deleted.")
        return redirect("portal:adapters", slug=slug)


class AdapterServeRequestView(TenantPage, View):
    """Ask a platform admin to serve one of the tenant's adapters (`request_serving()`): shown
    as pending here, and offered first on the deployments' attach forms in the console."""

    section = "adapters"

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        adapter = get_object_or_404(LoraAdapter.objects.for_tenant(self.tenant), pk=pk)
        if adapter.request_serving():
            messages.success(request, f"Asked the platform's admins to serve {adapter.name}: "
                                      "it shows as pending until one attaches it.")
        else:
            messages.info(request, f"{adapter.name} is served or was asked for already.")
        return redirect("portal:adapters", slug=slug)


# ----------------------------------------------------------------------------- models


class ModelsView(TenantPage, View):
    section = "models"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        models = catalog(self.tenant)
        try:
            shares = engine_shares(self.tenant.pk)
        except redis.RedisError:
            shares = None
        return self.render("portal/models.html", models=models, shares=shares,
                           base_url=request.build_absolute_uri("/v1"),
                           example=models[0]["name"] if models else "MODEL")


# ----------------------------------------------------------------------------- playground


class PlaygroundView(TenantPage, View):
    section = "playground"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.render("portal/playground.html", models=catalog(self.tenant),
                           lifetime_minutes=int(PLAYGROUND_KEY_LIFETIME.total_seconds() // 60))


class PlaygroundKeyView(TenantPage, View):
    """A short-lived key for the playground (owners and admins), returned once as JSON."""

    section = "playground"

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        now = timezone.now()
        expires_at = now + PLAYGROUND_KEY_LIFETIME
        name = f"playground {request.user.get_username()} {now:%Y-%m-%d %H:%M}"[:90]
        taken = set(ApiKey.objects.for_tenant(self.tenant).filter(name__startswith=name)
                    .values_list("name", flat=True))
        # Named to the minute, as people read it; a second key in that minute gets a number.
        name = next(n for n in (name, *(f"{name} ({i})" for i in range(2, 1000)))
                    if n not in taken)
        key, secret = ApiKey.objects.create_key(
            tenant=self.tenant,
            name=name,
            expires_at=expires_at,
            created_by=request.user,
        )
        response = JsonResponse({"secret": secret, "prefix": key.prefix,
                                 "expires_at": expires_at.isoformat()})
        response["Cache-Control"] = "no-store"
        return response
