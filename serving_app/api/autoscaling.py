"""Autoscaling policies in the management API (platform admins only; tenants get 403).

- ``/api/v1/autoscalers/``: one policy per deployment (named by the deployment's name): list,
  create, read, change, delete. A body is validated by the model's ``clean()`` (through
  ``ValidatedModelSerializer``): a range with ``min_replicas`` above ``max_replicas`` or a
  KV-cache target above 1 is a 400 under the field. What the control worker last decided, and
  when it last scaled, are read-only fields; each change it made is an event on the deployment.
"""

from __future__ import annotations

from rest_framework import serializers

from serving_app.models import Deployment
from serving_app.models.autoscalers import Autoscaler
from tenants_app.api.base import (
    IsStaff,
    LookupSlugField,
    ScopedModelViewSet,
    ValidatedModelSerializer,
)


class AutoscalerSerializer(ValidatedModelSerializer):
    deployment = LookupSlugField(slug_field="name", queryset=Deployment.objects.all())
    replicas = serializers.IntegerField(source="deployment.replicas", read_only=True)

    class Meta:
        model = Autoscaler
        fields = ["id", "deployment", "enabled", "min_replicas", "max_replicas", "metric",
                  "target", "up_window_seconds", "down_window_seconds", "up_cooldown_seconds",
                  "down_cooldown_seconds", "replicas", "last_decision", "last_scaled_at",
                  "last_evaluated_at", "updated_at"]
        read_only_fields = ["id", "replicas", "last_decision", "last_scaled_at",
                            "last_evaluated_at", "updated_at"]


class AutoscalerViewSet(ScopedModelViewSet):
    """Autoscaling policies: a deployment's replica range, metric and target, windows and
    cooldowns. The console keeps the replicas that would bring the metric's average per ready
    instance to the target; it scales up to the smallest of those over the up window and down
    to the largest over the down window, then waits the direction's cooldown. A minimum of 0
    lets an idle deployment stop; its next request wakes it."""

    # How decisions are made, in full: the Autoscaler model's docstring.

    queryset = Autoscaler.objects.select_related("deployment")
    serializer_class = AutoscalerSerializer
    permission_classes = [IsStaff]
    filterset_fields = ["enabled", "metric"]
