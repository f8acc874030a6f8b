"""What the control plane did and why: one timeline per deployment, and one for the cluster.

Every decision the reconciler, the node agents and the rollouts make is recorded here with
`record()`: placements, starts, readiness, failures, restarts, drains, stops, revisions and
rollouts, nodes lost or back and the instances replaced, and operators' cordons and node drains
with each of their steps (and, written by their own modules, autoscaling decisions). An
event is written in the transaction of the change it explains, so a change that rolls back
leaves no event behind.

The model lives in its own module below the other models (as the usage models do) so that
every layer, the node agent included, can record without importing the domain's workflows; its
foreign keys name the models by label.

Who reads what: platform admins read every event. A tenant user reads the deployment-level
kinds (`TENANT_KINDS`: desired state, scaling, revisions, rollouts, autoscaling) of the
deployments open to their tenants, without `data` and with paths redacted. Messages of those
kinds never name a host or quote an engine's error (those go in `data`), because tenant users
never learn where and how engines run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.db import models

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser, AnonymousUser

log = logging.getLogger(__name__)


class Kind(models.TextChoices):
    PLACED = "placed", "Placed"
    PLACEMENT_FAILED = "placement_failed", "Placement refused"
    STAGED = "staged", "Files staged"
    STARTING = "starting", "Starting"
    READY = "ready", "Ready"
    FAILED = "failed", "Failed"
    RESTARTING = "restarting", "Restarting"
    CRASH_LOOP = "crash_loop", "Crash loop"
    DRAINING = "draining", "Draining"
    DRAINED = "drained", "Drained"
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    DESIRED_STATE = "desired_state", "Desired state"
    SCALED = "scaled", "Scaled"
    REVISION = "revision", "Revision"
    APPLIED = "applied", "Revision applied"
    ROLLOUT_STARTED = "rollout_started", "Rollout started"
    ROLLOUT_STEP = "rollout_step", "Rollout step"
    ROLLOUT_PAUSED = "rollout_paused", "Rollout paused"
    ROLLOUT_RESUMED = "rollout_resumed", "Rollout resumed"
    ROLLOUT_SWITCHED = "rollout_switched", "Traffic switched"
    ROLLOUT_SUCCEEDED = "rollout_succeeded", "Rollout succeeded"
    ROLLOUT_FAILED = "rollout_failed", "Rollout failed"
    ROLLOUT_ABORTED = "rollout_aborted", "Rollout aborted"
    ROLLED_BACK = "rolled_back", "Rolled back"
    AUTOSCALE = "autoscale", "Autoscaling decision"
    NODE_LOST = "node_lost", "Node lost"
    NODE_BACK = "node_back", "Node back"
    REPLACED = "instance_replaced", "Instance replaced"
    NODE_CORDONED = "node_cordoned", "Node cordoned"
    NODE_UNCORDONED = "node_uncordoned", "Node uncordoned"
    NODE_DRAIN = "node_drain", "Node drain requested"
    DRAIN_STEP = "drain_step", "Node drain step"
    DRAIN_WAITING = "drain_waiting", "Node drain waiting"
    DRAIN_DONE = "drain_done", "Node drained"
    CANARY_FAILED = "canary_failed", "Canary generation failed"
    CANARY_PASSED = "canary_passed", "Canary generation passed"


class Level(models.TextChoices):
    INFO = "info", "Info"
    WARNING = "warning", "Warning"
    ERROR = "error", "Error"


# What a tenant user may read (the module docstring says why these).
TENANT_KINDS = (
    Kind.DESIRED_STATE, Kind.SCALED, Kind.REVISION, Kind.APPLIED, Kind.ROLLOUT_STARTED,
    Kind.ROLLOUT_PAUSED, Kind.ROLLOUT_RESUMED, Kind.ROLLOUT_SWITCHED, Kind.ROLLOUT_SUCCEEDED,
    Kind.ROLLOUT_FAILED, Kind.ROLLOUT_ABORTED, Kind.ROLLED_BACK, Kind.AUTOSCALE,
)


class EventQuerySet(models.QuerySet["Event"]):
    def for_user(self, user: AbstractUser | AnonymousUser) -> EventQuerySet:
        """Staff read every event; a tenant user the deployment-level events of the deployments
        open to their tenants (see the module docstring)."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(
            deployment__tenants__memberships__user__pk=user.pk, kind__in=TENANT_KINDS,
        ).distinct()


class Event(models.Model):
    """One thing the control plane did, with why (`message`) and the figures behind it (`data`)."""

    kind = models.CharField(max_length=32, choices=Kind.choices, db_index=True)
    level = models.CharField(max_length=8, choices=Level.choices, default=Level.INFO)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    deployment = models.ForeignKey(
        "serving_app.Deployment", null=True, blank=True, on_delete=models.CASCADE,
        related_name="events",
    )
    instance = models.ForeignKey(
        "serving_app.Instance", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="events",
    )
    node = models.ForeignKey(
        "serving_app.Node", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="events",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = EventQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["deployment", "-created_at"], name="event_deployment_at")]

    def __str__(self) -> str:
        return f"{self.get_kind_display()}: {self.message[:80]}"

    @property
    def detail(self) -> str:
        """The reason or engine error behind the message, where there is one (staff only)."""
        value = self.data.get("error") or self.data.get("reason") or ""
        return str(value)


def _pk(value: Any) -> int | None:
    if value is None or isinstance(value, int):
        return value
    return int(value.pk)


def record(
    kind: str,
    message: str,
    *,
    deployment: Any = None,
    instance: Any = None,
    node: Any = None,
    data: dict[str, Any] | None = None,
    level: str = Level.INFO,
) -> Event:
    """Record one event. `deployment`, `instance` and `node` are rows or ids; an instance's
    deployment and node are taken from it when not given."""
    deployment_id = _pk(deployment)
    node_id = _pk(node)
    instance_id = _pk(instance)
    if instance is not None and not isinstance(instance, int):
        deployment_id = deployment_id or instance.deployment_id
        node_id = node_id or instance.node_id
    log.info("event %s: %s", kind, message)
    return Event.objects.create(
        kind=kind, level=level, message=message, data=data or {},
        deployment_id=deployment_id, instance_id=instance_id, node_id=node_id,
    )


__all__ = ["TENANT_KINDS", "Event", "EventQuerySet", "Kind", "Level", "record"]
