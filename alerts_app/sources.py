"""The values alert rules judge, read from what the console already stores.

One evaluation round reads each source once for all the rules that need it: the usage rollups
once per distinct window (one aggregate query grouped by tenant, model and deployment, folded
here into cluster, deployment, tenant and model values), GPU samples and engine samples once
per window, the month's usage against budgets once, instance and node states once, the usage
stream's lag once.
Nothing here touches the request path: the gateway only appends usage events, and the writer's
rollups are what is read.

A rule's scope keys are the ones it expects (each running deployment, each active tenant, each
node, its one target) plus any other key that has data. A key expected but without data in the
window reads as None: the alert's "no data" state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import connection
from django.db.models import Avg, Count, FloatField, Max, QuerySet, Sum
from django.db.models.functions import Cast

from alerts_app.metrics import Metric, Scope, Source
from alerts_app.models import AlertRule
from serving_app.deployments import sharing
from serving_app.metering import health
from serving_app.models import Deployment, Gpu, GpuSample, Instance, KeyUsage, Node
from serving_app.models.engine_metrics import EngineSample
from serving_app.models.revisions import Rollout
from serving_app.models.usage import (
    LATENCY_FIELDS,
    TTFT_FIELDS,
    GuardrailMinute,
    UsageHour,
    UsageMinute,
    UsageRollup,
    UsageTenSecond,
    histogram_quantile,
)
from tenants_app.models import MoneyBudget, Tenant

# The layout of one usage vector: request counts, then the two histograms.
_REQUESTS, _SERVER_ERRORS, _RATE_LIMITED, _ROUTED, _LATENCY_MAX, _TTFT_COUNT, _TTFT_MAX = range(7)
_HIST = 7
_BUCKETS = len(LATENCY_FIELDS)
_WIDTH = _HIST + 2 * _BUCKETS
_SUMMED = ("requests", "server_errors", "rate_limited", "ttft_count", *LATENCY_FIELDS,
           *TTFT_FIELDS)


@dataclass(slots=True)
class Reading:
    """One scope key's value for one rule (None: no data)."""

    key: str
    label: str
    tenant_id: int | None
    value: float | None
    detail: dict[str, Any] = field(default_factory=dict)


def rollup_for(window_seconds: int) -> type[UsageRollup]:
    """The finest rollup that holds the window cheaply: ten seconds up to an hour, minutes up
    to two days, hours beyond."""
    if window_seconds <= 3600:
        return UsageTenSecond
    if window_seconds <= 2 * 86400:
        return UsageMinute
    return UsageHour


def _window_start(now: datetime, window_seconds: int, rollup: type[UsageRollup]) -> datetime:
    start = now - timedelta(seconds=window_seconds)
    if rollup is UsageTenSecond:
        return start.replace(second=start.second - start.second % 10, microsecond=0)
    if rollup is UsageMinute:
        return start.replace(second=0, microsecond=0)
    return start.replace(minute=0, second=0, microsecond=0)


