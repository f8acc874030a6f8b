"""A money budget's soft threshold alerts through the alert rules and channels once a period:
the platform rule `money-budget-soft` fires when a budget's period spend reaches it, stays
firing (one notification) while the period lasts, and resolves when the next period starts."""

from __future__ import annotations

import importlib
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.apps import apps as django_apps

from alerts_app.evaluate import evaluate
from alerts_app.models import Alert, AlertTransition, Notification
from serving_app.models import PriceCard
from tenants_app.models import MoneyBudget
from tests.alerts.conftest import traffic

pytestmark = pytest.mark.django_db

State = Alert.State

NOON = datetime(2026, 12, 2, 11, 0, tzinfo=UTC)  # noon in Berlin


@pytest.fixture
def money_rule():
    importlib.import_module("alerts_app.migrations.0006_money_budget_soft_rule").create_rule(
        django_apps, None)


def test_the_soft_threshold_fires_once_a_period(served, money_rule, platform_hook):
    acme, _, deployment = served
    # Each traffic() request: 10 prompt and 5 completion tokens at 1 per token (per million
    # 1,000,000): 15 a request.
    PriceCard.objects.create(base_model=deployment.base_model, effective_from=NOON
                             - timedelta(days=30), input_per_million=Decimal(10**6),
                             cached_input_per_million=Decimal(10**6),
                             output_per_million=Decimal(10**6))
    MoneyBudget.objects.create(tenant=acme, amount=Decimal(1000), period="day",
                               time_zone="Europe/Berlin", soft_threshold_percent=50)
    traffic(acme, NOON - timedelta(hours=1), n=30, deployment=deployment.pk)  # 450: 90%
    evaluate(now=NOON)
    assert not Alert.objects.filter(rule__key="money-budget-soft", state=State.FIRING)
    traffic(acme, NOON, n=4, deployment=deployment.pk)  # 510: past 500
    evaluate(now=NOON + timedelta(minutes=1))
    (alert,) = Alert.objects.filter(rule__key="money-budget-soft")
    assert alert.state == State.FIRING and alert.tenant == acme
    traffic(acme, NOON + timedelta(minutes=2), n=10, deployment=deployment.pk)
    evaluate(now=NOON + timedelta(minutes=3))
    evaluate(now=NOON + timedelta(minutes=4))
    fired = AlertTransition.objects.filter(alert=alert, kind=AlertTransition.Kind.FIRING)
    assert fired.count() == 1
    assert Notification.objects.filter(transition__alert=alert,
                                       channel=platform_hook).count() == 1
    # The next local day (Berlin's midnight, 23:00 UTC): nothing spent yet, it resolves.
    evaluate(now=datetime(2026, 12, 2, 23, 1, tzinfo=UTC))
    alert.refresh_from_db()
    assert alert.state != State.FIRING
