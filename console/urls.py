"""Root URLs: admin, management API under /api/v1/, OpenAPI schema and docs, the liveness and
readiness probes (`/healthz`, `/readyz`) and Prometheus' `/metrics`."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import APIRootView, DefaultRouter

from alerts_app import exporter
from alerts_app.api import views as alert_views
from backups_app.api.views import BackupViewSet
from billing_app.api.views import StatementViewSet
from guardrails_app.api import views as guardrail_views
from serving_app.api import artifacts as artifact_views
from serving_app.api import fleet as fleet_views
from serving_app.api import views as serving_views
from serving_app.api.autoscaling import AutoscalerViewSet
from serving_app.api.capacity import CapacityTestViewSet
from serving_app.api.fleetplans import FleetPlanViewSet
from serving_app.api.joins import NodeJoinTokenViewSet, NodeJoinView
from serving_app.api.prices import GpuPriceCardViewSet, PriceCardViewSet
from serving_app.api.requests import RequestViewSet
from tenants_app.api import views as tenant_views
from tenants_app.api.auth import TokenLoginView, TokenLogoutAllView, TokenLogoutView
from ui_app.console import views as console_views
from ui_app.scoping import Scope, declare_included, public, signed_in


class ApiRootView(APIRootView):
    """The API's index: a link to each endpoint, for any signed-in user."""

    page_scope = Scope.SIGNED_IN


router = DefaultRouter()
router.APIRootView = ApiRootView
router.register("tenants", tenant_views.TenantViewSet)
router.register("memberships", tenant_views.MembershipViewSet)
router.register("invitations", tenant_views.InvitationViewSet)
router.register(
    "my-invitations", tenant_views.ReceivedInvitationViewSet, basename="received-invitation"
)
router.register("api-keys", tenant_views.ApiKeyViewSet)
router.register("users", tenant_views.UserViewSet)
router.register("prefix-cache-groups", tenant_views.PrefixCacheGroupViewSet)
router.register("base-models", serving_views.BaseModelViewSet)
router.register("adapters", serving_views.LoraAdapterViewSet)
router.register("artifacts", artifact_views.ArtifactViewSet)
router.register("artifact-imports", artifact_views.ArtifactImportViewSet)
router.register("nodes", serving_views.NodeViewSet)
router.register("node-join-tokens", NodeJoinTokenViewSet)
router.register("gpus", serving_views.GpuViewSet)
router.register("deployments", serving_views.DeploymentViewSet)
router.register("instances", serving_views.InstanceViewSet)
router.register("audit-log", serving_views.AuditLogViewSet)
router.register("alert-rules", alert_views.AlertRuleViewSet)
router.register("alerts", alert_views.AlertViewSet)
router.register("alert-channels", alert_views.ChannelViewSet)
router.register("alert-silences", alert_views.SilenceViewSet)
router.register("alert-deliveries", alert_views.NotificationViewSet)
router.register("fleet-plans", FleetPlanViewSet)
router.register("autoscalers", AutoscalerViewSet)
router.register("capacity-tests", CapacityTestViewSet)
router.register("events", fleet_views.EventViewSet)
router.register("guardrail-floor", guardrail_views.FloorPolicyViewSet)
router.register("tenant-guardrails", guardrail_views.TenantPolicyViewSet)
router.register("key-guardrails", guardrail_views.KeyPolicyViewSet)
router.register("guardrail-patterns", guardrail_views.TenantPatternViewSet)
router.register("guard-models", guardrail_views.GuardModelViewSet)
router.register("backups", BackupViewSet)
router.register("price-cards", PriceCardViewSet)
router.register("money-budgets", tenant_views.MoneyBudgetViewSet)
router.register("gpu-price-cards", GpuPriceCardViewSet)
router.register("requests", RequestViewSet)
router.register("statements", StatementViewSet, basename="statement")

urlpatterns = [
    path("healthz", public(console_views.healthz, "the liveness probe (says only 'ok')"),
         name="healthz"),
    path("readyz", public(console_views.readyz, "the readiness probe (which dependency is down, "
                                                "no data)"), name="readyz"),
    path("metrics", public(exporter.metrics, "Prometheus scrapes it with its bearer token "
                                             "(METRICS_SCRAPE_TOKEN), checked by the view"),
         name="metrics"),
    path("alerts/", include("ui_app.alerts.urls")),
    path("portal/<slug:slug>/alerts/", include("ui_app.alerts.portal_urls")),
    path("", include("ui_app.console.urls")),
    path("portal/", include("ui_app.portal.urls")),
    path("admin/", admin.site.urls),
    path("api/v1/", include("serving_app.api.placement_views")),
    path("api/v1/", include("serving_app.api.health_views")),
    path("api/v1/", include("serving_app.api.metrics_views")),
    path("api/v1/node-join/", public(NodeJoinView.as_view(), "a joining host, authenticated by "
                                     "its one-time join token"), name="node-join"),
    path("api/v1/", include(router.urls)),
    path("api/v1/node-artifacts/blobs/<str:sha256>",
         public(artifact_views.node_blob, "node agents' file fetches, authenticated per node "
                                          "(its token) by the view"), name="node-blob"),
    path("api/v1/auth/token/", public(TokenLoginView.as_view(), "signing in for a token"),
         name="api-token"),
    # Revoking tokens: this one, or every token of the signed-in user.
    path("api/v1/auth/logout/", signed_in(TokenLogoutView.as_view(), "revokes the caller's token"),
         name="api-token-logout"),
    path("api/v1/auth/logout-all/", signed_in(TokenLogoutAllView.as_view(),
                                              "revokes the caller's own tokens"),
         name="api-token-logout-all"),
    path("api/schema/", public(SpectacularAPIView.as_view(), "the API's OpenAPI schema"),
         name="schema"),
    # The split view serves Swagger UI's start-up script as a file of its own (no inline script,
    # so the page works under the content security policy).
    path("api/docs/", public(SpectacularSwaggerSplitView.as_view(url_name="schema"),
                             "the API's documentation"), name="api-docs"),
    path("api-auth/", include(declare_included(
        include("rest_framework.urls"), Scope.PUBLIC,
        "the browsable API's sign-in and sign-out pages"))),
]
