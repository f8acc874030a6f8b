"""What the statements API reads from the query and answers: a period, a statement's totals
and lines, the fleet's reconciliation."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.utils import timezone
from rest_framework import serializers

from billing_app.periods import BillingPeriod
from billing_app.statements import FleetStatement, Statement, shown
from tenants_app.models import Tenant


class PeriodQuery(serializers.Serializer[Any]):
    """`?period=YYYY-MM` (default: the current month, UTC)."""

    period = serializers.CharField(required=False, max_length=7,
                                   help_text="A month as YYYY-MM (UTC); default: this month.")

    def validate_period(self, value: str) -> BillingPeriod:
        try:
            return BillingPeriod.parse(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from exc

    def chosen(self) -> BillingPeriod:
        found = self.validated_data.get("period")
        return found if isinstance(found, BillingPeriod) else BillingPeriod.containing(
            timezone.now())


class TenantSlugSerializer(serializers.ModelSerializer[Tenant]):
    """A statement's tenant (the viewset's rows are tenants; its answers are statements)."""

    class Meta:
        model = Tenant
        fields = ["slug"]
        read_only_fields = fields


def _money(value: Decimal | None) -> str | None:
    return None if value is None else f"{value:f}"


def statement_summary(statement: Statement) -> dict[str, Any]:
    return {
        "tenant": statement.tenant.slug,
        "period": statement.period.key,
        "currency": statement.currency,
        "billing_basis": statement.basis,
        "token_cost": _money(statement.token_total),
        "capacity_cost": _money(statement.capacity_total),
        "dedicated_cost": _money(shown(statement.dedicated_cost)),
        "shared_cost": _money(shown(statement.shared_cost)),
        "gpu_seconds": _money(shown(statement.gpu_seconds)),
        "billed": _money(statement.billed),
        "unpriced_requests": statement.unpriced_requests,
    }


def _rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: (_money(v) if isinstance(v, Decimal) else str(v) if k == "day" else v)
             for k, v in row.items() if k != "key" or isinstance(v, str)} for row in rows]


def statement_detail(statement: Statement) -> dict[str, Any]:
    return {
        **statement_summary(statement),
        "by_model": _rows(statement.by_model()),
        "by_adapter": _rows(statement.by_adapter()),
        "by_key": _rows(statement.by_key()),
        "by_day": _rows(statement.by_day()),
        "capacity": _rows(statement.by_deployment()),
    }


def fleet_summary(fleet: FleetStatement) -> dict[str, Any]:
    return {
        "period": fleet.period.key,
        "currency": fleet.currency,
        "statements": [statement_summary(s) for s in fleet.statements],
        "idle_cost": _money(fleet.idle_cents),
        "idle_gpu_seconds": _money(shown(fleet.idle_seconds)),
        "fleet_cost": _money(fleet.fleet_total),
        "fleet_gpu_seconds": _money(shown(fleet.fleet_seconds)),
        "overheld": _money(shown(fleet.overheld)),
    }
