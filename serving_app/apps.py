from __future__ import annotations

from typing import TYPE_CHECKING

from django.apps import AppConfig
from django.db import transaction
from django.db.models.signals import post_delete

from audit_app.registry import exclude, track
from serving_app.fleet import credentials

if TYPE_CHECKING:
    from serving_app.models import LoraAdapter, Node


def _adapter_deleted(sender: type, instance: LoraAdapter, **kwargs: object) -> None:
    instance.release_files()


def _node_deleted(sender: type, instance: Node, **kwargs: object) -> None:
    if instance.db_role or instance.redis_user:
        transaction.on_commit(lambda: credentials.revoke(instance))


class ServingAppConfig(AppConfig):
    name = "serving_app"
    verbose_name = "Serving"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # A deleted adapter's uploaded files are removed once no engine has them, whatever
        # deleted it (the tenant's cascade too).
        post_delete.connect(_adapter_deleted, sender=self.get_model("LoraAdapter"),
                            dispatch_uid="adapter-files")
        # A deleted node's database role and Redis user are dropped, whatever deleted it.
        post_delete.connect(_node_deleted, sender=self.get_model("Node"),
                            dispatch_uid="node-credentials")
        # What people change is audited; what the control plane writes (agents' heartbeats and
        # readings, placement and load errors) is named here and is no change of its own.
        # docs/architecture.md ("The audit log") says why each exclusion is one.
        track(self.get_model("BaseModel"))
        track(self.get_model("FleetPlan"))
        track(self.get_model("PriceCard"))
        track(self.get_model("GpuPriceCard"))
        track(self.get_model("LoraAdapter"), ignore=["last_error"])
        track(self.get_model("Deployment"), ignore=["placement_error"])
        track(self.get_model("Autoscaler"), ignore=[
            "recommendations", "last_scaled_at", "last_decision", "last_evaluated_at",
        ])
        track(self.get_model("Node"), ignore=["agent_pid", "last_heartbeat", "inventory_source"],
              secret=["fetch_token_hash"])
        track(self.get_model("NodeJoinToken"), secret=["token_hash"])
        track(self.get_model("Gpu"), ignore=[
            "memory_used_bytes", "utilization_percent", "temperature_c", "power_w", "processes",
        ])
        track(self.get_model("Instance"), events=["delete"], ignore=["log_tail"],
              secret=["environment"], reason=(
            "instances are created, placed and moved through their states by the reconciler and "
            "the node agents (control-plane transitions); a person only deletes one"))
        control_plane = "written by the control plane, never by a person (read only everywhere)"
        track(self.get_model("CapacityTest"), events=["create", "delete"], reason=(
            "a person starts a capacity test (create), cancels it (its entry `cancel`, "
            "CapacityTest.cancel()) or deletes it; its states, progress and error are the node "
            "agent's"))
        exclude(self.get_model("CapacityPoint"),
                f"a capacity test's measured levels, {control_plane}")
        track(self.get_model("Artifact"))
        # Its progress is no change of its own; its completion (the version it made) is.
        track(self.get_model("ArtifactImport"), ignore=[
            "state", "bytes_total", "bytes_done", "error", "updated_at"])
        exclude(self.get_model("ArtifactVersion"),
                "made by its import (audited) when its files are complete; immutable")
        exclude(self.get_model("ArtifactFile"), "part of its version, made with it")
        exclude(self.get_model("Blob"), "a file's content by digest, made with its version")
        exclude(self.get_model("NodeCacheEntry"),
                f"what a node's cache holds, {control_plane}")
        exclude(self.get_model("GpuSample"), f"GPU readings, {control_plane}")
        exclude(self.get_model("InstanceWorker"),
                f"a multi-node instance's headless workers, made with it at placement and "
                f"moved through their states by the node agents, {control_plane}")
        exclude(self.get_model("AdapterFileRemoval"),
                f"files of deleted adapters waiting for removal, {control_plane}")
        for name in ("UsageEvent", "UsageTenSecond", "UsageMinute", "UsageHour", "UsageTotal",
                     "GuardrailMinute", "GuardrailHour", "GuardrailTotal", "KeyUsage"):
            exclude(self.get_model(name), f"metering, {control_plane}")
        for name in ("EngineSample", "EngineHour"):
            exclude(self.get_model(name), f"engine metric samples, {control_plane}")
        exclude(self.get_model("Event"), f"the control plane's timeline, {control_plane}")
        exclude(self.get_model("DeploymentRevision"),
                "a copy of a deployment's engine settings, recorded by the deployment's own "
                "(audited) edit")
        exclude(self.get_model("Rollout"),
                "started by Deployment.apply()/rollback() and paused, resumed or aborted by its "
                "own methods, each of which records its entry; its progress is the reconciler's")
