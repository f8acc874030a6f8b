"""Autoscaling: the control worker's decisions for deployments whose `Autoscaler` is enabled.

`evaluate_all()` runs on the control worker's beat every `ENGINE_METRICS_INTERVAL_SECONDS`, from
the engine metric samples the node agents stored (never from the request path) and, for the
request-count metrics, the requests waiting in the gateway's flow-control queue (under flow
control the engines' own queues stay within the dispatch budget's allowance, and the rest of
the demand waits there: `serving_app.deployments.sharing.waiting()`, one Redis read). For each
deployment it computes a recommendation (the `Autoscaler` docstring has the rule), keeps the
recommendations of its windows, and scales through `Deployment.scale_to()` (the reconciler then
starts instances, or drains and stops them) when the windows and cooldowns allow. Each change
is an `autoscale` event on the deployment's timeline (its message says what and why; its data
holds the metric's values, the old and new counts and the reason); a decision to hold is kept on
the autoscaler (`last_decision`) for the deployment page, not recorded.

`wake()` is the way back from zero: the gateway asks for it (task `serving.wake_deployment`)
when a request names a model whose deployment has scaled to zero, and holds the request until an
instance is ready.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from serving_app.deployments import sharing
from serving_app.models import Deployment, Instance, events
from serving_app.models.autoscalers import Autoscaler, Metric
from serving_app.models.engine_metrics import EngineSample

log = logging.getLogger(__name__)

# A metric within this share of its target leaves the count alone (as Kubernetes' autoscaler
# does), so that an average hovering at the target does not add and remove an instance in turn.
TOLERANCE = 0.1


@dataclass(frozen=True)
class Reading:
    """What the samples say now: the metric per ready instance, the requests waiting in the
    gateway's queue (request-count metrics only; None when Redis could not be read), and
    whether the deployment generated nothing over the down window (idle: it may go to zero)."""

    values: list[float]
    idle: bool
    queued: int | None = 0


@dataclass(frozen=True)
class Decision:
    replicas: int  # the count to scale to; the current one when holding
    recommendation: int
    reason: str

    @property
    def message(self) -> str:
        return self.reason


def _metric_value(sample: EngineSample, metric: str) -> float:
    if metric == Metric.KV_CACHE:
        return float(sample.kv_cache_usage)
    if metric == Metric.RUNNING:
        return float(sample.requests_running + sample.requests_waiting)
    return float(sample.requests_waiting)


def read(autoscaler: Autoscaler, now: datetime) -> Reading | None:
    """The metric of each ready instance (its newest sample, if fresh), or None when a ready
    instance has no fresh sample (no data: no decision)."""
    interval = settings.ENGINE_METRICS_INTERVAL_SECONDS
    fresh_since = now - timedelta(seconds=3 * interval)
    ready = list(Instance.objects.filter(deployment_id=autoscaler.deployment_id,
                                         state=Instance.State.READY).values_list("pk", flat=True))
    values = []
    for pk in ready:
        sample = (EngineSample.objects.filter(instance_id=pk, at__gte=fresh_since)
                  .order_by("-at").first())
        if sample is None:
            return None
        values.append(_metric_value(sample, autoscaler.metric))
    window_start = now - timedelta(seconds=autoscaler.down_window_seconds)
    samples = EngineSample.objects.filter(deployment_id=autoscaler.deployment_id,
                                          at__gt=window_start)
    generated = samples.aggregate(n=Sum("generation_tokens"))["n"] or 0
    covered = EngineSample.objects.filter(
        deployment_id=autoscaler.deployment_id,
        at__lte=window_start + timedelta(seconds=interval)).exists()
    queued: int | None = 0
    busy_now = False
    if autoscaler.metric != Metric.KV_CACHE:
        try:
            queued = sharing.waiting(autoscaler.deployment_id)
        except redis.RedisError as exc:  # the engines' samples alone, as without flow control
            log.warning("gateway queue of deployment %s unreadable: %s",
                        autoscaler.deployment_id, exc)
            queued = None
        busy_now = any(v > 0 for v in values) or bool(queued)
    idle = covered and generated == 0 and not busy_now
    return Reading(values, idle, queued)


def recommend(autoscaler: Autoscaler, current: int, reading: Reading) -> tuple[int, str]:
    """The replicas that bring the metric's average per ready instance to the target, within
    the autoscaler's range, and why."""
    ready = len(reading.values)
    # Requests held in the gateway's queue count as waiting on the deployment's instances.
    total = sum(reading.values) + (reading.queued or 0)
    average = total / ready if ready else 0.0
    ratio = average / autoscaler.target
    if ready and abs(ratio - 1) <= TOLERANCE:
        wanted, why = current, f"{_name(autoscaler)} {average:.2f} is at its target"
    else:
        wanted = math.ceil(total / autoscaler.target)
        why = (f"{_name(autoscaler)} averages {average:.2f} over {ready} ready instance(s) "
               f"against a target of {autoscaler.target:g}")
    if reading.queued:
        why += f" ({reading.queued} of them waiting in the gateway's queue)"
    elif reading.queued is None:
        why += " (the gateway's queue could not be read: engines' samples alone)"
    floor = 0 if reading.idle else 1
    if reading.idle:
        why += "; nothing was generated over the down window"
    wanted = max(wanted, floor, autoscaler.min_replicas)
    return min(wanted, autoscaler.max_replicas), why


