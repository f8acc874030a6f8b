"""Money budgets' pages: every tenant's and key's budget with its period's spend (what
PostgreSQL has written), what the gateway holds beyond it in Redis (reservations of requests in
flight, events not written yet), what is left and when the period ends; the forms that add and
change one (its rules are `MoneyBudget.clean()`'s). The portal shows a tenant its own through
`budget_rows()`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from functools import lru_cache
from typing import Any

import redis
from django.conf import settings
from django.db.models import QuerySet
from django.urls import reverse
from django.utils import timezone
from django.views.generic import TemplateView

from gateway_app import money
from serving_app.models import KeyUsage
from tenants_app.models import MoneyBudget
from ui_app.console.base import ObjectCreateView, ObjectUpdateView
from ui_app.console.forms import MoneyBudgetForm
from ui_app.scoping import StaffPage

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BudgetRow:
    """One budget as a page shows it (amounts in the price cards' currency)."""

    budget: MoneyBudget
    start: datetime
    end: datetime
    spent: Decimal
    reserved: Decimal | None  # None: Redis could not be read
    remaining: Decimal
    percent: float


@lru_cache(maxsize=4)
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def budget_rows(budgets: QuerySet[MoneyBudget]) -> list[BudgetRow]:
    """Each budget's current period: spent (written usage), reserved (what the gateway's Redis
    counter holds beyond that, for hard budgets), remaining."""
    now = timezone.now()
    found = list(budgets.select_related("tenant", "api_key"))
    try:
        counted = money.counted(_redis(settings.GATEWAY["REDIS_URL"]),
                                [b for b in found if b.hard_limit], now)
    except redis.RedisError as exc:
        log.warning("money budgets' counters not read: %s", exc)
        counted = None
    rows = []
    for budget in found:
        start, end = budget.bounds(now)
        spent = KeyUsage.objects.spend(budget.tenant_id, start, key_id=budget.api_key_id)
        reserved: Decimal | None = Decimal(0)
        if counted is None:
            reserved = None
        elif counted.get(budget.pk) is not None:
            reserved = max(Decimal(0), Decimal(counted[budget.pk] or 0) / money.NANO - spent)
        used = spent + (reserved or 0)
        rows.append(BudgetRow(budget, start, end, spent, reserved,
                              max(Decimal(0), budget.amount - used),
                              round(float(100 * used / budget.amount), 1)))
    return rows


class MoneyBudgetListView(StaffPage, TemplateView):
    template_name = "console/moneybudget_list.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["rows"] = budget_rows(MoneyBudget.objects.order_by("tenant__slug", "api_key_id"))
        return context


class MoneyBudgetCreateView(ObjectCreateView[MoneyBudget, MoneyBudgetForm]):
    model = MoneyBudget
    form_class = MoneyBudgetForm
    noun = "money budget"

    def get_initial(self) -> dict[str, Any]:
        return {"tenant": self.request.GET.get("tenant")}

    def get_success_url(self) -> str:
        return reverse("console:moneybudget-list")


class MoneyBudgetUpdateView(ObjectUpdateView[MoneyBudget, MoneyBudgetForm]):
    model = MoneyBudget
    form_class = MoneyBudgetForm
    noun = "money budget"

    def get_success_url(self) -> str:
        return reverse("console:moneybudget-list")
