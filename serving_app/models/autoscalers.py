"""A deployment's autoscaling policy: the row people set (off by default) and what the control
worker last decided. The decisions are made in `serving_app.deployments.autoscaling`.

The model lives in its own module below `deployments` (as the engine samples do): it names the
deployment by label, so the node agent and every layer above can read it without importing the
domain's workflows.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.urls import reverse

from serving_app.enginespec import MAX_REPLICAS
from tenants_app.models import StaffOnlyQuerySet


class Metric(models.TextChoices):
    WAITING = "waiting", "Waiting requests per instance"
    KV_CACHE = "kv_cache", "KV-cache usage per instance (0 to 1)"
    RUNNING = "running", "Running and waiting requests per instance"


class Autoscaler(models.Model):
    """How many instances a deployment runs, decided from its engines' metric samples.

    The control worker computes, every engine-metrics interval, the replicas that would bring the
    metric's average per ready instance to `target` (ceil(ready x average / target), within
    `min_replicas`..`max_replicas`; for the request-count metrics the requests waiting in the
    gateway's flow-control queue count as waiting on the deployment's instances), and keeps
    those recommendations. It scales up to the
    smallest recommendation of the last `up_window_seconds` when that is above the current count,
    and down to the largest of the last `down_window_seconds` when that is below it (so a short
    spike does not scale up and a short lull does not scale down); after a change it waits the
    direction's cooldown. `min_replicas` 0 lets an idle deployment (no token generated over the
    down window) scale to zero; the gateway wakes it on the next request.
    """

    deployment = models.OneToOneField("serving_app.Deployment", on_delete=models.CASCADE,
                                      related_name="autoscaler")
    enabled = models.BooleanField(default=False)
    min_replicas = models.PositiveSmallIntegerField(
        default=1, validators=[MaxValueValidator(MAX_REPLICAS)],
        help_text="0 lets an idle deployment stop; the first request wakes it.")
    max_replicas = models.PositiveSmallIntegerField(
        default=2, validators=[MinValueValidator(1), MaxValueValidator(MAX_REPLICAS)])
    metric = models.CharField(max_length=16, choices=Metric.choices, default=Metric.WAITING)
    target = models.FloatField(
        default=2.0, validators=[MinValueValidator(0.01)],
        help_text="The metric's wanted average per ready instance.")
    up_window_seconds = models.PositiveIntegerField(
        default=30, validators=[MaxValueValidator(3600)],
        help_text="Scale up only when every recommendation of this window is above the count.")
    down_window_seconds = models.PositiveIntegerField(
        default=300, validators=[MaxValueValidator(86400)],
        help_text="Scale down only when every recommendation of this window is below it.")
    up_cooldown_seconds = models.PositiveIntegerField(
        default=60, validators=[MaxValueValidator(86400)],
        help_text="After a change, no scaling up for this long.")
    down_cooldown_seconds = models.PositiveIntegerField(
        default=300, validators=[MaxValueValidator(86400)],
        help_text="After a change, no scaling down for this long.")
    # Written by the control worker with update() (no audit entry: not a person's change).
    recommendations = models.JSONField(default=list, blank=True, editable=False,
                                       help_text="[epoch seconds, replicas] of the last window.")
    last_scaled_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_decision = models.TextField(blank=True, editable=False)
    last_evaluated_at = models.DateTimeField(null=True, blank=True, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["deployment_id"]

    def __str__(self) -> str:
        return str(self.deployment)

    def get_absolute_url(self) -> str:
        """Its page in the console (the admin's "view on site" too)."""
        return reverse("console:deployment-autoscaling", args=[self.deployment_id])

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.min_replicas > self.max_replicas:
            errors["min_replicas"] = (f"Must not exceed max_replicas ({self.max_replicas}).")
        if self.metric == Metric.KV_CACHE and self.target > 1:
            errors["target"] = "KV-cache usage is a share from 0 to 1: pick a target up to 1."
        if errors:
            raise ValidationError(errors)
