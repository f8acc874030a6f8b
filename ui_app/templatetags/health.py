"""`{% health_banner %}`: the console's "degraded" banner while PostgreSQL, Redis or the usage
writer is unhealthy (see serving_app/metering/health.py)."""

from __future__ import annotations

from typing import Any

from django import template

from serving_app.metering import health

register = template.Library()


@register.inclusion_tag("console/_health_banner.html")
def health_banner() -> dict[str, Any]:
    return {"problems": health.cached_report().problems}
