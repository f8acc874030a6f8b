"""The portal's request log: the tenant's own requests, filtered, each opening its story (no
instance, no host path: `requests.story(..., for_tenant=True)`). The same pages as the
console's (`ui_app.console.requests`), scoped to the page's one tenant."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views import View

from ui_app.console.requests import log_context, story_context
from ui_app.scoping import TenantPage


class TenantRequestLogView(TenantPage, View):
    section = "requests"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.render("portal/request_log.html", **log_context(request, self.scope))


class TenantRequestDetailView(TenantPage, View):
    section = "requests"

    def get(self, request: HttpRequest, slug: str, request_id: str) -> HttpResponse:
        return self.render("portal/request_detail.html",
                           **story_context(self.scope, request_id, for_tenant=True))
