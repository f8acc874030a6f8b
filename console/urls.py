"""Root URLs: admin, management API under /api/v1/, OpenAPI schema and docs, and the
liveness and readiness probes (`/healthz`, `/readyz`)."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from serving_app import views as console_views
from serving_app.api import views as serving_views
from serving_app.api.autoscaling import AutoscalerViewSet
from serving_app.api.fleetplans import FleetPlanViewSet
from tenants_app.api import views as tenant_views
from tenants_app.api.auth import TokenLoginView, TokenLogoutAllView, TokenLogoutView

router = DefaultRouter()
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
router.register("nodes", serving_views.NodeViewSet)
router.register("gpus", serving_views.GpuViewSet)
router.register("deployments", serving_views.DeploymentViewSet)
router.register("instances", serving_views.InstanceViewSet)
router.register("audit-log", serving_views.AuditLogViewSet)
router.register("fleet-plans", FleetPlanViewSet)
router.register("autoscalers", AutoscalerViewSet)

urlpatterns = [
    path("healthz", console_views.healthz, name="healthz"),
    path("readyz", console_views.readyz, name="readyz"),
    path("", include("serving_app.urls")),
    path("portal/", include("serving_app.portal_urls")),
    path("admin/", admin.site.urls),
    path("api/v1/", include("serving_app.api.placement_views")),
    path("api/v1/", include("serving_app.api.health_views")),
    path("api/v1/", include("serving_app.api.metrics_views")),
    path("api/v1/", include(router.urls)),
    path("api/v1/auth/token/", TokenLoginView.as_view(), name="api-token"),
    # Revoking tokens: this one, or every token of the signed-in user.
    path("api/v1/auth/logout/", TokenLogoutView.as_view(), name="api-token-logout"),
    path("api/v1/auth/logout-all/", TokenLogoutAllView.as_view(),
         name="api-token-logout-all"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves Swagger UI's start-up script as a file of its own (no inline script,
    # so the page works under the content security policy).
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    path("api-auth/", include("rest_framework.urls")),
]
