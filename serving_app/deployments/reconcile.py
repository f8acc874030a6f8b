"""Reconciliation: converge each deployment's instances to what it asks for.

Runs on the control queue (periodically from beat, and right after a deployment changes). Each
round locks the deployment's row and hands its instances to
`serving_app.deployments.rollout.converge()`, which places and starts missing instances, replaces
outdated ones (rolling, or blue-green while
such a rollout is active) and those of lost nodes, drains and stops surplus ones, restarts failed
ones with exponential backoff, puts repeat failures in crash loop and sends lost node tasks
again; then ready instances are asked to load or unload adapters. It never talks to an engine
itself: node agents do, through their own queues.

Each round (`reconcile_all`) first declares lost the nodes whose heartbeat stopped (their
instances leave routing and are replaced elsewhere) and takes one step of each node drain (a
replacement placed elsewhere for one instance at a time; the old one drains once it is ready),
then reconciles every deployment.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from serving_app import lifecycle
from serving_app.deployments import draining
from serving_app.deployments.rollout import (
    backoff_seconds,
    converge,
    handle_failed,
    leave_lost_node,
)
from serving_app.fleet.place import place_replicas
from serving_app.models import AdapterFileRemoval, Deployment, Instance, Node, events

log = logging.getLogger(__name__)
State = Instance.State

__all__ = ["advance_drain", "backoff_seconds", "declare_lost_nodes", "handle_failed",
           "reconcile_all", "reconcile_deployment"]


def reconcile_deployment(deployment_id: int) -> dict[str, int]:
    counts = {"started": 0, "stopped": 0, "restarted": 0, "adapters": 0}
    with transaction.atomic():
        deployment = (Deployment.objects.select_for_update(of=("self",), no_key=True)
                      .select_related("base_model", "applied_revision")
                      .filter(pk=deployment_id).first())
        if deployment is None:
            return counts
        instances = list(deployment.instances.select_related("node").exclude(state=State.STOPPED))
        converge(deployment, instances, counts)
        if deployment.desired_state == Deployment.DesiredState.STOPPED:
            return counts

        wanted = {a.engine_name for a in deployment.adapters.select_related("tenant")}
        for instance in instances:
            node = instance.node
            if instance.state != State.READY or node is None:
                continue
            errors = set(instance.adapter_errors)
            if set(instance.loaded_adapters) != wanted - errors or errors - wanted:
                lifecycle.instance_task(lifecycle.SYNC_ADAPTERS, instance.pk, node.queue)
                counts["adapters"] += 1
    return counts


def _node_name(instance: Instance) -> str:
    node = instance.node
    return node.name if node is not None else ""


# -- lost nodes ------------------------------------------------------------------------------
def declare_lost_nodes() -> list[Node]:
    """Declare lost every node whose heartbeat is older than NODE_LOST_SECONDS, and take its
    instances out of service (and the multi-node groups with a worker there, as one): each is
    stopped at once (`rollout.leave_lost_node()`, which takes
    it out of routing in every gateway worker), and the deployments' round then places
    replacements on the nodes where they fit. The stop tasks wait in the node's queue: an agent
    that was only frozen or cut off stops its replaced engines when it is back, rather than
    adopting them twice. Conditional on the heartbeat read, so an agent that beats meanwhile is
    not declared lost.

    A node row locked by another transaction is skipped this round rather than waited for: an
    agent frozen (or cut off) in the middle of one of its own transactions holds its node's
    row until the database ends that session (agents' sessions have an idle-in-transaction
    timeout below NODE_LOST_SECONDS, `console.settings`), and waiting for it here would stall
    every reconciling thread with it.
    """
    now = timezone.now()
    cutoff = now - timedelta(seconds=settings.NODE_LOST_SECONDS)
    declared = []
    for node in Node.objects.filter(lost_at__isnull=True, last_heartbeat__lt=cutoff):
        with transaction.atomic():
            still_silent = Node.objects.select_for_update(skip_locked=True).filter(
                pk=node.pk, lost_at__isnull=True, last_heartbeat__lt=cutoff)
            if not list(still_silent.values_list("pk", flat=True)):
                continue
            Node.objects.filter(pk=node.pk).update(lost_at=now)
            node.lost_at = now
            silent = (now - node.last_heartbeat).total_seconds() if node.last_heartbeat else None
            reason = f"node {node.name} lost: no heartbeat for {silent or 0:.0f} s"
            # Its instances, and the multi-node groups with a worker there: a group is
            # stopped and replaced as one.
            moved = list(Instance.objects.filter(Q(node=node) | Q(workers__node=node))
                         .distinct().select_related("node", "deployment")
                         .exclude(state__in=(State.STOPPED, State.STOPPING)))
            for instance in moved:
                leave_lost_node(instance, reason)
            events.record(events.Kind.NODE_LOST,
                          f"Node {node.name} lost: no heartbeat for {silent or 0:.0f} s; "
                          f"{len(moved)} instance(s) replaced elsewhere.", node=node,
                          level=events.Level.ERROR,
                          data={"last_heartbeat": node.last_heartbeat.isoformat()
                                if node.last_heartbeat else None,
                                "instances": [str(i) for i in moved]})
            log.warning("%s; replacing %s", reason, [str(i) for i in moved] or "nothing")
            declared.append(node)
    return declared


# -- node drain ------------------------------------------------------------------------------
SERVING = (State.READY, State.UNHEALTHY)
LEAVING = (State.DRAINING, State.STOPPING)


def advance_drain(node: Node) -> str:
    """One step of moving every instance off a draining node, one at a time and without
    downtime: a replacement is placed on another node (this one is cordoned) and started; once it
    is ready its deployment's round drains the old one (`serving_app.deployments.draining`: it
    leaves routing, and stops once its requests in flight are done), and the next move begins.
    Instances that serve nothing yet (pending, starting, failed) are simply stopped: their
    deployments place them elsewhere. Without room elsewhere the drain waits, saying why;
    stopping the old instance first would not make room, which is on other nodes. The node is
    drained once nothing of it runs any more. Returns the node's status."""
    if not node.cordoned:  # uncordoned by an edit rather than `uncordon`: the drain ends too
        Node.objects.filter(pk=node.pk).update(draining=False,
                                               drain_status="Ended: the node was uncordoned.")
        return "ended"
    remaining = list(node.instances.select_related("deployment", "node")
                     .exclude(state=State.STOPPED).order_by("deployment__name", "ordinal"))
    if not remaining:
        Node.objects.filter(pk=node.pk, draining=True).update(
            draining=False, drain_status=f"Drained at {timezone.now():%Y-%m-%d %H:%M:%S %Z}.")
        events.record(events.Kind.DRAIN_DONE, f"Node {node.name} drained: nothing of it runs "
                                              "any more.", node=node)
        log.info("node %s drained", node.name)
        return "drained"
    on_node = [i for i in remaining if i.state not in LEAVING]
    if not on_node:  # drained once these have stopped: the host may then be taken down
        return _drain_status(node, f"Waiting for {len(remaining)} instance(s) to stop.")
    moving = list(Instance.objects.select_related("node").filter(replaces__in=on_node)
                  .exclude(state__in=(State.STOPPED, *LEAVING)))
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
            # Serves nothing yet: its deployment places it elsewhere.
            draining.request_stop(instance, f"node {node.name} is drained")
    candidates = [i for i in on_node if i.state in SERVING
                  and i.deployment.desired_state == Deployment.DesiredState.RUNNING
                  and i.generation == i.deployment.generation
                  and i.revision_id == i.deployment.applied_revision_id]
    if not candidates:
        return _drain_status(node, "Waiting for the instances left to stop.")
    return _move(node, candidates[0])


