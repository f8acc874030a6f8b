"""The request log: why a request failed, for platform admins (every tenant) here and, through
`RequestLog`, for a tenant's members in the portal (their tenant only). Rows come from
`UsageEvent.objects.in_scope(tenants)` with tenants already scoped by the page, filtered by
`serving_app.metering.requests.RequestFilter` (the API's filters too); a row opens the
request's story (`requests.story()`)."""

from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views import View

from serving_app.metering import requests as request_log
from serving_app.models import UsageEvent
from tenants_app.models import Tenant
from ui_app.scoping import StaffPage

REQUESTS_ON_PAGE = 50


def log_context(request: HttpRequest, tenants: QuerySet[Tenant]) -> dict[str, Any]:
    """The log page's rows (a page of them, newest first), its filter form and the query
    string the pager keeps; `tenants` already scoped (every tenant or the portal's one)."""
    rows = UsageEvent.objects.in_scope(tenants).select_related("tenant")
    filters = request_log.RequestFilter(request.GET or None, queryset=rows)
    page = Paginator(filters.qs, REQUESTS_ON_PAGE).get_page(request.GET.get("page"))
    events = list(page.object_list)
    keys = request_log.key_names(events)
    query = request.GET.copy()
    query.pop("page", None)
    return {
        "filter": filters,
        "page_obj": page,
        "rows": [(e, keys.get(e.api_key_id or 0, "")) for e in events],
        "error_codes": request_log.error_codes(rows),
        "query": query.urlencode(),
        "filtered": bool(request.GET.keys() - {"page"}),
    }


def story_context(tenants: QuerySet[Tenant], request_id: str, *,
                  for_tenant: bool) -> dict[str, Any]:
    """One request's story, among `tenants`' requests only (another's is a 404)."""
    event = UsageEvent.objects.in_scope(tenants).select_related("tenant").filter(
        request_id=request_id).first()
    if event is None:
        raise Http404("No such request.")
    return {"story": request_log.story(event, for_tenant=for_tenant)}


class RequestLogView(StaffPage, View):
    """Every tenant's requests, filtered; each row links to its story."""

    def get(self, request: HttpRequest) -> HttpResponse:
        context = log_context(request, Tenant.objects.for_user(request.user))
        return render(request, "console/request_log.html", context)


class RequestDetailView(StaffPage, View):
    def get(self, request: HttpRequest, request_id: str) -> HttpResponse:
        context = story_context(Tenant.objects.for_user(request.user), request_id,
                                for_tenant=False)
        return render(request, "console/request_detail.html", context)