def _name(autoscaler: Autoscaler) -> str:
    return {Metric.WAITING: "waiting requests", Metric.KV_CACHE: "KV-cache usage",
            Metric.RUNNING: "running and waiting requests"}[Metric(autoscaler.metric)]


def decide(autoscaler: Autoscaler, current: int, history: list[tuple[float, int]],
           now: float, reason: str) -> Decision:
    """Scale up to the smallest recommendation of the up window when it is above `current`,
    down to the largest of the down window when below, each once its window is covered by
    recommendations and its cooldown has passed; otherwise hold. `history` ends with this
    round's recommendation."""
    recommendation = history[-1][1]
    last = autoscaler.last_scaled_at.timestamp() if autoscaler.last_scaled_at else None
    interval = settings.ENGINE_METRICS_INTERVAL_SECONDS

    def window(seconds: int) -> list[int] | None:
        # Covered: a recommendation at least `seconds` old (one interval of slack) is kept.
        if seconds and history[0][0] > now - seconds + interval:
            return None
        return [n for t, n in history if t >= now - seconds] or [recommendation]

    if recommendation > current:
        ups = window(autoscaler.up_window_seconds)
        if ups is None:
            return Decision(current, recommendation, f"{reason}; waiting for the up window")
        if last is not None and now - last < autoscaler.up_cooldown_seconds:
            return Decision(current, recommendation, f"{reason}; in the up cooldown")
        if min(ups) > current:
            return Decision(min(ups), recommendation, reason)
    elif recommendation < current:
        downs = window(autoscaler.down_window_seconds)
        if downs is None:
            return Decision(current, recommendation, f"{reason}; waiting for the down window")
        if last is not None and now - last < autoscaler.down_cooldown_seconds:
            return Decision(current, recommendation, f"{reason}; in the down cooldown")
        if max(downs) < current:
            return Decision(max(downs), recommendation, reason)
    return Decision(current, recommendation, reason)


