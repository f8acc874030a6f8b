"""The admin console's URLs (namespace ``console``), mounted at the site root."""

from __future__ import annotations

from django.urls import path, re_path

from ui_app.console import artifacts as artifact_views
from ui_app.console import autoscaling as autoscaling_views
from ui_app.console import backups as backup_views
from ui_app.console import budgets as budget_views
from ui_app.console import capacity, dashboards, deployments, joins, nodes, overview, views
from ui_app.console import fleet as fleet_views
from ui_app.console import guardrails as guardrail_views
from ui_app.console import metrics as metrics_views
from ui_app.console import prices as price_views
from ui_app.console import requests as request_views
from ui_app.console import statements as statement_views
from ui_app.scoping import public

app_name = "console"

urlpatterns = [
    path("", overview.OverviewView.as_view(), name="overview"),
    path("overview/deployments/", overview.OverviewDeploymentsPartial.as_view(),
         name="overview-deployments"),
    path("login/", public(views.LoginView.as_view(), "the sign-in page"), name="login"),
    path("logout/", public(views.LogoutView.as_view(), "signing out ends any session"),
         name="logout"),
    # tenants
    path("tenants/", views.TenantListView.as_view(), name="tenant-list"),
    path("tenants/new/", views.TenantCreateView.as_view(), name="tenant-create"),
    path("tenants/<slug:slug>/", views.TenantDetailView.as_view(), name="tenant-detail"),
    path("tenants/<slug:slug>/edit/", views.TenantUpdateView.as_view(), name="tenant-edit"),
    path("tenants/<slug:slug>/objective-costs/", capacity.TenantObjectiveCostsPartial.as_view(),
         name="tenant-objective-costs"),
    # artifacts: the files of base models and adapters
    path("artifacts/", artifact_views.ArtifactListView.as_view(), name="artifact-list"),
    path("artifacts/<int:pk>/", artifact_views.ArtifactDetailView.as_view(),
         name="artifact-detail"),
    # price cards
    path("prices/", price_views.PriceListView.as_view(), name="price-list"),
    path("prices/new/", price_views.PriceCardCreateView.as_view(), name="pricecard-create"),
    path("prices/gpu/new/", price_views.GpuPriceCardCreateView.as_view(),
         name="gpupricecard-create"),
    # statements: what each tenant cost, the idle capacity, the fleet (docs/statements.md)
    path("statements/", statement_views.StatementListView.as_view(), name="statement-list"),
    path("statements/fleet.csv", statement_views.FleetCsvView.as_view(),
         name="statement-fleet-csv"),
    path("statements/<slug:slug>/", statement_views.StatementDetailView.as_view(),
         name="statement-detail"),
    path("statements/<slug:slug>/csv/", statement_views.StatementCsvView.as_view(),
         name="statement-csv"),
    # money budgets
    path("budgets/", budget_views.MoneyBudgetListView.as_view(), name="moneybudget-list"),
    path("budgets/new/", budget_views.MoneyBudgetCreateView.as_view(),
         name="moneybudget-create"),
    path("budgets/<int:pk>/edit/", budget_views.MoneyBudgetUpdateView.as_view(),
         name="moneybudget-edit"),
    path("artifacts/<int:pk>/delete/", artifact_views.ArtifactDeleteView.as_view(),
         name="artifact-delete"),
    path("artifacts/<int:pk>/versions/<int:number>/delete/",
         artifact_views.ArtifactVersionDeleteView.as_view(), name="artifact-version-delete"),
    path("artifacts/<int:pk>/versions/<int:number>/register/",
         artifact_views.RegisterFromVersionView.as_view(), name="artifact-version-register"),
    # base models
    path("models/", views.BaseModelListView.as_view(), name="basemodel-list"),
    path("models/new/", views.BaseModelCreateView.as_view(), name="basemodel-create"),
    path("models/<int:pk>/", views.BaseModelDetailView.as_view(), name="basemodel-detail"),
    path("models/<int:pk>/edit/", views.BaseModelUpdateView.as_view(), name="basemodel-edit"),
    path("models/<int:pk>/delete/", views.BaseModelDeleteView.as_view(),
         name="basemodel-delete"),
    # adapters
    path("adapters/", views.AdapterListView.as_view(), name="loraadapter-list"),
    path("adapters/new/", views.AdapterCreateView.as_view(), name="loraadapter-create"),
    path("adapters/<int:pk>/", views.AdapterDetailView.as_view(), name="loraadapter-detail"),
    path("adapters/<int:pk>/edit/", views.AdapterUpdateView.as_view(), name="loraadapter-edit"),
    path("adapters/<int:pk>/delete/", views.AdapterDeleteView.as_view(),
         name="loraadapter-delete"),
    # deployments
    path("deployments/", deployments.DeploymentListView.as_view(), name="deployment-list"),
    path("deployments/new/", deployments.DeploymentCreateView.as_view(), name="deployment-create"),
    path("deployments/plan/", deployments.DeploymentPlanView.as_view(), name="deployment-plan-new"),
    path("deployments/<int:pk>/", deployments.DeploymentDetailView.as_view(),
         name="deployment-detail"),
    path("deployments/<int:pk>/edit/", deployments.DeploymentUpdateView.as_view(),
         name="deployment-edit"),
    path("deployments/<int:pk>/plan/", deployments.DeploymentPlanView.as_view(),
         name="deployment-plan-edit"),
    path("deployments/<int:pk>/instances/", deployments.DeploymentInstancesPartial.as_view(),
         name="deployment-instances"),
    path("deployments/<int:pk>/scale/", deployments.DeploymentScaleView.as_view(),
         name="deployment-scale"),
    path("deployments/<int:pk>/adapters/", deployments.DeploymentAttachAdapterView.as_view(),
         name="deployment-attach-adapter"),
    path("deployments/<int:pk>/autoscaling/", autoscaling_views.DeploymentAutoscalingView
         .as_view(), name="deployment-autoscaling"),
    path("deployments/<int:pk>/metrics/", metrics_views.DeploymentMetricsData.as_view(),
         name="deployment-metrics"),
    re_path(r"^deployments/(?P<pk>\d+)/(?P<action>start|stop|restart)/$",
            deployments.DeploymentActionView.as_view(), name="deployment-action"),
    path("deployments/<int:pk>/revisions/", fleet_views.DeploymentRevisionsPartial.as_view(),
         name="deployment-revisions"),
    path("deployments/<int:pk>/apply/", fleet_views.DeploymentApplyView.as_view(),
         name="deployment-apply"),
    re_path(r"^deployments/(?P<pk>\d+)/rollout/(?P<action>pause|resume|abort|rollback)/$",
            fleet_views.RolloutActionView.as_view(), name="deployment-rollout"),
    path("deployments/<int:pk>/events/", fleet_views.DeploymentEventsPartial.as_view(),
         name="deployment-events"),
    path("deployments/<int:pk>/capacity-tests/",
         capacity.DeploymentCapacityTestView.as_view(page=deployments.DeploymentDetailView),
         name="deployment-capacity-test"),
    path("deployments/<int:pk>/capacity-tests/progress/",
         capacity.DeploymentCapacityTestsPartial.as_view(), name="deployment-capacity-tests"),
    path("capacity-tests/<int:pk>/cancel/", capacity.CapacityTestCancelView.as_view(),
         name="capacity-test-cancel"),
    path("events/", fleet_views.EventListView.as_view(), name="event-list"),
    # nodes
    path("nodes/", nodes.NodeListView.as_view(), name="node-list"),
    path("nodes/add/", joins.AddNodeView.as_view(), name="node-add"),
    path("nodes/<int:pk>/remove/", joins.RemoveNodeView.as_view(), name="node-remove"),
    path("nodes/join-tokens/<int:pk>/revoke/", joins.RevokeJoinTokenView.as_view(),
         name="node-join-token-revoke"),
    path("nodes/<int:pk>/", nodes.NodeDetailView.as_view(), name="node-detail"),
    path("nodes/<int:pk>/cpu-binding/", nodes.NodeCpuBindingView.as_view(),
         name="node-cpu-binding"),
    re_path(r"^nodes/(?P<pk>\d+)/(?P<action>cordon|uncordon|drain)/$",
            nodes.NodeActionView.as_view(), name="node-action"),
    # what-if plans
    path("plans/", nodes.FleetPlanListView.as_view(), name="fleetplan-list"),
    path("plans/new/", nodes.FleetPlanCreateView.as_view(), name="fleetplan-create"),
    path("plans/<int:pk>/", nodes.FleetPlanDetailView.as_view(), name="fleetplan-detail"),
    path("plans/<int:pk>/edit/", nodes.FleetPlanUpdateView.as_view(), name="fleetplan-edit"),
    # instances
    path("instances/<int:pk>/", deployments.InstanceDetailView.as_view(), name="instance-detail"),
    path("instances/<int:pk>/startup/", deployments.InstanceStartupPartial.as_view(),
         name="instance-startup"),
    path("instances/<int:pk>/log/", deployments.InstanceLogPartial.as_view(), name="instance-log"),
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
    path("requests/", request_views.RequestLogView.as_view(), name="request-log"),
    path("requests/<str:request_id>/", request_views.RequestDetailView.as_view(),
         name="request-detail"),
    path("backups/", backup_views.BackupListView.as_view(), name="backup-list"),
    re_path(r"^dashboards/(?P<name>usage|latency|gpus)/$", dashboards.DashboardView.as_view(),
            name="dashboard"),
    re_path(r"^dashboards/(?P<name>usage|latency|gpus)/data/$",
            dashboards.DashboardDataView.as_view(), name="dashboard-data"),
]
