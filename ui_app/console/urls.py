"""The admin console's URLs (namespace ``console``), mounted at the site root."""

from __future__ import annotations

from django.urls import path, re_path

from ui_app.console import artifacts as artifact_views
from ui_app.console import autoscaling as autoscaling_views
from ui_app.console import fleet as fleet_views
from ui_app.console import guardrails as guardrail_views
from ui_app.console import joins, views
from ui_app.console import metrics as metrics_views
from ui_app.scoping import public

app_name = "console"

urlpatterns = [
    path("", views.OverviewView.as_view(), name="overview"),
    path("overview/deployments/", views.OverviewDeploymentsPartial.as_view(),
         name="overview-deployments"),
    path("login/", public(views.LoginView.as_view(), "the sign-in page"), name="login"),
    path("logout/", public(views.LogoutView.as_view(), "signing out ends any session"),
         name="logout"),
    # tenants
    path("tenants/", views.TenantListView.as_view(), name="tenant-list"),
    path("tenants/new/", views.TenantCreateView.as_view(), name="tenant-create"),
    path("tenants/<slug:slug>/", views.TenantDetailView.as_view(), name="tenant-detail"),
    path("tenants/<slug:slug>/edit/", views.TenantUpdateView.as_view(), name="tenant-edit"),
    # artifacts: the files of base models and adapters
    path("artifacts/", artifact_views.ArtifactListView.as_view(), name="artifact-list"),
    path("artifacts/<int:pk>/", artifact_views.ArtifactDetailView.as_view(),
         name="artifact-detail"),
    # base models
    path("models/", views.BaseModelListView.as_view(), name="basemodel-list"),
    path("models/new/", views.BaseModelCreateView.as_view(), name="basemodel-create"),
    path("models/<int:pk>/", views.BaseModelDetailView.as_view(), name="basemodel-detail"),
    path("models/<int:pk>/edit/", views.BaseModelUpdateView.as_view(), name="basemodel-edit"),
    # adapters
    path("adapters/", views.AdapterListView.as_view(), name="loraadapter-list"),
    path("adapters/new/", views.AdapterCreateView.as_view(), name="loraadapter-create"),
    path("adapters/<int:pk>/", views.AdapterDetailView.as_view(), name="loraadapter-detail"),
    path("adapters/<int:pk>/edit/", views.AdapterUpdateView.as_view(), name="loraadapter-edit"),
    # deployments
    path("deployments/", views.DeploymentListView.as_view(), name="deployment-list"),
    path("deployments/new/", views.DeploymentCreateView.as_view(), name="deployment-create"),
    path("deployments/plan/", views.DeploymentPlanView.as_view(), name="deployment-plan-new"),
    path("deployments/<int:pk>/", views.DeploymentDetailView.as_view(),
         name="deployment-detail"),
    path("deployments/<int:pk>/edit/", views.DeploymentUpdateView.as_view(),
         name="deployment-edit"),
    path("deployments/<int:pk>/plan/", views.DeploymentPlanView.as_view(),
         name="deployment-plan-edit"),
    path("deployments/<int:pk>/instances/", views.DeploymentInstancesPartial.as_view(),
         name="deployment-instances"),
    path("deployments/<int:pk>/scale/", views.DeploymentScaleView.as_view(),
         name="deployment-scale"),
    path("deployments/<int:pk>/autoscaling/", autoscaling_views.DeploymentAutoscalingView
         .as_view(), name="deployment-autoscaling"),
    path("deployments/<int:pk>/metrics/", metrics_views.DeploymentMetricsData.as_view(),
         name="deployment-metrics"),
    re_path(r"^deployments/(?P<pk>\d+)/(?P<action>start|stop|restart)/$",
            views.DeploymentActionView.as_view(), name="deployment-action"),
    path("deployments/<int:pk>/revisions/", fleet_views.DeploymentRevisionsPartial.as_view(),
         name="deployment-revisions"),
    path("deployments/<int:pk>/apply/", fleet_views.DeploymentApplyView.as_view(),
         name="deployment-apply"),
    re_path(r"^deployments/(?P<pk>\d+)/rollout/(?P<action>pause|resume|abort|rollback)/$",
            fleet_views.RolloutActionView.as_view(), name="deployment-rollout"),
    path("deployments/<int:pk>/events/", fleet_views.DeploymentEventsPartial.as_view(),
         name="deployment-events"),
    path("events/", fleet_views.EventListView.as_view(), name="event-list"),
    # nodes
    path("nodes/", views.NodeListView.as_view(), name="node-list"),
    path("nodes/add/", joins.AddNodeView.as_view(), name="node-add"),
    path("nodes/<int:pk>/remove/", joins.RemoveNodeView.as_view(), name="node-remove"),
    path("nodes/join-tokens/<int:pk>/revoke/", joins.RevokeJoinTokenView.as_view(),
         name="node-join-token-revoke"),
    path("nodes/<int:pk>/", views.NodeDetailView.as_view(), name="node-detail"),
    path("nodes/<int:pk>/cpu-binding/", views.NodeCpuBindingView.as_view(),
         name="node-cpu-binding"),
    re_path(r"^nodes/(?P<pk>\d+)/(?P<action>cordon|uncordon|drain)/$",
            views.NodeActionView.as_view(), name="node-action"),
    # what-if plans
    path("plans/", views.FleetPlanListView.as_view(), name="fleetplan-list"),
    path("plans/new/", views.FleetPlanCreateView.as_view(), name="fleetplan-create"),
    path("plans/<int:pk>/", views.FleetPlanDetailView.as_view(), name="fleetplan-detail"),
    path("plans/<int:pk>/edit/", views.FleetPlanUpdateView.as_view(), name="fleetplan-edit"),
    # instances
    path("instances/<int:pk>/", views.InstanceDetailView.as_view(), name="instance-detail"),
    path("instances/<int:pk>/startup/", views.InstanceStartupPartial.as_view(),
         name="instance-startup"),
    path("instances/<int:pk>/log/", views.InstanceLogPartial.as_view(), name="instance-log"),
    path("instances/<int:pk>/metrics/", metrics_views.InstanceMetricsData.as_view(),
         name="instance-metrics"),
    # guardrails
    path("guardrails/", guardrail_views.FloorPolicyView.as_view(), name="guardrail-floor"),
    path("guardrails/guard-models/", guardrail_views.GuardModelsView.as_view(),
         name="guard-models"),
    path("guardrails/guard-models/<int:pk>/delete/", guardrail_views.GuardModelDeleteView.as_view(),
         name="guard-model-delete"),
    # audit log and dashboards
    path("audit/", views.AuditLogView.as_view(), name="audit-log"),
    re_path(r"^dashboards/(?P<name>usage|latency|gpus)/$", views.DashboardView.as_view(),
            name="dashboard"),
    re_path(r"^dashboards/(?P<name>usage|latency|gpus)/data/$",
            views.DashboardDataView.as_view(), name="dashboard-data"),
]