def evaluate(autoscaler_id: int, now: datetime | None = None) -> Decision | None:
    """One round for one deployment; returns the decision (None: nothing to decide on)."""
    now = now or timezone.now()
    with transaction.atomic():
        autoscaler = (Autoscaler.objects.select_for_update(skip_locked=True)
                      .select_related("deployment").filter(pk=autoscaler_id).first())
        if autoscaler is None or not autoscaler.enabled:
            return None
        deployment = autoscaler.deployment
        current = deployment.replicas
        if deployment.desired_state != Deployment.DesiredState.RUNNING or current == 0:
            # Stopped, or at zero (the gateway wakes it): nothing to read.
            _keep(autoscaler, now, [], "" if current else "scaled to zero; the next request "
                  "wakes it")
            return None
        if not autoscaler.min_replicas <= current <= autoscaler.max_replicas:
            target = min(max(current, autoscaler.min_replicas), autoscaler.max_replicas)
            return _scale(autoscaler, current, target, target,
                          f"{current} instance(s) is outside the range "
                          f"{autoscaler.min_replicas}-{autoscaler.max_replicas}", {}, now)
        starting = Instance.objects.filter(
            deployment=deployment, state__in=[Instance.State.PENDING, Instance.State.STAGING,
                                              Instance.State.STARTING]
        ).count()
        reading = read(autoscaler, now)
        if starting or reading is None:
            why = (f"{starting} instance(s) not ready yet" if starting
                   else "no fresh engine metric sample for every ready instance")
            _keep(autoscaler, now, autoscaler.recommendations, f"holding at {current}: {why}")
            return None
        recommendation, reason = recommend(autoscaler, current, reading)
        stamp = now.timestamp()
        keep_for = max(autoscaler.up_window_seconds, autoscaler.down_window_seconds)
        history = [(float(t), int(n)) for t, n in autoscaler.recommendations
                   if float(t) >= stamp - keep_for - settings.ENGINE_METRICS_INTERVAL_SECONDS]
        history.append((stamp, recommendation))
        decision = decide(autoscaler, current, history, stamp, reason)
        figures = {"metric": autoscaler.metric, "values": reading.values,
                   "gateway_queued": reading.queued, "target": autoscaler.target,
                   "recommendation": recommendation}
        if decision.replicas != current:
            _scale(autoscaler, current, decision.replicas, recommendation, decision.reason,
                   figures, now, history)
        else:
            _keep(autoscaler, now, history, f"holding at {current}: {decision.reason}")
        return decision


def _keep(autoscaler: Autoscaler, now: datetime, history: Any, decision: str) -> None:
    Autoscaler.objects.filter(pk=autoscaler.pk).update(
        recommendations=[list(h) for h in history], last_decision=decision,
        last_evaluated_at=now)


def _scale(autoscaler: Autoscaler, current: int, replicas: int, recommendation: int,
           reason: str, figures: dict[str, Any], now: datetime,
           history: Any = ()) -> Decision:
    deployment = autoscaler.deployment
    deployment.scale_to(replicas)
    verb = "up" if replicas > current else "down"
    message = f"scaled {verb} from {current} to {replicas}: {reason}"
    events.record(events.Kind.AUTOSCALE, message, deployment=deployment,
                  data={"replicas": [current, replicas], "reason": reason, **figures})
    Autoscaler.objects.filter(pk=autoscaler.pk).update(
        recommendations=[list(h) for h in history], last_decision=message,
        last_scaled_at=now, last_evaluated_at=now)
    return Decision(replicas, recommendation, reason)


def evaluate_all(now: datetime | None = None) -> int:
    """A round for every enabled autoscaler; returns how many deployments changed size."""
    changed = 0
    for pk, before in Autoscaler.objects.filter(enabled=True).values_list(
            "pk", "deployment__replicas"):
        decision = evaluate(pk, now)
        if decision is not None and decision.replicas != before:
            changed += 1
    return changed


def wake(deployment_id: int, now: datetime | None = None) -> bool:
    """Bring a deployment scaled to zero back to `max(1, min_replicas)` instances, for a request
    that is waiting (idempotent: a second request's wake finds it scaled already)."""
    now = now or timezone.now()
    with transaction.atomic():
        autoscaler = (Autoscaler.objects.select_for_update(no_key=True).select_related("deployment")
                      .filter(deployment_id=deployment_id, enabled=True).first())
        if autoscaler is None:
            return False
        deployment = autoscaler.deployment
        if deployment.replicas != 0 or deployment.desired_state != Deployment.DesiredState.RUNNING:
            return False
        replicas = max(1, autoscaler.min_replicas)
        _scale(autoscaler, 0, replicas, replicas, "a request arrived while at zero",
               {"metric": autoscaler.metric}, now)
        return True
