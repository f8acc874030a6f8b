"""Celery tasks. Node tasks go to the queue of the instance's node (`node.<name>`); the
reconciler runs on `control`. Each takes ids, re-reads its rows and is safe to run twice."""

from __future__ import annotations

from celery import shared_task

from serving_app import reconcile
from serving_app.engine import agent
from serving_app.gateway.tasks import drain_usage_events  # noqa: F401 (registers the task)
from serving_app.models import AdapterFileRemoval


@shared_task(name="serving.start_instance", acks_late=True)
def start_instance(instance_id: int) -> str:
    return agent.start_instance(instance_id)


@shared_task(name="serving.stop_instance", acks_late=True)
def stop_instance(instance_id: int) -> str:
    return agent.stop_instance(instance_id)


@shared_task(name="serving.sync_adapters", acks_late=True)
def sync_adapters(instance_id: int) -> dict[str, str]:
    return agent.sync_adapters(instance_id)


@shared_task(name="serving.reconcile_deployment")
def reconcile_deployment(deployment_id: int) -> dict[str, int]:
    return reconcile.reconcile_deployment(deployment_id)


@shared_task(name="serving.reconcile_all")
def reconcile_all() -> int:
    return reconcile.reconcile_all()


@shared_task(name="serving.remove_adapter_files")
def remove_adapter_files() -> int:
    return AdapterFileRemoval.objects.remove_released()
