"""Stopping an instance without cutting its requests off.

`drain_then_stop()` is the one way the control plane stops an instance that may be serving:
stopping a deployment, scaling down, replacing an instance in a rollout or a restart, and
draining a node all go through it. A ready instance first leaves routing: it moves to
`draining`, which the gateway's catalog excludes, and the state change is announced on the
gateway's invalidation channel (`Instance.transition` sends `instance_routing_changed`), so
every gateway worker stops choosing it at once. `finish()`, run by the reconciler every round,
then stops it when the requests in flight on it are done (the cluster-wide count the gateway
keeps in Redis, `serving_app/deployments/inflight.py`), or when `DRAIN_TIMEOUT_SECONDS` have passed.

It is never stopped sooner than one gateway catalog refresh (`GATEWAY_CATALOG_REFRESH_SECONDS`)
plus a second after it began draining: a worker that missed the invalidation message routes to
it until its next refresh, and such a request must be counted before the count is trusted.

A blue-green rollout keeps the previous generation draining but running (`standby_until`) so
that a rollback switches back at once; it is stopped after that time, the same way.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.utils import timezone

from serving_app import lifecycle
from serving_app.deployments import inflight
from serving_app.models import Instance, events

log = logging.getLogger(__name__)
State = Instance.State


def _dispatch_stop(instance: Instance) -> None:
    node = instance.node
    if node is not None:
        lifecycle.instance_task(lifecycle.STOP_INSTANCE, instance.pk, node.queue)


def drain_then_stop(instance: Instance, reason: str, *,
                    standby_until: datetime | None = None) -> str:
    """Stop `instance` once the requests it serves are done (see the module docstring): a ready
    one drains first, anything else (starting, failed, unhealthy: not routed to) stops at once.
    `standby_until` keeps a drained instance running until then. Returns its state now."""
    if instance.state == State.READY:
        instance.leave_routing(reason, standby_until)
        return instance.state
    if instance.state != State.DRAINING:
        request_stop(instance, reason)
    return instance.state


def request_stop(instance: Instance, reason: str = "") -> None:
    """Stop at once: ask the node agent, or, for an instance with no process, mark it stopped."""
    if instance.state in (State.STOPPING, State.STOPPED):
        return
    why = f": {reason}" if reason else ""
    # A staging instance has nothing running either: its agent, fetching, finds it stopped
    # and launches nothing.
    if instance.pid is None and instance.state in (State.PENDING, State.STAGING, State.FAILED,
                                                   State.CRASH_LOOP):
        if instance.transition([instance.state], State.STOPPED, port=None):
            events.record(events.Kind.STOPPED,
                          f"Instance #{instance.ordinal} removed (no engine was running){why}.",
                          instance=instance)
        return
    if instance.transition([instance.state], State.STOPPING, standby_until=None):
        events.record(events.Kind.STOPPING, f"Instance #{instance.ordinal} stopping{why}.",
                      instance=instance)
        _dispatch_stop(instance)


def grace_seconds() -> float:
    """How long a draining instance stays up even with nothing in flight (the module docstring
    says why)."""
    return float(settings.GATEWAY["CATALOG_REFRESH_SECONDS"]) + 1.0


def finish(instances: list[Instance]) -> int:
    """Stop the draining instances among `instances` whose requests are done or whose drain
    timed out; how many were stopped. An unreadable count (Redis down) waits for the timeout."""
    draining = [i for i in instances if i.state == State.DRAINING]
    if not draining:
        return 0
    now = timezone.now()
    try:
        in_flight = inflight.counts(i.pk for i in draining)
    except redis.RedisError as exc:
        log.warning("requests in flight unknown (%s): draining instances wait for the timeout",
                    exc)
        in_flight = {}
    grace = timedelta(seconds=grace_seconds())
    timeout = timedelta(seconds=settings.DRAIN_TIMEOUT_SECONDS)
    stopped = 0
    for instance in draining:
        if instance.standby_until is not None and now < instance.standby_until:
            continue
        elapsed = now - instance.state_changed_at
        left = in_flight.get(instance.pk)
        if left == 0 and elapsed >= grace:
            message = (f"Instance #{instance.ordinal} drained: no request in flight after "
                       f"{elapsed.total_seconds():.1f} s.")
        elif elapsed >= timeout:
            shown = "an unknown number of" if left is None else str(left)
            message = (f"Instance #{instance.ordinal} drain timed out after "
                       f"{settings.DRAIN_TIMEOUT_SECONDS:g} s with {shown} request(s) in flight.")
        else:
            continue
        if instance.transition([State.DRAINING], State.STOPPING, standby_until=None):
            events.record(events.Kind.DRAINED, message, instance=instance,
                          data={"in_flight": left, "seconds": round(elapsed.total_seconds(), 1)},
                          level=events.Level.INFO if left == 0 else events.Level.WARNING)
            _dispatch_stop(instance)
            stopped += 1
    return stopped


__all__ = ["drain_then_stop", "finish", "grace_seconds", "request_stop"]
