"""Revisions of a deployment's engine settings, and the rollouts that apply them.

Editing the settings that change how a deployment's engines run (`ENGINE_FIELDS`, declared in
`serving_app.enginespec`) records a new `DeploymentRevision`. It is pending until someone
applies it: the deployment keeps running its applied revision, and every instance started
meanwhile (a restart, a scale-up, a replacement) runs that one. Each instance
records the revision it runs, so drift is read from the settings, never from a command line.
Adapters are not part of a revision: they are loaded and unloaded at runtime, as before. The
base model's files are: a revision pins the model's artifact version (`model_version`), so a
new version of the model's files rolls out, and rolls back, like a changed setting.

Applying (`Deployment.apply()`) creates a `Rollout`: the target revision, a strategy and its
options. The reconciler carries it out round by round (`serving_app/deployments/rollout.py`) and
keeps its state here, in PostgreSQL, so that a control worker that restarts resumes it where it was.
Operators pause, resume and abort it (`Rollout.pause()/resume()/abort()`); a rollback returns
to the revision applied before (`Deployment.rollback()`).

These models sit below `deployments` and `instances` (their foreign keys name the models by
label), so that the deployment's workflows can create them and an instance can name its revision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from audit_app import recording
from serving_app import lifecycle
from serving_app.enginespec import ENGINE_FIELDS, MAX_REPLICAS, EngineSpec, with_defaults
from serving_app.models import events

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser, AnonymousUser


def spec_of(deployment: Any) -> dict[str, Any]:
    """The engine settings of a deployment as they are now (saved or not), JSON-ready."""
    return {name: getattr(deployment, name) for name in ENGINE_FIELDS}


@dataclass(frozen=True)
class Change:
    """One engine setting that differs between two revisions."""

    field: str
    old: Any
    new: Any

    def as_dict(self) -> dict[str, Any]:
        return {"field": self.field, "old": self.old, "new": self.new}

    def __str__(self) -> str:
        return f"{self.field} {_shown(self.old)} → {_shown(self.new)}"


def _shown(value: Any) -> str:
    return "empty" if value is None or value == "" else str(value)


def diff(old: dict[str, Any] | None, new: dict[str, Any]) -> list[Change]:
    """The settings that differ from `old` to `new`, in `ENGINE_FIELDS` order (a setting a
    revision lacks, declared after it was recorded, is at its default)."""
    old = with_defaults(old) if old is not None else {}
    new = with_defaults(new)
    return [Change(name, old.get(name), new[name]) for name in ENGINE_FIELDS
            if old.get(name) != new[name]]


def describe(changes: list[Change]) -> str:
    return "; ".join(str(c) for c in changes) or "no engine setting changed"


class DeploymentRevision(models.Model):
    """One version of a deployment's engine settings (`spec`), numbered from 1."""

    deployment = models.ForeignKey(
        "serving_app.Deployment", on_delete=models.CASCADE, related_name="revisions"
    )
    number = models.PositiveIntegerField()
    spec = models.JSONField(default=dict)
    model_version = models.ForeignKey(
        "serving_app.ArtifactVersion", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
        help_text="The base model's files this revision runs (empty: a legacy host path, or a "
                  "version deleted since, which only an older revision's can be); a new "
                  "version of the model is a new revision, rolled out and rolled back as one.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["deployment_id", "-number"]
        verbose_name = "deployment revision"
        constraints = [
            models.UniqueConstraint(fields=["deployment", "number"],
                                    name="unique_revision_number"),
        ]

    def __str__(self) -> str:
        return f"revision {self.number}"

    def previous(self) -> DeploymentRevision | None:
        return (DeploymentRevision.objects.filter(deployment_id=self.deployment_id,
                                                  number__lt=self.number)
                .order_by("-number").first())

    def engine_spec(self) -> EngineSpec:
        """What an instance of this revision runs with, resolved against the base model."""
        return EngineSpec.resolve(self.spec, self.deployment.base_model)

    def changes_from(self, other: DeploymentRevision | None) -> list[Change]:
        """What this revision changes relative to `other` (the one before it by default)."""
        return diff(other.spec if other is not None else None, self.spec)


class RolloutQuerySet(models.QuerySet):
    def active(self) -> RolloutQuerySet:
        return self.filter(state__in=Rollout.ACTIVE_STATES)

    def for_user(self, user: AbstractUser | AnonymousUser) -> RolloutQuerySet:
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(deployment__tenants__memberships__user=user).distinct()


class Rollout(models.Model):
    """Moving a deployment's instances from one revision to another, and where that stands.

    The reconciler writes `step`, `instances_done`, `phase` and the outcome; operators change
    `state` between running and paused, or end it (abort). Only one rollout of a deployment is
    active (running or paused) at a time.
    """

    class Strategy(models.TextChoices):
        ROLLING = "rolling", "Rolling"
        BLUE_GREEN = "blue_green", "Blue-green"

    class State(models.TextChoices):
        RUNNING = "running", "Running"
        PAUSED = "paused", "Paused"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        ABORTED = "aborted", "Aborted"
        ROLLED_BACK = "rolled_back", "Rolled back"

    class Phase(models.TextChoices):
        """Blue-green only: the new generation is starting, or traffic was switched to it."""

        STARTING = "starting", "Starting the new generation"
        SWITCHED = "switched", "Switched; keeping the old generation"

    ACTIVE_STATES = (State.RUNNING, State.PAUSED)
    DEFAULT_KEEP_OLD_SECONDS = 300

    deployment = models.ForeignKey(
        "serving_app.Deployment", on_delete=models.CASCADE, related_name="rollouts"
    )
    from_revision = models.ForeignKey(
        DeploymentRevision, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    to_revision = models.ForeignKey(
        DeploymentRevision, on_delete=models.CASCADE, related_name="rollouts"
    )
    strategy = models.CharField(max_length=16, choices=Strategy.choices,
                                default=Strategy.ROLLING)
    max_surge = models.PositiveSmallIntegerField(
        default=1, validators=[MaxValueValidator(MAX_REPLICAS)],
        help_text="Rolling: new instances started beside the old ones at once.",
    )
    max_unavailable = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(MAX_REPLICAS)],
        help_text="Rolling: how many fewer ready instances than replicas are allowed.",
    )
    keep_old_seconds = models.PositiveIntegerField(
        default=DEFAULT_KEEP_OLD_SECONDS, validators=[MaxValueValidator(7 * 86400)],
        help_text="Blue-green: how long the old generation keeps running after the switch, "
                  "for a rollback.",
    )
    state = models.CharField(max_length=16, choices=State.choices, default=State.RUNNING)
    phase = models.CharField(max_length=16, choices=Phase.choices, blank=True, default="")
    step = models.TextField(blank=True, default="", help_text="What the rollout does now.")
    instances_done = models.PositiveIntegerField(default=0)
    instances_total = models.PositiveIntegerField(default=0)
    stop_then_start = models.BooleanField(
        default=False, help_text="No capacity was spare: old instances stopped before their "
                                 "replacements started.",
    )
    reason = models.TextField(blank=True, default="", help_text="Why it failed or ended.")
    switched_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = RolloutQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment"], condition=Q(state__in=["running", "paused"]),
                name="one_active_rollout_per_deployment",
            ),
            models.CheckConstraint(
                condition=~Q(strategy="rolling", max_surge=0, max_unavailable=0),
                name="rolling_rollout_can_move",
            ),
        ]

    def __str__(self) -> str:
        before = self.from_revision
        source = f"revision {before.number}" if before is not None else "none"
        return f"{source} → revision {self.to_revision.number} ({self.get_strategy_display()})"

    @property
    def is_active(self) -> bool:
        return self.state in self.ACTIVE_STATES

    def clean(self) -> None:
        if (self.strategy == self.Strategy.ROLLING and not self.max_surge
                and not self.max_unavailable):
            raise ValidationError({"max_surge": "With max_unavailable 0, max_surge must be at "
                                                "least 1, or the rollout can never move."})

    # -- operators' actions: each a conditional change of the row, locked against the
    # reconciler's round, that leaves its audit entry (the update sends no signal), then a
    # reconcile once it commits.
    def pause(self) -> dict[str, list]:
        return self._move("pause", [self.State.RUNNING], self.State.PAUSED,
                          events.Kind.ROLLOUT_PAUSED,
                          "Rollout paused: nothing new starts or stops until it is resumed.")

    def resume(self) -> dict[str, list]:
        return self._move("resume", [self.State.PAUSED], self.State.RUNNING,
                          events.Kind.ROLLOUT_RESUMED, "Rollout resumed.")

    def abort(self, reason: str = "") -> dict[str, list]:
        """End the rollout and return to the revision the deployment ran before it. A blue-green
        rollout that already switched switches back at once to the old generation, which is
        still running; otherwise the new instances are replaced by instances of the old
        revision without downtime (old ones start before new ones stop)."""
        with transaction.atomic():
            row = self._locked()
            if not row.is_active:
                raise ValidationError(f"The rollout is {row.get_state_display().lower()}, "
                                      "not running or paused.")
            switched_back = row.phase == self.Phase.SWITCHED
            state = self.State.ROLLED_BACK if switched_back else self.State.ABORTED
            detail = reason or "Aborted by an operator."
            if switched_back:
                self._switch_back(row)
            Rollout.objects.filter(pk=self.pk).update(
                state=state, reason=detail, finished_at=timezone.now(),
                step="Returned to the revision that ran before.",
            )
            source = row.from_revision
            target = source.number if source is not None else "none"
            message = (f"Switched traffic back to revision {target}." if switched_back else
                       f"Rollout to revision {row.to_revision.number} aborted: the deployment "
                       f"returns to revision {target}.")
            events.record(
                events.Kind.ROLLED_BACK if switched_back else events.Kind.ROLLOUT_ABORTED,
                message, deployment=row.deployment_id, level=events.Level.WARNING,
                data={"rollout": row.pk, "reason": detail},
            )
            recording.record("abort", row, {"state": [row.state, state]})
            lifecycle.deployment_changed(row.deployment_id)
        before = row.state
        self.refresh_from_db()
        return {"state": [before, self.state]}

    def _locked(self) -> Rollout:
        """The row as committed, locked after its deployment's row, in the reconciler's order.

        A reconcile round locks the deployment, then its active rollout. Locking the rollout
        alone deadlocked with such a round (seen in CI on a resume): the round waited for the
        rollout, and this transaction's commit waited for the deployment, whose key the
        foreign keys of the event and audit rows it wrote must share."""
        deployments = Rollout.deployment.field.related_model.objects  # type: ignore[attr-defined]
        list(deployments.select_for_update(of=("self",), no_key=True)
             .filter(pk=self.deployment_id).values_list("pk", flat=True))
        return Rollout.objects.select_for_update().get(pk=self.pk)

    def _switch_back(self, row: Rollout) -> None:
        """Blue-green after the switch: the old generation, kept running out of routing, serves
        again, and the new one leaves routing, in this one transaction (the gateway never routes
        to both); the deployment's applied revision is the old one again. The reconciler then
        stops the new generation once it has drained."""
        deployment = row.deployment
        type(deployment).objects.filter(pk=deployment.pk).update(
            applied_revision=row.from_revision_id)
        kept = deployment.instances.filter(state="draining", standby_until__isnull=False,
                                           revision_id=row.from_revision_id)
        for instance in kept:
            instance.transition(["draining"], "ready", standby_until=None)
        source = row.from_revision.number if row.from_revision else "none"
        for instance in deployment.instances.filter(state="ready", revision_id=row.to_revision_id):
            instance.leave_routing(f"traffic switched back to revision {source}")

    def _move(self, action: str, expected: list[str], new: str, kind: str,
              message: str) -> dict[str, list]:
        with transaction.atomic():
            row = self._locked()
            if row.state not in expected:
                raise ValidationError(f"The rollout is {row.get_state_display().lower()}.")
            Rollout.objects.filter(pk=self.pk).update(state=new)
            recording.record(action, row, {"state": [row.state, new]})
            events.record(kind, message, deployment=row.deployment_id, data={"rollout": row.pk})
            lifecycle.deployment_changed(row.deployment_id)
        before = row.state
        self.state = new
        return {"state": [before, new]}


__all__ = ["ENGINE_FIELDS", "Change", "DeploymentRevision", "Rollout", "describe", "diff",
           "spec_of"]
