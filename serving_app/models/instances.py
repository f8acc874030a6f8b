"""Instances: one engine process of a deployment each, where it runs and what state it is in,
and the headless workers of an instance that spans several nodes.

Node agents and the reconciler change an instance's state only through conditional updates
(`Instance.transition`). The foreign keys name the deployment, node and GPUs by label: those
modules sit above this one (a deployment and a node read their instances' states).
"""

from __future__ import annotations

import secrets
import shlex
from datetime import datetime
from typing import TYPE_CHECKING, Any, Self

from django.db import models
from django.urls import reverse
from django.utils import timezone

from serving_app import pki, signals
from serving_app.enginespec import EngineSpec
from serving_app.models import canaries, events
from serving_app.models.artifacts import ArtifactVersion
from serving_app.models.revisions import DeploymentRevision
from tenants_app.models import Tenant

if TYPE_CHECKING:
    from collections.abc import Iterable

    # request.user's types (AUTH_USER_MODEL is Django's own User).
    from django.contrib.auth.models import AnonymousUser, User


def new_instance_secret() -> str:
    """The engine's API key. Hex, because the engine's argument parser reads a value that begins
    with "-" as an option (`--api-key -x...`: "expected at least one argument"), which URL-safe
    base64 produced for one instance in 64: that instance could never start."""
    return secrets.token_hex(24)


