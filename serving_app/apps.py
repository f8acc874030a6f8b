from __future__ import annotations

from django.apps import AppConfig


class ServingAppConfig(AppConfig):
    name = "serving_app"
    verbose_name = "Serving"
    default_auto_field = "django.db.models.BigAutoField"
