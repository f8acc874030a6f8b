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

from serving_app.models import AdapterFileRemoval, Deployment, Instance

log = logging.getLogger(__name__)
State = Instance.State
PENDING_REDISPATCH_SECONDS = 30


def _dispatch(task_name: str, instance: Instance) -> None:
    from serving_app import tasks

    task = getattr(tasks, task_name)
    queue = instance.node.queue if instance.node_id else None
    if queue is None:
        return
    instance_id = instance.pk
    transaction.on_commit(lambda: task.apply_async((instance_id,), queue=queue))


def request_stop(instance: Instance) -> None:
    if instance.state == State.STOPPING:
        return
    if instance.pid is None and instance.state in (State.PENDING, State.FAILED, State.CRASH_LOOP):
        instance.transition([instance.state], State.STOPPED, port=None)
        return
    if instance.transition([instance.state], State.STOPPING):
        _dispatch("stop_instance", instance)


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
        _dispatch("start_instance", instance)


def place_and_start(deployment: Deployment, ordinals: list[int]) -> list[Instance]:
    """Place all the new instances or none (the reason goes on the deployment), then start them."""
    from serving_app.placement.service import place_replicas

    instances, reason = place_replicas(deployment, ordinals)
    if reason:
        log.info("%s not placed: %s", deployment, reason)
    for instance in instances:
        _dispatch("start_instance", instance)
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
            elif instance.state == State.PENDING and timezone.now() - instance.state_changed_at > (
                timedelta(seconds=PENDING_REDISPATCH_SECONDS)
            ):
                # The start task may have been lost with a node agent: it is safe to send again.
                Instance.objects.filter(pk=instance.pk).update(state_changed_at=timezone.now())
                _dispatch("start_instance", instance)

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
                _dispatch("sync_adapters", instance)
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
