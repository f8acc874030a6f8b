"""Reconciliation: converge each deployment's instances to what it asks for.

Runs on the control queue (periodically from beat, and right after a deployment changes).
It creates, places and starts missing instances, stops surplus and outdated ones, restarts
failed ones with exponential backoff, puts repeat failures in crash loop, and asks node agents
to load or unload adapters. It never talks to an engine itself: node agents do, through their
own queues.

Each round (`reconcile_all`) first declares lost the nodes whose heartbeat stopped (their
instances leave routing and are replaced elsewhere) and takes one step of each node drain (a
replacement placed elsewhere for one instance at a time; the old one is stopped once it is
ready), then reconciles every deployment.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from serving_app import events, lifecycle
from serving_app.models import AdapterFileRemoval, Deployment, Instance, Node
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

        # Replacements of instances being moved off a draining node, by the instance they
        # replace (one stopping, or stopped, has given up its place).
        successors = {i.replaces_id: i for i in instances
                      if i.replaces_id is not None and i.state != State.STOPPING}
        keep: list[Instance] = []
        for instance in sorted(instances, key=lambda i: i.ordinal):
            if instance.state == State.STOPPING:
                redispatch_if_stuck(instance)
                continue
            successor = successors.get(instance.pk)
            if successor is not None:
                # Its successor takes its place in the count; it serves until that one is ready.
                if successor.state == State.READY:
                    request_stop(instance)
                    counts["stopped"] += 1
                    events.record("instance_replaced", deployment, instance=str(instance),
                                  node=_node_name(instance), by=successor.pk,
                                  on=_node_name(successor), reason="drain")
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


def _node_name(instance: Instance) -> str:
    return instance.node.name if instance.node_id is not None else ""


# -- lost nodes ------------------------------------------------------------------------------
def declare_lost_nodes() -> list[Node]:
    """Declare lost every node whose heartbeat is older than NODE_LOST_SECONDS, and take its
    instances out of service: each is asked to stop (which takes it out of routing in every
    gateway worker at once), and the deployments' reconcile then places replacements on the
    nodes where they fit. The stop tasks wait in the node's queue: an agent that was only frozen
    or cut off stops its replaced engines when it is back, rather than adopting them twice.
    Conditional on the heartbeat read, so an agent that beats meanwhile is not declared lost.
    """
    now = timezone.now()
    cutoff = now - timedelta(seconds=settings.NODE_LOST_SECONDS)
    declared = []
    for node in Node.objects.filter(lost_at__isnull=True, last_heartbeat__lt=cutoff):
        with transaction.atomic():
            if not Node.objects.filter(pk=node.pk, lost_at__isnull=True,
                                       last_heartbeat__lt=cutoff).update(lost_at=now):
                continue
            node.lost_at = now
            silent = (now - node.last_heartbeat).total_seconds() if node.last_heartbeat else None
            reason = f"node {node.name} lost: no heartbeat for {silent or 0:.0f} s"
            moved = list(node.instances.select_related("node", "deployment")
                         .exclude(state__in=(State.STOPPED, State.STOPPING)))
            for instance in moved:
                request_stop(instance)
                events.record("instance_replaced", instance.deployment, instance=str(instance),
                              node=node.name, reason=reason)
            events.record("node_lost", node, last_heartbeat=node.last_heartbeat,
                          instances=[str(i) for i in moved])
            log.warning("%s; replacing %s", reason, [str(i) for i in moved] or "nothing")
            declared.append(node)
    return declared


# -- node drain ------------------------------------------------------------------------------
SERVING = (State.READY, State.UNHEALTHY)


def advance_drain(node: Node) -> str:
    """One step of moving every instance off a draining node, one at a time and without
    downtime: a replacement is placed on another node (this one is cordoned) and started; once it
    is ready its deployment's reconcile stops the old one, and the next move begins. Instances
    that serve nothing yet (pending, starting, failed) are simply stopped: their deployments
    place them elsewhere. Without room elsewhere the drain waits, saying why; stopping the old
    instance first would not make room, which is on other nodes. The node is drained once
    nothing of it runs any more. Returns the node's status."""
    if not node.cordoned:  # uncordoned by an edit rather than `uncordon`: the drain ends too
        Node.objects.filter(pk=node.pk).update(draining=False,
                                               drain_status="Ended: the node was uncordoned.")
        return "ended"
    remaining = list(node.instances.select_related("deployment", "node")
                     .exclude(state=State.STOPPED).order_by("deployment__name", "ordinal"))
    if not remaining:
        Node.objects.filter(pk=node.pk, draining=True).update(
            draining=False, drain_status=f"Drained at {timezone.now():%Y-%m-%d %H:%M:%S %Z}.")
        events.record("drain_done", node)
        log.info("node %s drained", node.name)
        return "drained"
    on_node = [i for i in remaining if i.state != State.STOPPING]
    if not on_node:  # drained once these have stopped: the host may then be taken down
        return _drain_status(node, f"Waiting for {len(remaining)} instance(s) to stop.")
    moving = list(Instance.objects.select_related("node").filter(replaces__in=on_node)
                  .exclude(state__in=(State.STOPPED, State.STOPPING)))
    if moving:
        successor = moving[0]
        if successor.state == State.CRASH_LOOP:
            return _drain_status(node, f"Stuck: the replacement of {successor.replaces} on "
                                       f"{_node_name(successor)} is in crash loop "
                                       f"({successor.last_error[:200]}); the old one serves on.")
        return _drain_status(node, f"Moving {successor.replaces} to {_node_name(successor)}: "
                                   f"waiting for the replacement to be ready ({successor.state}).")
    for instance in on_node:
        if instance.state not in SERVING:
            request_stop(instance)  # serves nothing yet: its deployment places it elsewhere
    candidates = [i for i in on_node if i.state in SERVING
                  and i.deployment.desired_state == Deployment.DesiredState.RUNNING
                  and i.generation == i.deployment.generation]
    if not candidates:
        return _drain_status(node, "Waiting for the instances left to stop.")
    return _move(node, candidates[0])


