"""Reconciliation: converge each deployment's instances to what it asks for.

Runs on the control queue (periodically from beat, and right after a deployment changes). Each
round locks the deployment's row and hands its instances to `serving_app.rollout.converge()`,
which places and starts missing instances, replaces outdated ones (rolling, or blue-green while
such a rollout is active), drains and stops surplus ones, restarts failed ones with exponential
backoff and puts repeat failures in crash loop; then ready instances are asked to load or
unload adapters. It never talks to an engine itself: node agents do, through their own queues.
"""

from __future__ import annotations

import logging

from django.db import transaction

from serving_app import lifecycle
from serving_app.models import AdapterFileRemoval, Deployment, Instance
from serving_app.rollout import backoff_seconds, converge, handle_failed

log = logging.getLogger(__name__)
State = Instance.State

__all__ = ["backoff_seconds", "handle_failed", "reconcile_all", "reconcile_deployment"]


def reconcile_deployment(deployment_id: int) -> dict[str, int]:
    counts = {"started": 0, "stopped": 0, "restarted": 0, "adapters": 0}
    with transaction.atomic():
        deployment = (Deployment.objects.select_for_update(of=("self",))
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
            if instance.state != State.READY or instance.node_id is None:
                continue
            errors = set(instance.adapter_errors)
            if set(instance.loaded_adapters) != wanted - errors or errors - wanted:
                lifecycle.instance_task(lifecycle.SYNC_ADAPTERS, instance.pk, instance.node.queue)
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
