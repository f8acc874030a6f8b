"""Reconciliation: converge each deployment's instances to what it asks for.

Runs on the control queue (periodically from beat, and right after a deployment changes).
It creates, places and starts missing instances, stops surplus and outdated ones, restarts
failed ones with exponential backoff, puts repeat failures in crash loop, and asks node agents
to load or unload adapters. It never talks to an engine itself: node agents do, through their
own queues.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from serving_app import lifecycle
from serving_app.models import AdapterFileRemoval, Deployment, Instance
from serving_app.placement.service import place_replicas

log = logging.getLogger(__name__)
State = Instance.State
PENDING_REDISPATCH_SECONDS = 30
# Beyond the longest a start or stop in flight can take, before its task is sent again.
REDISPATCH_MARGIN_SECONDS = 30


def _dispatch(task_name: str, instance: Instance) -> None:
    """Ask the instance's node agent to run `task_name` once this round commits."""
    if instance.node_id is None:
        return
    lifecycle.instance_task(task_name, instance.pk, instance.node.queue)


def redispatch_if_stuck(instance: Instance) -> bool:
    """Send an instance's task again when it has been pending, starting or stopping for longer
    than that task takes: the task was lost (with the broker, or a node agent that died with it
    in hand), and nothing else would ever send it. True if it was sent.

    Every node task is conditional on the state it finds, so a second delivery does no harm: a
    start of a starting instance resumes watching its engine (or fails it if none was
    launched), a stop of a stopping one stops whatever of its engine still runs. The update of
    `state_changed_at`, conditional on the value read, lets one round of any number racing send
    it, and the next only a full period later. A lost node's agent would not take it; it is
    sent once the node is back.
    """
    timeouts: dict[str, float] = {
        State.PENDING: PENDING_REDISPATCH_SECONDS,
        State.STARTING: settings.ENGINE_START_TIMEOUT_SECONDS + REDISPATCH_MARGIN_SECONDS,
        State.STOPPING: settings.ENGINE_STOP_GRACE_SECONDS + REDISPATCH_MARGIN_SECONDS,
    }
    tasks: dict[str, str] = {State.PENDING: lifecycle.START_INSTANCE,
                             State.STARTING: lifecycle.START_INSTANCE,
                             State.STOPPING: lifecycle.STOP_INSTANCE}
    if instance.state not in timeouts or instance.node_id is None or instance.node.is_lost:
        return False
    now = timezone.now()
    if now - instance.state_changed_at < timedelta(seconds=timeouts[instance.state]):
        return False
    if not Instance.objects.filter(pk=instance.pk, state=instance.state,
                                   state_changed_at=instance.state_changed_at,
                                   ).update(state_changed_at=now):
        return False
    instance.state_changed_at = now
    log.info("%s still %s: sending %s again", instance, instance.state, tasks[instance.state])
    _dispatch(tasks[instance.state], instance)
    return True


def request_stop(instance: Instance) -> None:
    if instance.state == State.STOPPING:
        redispatch_if_stuck(instance)
        return
    if instance.pid is None and instance.state in (State.PENDING, State.FAILED, State.CRASH_LOOP):
        instance.transition([instance.state], State.STOPPED, port=None)
        return
    if instance.transition([instance.state], State.STOPPING):
        _dispatch(lifecycle.STOP_INSTANCE, instance)


def backoff_seconds(recent_restarts: int) -> float:
    return min(settings.RESTART_BACKOFF_MAX_SECONDS,
               settings.RESTART_BACKOFF_SECONDS * (2 ** recent_restarts))


def _recent_restarts(instance: Instance) -> list[str]:
    cutoff = timezone.now() - timedelta(seconds=settings.CRASH_LOOP_WINDOW_SECONDS)
    recent = []
    for stamp in instance.restart_history:
        when = parse_datetime(stamp)
        if when is not None and when >= cutoff:
            recent.append(stamp)
    return recent


