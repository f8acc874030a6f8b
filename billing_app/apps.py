from __future__ import annotations

from django.apps import AppConfig


class BillingAppConfig(AppConfig):
    """Statements, showback and chargeback, and the FOCUS export (docs/statements.md). It owns
    no model: it reads the price cards, usage and placement records of serving_app and each
    tenant's billing basis."""

    name = "billing_app"
    verbose_name = "Billing"
    default_auto_field = "django.db.models.BigAutoField"
