"""`{% firing_alerts %}` (the console overview: every firing alert) and
`{% firing_alerts tenant %}` (a tenant's portal home: the alerts that concern it)."""

from __future__ import annotations

from typing import Any

from django import template
from django.urls import reverse

from alerts_app.models import Alert
from tenants_app.models import Tenant

register = template.Library()


@register.inclusion_tag("alerts/_firing.html")
def firing_alerts(tenant: Tenant | None = None) -> dict[str, Any]:
    alerts = Alert.objects.firing().select_related("rule", "tenant").order_by("-fired_at")
    if tenant is not None:
        alerts = alerts.filter(tenant=tenant)
        link = reverse("portal-alerts:alerts", kwargs={"slug": tenant.slug})
    else:
        link = reverse("alerts:console")
    shown = list(alerts[:20])
    return {"alerts": shown, "more": max(alerts.count() - len(shown), 0) if len(shown) == 20
            else 0, "link": link}
