"""The console's alert pages (namespace ``alerts``), mounted at ``/alerts/``."""

from __future__ import annotations

from django.urls import path, re_path

from ui_app.alerts import views

app_name = "alerts"

urlpatterns = [
    path("", views.ConsoleAlertsView.as_view(), name="console"),
    re_path(r"^(?P<kind>acknowledge|end-silence|test-channel)/(?P<pk>\d+)/$",
            views.ConsoleAlertActionView.as_view(), name="action"),
]
