"""Nodes (hosts running a node agent), their GPUs and MIG devices, and the GPUs' readings.

A node's operator actions (cordon, uncordon, drain) are methods that record their audit entry
and their event on the cluster's timeline.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.urls import reverse
from django.utils import timezone

from audit_app import recording
from audit_app.recording import Changes
from serving_app import lifecycle
from serving_app.models import events
from serving_app.models.instances import Instance
from serving_app.placement.inventory import cpulist_text, parse_cpulist
from tenants_app.models import StaffOnlyQuerySet


class Node(models.Model):
    """A host running a node agent (a Celery worker consuming `queue`)."""

    class InventorySource(models.TextChoices):
        NVML = "nvml", "NVML"
        DECLARED = "declared", "Declared in configuration"

    name = models.SlugField(max_length=100, unique=True)
    queue = models.CharField(max_length=150, unique=True)
    address = models.CharField(
        max_length=100, default="127.0.0.1", help_text="Where the gateway reaches its engines."
    )
    engine_env = models.CharField(max_length=500, blank=True, help_text="Engine virtualenv path.")
    engine_python = models.CharField(
        max_length=500, blank=True, default="",
        help_text="The engines' Python interpreter (NODE_ENGINE_PYTHON; blank: the engine "
                  "virtualenv's bin/python), e.g. the host's own python3 with torch.",
    )
    engine_pythonpath = models.CharField(
        max_length=2000, blank=True, default="",
        help_text="Folders put first on the engines' PYTHONPATH (NODE_ENGINE_PYTHONPATH), e.g. "
                  "a pip --target folder holding vLLM.",
    )
    engine_versions = models.JSONField(
        default=dict, blank=True, editable=False,
        help_text="What the engine interpreter reported when the agent registered: Python, "
                  "vLLM, torch, CUDA and driver versions, or the error.",
    )
    cpu_binding = models.CharField(
        max_length=200, blank=True, default="",
        help_text="How engines are pinned to CPU cores: blank pins each engine to the cores "
                  "nearest its GPUs (NVML's CPU affinity), 'off' pins nothing, a CPU list such "
                  "as 0-7,16-23 pins every engine of the node there.",
    )
    mps = models.JSONField(
        default=dict, blank=True, editable=False,
        help_text="The node's MPS control daemon, as its agent last saw it.",
    )
    inventory_source = models.CharField(
        max_length=16, choices=InventorySource.choices, default=InventorySource.DECLARED
    )
    cordoned = models.BooleanField(default=False, help_text="Gets no new instances.")
    draining = models.BooleanField(
        default=False, editable=False,
        help_text="Its instances are being moved to other nodes, one at a time (it is cordoned).",
    )
    drain_status = models.CharField(
        max_length=500, blank=True, default="", editable=False,
        help_text="Where the drain stands: the move in progress, or why it waits.",
    )
    lost_at = models.DateTimeField(
        null=True, blank=True, editable=False,
        help_text="When the reconciler declared the node lost (its heartbeat had stopped) and "
                  "replaced its instances; cleared when its agent is back.",
    )
    max_instances = models.PositiveIntegerField(
        default=4, help_text="Engines this host may run when it has no GPUs (CPU engines)."
    )
    # The node's artifact cache, as its agent reports it (serving_app/artifacts/staging.py).
    cache_path = models.CharField(max_length=500, blank=True, default="", editable=False)
    cache_quota_bytes = models.PositiveBigIntegerField(default=0, editable=False)
    cache_used_bytes = models.PositiveBigIntegerField(default=0, editable=False)
    cache_url = models.CharField(
        max_length=200, blank=True, default="", editable=False,
        help_text="Where other nodes fetch the files of its cache (its agent's peer server).")
    fetch_token_hash = models.CharField(
        max_length=64, blank=True, default="", editable=False,
        help_text="SHA-256 of the node's token: what its agent fetches artifacts with (made "
                  "by the join exchange, or by the agent of a node that did not join).")
    # The node's own database role and Redis user, made by the join exchange and dropped when
    # the node is deleted (serving_app/fleet/credentials.py); blank for a node that did not join
    # (its agent runs with the installation's shared URLs).
    db_role = models.CharField(max_length=63, blank=True, default="", editable=False)
    redis_user = models.CharField(max_length=100, blank=True, default="", editable=False)
    agent_pid = models.PositiveIntegerField(null=True, blank=True, editable=False)
    last_heartbeat = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:node-detail", args=[self.pk])

    def clean(self) -> None:
        if self.queue and not self.queue.startswith("node."):
            raise ValidationError({"queue": "A node agent's queue is named node.<host>."})
        if self.cpu_binding not in ("", "off"):
            try:
                self.cpu_binding = cpulist_text(parse_cpulist(self.cpu_binding))
            except ValueError as exc:
                raise ValidationError({"cpu_binding": str(exc)}) from exc

    def effective_cpu_binding(self) -> list[tuple[str, str]]:
        """Where this node's engines are pinned, as (what, CPU list) rows for its page: the
        node's CPU list for every engine, nothing ("off"), or by default each GPU's nearest
        cores (`serving_app.engine.starting.cpu_cores()` applies the same rule at each
        launch)."""
        if self.cpu_binding == "off":
            return [("every engine", "off: not pinned")]
        if self.cpu_binding:
            return [("every engine", self.cpu_binding)]
        rows = [(f"nearest cores of GPU {gpu.index}",
                 gpu.cpu_affinity or "unknown (NVML gave none)")
                for gpu in self.gpus.all() if gpu.parent_id is None]
        return rows or [("every engine", "not pinned (no GPU to be near)")]

    @property
    def is_lost(self) -> bool:
        if self.last_heartbeat is None:
            return True
        age = timezone.now() - self.last_heartbeat
        return age > timedelta(seconds=settings.NODE_LOST_SECONDS)

    @property
    def state(self) -> str:
        if self.is_lost or self.lost_at:
            return "lost"
        if self.draining:
            return "draining"
        return "cordoned" if self.cordoned else "ready"

    # -- operator actions. Each records its audit entry (a conditional update sends no signal)
    # and returns the change made ({field: [before, after]}, empty when nothing changed).
    def cordon(self) -> Changes:
        """No new instances on this node; what runs here goes on running."""
        return self._change("cordon", cordoned=True)

    def uncordon(self) -> Changes:
        """Take new instances again; a drain in progress stops after the move under way."""
        changes = self._change("uncordon", cordoned=False, draining=False, drain_status="")
        lifecycle.nodes_changed()  # placements that waited for room may fit now
        return changes

    def drain(self) -> Changes:
        """Cordon the node and move every instance off it, one at a time: the reconciler starts
        a replacement elsewhere, waits until it is ready, then stops the old one. Refused when
        no other node could take anything."""
        serving = self.instances.filter(
            state__in=(Instance.State.READY, Instance.State.UNHEALTHY, Instance.State.STARTING,
                       Instance.State.STAGING)
        ).count()
        others = [n for n in Node.objects.exclude(pk=self.pk).filter(cordoned=False)
                  if not n.is_lost]
        if serving and not others:
            raise ValidationError(
                f"Nothing to move the {serving} instance(s) of {self.name} to: no other node is "
                "online and uncordoned. Start another node agent, or cordon this node instead."
            )
        changes = self._change("drain", cordoned=True, draining=True,
                               drain_status="Drain requested." if not self.draining
                               else self.drain_status)
        lifecycle.nodes_changed()
        return changes

    def _change(self, action: str, **values: object) -> Changes:
        with transaction.atomic():
            current = Node.objects.select_for_update().get(pk=self.pk)
            changes = {name: [getattr(current, name), value] for name, value in values.items()
                       if getattr(current, name) != value}
            if changes:
                Node.objects.filter(pk=self.pk).update(**{n: v[1] for n, v in changes.items()})
            for name, value in values.items():
                setattr(self, name, value)
        changes.pop("drain_status", None)  # a message, not a setting
        # Recorded even when nothing changed, as a deployment's start is: someone asked for it.
        recording.record(action, self, changes)
        if changes:
            kind, message = NODE_ACTION_EVENTS[action]
            events.record(kind, message.format(node=self.name), node=self)
        return changes


# The event on the cluster's timeline of each operator action on a node that changed it.
NODE_ACTION_EVENTS: dict[str, tuple[str, str]] = {
    "cordon": (events.Kind.NODE_CORDONED, "Node {node} cordoned: it gets no new instances."),
    "uncordon": (events.Kind.NODE_UNCORDONED, "Node {node} uncordoned: it takes new instances "
                                              "again."),
    "drain": (events.Kind.NODE_DRAIN, "Node {node} cordoned and drained: its instances move "
                                      "to other nodes, one at a time."),
}


class Gpu(models.Model):
    """A GPU (or a MIG device, with `parent` set) on a node."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=100)
    name = models.CharField(max_length=100)
    memory_total_bytes = models.PositiveBigIntegerField()
    mig_mode = models.BooleanField(default=False)
    mig_profile = models.CharField(max_length=50, blank=True)
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="mig_devices"
    )
    memory_used_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    utilization_percent = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    processes = models.JSONField(default=list, blank=True)
    cpu_affinity = models.CharField(
        max_length=500, blank=True, default="",
        help_text="The CPU cores nearest the GPU (NVML), as a CPU list.",
    )
    declared = models.BooleanField(default=False, help_text="From configuration, not NVML.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["node__name", "index", "uuid"]
        verbose_name = "GPU"
        constraints = [
            models.UniqueConstraint(fields=["node", "uuid"], name="unique_gpu_per_node"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id and self.node.name} GPU {self.index} ({self.name})"

    def clean(self) -> None:
        if self.parent is not None and self.parent.node_id != self.node_id:
            raise ValidationError({"parent": "A MIG device belongs to a GPU on the same node."})


class GpuSample(models.Model):
    """A point-in-time reading of one GPU, kept for the dashboards."""

    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(default=timezone.now, db_index=True)
    memory_used_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    utilization_percent = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["gpu", "-at"], name="gpusample_gpu_at")]

    def __str__(self) -> str:
        return f"{self.gpu_id}@{self.at:%H:%M:%S}"
