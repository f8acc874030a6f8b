"""Tenant scoping that no code path can skip: every tenant-owned manager scopes by user and by
tenant, the API's base viewsets refuse a `get_queryset()` that would skip `for_user()`, and the
dashboard queries take an already-scoped tenant queryset, never ids or None."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.utils import timezone

from alerts_app.models import Alert, AlertRule, AlertTransition, Channel, Notification, Silence
from audit_app.models import AuditLog
from console.urls import router
from guardrails_app.models import KeyPolicy, TenantPattern, TenantPolicy
from serving_app.metering import panels, queries
from serving_app.models import Artifact, ArtifactImport, Deployment, Instance, LoraAdapter
from serving_app.models.usage import (
    TOTAL_BUCKET,
    GuardrailHour,
    GuardrailMinute,
    GuardrailTotal,
    KeyUsage,
    UsageEvent,
    UsageHour,
    UsageMinute,
    UsageTenSecond,
    UsageTotal,
)
from tenants_app.api.base import ScopedModelViewSet, ScopedQuerysetMixin
from tenants_app.models import ApiKey, Invitation, Membership, MoneyBudget, Tenant
from tests.factories import make_adapter, make_deployment, make_user

pytestmark = pytest.mark.django_db

TENANT_OWNED = {Tenant, Membership, ApiKey, Invitation, LoraAdapter, Deployment, Instance,
                AuditLog, UsageEvent, UsageTenSecond, UsageMinute, UsageHour, UsageTotal,
                AlertRule, Alert, AlertTransition, Channel, Silence, Notification,
                TenantPolicy, KeyPolicy, TenantPattern, Artifact, ArtifactImport,
                GuardrailMinute, GuardrailHour, GuardrailTotal, KeyUsage, MoneyBudget}


def test_every_tenant_owned_model_is_listed_here():
    """A model with a tenant relation (or the Tenant itself) is tenant-owned: listed above, so
    the scoping tests below cover it."""
    found = set()
    for model in apps.get_models():
        if model._meta.app_label not in ("serving_app", "tenants_app", "alerts_app",
                                          "guardrails_app"):
            continue
        names = {f.name for f in model._meta.get_fields() if not f.auto_created}
        if model is Tenant or names & {"tenant", "tenants"}:
            found.add(model)
    # Sharing groups hold tenants but are platform rows (staff only), like nodes and GPUs.
    found.discard(apps.get_model("tenants_app", "PrefixCacheGroup"))
    assert found - TENANT_OWNED == set()


@pytest.mark.parametrize("model", sorted(TENANT_OWNED, key=str))
def test_every_tenant_owned_manager_scopes_by_user_and_by_tenant(model, acme):
    assert callable(model.objects.for_user) and callable(model.objects.for_tenant)
    assert model.objects.for_tenant(acme.tenant).model is model
    assert not model.objects.for_user(make_user("nobody-at-all")).exists()


def usage_rows(*tenants):
    now = timezone.now().replace(second=0, microsecond=0)
    for tenant in tenants:
        UsageHour.objects.create(bucket=now.replace(minute=0), tenant=tenant, model="m",
                                 requests=1)
        UsageMinute.objects.create(bucket=now, tenant=tenant, model="m", requests=1)
        UsageTenSecond.objects.create(bucket=now, tenant=tenant, model="m", requests=1)
        UsageTotal.objects.create(bucket=TOTAL_BUCKET, tenant=tenant, model="m", requests=1)
        UsageEvent.objects.create(request_id=f"r-{tenant.slug}", created_at=now, tenant=tenant,
                                  endpoint="completions", status_code=200)


@pytest.mark.parametrize("model", [UsageEvent, UsageTenSecond, UsageMinute, UsageHour,
                                   UsageTotal])
def test_usage_is_read_per_user_and_per_scope(model, acme, globex, platform_admin):
    usage_rows(acme.tenant, globex.tenant)
    mine = model.objects.for_user(acme.viewer)
    assert {r.tenant_id for r in mine} == {acme.tenant.pk}
    assert model.objects.for_user(platform_admin).count() == 2
    scoped = model.objects.in_scope(Tenant.objects.for_user(acme.viewer))
    assert {r.tenant_id for r in scoped} == {acme.tenant.pk}
    for not_a_scope in (None, [acme.tenant.pk], {acme.tenant.pk}, Membership.objects.all()):
        with pytest.raises(TypeError):
            model.objects.in_scope(not_a_scope)


def test_dashboards_refuse_ids_or_none_for_a_scope(acme):
    trange = queries.RANGES["24h"]
    for call in (
        lambda scope: panels.usage_panel(trange, scope),
        lambda scope: panels.latency_panel(trange, scope),
        lambda scope: queries.current_load(scope),
        lambda scope: queries.month_used_tokens(scope),
        lambda scope: queries.models_in_range(trange, scope),
        lambda scope: queries.tenant_names(scope),
    ):
        for not_a_scope in (None, [acme.tenant.pk]):
            with pytest.raises(TypeError):
                call(not_a_scope)


def test_a_tenants_dashboard_names_only_that_tenant(acme, globex):
    usage_rows(acme.tenant, globex.tenant)
    scope = Tenant.objects.for_user(acme.viewer).for_tenant(acme.tenant)
    trange = queries.RANGES["24h"]
    usage = panels.usage_panel(trange, scope)
    latency = panels.latency_panel(trange, scope)
    assert [r["tenant"] for r in usage["rows"]] == [acme.tenant]
    assert {r["tenant"] for r in latency["rows"]} == {acme.tenant}
    assert set(queries.current_load(scope)) == {acme.tenant.pk}
    assert set(queries.month_used_tokens(scope)) == {acme.tenant.pk}
    # A user's scope is what they may see, whatever tenant is asked for.
    assert not Tenant.objects.for_user(acme.viewer).for_tenant(globex.tenant).exists()


def test_a_viewset_cannot_override_get_queryset():
    with pytest.raises(TypeError, match="safely_get_queryset"):
        class Leaky(ScopedModelViewSet):  # noqa: F841
            queryset = ApiKey.objects.all()

            def get_queryset(self):
                return ApiKey.objects.all()


def test_a_viewset_narrows_the_scoped_rows_or_names_its_bypass(acme, globex, base_model,
                                                              tmp_path, rf):
    mine = make_adapter(acme.tenant, base_model, tmp_path / "a", name="mine")
    make_adapter(globex.tenant, base_model, tmp_path / "b", name="theirs")

    class Narrow(ScopedModelViewSet):
        queryset = LoraAdapter.objects.all()

        def safely_get_queryset(self, queryset):
            return queryset.select_related("tenant")

    class Bypass(ScopedModelViewSet):
        queryset = LoraAdapter.objects.all()

        def dangerously_get_queryset(self):
            return LoraAdapter.objects.all()

    request = rf.get("/")
    request.user = acme.viewer
    assert list(Narrow(request=request).get_queryset()) == [mine]
    assert Bypass(request=request).get_queryset().count() == 2


def test_every_api_viewset_reads_through_the_scoped_base():
    unscoped = [viewset.__name__ for _, viewset, _ in router.registry
                if not issubclass(viewset, ScopedQuerysetMixin)]
    assert unscoped == []


def test_the_deliberate_bypasses_are_the_known_ones():
    bypasses = sorted(viewset.__name__ for _, viewset, _ in router.registry
                      if hasattr(viewset, "dangerously_get_queryset"))
    assert bypasses == ["ReceivedInvitationViewSet", "UserViewSet"]


def test_deployment_and_instance_scope_follow_the_tenants_served(acme, globex, base_model):
    shared = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared")
    make_deployment(base_model, [globex.tenant], name="theirs")
    assert list(Deployment.objects.for_user(acme.viewer)) == [shared]
    assert list(Deployment.objects.for_tenant(acme.tenant)) == [shared]
