"""A tenant's statements in the portal: its month's token and capacity costs, what it is
billed, printable, and its CSV in the FOCUS layout. Another tenant's answers 404
(`TenantPage`)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views import View

from tenants_app.models import Tenant
from ui_app.console.statements import csv_response, one_statement, period_of
from ui_app.scoping import TenantPage


class TenantStatementView(TenantPage, View):
    section = "statements"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        period = period_of(request)
        _, statement = one_statement(period, Tenant.objects.for_user(self.user), self.tenant)
        return self.render("portal/statement.html", statement=statement, period=period)


class TenantStatementCsvView(TenantPage, View):
    section = "statements"

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        fleet, _ = one_statement(period_of(request), Tenant.objects.for_user(self.user),
                                 self.tenant)
        return csv_response(fleet, self.tenant.slug, with_idle=False)