def _move(node: Node, instance: Instance) -> str:
    with transaction.atomic():
        deployment = (Deployment.objects.select_for_update(of=("self",), no_key=True)
                      .select_related("base_model", "applied_revision")
                      .get(pk=instance.deployment_id))
        if not Instance.objects.filter(pk=instance.pk, state__in=SERVING).exists():
            return node.drain_status
        shown_error = deployment.placement_error
        placed, reason = place_replicas(deployment, [instance.ordinal],
                                                revision=deployment.applied_revision)
        if not placed:
            # The deployment itself is fine; the refusal is the drain's to show.
            Deployment.objects.filter(pk=deployment.pk).update(placement_error=shown_error)
            return _drain_status(node, f"Waiting: no room elsewhere for {instance}: {reason}")
        [successor] = placed
        target = successor.node
        if target is None:  # place_replicas() gives each instance it places a node
            raise RuntimeError(f"{successor} was placed on no node")
        Instance.objects.filter(pk=successor.pk).update(replaces=instance)
        lifecycle.instance_task(lifecycle.START_INSTANCE, successor.pk, target.queue)
        where = _node_name(successor)
        events.record(events.Kind.DRAIN_STEP,
                      f"Node {node.name} drain: moving instance #{instance.ordinal} of "
                      f"{deployment.name} to {where}.", node=node,
                      data={"instance": str(instance), "to": where})
        events.record(events.Kind.PLACED,
                      f"Instance #{successor.ordinal} placed to take over from instance "
                      f"#{instance.ordinal}: its node is drained.", instance=successor,
                      data={"reason": f"node {node.name} drained", "replaces": instance.pk})
        return _drain_status(node, f"Moving {instance} to {where}: its replacement is starting.")


def _drain_status(node: Node, status: str) -> str:
    """Show where the drain stands; a new reason to wait is also an event."""
    if node.drain_status != status:
        Node.objects.filter(pk=node.pk, draining=True).update(drain_status=status)
        if status.startswith(("Waiting: no room", "Stuck")):
            events.record(events.Kind.DRAIN_WAITING, f"Node {node.name} drain waits.",
                          node=node, level=events.Level.WARNING, data={"reason": status})
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
