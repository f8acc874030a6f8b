from __future__ import annotations

from django.apps import AppConfig

from gateway_app.signals import connect_receivers


class GatewayAppConfig(AppConfig):
    name = "gateway_app"
    verbose_name = "Gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Every process that changes keys, tenants or the catalog (console, workers, commands)
        # publishes the gateway's cache invalidations.
        connect_receivers()