class InstanceQuerySet(models.QuerySet["Instance"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(deployment__tenants__memberships__user=user).distinct()

    def for_tenant(self, tenant: Tenant) -> Self:
        """Instances of the deployments that serve the tenant."""
        return self.filter(deployment__tenants=tenant).distinct()

    def active(self) -> Self:
        return self.exclude(state__in=Instance.TERMINAL_STATES)


class Instance(models.Model):
    """One engine process of a deployment: where it runs and what state it is in."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        # Placed, its node agent fetching and verifying its files into the node's cache: no
        # port, no GPU memory, no engine yet (docs/artifacts.md, "Staging").
        STAGING = "staging", "Staging files"
        STARTING = "starting", "Starting"
        READY = "ready", "Ready"
        UNHEALTHY = "unhealthy", "Unhealthy"
        FAILED = "failed", "Failed"
        CRASH_LOOP = "crash_loop", "Crash loop"
        # Out of routing in every gateway worker, still running: its requests in flight finish
        # before it stops (serving_app/deployments/draining.py).
        DRAINING = "draining", "Draining"
        STOPPING = "stopping", "Stopping"
        STOPPED = "stopped", "Stopped"

    TERMINAL_STATES = (State.STOPPED,)

    deployment = models.ForeignKey("serving_app.Deployment", on_delete=models.CASCADE,
                                   related_name="instances")
    ordinal = models.PositiveIntegerField(default=0)
    generation = models.PositiveIntegerField(default=0)
    revision = models.ForeignKey(
        DeploymentRevision, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="instances", help_text="The engine settings this instance runs.",
    )
    standby_until = models.DateTimeField(
        null=True, blank=True,
        help_text="Blue-green: the previous generation, out of routing but kept running until "
                  "then so that a rollback switches back at once.",
    )
    node = models.ForeignKey(
        "serving_app.Node", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="instances",
    )
    gpus = models.ManyToManyField("serving_app.Gpu", blank=True, related_name="instances")
    replaces = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="replacements",
        help_text="The instance this one takes over from (moved off a draining node): that one "
                  "is stopped once this one is ready.",
    )
    gpu_memory_fraction = models.FloatField(null=True, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    restarts = models.PositiveIntegerField(default=0)
    restart_history = models.JSONField(
        default=list, blank=True, help_text="When recent restarts happened (ISO times)."
    )
    exit_code = models.IntegerField(null=True, blank=True)
    health_failures = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    log_tail = models.TextField(blank=True, default="")
    log_path = models.CharField(max_length=500, blank=True, default="")
    command = models.JSONField(default=list, blank=True)
    environment = models.JSONField(default=dict, blank=True)
    secret = models.CharField(max_length=64, default=new_instance_secret, editable=False)
    model_version = models.ForeignKey(
        ArtifactVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="instances",
        help_text="The base model's files this instance runs (pinned when it is created); empty "
                  "for a model at a legacy host path, and once the version was deleted (only "
                  "a stopped instance's can be: serving_app/artifacts/removal.py).")
    staging = models.JSONField(
        default=dict, blank=True, editable=False,
        help_text="Fetching its files into the node's cache before the start: artifact, bytes, "
                  "rate, error.")
    loaded_adapters = models.JSONField(default=list, blank=True)
    adapter_errors = models.JSONField(
        default=dict, blank=True, help_text="Adapters that failed to load here: name -> error."
    )
    canary = models.JSONField(
        default=dict, blank=True, editable=False,
        help_text="Canary generations on this engine (serving_app/engine/canary.py): model "
                  "name -> whether its last one passed, its error, attempts and next try. An "
                  "adapter is routed to here only once its canary has passed.",
    )
    next_restart_at = models.DateTimeField(null=True, blank=True)
    startup = models.JSONField(
        default=dict, blank=True,
        help_text="How far the engine's start has got, read from its log: the phase (loading "
                  "weights, compiling, capturing CUDA graphs...) and the figures it logged.",
    )
    cpu_cores = models.CharField(
        max_length=500, blank=True, default="", help_text="The CPU cores its engine is pinned to."
    )
    master_addr = models.CharField(
        max_length=100, blank=True, default="",
        help_text="Multi-node only: where the headless workers meet the leader (vLLM's "
                  "--master-addr, the leader node's address), chosen at placement.")
    master_port = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Multi-node only: the rendezvous port on the leader's node (--master-port).")
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = InstanceQuerySet.as_manager()

    class Meta:
        ordering = ["deployment__name", "ordinal"]

    def __str__(self) -> str:
        return f"{self.deployment_id and self.deployment.name}#{self.ordinal}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        # An instance created without a revision runs its deployment's applied one.
        if self._state.adding and self.revision_id is None and self.deployment_id:
            self.revision_id = self.deployment.applied_revision_id
        # ...and pins the version of its base model's files it will run: its revision's.
        if self._state.adding and self.model_version_id is None and self.deployment_id:
            revision = self.revision if self.revision_id else None
            self.model_version_id = (revision.model_version_id if revision is not None
                                     and revision.model_version_id else
                                     self.deployment.base_model.artifact_version_id)
        super().save(*args, **kwargs)

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:instance-detail", args=[self.pk])

    def engine_spec(self) -> EngineSpec:
        """The engine settings of this instance's revision: what its engine is started with,
        whatever was edited since."""
        return self.deployment.engine_spec(self.revision)

    def transition(self, expected: Iterable[str], new: str, **fields: Any) -> bool:
        """Move to `new` only if the row is still in one of `expected` (Celery may redeliver)."""
        now = timezone.now()
        expected = list(expected)
        updated = Instance.objects.filter(pk=self.pk, state__in=expected).update(
            state=new, state_changed_at=now, **fields
        )
        if updated:
            self.state = new
            self.state_changed_at = now
            for name, value in fields.items():
                setattr(self, name, value)
            if new == self.State.READY or self.State.READY in expected:
                # The gateway routes to ready instances: its workers hear of it now, not at
                # their next periodic refresh.
                signals.instance_routing_changed.send(sender=Instance, instance=self)
        return bool(updated)

    def leave_routing(self, reason: str, standby_until: datetime | None = None) -> bool:
        """A ready instance leaves routing and drains (its event says why); `standby_until`
        keeps it running, drained, until then for a rollback. False if it was not ready."""
        if not self.transition([self.State.READY], self.State.DRAINING,
                               standby_until=standby_until):
            return False
        kept = (f"; kept running until {standby_until:%H:%M:%S} for a rollback"
                if standby_until else "")
        events.record(events.Kind.DRAINING,
                      f"Instance #{self.ordinal} left routing and drains: {reason}{kept}.",
                      instance=self, data={"reason": reason})
        return True

    @property
    def routable_adapters(self) -> list[str]:
        """The loaded adapters whose canary generation has passed here: what the gateway
        routes to (a loaded adapter whose generation fails is never routed here)."""
        entries = self.canary or {}
        return [name for name in self.loaded_adapters or [] if canaries.passed(entries, name)]

    @property
    def canary_failures(self) -> list[str]:
        """The models (base model or adapters) whose last canary on this engine failed."""
        return sorted(name for name, entry in (self.canary or {}).items()
                      if not (entry or {}).get("ok"))

    @property
    def canary_problems(self) -> list[str]:
        """One line per model of this engine whose canary has not passed, with why."""
        return canaries.problems(self.canary or {}, self.deployment.base_model.name)

    @property
    def command_line(self) -> str:
        """The engine's command as a shell would take it (it holds no secret: the engine's key
        is in its environment only)."""
        return shlex.join(self.command or [])

    @property
    def base_url(self) -> str:
        address = self.node.address if self.node is not None else "127.0.0.1"
        return f"{pki.engine_scheme()}://{address}:{self.port}"

    @property
    def multi_node(self) -> bool:
        """Whether its engine spans several nodes: this row's node runs the leader (node rank
        0, the API server the gateway routes to), each `workers` row a headless worker."""
        return self.master_port is not None

    @property
    def nnodes(self) -> int:
        """Nodes its engine spans (vLLM's --nnodes)."""
        return 1 + self.workers.count() if self.multi_node else 1


class InstanceWorker(models.Model):
    """A headless worker of a multi-node instance: node rank 1 and up of its engine, on a node
    of its own, started, supervised and stopped by that node's agent. It serves no API: the
    leader (its instance's own node) does, and the gateway routes to the leader only. A worker
    lost is the group's failure: the leader's agent stops the whole group and the reconciler
    restarts it as one."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        STARTING = "starting", "Starting"
        RUNNING = "running", "Running"
        FAILED = "failed", "Failed"
        STOPPING = "stopping", "Stopping"
        STOPPED = "stopped", "Stopped"

    # A worker in these states may have a process; the others have none.
    LIVE_STATES = (State.STARTING, State.RUNNING, State.STOPPING)

    instance = models.ForeignKey(Instance, on_delete=models.CASCADE, related_name="workers")
    node_rank = models.PositiveIntegerField()
    node = models.ForeignKey(
        "serving_app.Node", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="instance_workers",
    )
    gpus = models.ManyToManyField("serving_app.Gpu", blank=True, related_name="instance_workers")
    state = models.CharField(max_length=16, choices=State.choices, default=State.STOPPED)
    pid = models.PositiveIntegerField(null=True, blank=True)
    command = models.JSONField(default=list, blank=True)
    environment = models.JSONField(
        default=dict, blank=True, help_text="The placer's environment for this node's part "
                                            "(its devices); the rest is the launch spec's.")
    log_path = models.CharField(max_length=500, blank=True, default="")
    log_tail = models.TextField(blank=True, default="")
    last_error = models.TextField(blank=True, default="")
    exit_code = models.IntegerField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["instance", "node_rank"]
        constraints = [models.UniqueConstraint(fields=["instance", "node_rank"],
                                               name="one_worker_per_node_rank")]

    def __str__(self) -> str:
        return f"{self.instance} rank {self.node_rank}"

    def transition(self, expected: Iterable[str], new: str, **fields: Any) -> bool:
        """Move to `new` only if the row is still in one of `expected` (Celery may redeliver)."""
        now = timezone.now()
        updated = InstanceWorker.objects.filter(pk=self.pk, state__in=list(expected)).update(
            state=new, state_changed_at=now, **fields)
        if updated:
            self.state = new
            self.state_changed_at = now
            for name, value in fields.items():
                setattr(self, name, value)
        return bool(updated)
