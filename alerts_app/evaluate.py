"""One evaluation round: every enabled rule against the values of its scope keys.

Per rule and scope key, an alert moves between four states:

    ok ──condition holds──> pending ──held for `for_seconds`──> firing ──value past the
     ^                         │                                  │      recovery threshold──> ok
     └──condition gone─────────┘                                  └──no data──> no_data
    no data (the key expected, no samples) ──> no_data; data again ──> ok, then as above

`for_seconds` 0 goes from ok straight to firing. A firing alert stays firing while the value is
between the threshold and the recovery threshold (hysteresis), so a value hovering at the
threshold does not flap. Firing, resolved and no-data-while-firing are transitions: recorded
(`AlertTransition`, with the values that led to it) and told to the channels they are routed to,
through one `Notification` per channel, created in the round's transaction and sent after it
commits by the `alerts.deliver_notification` task. A silence turns the notification into a
"silenced" entry of the delivery log instead.

Rows are written only where something changed (or for alerts pending or firing, whose value the
console shows): an alert that is ok and stays ok costs nothing but the read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from alerts_app.models import (
    Alert,
    AlertRule,
    AlertTransition,
    Channel,
    EvaluationState,
    Notification,
    Silence,
    compare,
)
from alerts_app.sources import Reader, Reading, Snapshot
from serving_app import lifecycle

log = logging.getLogger(__name__)
State = Alert.State
Kind = AlertTransition.Kind
KEEP_VALUES = 30  # [time, value] pairs kept on an alert (what fired it)


@dataclass
class RoundResult:
    rules: int = 0
    readings: int = 0
    transitions: list[AlertTransition] = field(default_factory=list)
    notifications: int = 0
    skipped: bool = False
    duration_ms: float = 0.0


@dataclass
class _Step:
    """What one reading does to its alert."""

    alert: Alert
    created: bool
    changed: bool
    transition: str | None = None


def _advance(rule: AlertRule, alert: Alert, reading: Reading, threshold: float | None,
             now: datetime) -> str | None:
    """Apply one reading to `alert` in memory; return the transition kind, if any."""
    previous = alert.state
    alert.value = reading.value
    alert.threshold = threshold
    alert.last_evaluated_at = now
    if reading.value is None or threshold is None:
        if previous == State.NO_DATA:
            return None
        alert.state, alert.state_changed_at, alert.pending_since = State.NO_DATA, now, None
        alert.values = []
        if previous == State.FIRING:
            alert.resolved_at = now
            return Kind.NO_DATA
        return None
    sample = [now.isoformat(timespec="seconds"), round(reading.value, 3)]
    holds = compare(rule.comparison, reading.value, threshold)
    if holds:
        if previous in (State.OK, State.NO_DATA):
            alert.pending_since = now
            alert.values = [sample]
            if rule.for_seconds > 0:
                alert.state, alert.state_changed_at = State.PENDING, now
                return None
        else:
            alert.values = [*alert.values, sample][-KEEP_VALUES:]
        if alert.state == State.FIRING:
            return None
        pending_since = alert.pending_since or now
        if (now - pending_since).total_seconds() + 1e-6 >= rule.for_seconds:
            alert.state, alert.state_changed_at, alert.fired_at = State.FIRING, now, now
            alert.resolved_at = None
            alert.acknowledged_at, alert.acknowledged_by = None, None
            return Kind.FIRING
        return None
    if previous == State.FIRING:
        if compare(rule.comparison, reading.value, rule.recovery_for(threshold)):
            # Past the threshold no more, but not past the recovery threshold: still firing.
            alert.values = [*alert.values, sample][-KEEP_VALUES:]
            return None
        alert.state, alert.state_changed_at, alert.resolved_at = State.OK, now, now
        alert.pending_since = None
        alert.values = [*alert.values, sample][-KEEP_VALUES:]
        return Kind.RESOLVED
    if previous in (State.PENDING, State.NO_DATA):
        alert.state, alert.state_changed_at, alert.pending_since = State.OK, now, None
        alert.values = []
    return None


def _payload(notification: Notification, transition: AlertTransition, alert: Alert,
             rule: AlertRule, tenants: dict[int, Any]) -> dict[str, Any]:
    unit = rule.spec.unit
    value = "no data" if transition.value is None else f"{transition.value:.4g} {unit}"
    verb = {Kind.FIRING: "FIRING", Kind.RESOLVED: "RESOLVED", Kind.NO_DATA: "NO DATA"}
    return {
        "id": str(notification.uuid),
        "kind": transition.kind,
        "at": transition.at.isoformat(),
        "severity": transition.severity,
        "summary": f"[{verb[Kind(transition.kind)]}] {rule.name}: {alert.scope_label} "
                   f"at {value} ({rule.describe()})",
        "value": transition.value,
        "threshold": transition.threshold,
        "unit": unit,
        "values": transition.values,
        "rule": {"id": rule.pk, "name": rule.name, "metric": rule.metric, "scope": rule.scope,
                 "description": rule.describe(), "tenant": _slug(tenants, rule.tenant_id)},
        "alert": {"id": alert.pk, "scope_key": alert.scope_key, "scope": alert.scope_label,
                  "tenant": _slug(tenants, alert.tenant_id), "state": alert.state,
                  "fired_at": alert.fired_at.isoformat() if alert.fired_at else None,
                  "resolved_at": alert.resolved_at.isoformat() if alert.resolved_at else None},
    }


def _slug(tenants: dict[int, Any], tenant_id: int | None) -> str | None:
    tenant = tenants.get(tenant_id) if tenant_id is not None else None
    return tenant.slug if tenant is not None else None


def _routes(channels: list[Channel], rule: AlertRule, alert: Alert) -> list[Channel]:
    """The channels whose owner hears of this alert: the platform's for platform rules, the
    tenant's for alerts concerning it (its own rules' and the platform's about it)."""
    out = []
    for channel in channels:
        if channel.tenant_id is None:
            if rule.tenant_id is None:
                out.append(channel)
        elif channel.tenant_id == alert.tenant_id:
            out.append(channel)
    return out


