"""What an alert rule can watch: each metric, its unit, the scopes it has values for, whether a
tenant may put a rule on it, and where its values come from.

The registry is data, read by the rule model's validation, the forms, the API and the
evaluator alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import models

from serving_app.deployments.sharing import STATS_KEPT_SECONDS


class Scope(models.TextChoices):
    CLUSTER = "cluster", "Cluster"
    NODE = "node", "Node"
    DEPLOYMENT = "deployment", "Deployment"
    TENANT = "tenant", "Tenant"
    MODEL = "model", "Model"


class Metric(models.TextChoices):
    GPU_UTILIZATION = "gpu_utilization", "GPU utilisation"
    GPU_MEMORY = "gpu_memory", "GPU memory used"
    LATENCY = "latency", "Latency percentile"
    TTFT = "ttft", "Time to first token percentile"
    ERROR_RATE = "error_rate", "Failure rate (5xx and engine errors)"
    RATE_LIMITED = "rate_limited", "Rate-limited share (429)"
    BUDGET_USED = "budget_used", "Monthly token budget used"
    CRASH_LOOP = "crash_loop", "Instances in crash loop"
    NODE_LOST = "node_lost", "Nodes lost"
    METERING_LAG = "metering_lag", "Metering lag"
    ENGINE_QUEUE = "engine_queue", "Engine queue depth"
    KV_CACHE = "kv_cache", "KV-cache usage"
    GATEWAY_QUEUE_WAIT = "gateway_queue_wait", "Gateway queue wait"
    ROLLOUT_FAILED = "rollout_failed", "Failed rollouts"
    GUARDRAIL_BLOCKED = "guardrail_blocked", "Requests blocked by guardrails"
    MONEY_SOFT = "money_budget_soft", "Money budget's soft threshold reached"


class Source(models.TextChoices):
    """Where the evaluator reads a metric's values (alerts_app.sources)."""

    USAGE = "usage", "Usage rollups"
    BUDGET = "budget", "Monthly usage against budgets"
    GPU = "gpu", "GPU samples"
    INSTANCES = "instances", "Instance states"
    NODES = "nodes", "Node heartbeats"
    METERING = "metering", "The usage stream"
    ENGINE = "engine", "Engine metric samples"
    FLOW = "flow", "The gateway's flow-control counters"
    ROLLOUTS = "rollouts", "Rollout states"
    GUARDRAILS = "guardrails", "Guardrail counts"
    MONEY = "money", "Spend against money budgets"


@dataclass(frozen=True)
class MetricSpec:
    metric: Metric
    unit: str
    scopes: tuple[Scope, ...]
    source: Source
    tenant_allowed: bool = False
    quantile: bool = False  # the rule names a percentile (latency, TTFT)
    windowed: bool = True  # the value is read over the rule's window
    max_window_seconds: int = 0  # the longest window its source keeps (0: any)

    @property
    def label(self) -> str:
        return str(self.metric.label)


_TRAFFIC = (Scope.CLUSTER, Scope.DEPLOYMENT, Scope.TENANT, Scope.MODEL)
_HOSTS = (Scope.CLUSTER, Scope.NODE)
_ENGINES = (Scope.CLUSTER, Scope.NODE, Scope.DEPLOYMENT)

REGISTRY: dict[str, MetricSpec] = {
    spec.metric.value: spec
    for spec in (
        MetricSpec(Metric.GPU_UTILIZATION, "%", _HOSTS, Source.GPU),
        MetricSpec(Metric.GPU_MEMORY, "%", _HOSTS, Source.GPU),
        MetricSpec(Metric.LATENCY, "ms", _TRAFFIC, Source.USAGE, tenant_allowed=True,
                   quantile=True),
        MetricSpec(Metric.TTFT, "ms", _TRAFFIC, Source.USAGE, tenant_allowed=True,
                   quantile=True),
        MetricSpec(Metric.ERROR_RATE, "%", _TRAFFIC, Source.USAGE, tenant_allowed=True),
        MetricSpec(Metric.RATE_LIMITED, "%", _TRAFFIC, Source.USAGE, tenant_allowed=True),
        MetricSpec(Metric.BUDGET_USED, "%", (Scope.TENANT,), Source.BUDGET, tenant_allowed=True,
                   windowed=False),
        # 100: the budget's soft threshold is reached (its period's spend, per budget).
        MetricSpec(Metric.MONEY_SOFT, "%", (Scope.TENANT,), Source.MONEY, tenant_allowed=True,
                   windowed=False),
        MetricSpec(Metric.CRASH_LOOP, "instances", _ENGINES, Source.INSTANCES, windowed=False),
        MetricSpec(Metric.NODE_LOST, "nodes", _HOSTS, Source.NODES, windowed=False),
        MetricSpec(Metric.METERING_LAG, "s", (Scope.CLUSTER,), Source.METERING, windowed=False),
        MetricSpec(Metric.ENGINE_QUEUE, "requests", _ENGINES, Source.ENGINE),
        MetricSpec(Metric.KV_CACHE, "%", _ENGINES, Source.ENGINE),
        MetricSpec(Metric.GATEWAY_QUEUE_WAIT, "ms", (Scope.CLUSTER, Scope.DEPLOYMENT,
                                                     Scope.TENANT),
                   Source.FLOW, max_window_seconds=STATS_KEPT_SECONDS),
        MetricSpec(Metric.ROLLOUT_FAILED, "rollouts", (Scope.CLUSTER, Scope.DEPLOYMENT),
                   Source.ROLLOUTS, windowed=False),
        MetricSpec(Metric.GUARDRAIL_BLOCKED, "requests", (Scope.CLUSTER, Scope.TENANT),
                   Source.GUARDRAILS, tenant_allowed=True),
    )
}

# The scopes a tenant's own rule may have: its tenant as a whole, or its models.
TENANT_SCOPES = (Scope.TENANT, Scope.MODEL)
QUANTILES = (50, 90, 95, 99)


def spec(metric: str) -> MetricSpec:
    return REGISTRY[metric]


def tenant_metrics() -> list[MetricSpec]:
    return [s for s in REGISTRY.values() if s.tenant_allowed]