class Snapshot:
    """Everything one evaluation round reads, each source at most once (per window)."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self._usage: dict[int, list[tuple[int, str, int, list[float]]]] = {}
        self._folded: dict[tuple[int, str], dict[Any, list[float]]] = {}
        self._gpu: dict[int, dict[int, tuple[float | None, float | None]]] = {}
        self._engines: dict[int, list[tuple[int, int, int | None, float, float]]] = {}
        self._budgets: dict[int, float] | None = None
        self._lag: float | None | bool = False  # False: not read yet
        self._flow: dict[int, dict[tuple[int, int], list[float]] | None] = {}
        self._failed_rollouts: dict[int, bool] | None = None
        self._guardrail_blocks: dict[int, dict[int, float]] = {}
        self.tenants = {t.pk: t for t in Tenant.objects.all()}
        self._deployments: dict[int, Deployment] | None = None
        self._nodes: dict[int, Node] | None = None
        self._gpus: dict[int, Gpu] | None = None

    # -- platform rows, read once --------------------------------------------------------------
    @property
    def deployments(self) -> dict[int, Deployment]:
        if self._deployments is None:
            self._deployments = {d.pk: d for d in Deployment.objects.all()}
        return self._deployments

    @property
    def nodes(self) -> dict[int, Node]:
        if self._nodes is None:
            self._nodes = {n.pk: n for n in Node.objects.all()}
        return self._nodes

    @property
    def gpus(self) -> dict[int, Gpu]:
        if self._gpus is None:
            self._gpus = {g.pk: g for g in Gpu.objects.filter(parent__isnull=True)}
        return self._gpus

    # -- usage ----------------------------------------------------------------------------------
    def usage_rows(self, window_seconds: int) -> list[tuple[int, str, int, list[float]]]:
        """(tenant, model, deployment, vector) summed over the window: one query."""
        rows = self._usage.get(window_seconds)
        if rows is not None:
            return rows
        rollup = rollup_for(window_seconds)
        start = _window_start(self.now, window_seconds, rollup)
        # Sums as float8: no Decimal per value (sums of bigint are numeric in PostgreSQL), and
        # the rows are read straight from the cursor, without a converter per value.
        qs: QuerySet[Any] = (
            rollup.objects.filter(bucket__gte=start).order_by()
            .values_list("tenant_id", "model", "deployment_id")
            .annotate(**{f"s{i}": Cast(Sum(name), FloatField()) for i, name in enumerate(_SUMMED)},
                      lmax=Cast(Max("latency_ms_max"), FloatField()),
                      tmax=Cast(Max("ttft_ms_max"), FloatField()))
        )
        sql, params = qs.query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            fetched = cursor.fetchall()
        rows = []
        for tenant_id, model, deployment_id, requests, server_errors, rate_limited, ttft_count, \
                *rest in fetched:
            hists, latency_max, ttft_max = rest[:-2], rest[-2], rest[-1]
            vector = [0.0] * _WIDTH
            vector[_REQUESTS] = requests or 0.0
            vector[_SERVER_ERRORS] = server_errors or 0.0
            vector[_RATE_LIMITED] = rate_limited or 0.0
            if deployment_id:
                # Latency is judged on requests that reached a deployment: a 429 or an
                # unknown model answered in a millisecond would pull the percentiles down.
                vector[_ROUTED] = vector[_REQUESTS]
                vector[_LATENCY_MAX] = latency_max or 0.0
                vector[_TTFT_COUNT] = ttft_count or 0.0
                vector[_TTFT_MAX] = ttft_max or 0.0
                vector[_HIST:] = [c or 0.0 for c in hists]
            rows.append((tenant_id, model, deployment_id, vector))
        self._usage[window_seconds] = rows
        return rows

    def usage(self, window_seconds: int, fold: str) -> dict[Any, list[float]]:
        """Usage vectors of the window folded by "cluster", "tenant", "deployment", "model"
        (across tenants) or "tenant_model"."""
        cache_key = (window_seconds, fold)
        folded = self._folded.get(cache_key)
        if folded is not None:
            return folded
        folded = {}
        for tenant_id, model, deployment_id, vector in self.usage_rows(window_seconds):
            key: Any
            if fold == "cluster":
                key = None
            elif fold == "tenant":
                key = tenant_id
            elif fold == "deployment":
                if not deployment_id:
                    continue
                key = deployment_id
            elif fold == "model":
                key = model
            else:
                key = (tenant_id, model)
            into = folded.get(key)
            if into is None:
                folded[key] = list(vector)
                continue
            into[_LATENCY_MAX] = max(into[_LATENCY_MAX], vector[_LATENCY_MAX])
            into[_TTFT_MAX] = max(into[_TTFT_MAX], vector[_TTFT_MAX])
            for i in (_REQUESTS, _SERVER_ERRORS, _RATE_LIMITED, _ROUTED, _TTFT_COUNT):
                into[i] += vector[i]
            if vector[_ROUTED]:
                for i in range(_HIST, _WIDTH):
                    into[i] += vector[i]
        self._folded[cache_key] = folded
        return folded

    # -- other sources --------------------------------------------------------------------------
    def gpu_means(self, window_seconds: int) -> dict[int, tuple[float | None, float | None]]:
        """Per GPU: mean utilisation (%) and mean memory used (% of its memory) in the window."""
        means = self._gpu.get(window_seconds)
        if means is not None:
            return means
        start = self.now - timedelta(seconds=window_seconds)
        rows = (GpuSample.objects.filter(at__gte=start, gpu_id__in=list(self.gpus)).order_by()
                .values_list("gpu_id").annotate(Avg("utilization_percent"),
                                                Avg("memory_used_bytes"), Count("id")))
        means = {}
        for gpu_id, utilization, memory, _ in rows:
            total = self.gpus[gpu_id].memory_total_bytes
            means[gpu_id] = (
                None if utilization is None else float(utilization),
                None if memory is None or not total else 100.0 * float(memory) / total,
            )
        self._gpu[window_seconds] = means
        return means

    def engine_means(self, window_seconds: int) -> list[tuple[int, int, int | None, float, float]]:
        """Per engine (instance) with samples in the window: (instance, deployment, node, mean
        requests waiting, mean KV-cache usage in %)."""
        means = self._engines.get(window_seconds)
        if means is not None:
            return means
        start = self.now - timedelta(seconds=window_seconds)
        nodes = dict(Instance.objects.values_list("pk", "node_id"))
        rows = (EngineSample.objects.filter(at__gte=start).order_by()
                .values_list("instance_id", "deployment_id")
                .annotate(Avg("requests_waiting"), Avg("kv_cache_usage")))
        means = [(instance_id, deployment_id, nodes.get(instance_id), float(waiting or 0),
                  100.0 * float(kv or 0)) for instance_id, deployment_id, waiting, kv in rows]
        self._engines[window_seconds] = means
        return means

    def budgets(self) -> dict[int, float]:
        """Per tenant with a budget: the month's tokens as a percentage of it."""
        if self._budgets is None:
            used = UsageHour.objects.month_tokens(Tenant.objects.all(), self.now)
            self._budgets = {
                pk: 100.0 * used.get(pk, 0) / t.monthly_token_budget
                for pk, t in self.tenants.items() if t.monthly_token_budget
            }
        return self._budgets

    def money_soft(self) -> list[tuple[MoneyBudget, float]]:
        """Each money budget with a soft threshold, and how far its period's spend is towards
        it (100: reached). Its period's spend drops back at the period's start, so its alert
        resolves then and fires at most once a period."""
        found = []
        for budget in MoneyBudget.objects.filter(soft_threshold_percent__isnull=False)\
                .select_related("api_key"):
            start, _ = budget.bounds(self.now)
            spent = KeyUsage.objects.spend(budget.tenant_id, start, key_id=budget.api_key_id)
            soft = budget.amount * (budget.soft_threshold_percent or 100) / 100
            found.append((budget, float(100 * spent / soft)))
        return found

    def metering_lag(self) -> float | None:
        if self._lag is False:
            client = redis.Redis.from_url(
                settings.GATEWAY["REDIS_URL"], socket_timeout=2.0, socket_connect_timeout=2.0
            )
            try:
                self._lag = health.metering_lag(client)[1]
            except redis.RedisError:
                self._lag = None
            finally:
                client.close()
        return self._lag if self._lag is not False else None

    def flow_controlled(self) -> list[int]:
        """The running deployments whose requests go through the gateway's flow control."""
        return [d.pk for d in self.deployments.values()
                if d.desired_state == Deployment.DesiredState.RUNNING and d.flow_controlled]

    def flow_waits(self, window_seconds: int) -> dict[tuple[int, int], list[float]] | None:
        """Per (deployment, tenant) with requests through the gateway's queue in the window:
        [requests dispatched, ms they waited, requests that left the queue without a slot, ms
        those waited], from the gateway's per-minute counters (whole minutes, the current one
        included). None when Redis cannot be read."""
        if window_seconds in self._flow:
            return self._flow[window_seconds]
        minutes = max(1, -(-window_seconds // 60))
        try:
            stats = sharing.minute_stats(self.flow_controlled(), self.now.timestamp(), minutes)
        except redis.RedisError:
            self._flow[window_seconds] = None
            return None
        waits: dict[tuple[int, int], list[float]] = {}
        fields = ("n", "w", "x", "xw")
        for deployment_id, counters in stats.items():
            for name, value in counters.items():
                kind, _, tenant = name.partition(":")
                if kind in fields and tenant.isdigit():
                    row = waits.setdefault((deployment_id, int(tenant)), [0.0] * 4)
                    row[fields.index(kind)] += value
        self._flow[window_seconds] = waits
        return waits

    def failed_rollouts(self) -> dict[int, bool]:
        """Per deployment with a rollout: whether its latest one failed (a later rollout, a
        rollback or an abort clears it)."""
        if self._failed_rollouts is None:
            latest = (Rollout.objects.order_by("deployment_id", "-created_at", "-pk")
                      .distinct("deployment_id").values_list("deployment_id", "state"))
            self._failed_rollouts = {d: state == Rollout.State.FAILED for d, state in latest}
        return self._failed_rollouts

    def guardrail_blocks(self, window_seconds: int) -> dict[int, float]:
        """Per tenant: the requests (or answers' choices) guardrails blocked in the window, from
        the per-minute guardrail rollup (one query per window)."""
        blocks = self._guardrail_blocks.get(window_seconds)
        if blocks is None:
            start = _window_start(self.now, window_seconds, UsageMinute)
            blocks = {tenant_id: float(n or 0) for tenant_id, n in (
                GuardrailMinute.objects.filter(bucket__gte=start, action="block").order_by()
                .values_list("tenant_id").annotate(Sum("count")))}
            self._guardrail_blocks[window_seconds] = blocks
        return blocks

    def crash_loops(self) -> list[tuple[int, int | None]]:
        """(deployment, node) of each instance in crash loop."""
        return list(Instance.objects.filter(state=Instance.State.CRASH_LOOP)
                     .values_list("deployment_id", "node_id"))


# ----------------------------------------------------------------------------- per rule


def _usage_value(rule: AlertRule, vector: list[float] | None) -> tuple[float | None, dict]:
    if vector is None:
        return None, {"requests": 0}
    q = rule.percentile / 100.0
    if rule.metric == Metric.LATENCY:
        count = vector[_ROUTED]
        value = histogram_quantile(vector[_HIST:_HIST + _BUCKETS], count, vector[_LATENCY_MAX], q)
    elif rule.metric == Metric.TTFT:
        count = vector[_TTFT_COUNT]
        value = histogram_quantile(vector[_HIST + _BUCKETS:], count, vector[_TTFT_MAX], q)
    else:
        count = vector[_REQUESTS]
        part = vector[_SERVER_ERRORS if rule.metric == Metric.ERROR_RATE else _RATE_LIMITED]
        value = 100.0 * part / count if count else None
    if count < rule.min_requests:
        return None, {"requests": int(count)}
    return value, {"requests": int(count)}


class Reader:
    """Turns one rule into its readings, from the round's snapshot."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.s = snapshot

    # keys and labels
    def tenant_key(self, tenant_id: int) -> tuple[str, str]:
        tenant = self.s.tenants.get(tenant_id)
        return f"tenant:{tenant_id}", f"tenant {tenant.slug if tenant else tenant_id}"

    def deployment_key(self, deployment_id: int) -> tuple[str, str]:
        deployment = self.s.deployments.get(deployment_id)
        return (f"deployment:{deployment_id}",
                f"deployment {deployment.name if deployment else deployment_id}")

    def node_key(self, node_id: int) -> tuple[str, str]:
        node = self.s.nodes.get(node_id)
        return f"node:{node_id}", f"node {node.name if node else node_id}"

    def _tenant_ids(self, rule: AlertRule) -> list[int]:
        """The tenants a tenant-scoped rule expects a value for: its own, its target, or each
        active one (for the budget, each with a budget)."""
        if rule.tenant_id is not None:
            return [rule.tenant_id]
        if rule.target:
            return [t.pk for t in self.s.tenants.values() if t.slug == rule.target]
        budget = rule.spec.source == Source.BUDGET
        return [t.pk for t in self.s.tenants.values()
                if t.is_active and (t.monthly_token_budget or not budget)]

    def _deployment_ids(self, rule: AlertRule) -> list[int]:
        deployments = self.s.deployments.values()
        if rule.target:
            return [d.pk for d in deployments if d.name == rule.target]
        return [d.pk for d in deployments if d.desired_state == Deployment.DesiredState.RUNNING]

    def _node_ids(self, rule: AlertRule) -> list[int]:
        if rule.target:
            return [n.pk for n in self.s.nodes.values() if n.name == rule.target]
        return list(self.s.nodes)

    def read(self, rule: AlertRule) -> list[Reading]:
        source = rule.spec.source
        if source == Source.USAGE:
            return self._usage(rule)
        if source == Source.BUDGET:
            budgets = self.s.budgets()
            return [Reading(*self.tenant_key(t), t, budgets.get(t))
                    for t in self._tenant_ids(rule)]
        if source == Source.MONEY:
            return self._money(rule)
        if source == Source.GPU:
            return self._gpu(rule)
        if source == Source.NODES:
            lost = {pk: 1.0 if n.state == "lost" else 0.0 for pk, n in self.s.nodes.items()}
            if rule.scope == Scope.CLUSTER:
                return [Reading("cluster", "cluster", None, sum(lost.values()))]
            return [Reading(*self.node_key(n), None, lost[n]) for n in self._node_ids(rule)]
        if source == Source.INSTANCES:
            return self._crash_loops(rule)
        if source == Source.METERING:
            return [Reading("cluster", "cluster", None, self.s.metering_lag())]
        if source == Source.ENGINE:
            return self._engines(rule)
        if source == Source.FLOW:
            return self._queue_waits(rule)
        if source == Source.GUARDRAILS:
            return self._guardrail_blocks(rule)
        if source == Source.ROLLOUTS:
            failed = self.s.failed_rollouts()
            if rule.scope == Scope.CLUSTER:
                return [Reading("cluster", "cluster", None, float(sum(failed.values())))]
            ids = ([d.pk for d in self.s.deployments.values() if d.name == rule.target]
                   if rule.target else list(self.s.deployments))
            return [Reading(*self.deployment_key(d), None, 1.0 if failed.get(d) else 0.0)
                    for d in ids]
        return []

    def _money(self, rule: AlertRule) -> list[Reading]:
        """One reading per money budget of the rule's tenants (a key's budget apart)."""
        tenants = set(self._tenant_ids(rule))
        readings = []
        for budget, value in self.s.money_soft():
            if budget.tenant_id not in tenants:
                continue
            key, label = self.tenant_key(budget.tenant_id)
            if budget.api_key is not None:
                key, label = f"{key}:key:{budget.api_key_id}", f"{label}, key {budget.api_key}"
            readings.append(Reading(key, label, budget.tenant_id, value,
                                    {"amount": str(budget.amount), "period": budget.period}))
        return readings

    def _guardrail_blocks(self, rule: AlertRule) -> list[Reading]:
        """Blocks are counted: a tenant without any in the window reads 0, not "no data"."""
        blocks = self.s.guardrail_blocks(rule.window_seconds)
        if rule.scope == Scope.CLUSTER:
            return [Reading("cluster", "cluster", None, sum(blocks.values()))]
        expected = self._tenant_ids(rule)
        ids = expected if rule.tenant_id or rule.target else _union(
            expected, (t for t in blocks if t in self.s.tenants))
        return [Reading(*self.tenant_key(t), t, blocks.get(t, 0.0)) for t in ids]

    def _queue_waits(self, rule: AlertRule) -> list[Reading]:
        """The mean wait in the gateway's queue of the requests that went through it in the
        window: those dispatched and those that left without a slot (timed out or
        disconnected), which count with the time they had waited. No requests: no data."""
        waits = self.s.flow_waits(rule.window_seconds)
        if waits is None:  # Redis unreadable: every expected key reads as no data
            waits = {}
        per_scope: dict[Any, list[float]] = defaultdict(lambda: [0.0] * 4)
        for (deployment_id, tenant_id), row in waits.items():
            for key in ("cluster", ("deployment", deployment_id), ("tenant", tenant_id)):
                per_scope[key] = [a + b for a, b in zip(per_scope[key], row, strict=True)]

        def reading(key: str, label: str, tenant_id: int | None, scope_key: Any) -> Reading:
            row = per_scope.get(scope_key)
            requests = (row[0] + row[2]) if row else 0.0
            if not row or not requests:
                return Reading(key, label, tenant_id, None, {"requests": 0})
            return Reading(key, label, tenant_id, (row[1] + row[3]) / requests,
                           {"requests": int(row[0]), "left_queue": int(row[2])})

        controlled = self.s.flow_controlled()
        if rule.scope == Scope.CLUSTER:
            if not controlled:
                return []
            return [reading("cluster", "cluster", None, "cluster")]
        if rule.scope == Scope.DEPLOYMENT:
            ids = (self._deployment_ids(rule) if rule.target else
                   _union(controlled, [k[1] for k in per_scope if k[0] == "deployment"
                                       and k[1] in self.s.deployments]))
            return [reading(*self.deployment_key(d), None, ("deployment", d)) for d in ids]
        if rule.target:
            tenant_ids = self._tenant_ids(rule)
        else:
            serving = set(Deployment.tenants.through.objects
                          .filter(deployment_id__in=controlled)
                          .values_list("tenant_id", flat=True))
            tenant_ids = _union(sorted(t for t in serving if t in self.s.tenants),
                                [k[1] for k in per_scope if k[0] == "tenant"
                                 and k[1] in self.s.tenants])
        return [reading(*self.tenant_key(t), t, ("tenant", t)) for t in tenant_ids]

    def _engines(self, rule: AlertRule) -> list[Reading]:
        """Queue depth adds up over a scope's engines (requests waiting anywhere wait); KV-cache
        usage is the fullest engine's (one full engine preempts whatever the others hold)."""
        queue = rule.metric == Metric.ENGINE_QUEUE
        per_scope: dict[Any, list[float]] = defaultdict(list)
        for _, deployment_id, node_id, waiting, kv in self.s.engine_means(rule.window_seconds):
            value = waiting if queue else kv
            per_scope["cluster"].append(value)
            per_scope[("deployment", deployment_id)].append(value)
            if node_id is not None:
                per_scope[("node", node_id)].append(value)

        def combine(values: list[float] | None) -> float | None:
            if not values:
                return None
            return sum(values) if queue else max(values)

        if rule.scope == Scope.CLUSTER:
            if "cluster" not in per_scope and not self._running_deployment_ids():
                return []
            return [Reading("cluster", "cluster", None, combine(per_scope.get("cluster")))]
        if rule.scope == Scope.DEPLOYMENT:
            ids = self._deployment_ids(rule)
            if not rule.target:
                ids = _union(ids, [key[1] for key in per_scope if key != "cluster"
                                   and key[0] == "deployment" and key[1] in self.s.deployments])
            return [Reading(*self.deployment_key(d), None,
                            combine(per_scope.get(("deployment", d)))) for d in ids]
        hosting = set(Instance.objects.active().exclude(node__isnull=True)
                      .values_list("node_id", flat=True))
        ids = self._node_ids(rule) if rule.target else [
            n for n in self._node_ids(rule) if n in hosting or ("node", n) in per_scope]
        return [Reading(*self.node_key(n), None, combine(per_scope.get(("node", n))))
                for n in ids]

    def _running_deployment_ids(self) -> list[int]:
        return [d.pk for d in self.s.deployments.values()
                if d.desired_state == Deployment.DesiredState.RUNNING]

    def _usage(self, rule: AlertRule) -> list[Reading]:
        window = rule.window_seconds
        out: list[Reading] = []

        def add(key: str, label: str, tenant_id: int | None, vector: list[float] | None) -> None:
            value, detail = _usage_value(rule, vector)
            out.append(Reading(key, label, tenant_id, value, detail))

        if rule.scope == Scope.CLUSTER:
            add("cluster", "cluster", None, self.s.usage(window, "cluster").get(None))
        elif rule.scope == Scope.TENANT:
            by_tenant = self.s.usage(window, "tenant")
            expected = self._tenant_ids(rule)
            keys = expected if rule.tenant_id or rule.target else _union(
                expected, (t for t in by_tenant if t in self.s.tenants))
            for tenant_id in keys:
                add(*self.tenant_key(tenant_id), tenant_id, by_tenant.get(tenant_id))
        elif rule.scope == Scope.DEPLOYMENT:
            by_deployment = self.s.usage(window, "deployment")
            expected = self._deployment_ids(rule)
            keys = expected if rule.target else _union(
                expected, (d for d in by_deployment if d in self.s.deployments))
            for deployment_id in keys:
                add(*self.deployment_key(deployment_id), None, by_deployment.get(deployment_id))
        elif rule.tenant_id is not None:  # a tenant's rule per model: its own models only
            by_model = self.s.usage(window, "tenant_model")
            tenant_key, tenant_label = self.tenant_key(rule.tenant_id)
            models = [rule.target] if rule.target else sorted(
                m for (t, m) in by_model if t == rule.tenant_id)
            for model in models:
                add(f"{tenant_key}/model:{model}", f"{tenant_label}, model {model}",
                    rule.tenant_id, by_model.get((rule.tenant_id, model)))
        else:
            by_model = self.s.usage(window, "model")
            models = [rule.target] if rule.target else sorted(by_model)
            for model in models:
                add(f"model:{model}", f"model {model}", None, by_model.get(model))
        return out

    def _gpu(self, rule: AlertRule) -> list[Reading]:
        means = self.s.gpu_means(rule.window_seconds)
        column = 0 if rule.metric == Metric.GPU_UTILIZATION else 1
        per_node: dict[int, list[tuple[float, Gpu]]] = defaultdict(list)
        for gpu_id, values in means.items():
            value = values[column]
            if value is not None:
                gpu = self.s.gpus[gpu_id]
                per_node[gpu.node_id].append((value, gpu))

        def busiest(items: list[tuple[float, Gpu]]) -> tuple[float | None, dict]:
            if not items:
                return None, {}
            value, gpu = max(items, key=lambda item: item[0])
            node = self.s.nodes.get(gpu.node_id)
            return value, {"gpu": f"{node.name if node else gpu.node_id} GPU {gpu.index}"}

        if rule.scope == Scope.CLUSTER:
            if not self.s.gpus:
                return []
            value, detail = busiest([i for items in per_node.values() for i in items])
            return [Reading("cluster", "cluster", None, value, detail)]
        with_gpus = {g.node_id for g in self.s.gpus.values()}
        out = []
        for node_id in self._node_ids(rule):
            if node_id not in with_gpus and not rule.target:
                continue  # a CPU host has no GPU values: not "no data"
            value, detail = busiest(per_node.get(node_id, []))
            out.append(Reading(*self.node_key(node_id), None, value, detail))
        return out

    def _crash_loops(self, rule: AlertRule) -> list[Reading]:
        looping = self.s.crash_loops()
        if rule.scope == Scope.CLUSTER:
            return [Reading("cluster", "cluster", None, float(len(looping)))]
        if rule.scope == Scope.NODE:
            counts = _count(node for _, node in looping if node is not None)
            return [Reading(*self.node_key(n), None, counts.get(n, 0.0))
                    for n in self._node_ids(rule)]
        counts = _count(deployment for deployment, _ in looping)
        ids = ([d.pk for d in self.s.deployments.values() if d.name == rule.target]
               if rule.target else list(self.s.deployments))
        return [Reading(*self.deployment_key(d), None, counts.get(d, 0.0)) for d in ids]


def _union(expected: list[int], seen: Iterable[Any]) -> list[int]:
    return list(dict.fromkeys([*expected, *(k for k in seen if k)]))


def _count(items: Iterable[int]) -> dict[int, float]:
    counts: dict[int, float] = defaultdict(float)
    for item in items:
        counts[item] += 1.0
    return counts