def _notify(result: RoundResult, transitions: list[tuple[AlertTransition, Alert, AlertRule]],
            channels: list[Channel], silences: list[Silence], tenants: dict[int, Any]) -> None:
    notifications: list[Notification] = []
    for transition, alert, rule in transitions:
        silenced_for = {s.tenant_id for s in silences if s.matches(alert)}
        for channel in _routes(channels, rule, alert):
            if not channel.wants(rule, transition.severity, transition.kind):
                continue
            # A silence holds back what its owner (the platform or the tenant) is told.
            silenced = channel.tenant_id in silenced_for
            notification = Notification(
                channel=channel, transition=transition, tenant_id=channel.tenant_id,
                kind=transition.kind,
                state=Notification.State.SILENCED if silenced else Notification.State.PENDING,
            )
            notification.payload = _payload(notification, transition, alert, rule, tenants)
            notifications.append(notification)
    Notification.objects.bulk_create(notifications)
    for notification in notifications:
        if notification.state == Notification.State.PENDING:
            lifecycle.enqueue(lifecycle.DELIVER_NOTIFICATION, notification.pk)
    result.notifications = len(notifications)


def _claim_round(now: datetime) -> EvaluationState | None:
    """Lock the evaluator's row for this transaction; None if another round holds it."""
    EvaluationState.objects.get_or_create(pk=1)
    state = EvaluationState.objects.select_for_update(skip_locked=True).filter(pk=1).first()
    if state is not None:
        state.last_started_at = now
    return state


def evaluate(now: datetime | None = None) -> RoundResult:
    """Run one round (the `alerts.evaluate` task's body). A round another worker is running
    already makes this one a no-op."""
    started = time.perf_counter()
    now = now or timezone.now()
    result = RoundResult()
    with transaction.atomic():
        state = _claim_round(now)
        if state is None:
            result.skipped = True
            return result
        rules = list(AlertRule.objects.filter(enabled=True))
        result.rules = len(rules)
        # A disabled rule's alerts end, quietly: nobody is told about a rule switched off.
        Alert.objects.filter(rule__enabled=False).exclude(state=State.OK).update(
            state=State.OK, state_changed_at=now, pending_since=None, value=None, values=[])
        snapshot = Snapshot(now)
        reader = Reader(snapshot)
        existing: dict[tuple[int, str], Alert] = {}
        by_rule: dict[int, list[Alert]] = {}
        for alert in Alert.objects.filter(rule__enabled=True):
            existing[(alert.rule_id, alert.scope_key)] = alert
            by_rule.setdefault(alert.rule_id, []).append(alert)
        steps: list[tuple[_Step, AlertRule]] = []
        for rule in rules:
            seen = set()
            for reading in reader.read(rule):
                seen.add(reading.key)
                result.readings += 1
                steps.append((_step(rule, existing, reading, snapshot, now), rule))
            for alert in by_rule.get(rule.pk, []):
                if alert.scope_key not in seen and alert.state != State.OK:
                    steps.append((_unread(rule, alert, snapshot, now), rule))
        _write(steps, result, now, snapshot)
        result.duration_ms = (time.perf_counter() - started) * 1000
        state.last_finished_at = timezone.now()
        state.last_duration_ms = round(result.duration_ms, 1)
        state.rules = result.rules
        state.rounds += 1
        state.last_error = ""
        state.save()
    return result


