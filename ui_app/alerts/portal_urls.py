"""The portal's alert pages (namespace ``portal-alerts``), mounted at
``/portal/<slug>/alerts/``."""

from __future__ import annotations

from django.urls import path

from ui_app.alerts import views

app_name = "portal-alerts"

urlpatterns = [
    path("", views.PortalAlertsView.as_view(), name="alerts"),
    path("<int:pk>/acknowledge/", views.PortalAcknowledgeView.as_view(), name="acknowledge"),
    path("silences/<int:pk>/end/", views.PortalSilenceEndView.as_view(), name="silence-end"),
    path("rules/", views.PortalRulesView.as_view(), name="rules"),
    path("rules/<int:pk>/", views.PortalRuleView.as_view(), name="rule"),
    path("channels/", views.PortalChannelsView.as_view(), name="channels"),
    path("channels/<int:pk>/", views.PortalChannelView.as_view(), name="channel"),
]
