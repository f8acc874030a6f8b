"""The tenant portal's URLs (namespace ``portal``), mounted at ``/portal/``: the tenant-only
pages of `ui_app.portal.tenants` and the serving pages of `ui_app.portal.views`."""

from __future__ import annotations

from django.urls import path, re_path

from ui_app.portal import guardrails, statements
from ui_app.portal import requests as request_log
from ui_app.portal import tenants as views
from ui_app.portal import views as portal

app_name = "portal"

urlpatterns = [
    path("", views.PortalHomeView.as_view(), name="home"),
    re_path(r"^invitations/(?P<pk>\d+)/(?P<answer>accept|decline)/$",
            views.InvitationAnswerView.as_view(), name="invitation-answer"),
    path("<slug:slug>/", portal.TenantHomeView.as_view(), name="tenant-home"),
    re_path(r"^(?P<slug>[-\w]+)/dashboards/(?P<name>usage|latency)/$",
            portal.TenantDashboardView.as_view(), name="dashboard"),
    re_path(r"^(?P<slug>[-\w]+)/dashboards/(?P<name>usage|latency)/data/$",
            portal.TenantDashboardDataView.as_view(), name="dashboard-data"),
    path("<slug:slug>/requests/", request_log.TenantRequestLogView.as_view(), name="requests"),
    path("<slug:slug>/requests/<str:request_id>/", request_log.TenantRequestDetailView.as_view(),
         name="request-detail"),
    path("<slug:slug>/statements/", statements.TenantStatementView.as_view(), name="statement"),
    path("<slug:slug>/statements/csv/", statements.TenantStatementCsvView.as_view(),
         name="statement-csv"),
    path("<slug:slug>/keys/", portal.ApiKeysView.as_view(), name="keys"),
    path("<slug:slug>/keys/<int:pk>/revoke/", views.ApiKeyRevokeView.as_view(),
         name="key-revoke"),
    path("<slug:slug>/keys/<int:pk>/guardrails/", guardrails.KeyGuardrailsView.as_view(),
         name="key-guardrails"),
    path("<slug:slug>/guardrails/", guardrails.GuardrailsView.as_view(), name="guardrails"),
    path("<slug:slug>/guardrails/test/", guardrails.GuardrailBenchView.as_view(),
         name="guardrail-bench"),
    path("<slug:slug>/guardrails/patterns/", guardrails.GuardrailPatternsView.as_view(),
         name="guardrail-patterns"),
    path("<slug:slug>/guardrails/patterns/<int:pk>/delete/",
         guardrails.GuardrailPatternDeleteView.as_view(), name="guardrail-pattern-delete"),
    path("<slug:slug>/adapters/", portal.AdaptersView.as_view(), name="adapters"),
    path("<slug:slug>/adapters/<int:pk>/delete/", portal.AdapterDeleteView.as_view(),
         name="adapter-delete"),
    path("<slug:slug>/adapters/files/<int:pk>/versions/<int:number>/delete/",
         portal.ArtifactVersionDeleteView.as_view(), name="artifact-version-delete"),
    path("<slug:slug>/adapters/<int:pk>/request/", portal.AdapterServeRequestView.as_view(),
         name="adapter-request"),
    path("<slug:slug>/models/", portal.ModelsView.as_view(), name="models"),
    path("<slug:slug>/playground/", portal.PlaygroundView.as_view(), name="playground"),
    path("<slug:slug>/playground/key/", portal.PlaygroundKeyView.as_view(),
         name="playground-key"),
    path("<slug:slug>/members/", views.MembersView.as_view(), name="members"),
    path("<slug:slug>/members/<int:pk>/", views.MemberChangeView.as_view(), name="member"),
    path("<slug:slug>/invitations/<int:pk>/revoke/", views.InvitationRevokeView.as_view(),
         name="invitation-revoke"),
]
