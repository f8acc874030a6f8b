from __future__ import annotations

from django.apps import AppConfig


class TenantsAppConfig(AppConfig):
    name = "tenants_app"
    verbose_name = "Tenants"
    default_auto_field = "django.db.models.BigAutoField"
