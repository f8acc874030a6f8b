from __future__ import annotations

from django.apps import AppConfig


class GuardrailsAppConfig(AppConfig):
    name = "guardrails_app"
    verbose_name = "Guardrails"
    default_auto_field = "django.db.models.BigAutoField"
