"""The project's URLs plus the console and portal, for tests run before console/urls.py
includes them (the fixture in conftest.py uses this only while they are not wired)."""

from __future__ import annotations

from django.urls import include, path

from console.urls import urlpatterns as project_patterns

_wired = {getattr(p, "namespace", None) for p in project_patterns} >= {"console", "portal"}
urlpatterns = project_patterns if _wired else [
    path("", include("ui_app.console.urls")),
    path("portal/", include("ui_app.portal.urls")),
    *project_patterns,
]
