"""With DEBUG on (the demo, development), Django answers a missing page or a crash with its
debug page, which lists every URL pattern and the settings. Only platform admins see that;
anyone else gets the styled error page that production shows (templates/404.html, 500.html),
which points a tenant user to the portal."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string

ERROR_TEMPLATES = {404: "404.html", 500: "500.html"}
# JSON answers (the API, the probes) and the admin keep their own error bodies.
OWN_ERRORS = ("/api/", "/admin/", "/v1/")


class DebugPagesForStaffOnlyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        template = ERROR_TEMPLATES.get(response.status_code)
        if (template is None or not settings.DEBUG
                or not response.get("Content-Type", "").startswith("text/html")
                or request.path.startswith(OWN_ERRORS)):
            return response
        user = getattr(request, "user", None)
        if user is not None and user.is_staff:
            return response
        return HttpResponse(render_to_string(template, request=request),
                            status=response.status_code)
