"""A tenant's money budgets as they stand: spent this period, the amount left and when the
period resets (the portal's usage page). Spend is summed from the key usage rollups, as the
gateway re-seeds its counters (`KeyUsage.objects.spend`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal

from django.db.models import F
from django.utils import timezone

from serving_app.models import KeyUsage
from tenants_app.models import MoneyBudget, Tenant

__all__ = ["Standing", "standings"]


@dataclass(frozen=True, slots=True)
class Standing:
    """One budget's current period."""

    budget: MoneyBudget
    start: datetime
    resets_at: datetime
    spent: Decimal

    @property
    def remaining(self) -> Decimal:
        return max(self.budget.amount - self.spent, Decimal(0))

    @property
    def spent_cents(self) -> Decimal:
        return self.spent.quantize(Decimal("0.01"), ROUND_HALF_EVEN)

    @property
    def remaining_cents(self) -> Decimal:
        return self.remaining.quantize(Decimal("0.01"), ROUND_HALF_EVEN)

    @property
    def percent(self) -> float:
        return float(self.spent / self.budget.amount * 100) if self.budget.amount else 0.0

    @property
    def over(self) -> bool:
        return self.spent >= self.budget.amount

    @property
    def owner(self) -> str:
        key = self.budget.api_key
        return f"key {key.name} ({key.prefix})" if key is not None else "the tenant"


def standings(tenant: Tenant, at: datetime | None = None) -> list[Standing]:
    """The tenant's budget first, then its keys' budgets."""
    now = at or timezone.now()
    found = []
    rows = (MoneyBudget.objects.for_tenant(tenant).select_related("api_key")
            .order_by(F("api_key_id").asc(nulls_first=True)))
    for budget in rows:
        start, end = budget.bounds(now)
        spent = KeyUsage.objects.spend(tenant.pk, start, end, key_id=budget.api_key_id)
        found.append(Standing(budget, start, end, spent))
    return found