def _move(node: Node, instance: Instance) -> str:
    with transaction.atomic():
        deployment = (Deployment.objects.select_for_update().select_related("base_model")
                      .get(pk=instance.deployment_id))
        if not Instance.objects.filter(pk=instance.pk, state__in=SERVING).exists():
            return node.drain_status
        shown_error = deployment.placement_error
        placed, reason = place_replicas(deployment, [instance.ordinal])
        if not placed:
            # The deployment itself is fine; the refusal is the drain's to show.
            Deployment.objects.filter(pk=deployment.pk).update(placement_error=shown_error)
            return _drain_status(node, f"Waiting: no room elsewhere for {instance}: {reason}")
        [successor] = placed
        Instance.objects.filter(pk=successor.pk).update(replaces=instance)
        _dispatch(lifecycle.START_INSTANCE, successor)
        where = _node_name(successor)
        events.record("drain_step", node, instance=str(instance), to=where)
        events.record("instance_moving", deployment, instance=str(instance), node=node.name,
                      to=where, reason=f"node {node.name} drained")
        return _drain_status(node, f"Moving {instance} to {where}: its replacement is starting.")


def _drain_status(node: Node, status: str) -> str:
    """Show where the drain stands; a new reason to wait is also an event."""
    if node.drain_status != status:
        Node.objects.filter(pk=node.pk, draining=True).update(drain_status=status)
        if status.startswith(("Waiting: no room", "Stuck")):
            events.record("drain_waiting", node, reason=status)
        node.drain_status = status
    return status


def reconcile_all() -> int:
    for step in (declare_lost_nodes, _advance_drains):
        try:
            step()
        except Exception:
            log.exception("reconcile: %s", step.__name__)
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


def _advance_drains() -> None:
    for node in Node.objects.filter(draining=True, lost_at__isnull=True):
        try:
            advance_drain(node)
        except Exception:
            log.exception("draining node %s", node.name)