def handle_failed(instance: Instance) -> None:
    """Restart a failed instance after its backoff, or declare a crash loop."""
    now = timezone.now()
    recent = _recent_restarts(instance)
    if len(recent) >= settings.CRASH_LOOP_RESTARTS:
        reason = (f"Crash loop: {len(recent)} restarts within "
                  f"{settings.CRASH_LOOP_WINDOW_SECONDS:g} s. Last error: {instance.last_error}")
        instance.transition([State.FAILED], State.CRASH_LOOP, last_error=reason,
                            next_restart_at=None)
        return
    if instance.next_restart_at is None:
        delay = backoff_seconds(len(recent))
        Instance.objects.filter(pk=instance.pk, state=State.FAILED).update(
            next_restart_at=now + timedelta(seconds=delay))
        if delay > 0:
            return
    elif instance.next_restart_at > now:
        return
    if instance.node_id and instance.node.is_lost:
        return
    if instance.transition([State.FAILED], State.PENDING, restarts=instance.restarts + 1,
                           restart_history=[*recent, now.isoformat()], next_restart_at=None,
                           pid=None):
        log.info("restarting %s (restart %s)", instance, instance.restarts)
        _dispatch(lifecycle.START_INSTANCE, instance)


def place_and_start(deployment: Deployment, ordinals: list[int]) -> list[Instance]:
    """Place all the new instances or none (the reason goes on the deployment), then start them."""
    instances, reason = place_replicas(deployment, ordinals)
    if reason:
        log.info("%s not placed: %s", deployment, reason)
    for instance in instances:
        _dispatch(lifecycle.START_INSTANCE, instance)
    return instances


def reconcile_deployment(deployment_id: int) -> dict[str, int]:
    counts = {"started": 0, "stopped": 0, "restarted": 0, "adapters": 0}
    with transaction.atomic():
        deployment = (Deployment.objects.select_for_update().select_related("base_model")
                      .filter(pk=deployment_id).first())
        if deployment is None:
            return counts
        instances = list(deployment.instances.select_related("node").exclude(state=State.STOPPED))
        if deployment.desired_state == Deployment.DesiredState.STOPPED:
            for instance in instances:
                request_stop(instance)
                counts["stopped"] += 1
            return counts

        keep: list[Instance] = []
        for instance in sorted(instances, key=lambda i: i.ordinal):
            if instance.state == State.STOPPING:
                redispatch_if_stuck(instance)
                continue
            if instance.generation != deployment.generation or len(keep) >= deployment.replicas:
                request_stop(instance)
                counts["stopped"] += 1
            else:
                keep.append(instance)

        for instance in keep:
            if instance.state == State.FAILED:
                handle_failed(instance)
                counts["restarted"] += 1
            elif instance.state in (State.PENDING, State.STARTING):
                redispatch_if_stuck(instance)

        used = {i.ordinal for i in keep}
        ordinals: list[int] = []
        ordinal = 0
        while len(ordinals) < deployment.replicas - len(keep):
            if ordinal not in used:
                ordinals.append(ordinal)
            ordinal += 1
        if ordinals:
            counts["started"] = len(place_and_start(deployment, ordinals))
        elif deployment.placement_error:
            Deployment.objects.filter(pk=deployment.pk).update(placement_error="")

        wanted = {a.engine_name for a in deployment.adapters.select_related("tenant")}
        for instance in keep:
            if instance.state != State.READY:
                continue
            errors = set(instance.adapter_errors)
            if set(instance.loaded_adapters) != wanted - errors or errors - wanted:
                _dispatch(lifecycle.SYNC_ADAPTERS, instance)
                counts["adapters"] += 1
    return counts


def reconcile_all() -> int:
    ids = list(Deployment.objects.values_list("pk", flat=True))
    for deployment_id in ids:
        try:
            reconcile_deployment(deployment_id)
        except Exception:
            log.exception("reconciling deployment %s", deployment_id)
    try:
        # Deleted adapters' files whose engines have unloaded them since the last round.
        AdapterFileRemoval.objects.remove_released()
    except Exception:
        log.exception("removing deleted adapters' files")
    return len(ids)
