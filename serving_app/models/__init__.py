"""The serving domain's models, one module per family.

A Deployment is desired state; Instances record what actually runs. Node agents and the
reconciler change Instance state only through conditional updates (`Instance.transition`).

From the top of the contract `serving-models` (pyproject.toml) down: `capacity` (capacity
tests of a deployment's engine and their points); `deployments`; `adapters`
(LoRA adapters and the removal of a deleted one's files) and `fleetplans` (what-if plans);
`basemodels` and `nodes` (nodes, GPUs and their readings); `instances` (instances and the
workers of a multi-node one); `revisions` (revisions and rollouts); and at the bottom `events`,
`autoscalers`, `engine_metrics`, `joins`, `usage`, `prices`, `artifacts` and `canaries`. A
module names a model above it by label ("serving_app.Deployment"), never by an import.

Every model is imported here: Django registers an app's models from its `models` module, and
`from serving_app.models import X` is how the rest of the project reads them.
"""

from __future__ import annotations

from serving_app.models.adapters import AdapterFileRemoval, LoraAdapter
from serving_app.models.artifacts import (
    Artifact,
    ArtifactFile,
    ArtifactImport,
    ArtifactVersion,
    Blob,
    NodeCacheEntry,
    artifact_folder,
    version_files,
)
from serving_app.models.autoscalers import Autoscaler
from serving_app.models.basemodels import LEGACY_PATH_LABEL, BaseModel
from serving_app.models.capacity import CapacityPoint, CapacityTest
from serving_app.models.deployments import Deployment, engine_field
from serving_app.models.engine_metrics import EngineHour, EngineSample
from serving_app.models.events import Event
from serving_app.models.fleetplans import FleetPlan
from serving_app.models.instances import Instance, InstanceWorker, new_instance_secret
from serving_app.models.joins import NodeJoinToken
from serving_app.models.nodes import NODE_ACTION_EVENTS, Gpu, GpuSample, Node
from serving_app.models.prices import GpuPriceCard, PriceCard, PriceTable, TokenPrice
from serving_app.models.revisions import DeploymentRevision, Rollout
from serving_app.models.usage import (
    LATENCY_BUCKETS_MS,
    LATENCY_FIELDS,
    ROLLUP_COUNTERS,
    TTFT_FIELDS,
    GuardrailHour,
    GuardrailMinute,
    GuardrailTotal,
    KeyUsage,
    UsageEvent,
    UsageHour,
    UsageMinute,
    UsageTenSecond,
    UsageTotal,
    bucket_index,
    histogram_quantile,
)

__all__ = [
    # Models, by module.
    "AdapterFileRemoval", "LoraAdapter",
    "Artifact", "ArtifactFile", "ArtifactImport", "ArtifactVersion", "Blob", "NodeCacheEntry",
    "Autoscaler",
    "BaseModel",
    "CapacityPoint", "CapacityTest",
    "Deployment",
    "EngineHour", "EngineSample",
    "Event",
    "FleetPlan",
    "Instance", "InstanceWorker",
    "NodeJoinToken",
    "Gpu", "GpuSample", "Node",
    "GpuPriceCard", "PriceCard",
    "DeploymentRevision", "Rollout",
    "GuardrailHour", "GuardrailMinute", "GuardrailTotal", "KeyUsage", "UsageEvent", "UsageHour",
    "UsageMinute", "UsageTenSecond", "UsageTotal",
    # Helpers and constants the package has always offered (migration 0001 names
    # `new_instance_secret` here).
    "LEGACY_PATH_LABEL", "NODE_ACTION_EVENTS", "artifact_folder", "engine_field",
    "new_instance_secret", "version_files", "PriceTable", "TokenPrice",
    "LATENCY_BUCKETS_MS", "LATENCY_FIELDS", "ROLLUP_COUNTERS", "TTFT_FIELDS", "bucket_index",
    "histogram_quantile",
]
