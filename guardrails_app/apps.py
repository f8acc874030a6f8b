from __future__ import annotations

from django.apps import AppConfig

from audit_app.registry import track


class GuardrailsAppConfig(AppConfig):
    name = "guardrails_app"
    verbose_name = "Guardrails"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Policies, patterns and guard models are changed by people and API clients: every
        # change is audited.
        for name in ("FloorPolicy", "TenantPolicy", "KeyPolicy", "TenantPattern", "GuardModel"):
            track(self.get_model(name), ignore=["updated_at"])
