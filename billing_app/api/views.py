"""`/api/v1/statements/`: each tenant's statement for a month (a tenant's users read their own
tenants': another's is a 404), the platform's reconciliation with the idle capacity (platform
admins), and the FOCUS 1.0 rows, paged (`?limit=&offset=`)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from billing_app import focus
from billing_app.api.serializers import (
    PeriodQuery,
    TenantSlugSerializer,
    fleet_summary,
    statement_detail,
    statement_summary,
)
from billing_app.periods import BillingPeriod
from billing_app.statements import FleetStatement, build
from tenants_app.api.base import ScopedReadOnlyModelViewSet
from tenants_app.models import Tenant

PERIOD = OpenApiParameter("period", str, description="A month as YYYY-MM (UTC); default: this "
                                                     "month.")
PAGING = [OpenApiParameter("limit", int, description="Rows per page."),
          OpenApiParameter("offset", int, description="Rows to skip.")]


class StatementViewSet(ScopedReadOnlyModelViewSet[Tenant]):
    """Statements per tenant and month: token and capacity costs side by side (showback), the
    billed one by the tenant's basis (chargeback), lines by model, adapter, key, day and
    deployment; `focus/` in the FOCUS 1.0 layout."""

    queryset = Tenant.objects.all()
    lookup_field = "slug"
    serializer_class = TenantSlugSerializer
    filter_backends: list[Any] = []

    def get_object(self) -> Tenant:
        # A slug holding a NUL character matches nothing; PostgreSQL would refuse the query.
        if "\x00" in str(self.kwargs.get(self.lookup_field, "")):
            raise Http404
        return super().get_object()

    def _period(self) -> BillingPeriod:
        query = PeriodQuery(data=self.request.query_params)
        query.is_valid(raise_exception=True)
        return query.chosen()

    def _build(self, tenants: QuerySet[Tenant]) -> FleetStatement:
        return build(self._period(), tenants)

    @extend_schema(summary="Every statement of a month (the caller's tenants), paged",
                   operation_id="statements_list", parameters=[PERIOD, *PAGING],
                   responses=OpenApiTypes.OBJECT)
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        fleet = self._build(self.get_queryset())
        summaries = [statement_summary(s) for s in fleet.statements]
        page = self.paginate_queryset(summaries)  # type: ignore[arg-type, unused-ignore]
        return self.get_paginated_response(page)

    @extend_schema(summary="A tenant's statement for a month", parameters=[PERIOD],
                   operation_id="statements_retrieve", responses=OpenApiTypes.OBJECT)
    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        tenant = self.get_object()
        fleet = self._build(self.get_queryset().filter(pk=tenant.pk))
        statement = fleet.for_tenant(tenant)
        assert statement is not None  # build() answers every tenant it is given
        return Response(statement_detail(statement))

    @extend_schema(summary="The fleet's month: statements, idle capacity, fleet cost",
                   parameters=[PERIOD], responses=OpenApiTypes.OBJECT)
    @action(detail=False, url_path="fleet")
    def fleet(self, request: Request) -> Response:
        if not request.user.is_staff:
            raise PermissionDenied("The fleet's reconciliation is for platform admins.")
        return Response(fleet_summary(self._build(self.get_queryset())))

    def _focus(self, tenants: QuerySet[Tenant]) -> Response:
        fleet = self._build(tenants)
        rows = focus.rows(fleet, with_idle=bool(self.request.user.is_staff and
                                                self.kwargs.get("slug") is None))
        page = self.paginate_queryset(rows)  # type: ignore[arg-type, unused-ignore]
        return self.get_paginated_response(page)

    @extend_schema(summary="All statements' rows in FOCUS 1.0 columns, paged (admins: with idle)",
                   operation_id="statements_focus_list", parameters=[PERIOD, *PAGING],
                   responses=OpenApiTypes.OBJECT)
    @action(detail=False, url_path="focus", url_name="focus-all")
    def focus_all(self, request: Request) -> Response:
        return self._focus(self.get_queryset())

    @extend_schema(summary="A tenant's statement in the FOCUS 1.0 layout, paged",
                   operation_id="statements_focus_retrieve", parameters=[PERIOD, *PAGING],
                   responses=OpenApiTypes.OBJECT)
    @action(detail=True, url_path="focus")
    def focus(self, request: Request, slug: str) -> Response:
        tenant = self.get_object()
        return self._focus(self.get_queryset().filter(pk=tenant.pk))
