from __future__ import annotations

from django.apps import AppConfig

from audit_app.registry import track


class TenantsAppConfig(AppConfig):
    name = "tenants_app"
    verbose_name = "Tenants"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Every change people and API clients make is audited; the gateway stamps a key's use.
        for name in ("Tenant", "PrefixCacheGroup", "Membership", "Invitation", "MoneyBudget"):
            track(self.get_model(name))
        track(self.get_model("ApiKey"), ignore=["last_used_at"])