def _step(rule: AlertRule, existing: dict[tuple[int, str], Alert], reading: Reading,
          snapshot: Snapshot, now: datetime) -> _Step:
    alert = existing.get((rule.pk, reading.key))
    created = alert is None
    if alert is None:
        alert = Alert(rule=rule, scope_key=reading.key, scope_label=reading.label,
                      tenant_id=reading.tenant_id, state=State.OK, state_changed_at=now)
    before = (alert.state, alert.value)
    tenant = snapshot.tenants.get(reading.tenant_id) if reading.tenant_id else None
    threshold = rule.threshold_for(tenant)
    if threshold is None and rule.use_tenant_objective:
        # No objective set for this tenant: nothing to judge, and nothing to keep.
        if created or alert.state == State.OK:
            return _Step(alert, created=False, changed=False)
        return _unread(rule, alert, snapshot, now)
    transition = _advance(rule, alert, reading, threshold, now)
    # An ok alert that stays ok is not written (nor created); a pending or firing one is, for
    # the value the console shows.
    changed = alert.state != before[0] or (
        alert.state in (State.PENDING, State.FIRING) and alert.value != before[1])
    if created and alert.state == State.OK:
        return _Step(alert, created=False, changed=False)
    return _Step(alert, created=created, changed=changed, transition=transition)


def _exists(key: str, snapshot: Snapshot) -> bool:
    """Whether what a scope key names is still there (a model always is)."""
    kind, _, rest = key.partition(":")
    ident = rest.split("/", 1)[0]
    if kind == "deployment":
        return int(ident) in snapshot.deployments
    if kind == "node":
        return int(ident) in snapshot.nodes
    if kind == "tenant":
        return int(ident) in snapshot.tenants
    return True


def _unread(rule: AlertRule, alert: Alert, snapshot: Snapshot, now: datetime) -> _Step:
    """An alert whose key this round did not read: its scope is gone (a deleted deployment, a
    changed target: the alert ends), or it has no data any more (a deployment stopped, a model
    no longer called), or it was "no data" for a key nobody expects (back to ok, quietly)."""
    if alert.state in (State.PENDING, State.FIRING) and _exists(alert.scope_key, snapshot):
        reading = Reading(alert.scope_key, alert.scope_label, alert.tenant_id, None)
        transition = _advance(rule, alert, reading, alert.threshold, now)
        return _Step(alert, created=False, changed=True, transition=transition)
    kind = Kind.RESOLVED if alert.state == State.FIRING else None
    alert.state, alert.state_changed_at, alert.pending_since = State.OK, now, None
    alert.value, alert.values = None, []
    if kind:
        alert.resolved_at = now
    return _Step(alert, created=False, changed=True, transition=kind)


_ALERT_FIELDS = ["state", "value", "threshold", "values", "state_changed_at", "pending_since",
                 "fired_at", "resolved_at", "last_evaluated_at", "acknowledged_at",
                 "acknowledged_by"]


def _write(steps: list[tuple[_Step, AlertRule]], result: RoundResult, now: datetime,
           snapshot: Snapshot) -> None:
    new = [step.alert for step, _ in steps if step.created]
    Alert.objects.bulk_create(new)
    changed = [step.alert for step, _ in steps if step.changed and not step.created]
    Alert.objects.bulk_update(changed, _ALERT_FIELDS, batch_size=200)
    pairs = []
    for step, rule in steps:
        if step.transition is None:
            continue
        alert = step.alert
        pairs.append((AlertTransition(
            alert=alert, tenant_id=alert.tenant_id, kind=step.transition, at=now,
            value=alert.value, threshold=alert.threshold, values=list(alert.values),
            severity=rule.severity,
        ), alert, rule))
    AlertTransition.objects.bulk_create([t for t, _, _ in pairs])
    result.transitions = [t for t, _, _ in pairs]
    if not pairs:
        return
    channels = list(Channel.objects.filter(enabled=True))
    silences = list(Silence.objects.active(now))
    _notify(result, pairs, channels, silences, snapshot.tenants)
