"""`{% engine_metrics deployment %}` / `{% engine_metrics instance=instance %}`: the engine
metric charts of a deployment page or an instance page (ui_app/console/metrics.py answers
their data)."""

from __future__ import annotations

from typing import Any

from django import template
from django.urls import reverse

from serving_app.metering import engine_charts as engine
from serving_app.models import Deployment, Instance

register = template.Library()


@register.inclusion_tag("console/_engine_metrics.html", takes_context=True)
def engine_metrics(context: template.Context, deployment: Deployment | None = None,
                   instance: Instance | None = None) -> dict[str, Any]:
    request = context["request"]
    if instance is not None:
        data_url = reverse("console:instance-metrics", args=[instance.pk])
    elif deployment is not None:
        data_url = reverse("console:deployment-metrics", args=[deployment.pk])
    else:
        raise template.TemplateSyntaxError("engine_metrics needs a deployment or an instance")
    return {
        "data_url": data_url,
        "ranges": engine.RANGES.values(),
        "range": engine.get_range(request.GET.get("range")),
        "charts": engine.CHARTS,
    }
