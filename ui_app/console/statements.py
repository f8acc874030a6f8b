"""The statements' pages of the console: the fleet's month (every tenant's token and capacity
costs, the billed one, the idle capacity and the fleet's total, reconciled to the cent), a
tenant's statement (printable) and its CSV in the FOCUS layout (docs/statements.md)."""

from __future__ import annotations

import io
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views import View
from django.views.generic import TemplateView

from billing_app import focus
from billing_app.periods import BillingPeriod
from billing_app.statements import FleetStatement, Statement, build
from tenants_app.models import Tenant
from ui_app.scoping import StaffPage


def period_of(request: HttpRequest) -> BillingPeriod:
    """`?period=YYYY-MM`, else this month; a malformed one is a 404 (no such page)."""
    text = request.GET.get("period")
    if not text:
        return BillingPeriod.containing(timezone.now())
    try:
        return BillingPeriod.parse(text)
    except ValueError as exc:
        raise Http404(str(exc)) from exc


def one_statement(period: BillingPeriod, tenants: Any, tenant: Tenant
                  ) -> tuple[FleetStatement, Statement]:
    fleet = build(period, tenants.filter(pk=tenant.pk))
    statement = fleet.for_tenant(tenant)
    if statement is None:
        raise Http404("No statement.")
    return fleet, statement


def csv_response(fleet: FleetStatement, name: str, with_idle: bool) -> HttpResponse:
    out = io.StringIO()
    focus.write_csv(focus.rows(fleet, with_idle=with_idle), out)
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}-{fleet.period.key}.csv"'
    return response


class StatementListView(StaffPage, TemplateView):
    template_name = "console/statement_list.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        period = period_of(self.request)
        context.update(fleet=build(period, Tenant.objects.all()), period=period)
        return context


class FleetCsvView(StaffPage, View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return csv_response(build(period_of(request), Tenant.objects.all()), "fleet", True)


class StatementDetailView(StaffPage, View):
    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        tenant = get_object_or_404(Tenant, slug=slug)
        period = period_of(request)
        _, statement = one_statement(period, Tenant.objects.all(), tenant)
        return render(request, "console/statement_detail.html",
                      {"statement": statement, "tenant": tenant, "period": period})


class StatementCsvView(StaffPage, View):
    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        tenant = get_object_or_404(Tenant, slug=slug)
        fleet, _ = one_statement(period_of(request), Tenant.objects.all(), tenant)
        return csv_response(fleet, tenant.slug, False)
