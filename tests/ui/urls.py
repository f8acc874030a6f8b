"""The project's URLs plus the console and portal, for tests run before console/urls.py
includes them (the fixture in conftest.py uses this only while they are not wired)."""

from __future__ import annotations

from django.urls import include, path

from console.urls import urlpatterns as project_patterns

_wired = {getattr(p, "namespace", None) for p in project_patterns} >= {"console", "portal"}
urlpatterns = project_patterns if _wired else [
    path("", include("serving_app.urls")),
    path("portal/", include("serving_app.portal_urls")),
    *project_patterns,
]
