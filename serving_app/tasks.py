"""Celery tasks. Node tasks go to the queue of the instance's node (`node.<name>`); the
reconciler runs on `control`. Each takes ids, re-reads its rows and is safe to run twice.

Only this module imports the node agent and the reconciler to
run them; everything that queues work does so by name through `serving_app.lifecycle`. A task
that meets the database, Redis or the broker briefly down retries with exponential backoff
(each re-run is safe: the work is conditional on the state it expects).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import shared_task
from celery.signals import worker_ready, worker_shutdown
from django.conf import settings
from django.db import InterfaceError, OperationalError
from kombu.exceptions import OperationalError as BrokerError

from serving_app import lifecycle
from serving_app.artifacts import sources, staging
from serving_app.deployments import autoscaling, reconcile
from serving_app.engine import agent
from serving_app.models import AdapterFileRemoval, EngineHour, EngineSample
from serving_app.models.capacity import MAX_LEVELS

# Failures that pass by themselves: a restarted PostgreSQL, Redis or broker.
TRANSIENT = (OperationalError, InterfaceError, redis.ConnectionError, redis.TimeoutError,
             BrokerError)
RETRY: dict[str, Any] = {
    "autoretry_for": TRANSIENT, "retry_backoff": 2, "retry_backoff_max": 60,
    "retry_jitter": True, "max_retries": 6,
}


@shared_task(name=lifecycle.START_INSTANCE, **RETRY)
def start_instance(instance_id: int) -> str:
    return agent.start_instance(instance_id)


@shared_task(name=lifecycle.STOP_INSTANCE, **RETRY)
def stop_instance(instance_id: int) -> str:
    return agent.stop_instance(instance_id)


@shared_task(name=lifecycle.START_WORKER, **RETRY)
def start_worker(worker_id: int) -> str:
    return agent.start_worker(worker_id)


@shared_task(name=lifecycle.STOP_WORKER, **RETRY)
def stop_worker(worker_id: int) -> str:
    return agent.stop_worker(worker_id)


@shared_task(name=lifecycle.SYNC_ADAPTERS, **RETRY)
def sync_adapters(instance_id: int) -> dict[str, str]:
    return agent.sync_adapters(instance_id)


# Not retried: a test is measured once (a failure is its error, shown to the person who ran it).
# Its levels bound themselves (CAPACITY_TEST_LEVEL_TIMEOUT_SECONDS each); this limit only keeps
# a prefork pool's default one (CELERY_TASK_TIME_LIMIT) from cutting a long test short.
CAPACITY_TEST_LIMIT = int(MAX_LEVELS * settings.CAPACITY_TEST_LEVEL_TIMEOUT_SECONDS) + 120


@shared_task(name=lifecycle.RUN_CAPACITY_TEST, time_limit=CAPACITY_TEST_LIMIT,
             soft_time_limit=CAPACITY_TEST_LIMIT - 60)
def run_capacity_test(test_id: int) -> str:
    return agent.run_capacity_test(test_id)


@shared_task(name=lifecycle.RECONCILE_DEPLOYMENT, **RETRY)
def reconcile_deployment(deployment_id: int) -> dict[str, int]:
    return reconcile.reconcile_deployment(deployment_id)


# Periodic: a round missed while the database is down is simply the next round.
@shared_task(name=lifecycle.RECONCILE_ALL)
def reconcile_all() -> int:
    return reconcile.reconcile_all()


@shared_task(name=lifecycle.ROLL_UP_ENGINE_SAMPLES)
def roll_up_engine_samples() -> dict[str, int]:
    """Roll finished hours of engine samples up, then prune samples and rollups past their
    retention (in that order: no sample goes before its hour is rolled up)."""
    return {"rolled_up": EngineHour.objects.roll_up(),
            "samples_pruned": EngineSample.objects.prune(),
            "hours_pruned": EngineHour.objects.prune()}


@shared_task(name=lifecycle.AUTOSCALE)
def autoscale() -> int:
    return autoscaling.evaluate_all()


@shared_task(name=lifecycle.WAKE_DEPLOYMENT)
def wake_deployment(deployment_id: int) -> bool:
    return autoscaling.wake(deployment_id)


@shared_task(name=lifecycle.REMOVE_ADAPTER_FILES, **RETRY)
def remove_adapter_files() -> int:
    return AdapterFileRemoval.objects.remove_released()


@shared_task(name=lifecycle.IMPORT_ARTIFACT, **RETRY)
def import_artifact(import_id: int) -> str:
    return sources.run_import(import_id)


@shared_task(name=lifecycle.EXPIRE_ABANDONED_UPLOADS)
def expire_abandoned_uploads() -> int:
    return sources.expire_abandoned_uploads()


@shared_task(name=lifecycle.IMPORT_NODE_FOLDER, **RETRY)
def import_node_folder(import_id: int) -> str:
    name = os.environ.get("NODE_NAME", "")
    return staging.import_node_folder(import_id, staging.NodeCacheConfig.from_environment(name))


@shared_task(name=lifecycle.STAGE_VERSION, **RETRY)
def stage_version(version_id: int) -> str:
    name = os.environ.get("NODE_NAME", "")
    return staging.prestage(version_id, staging.NodeCacheConfig.from_environment(name))


@shared_task(name=lifecycle.FREE_CACHED_VERSION, **RETRY)
def free_cached_version(removal_id: int) -> str:
    name = os.environ.get("NODE_NAME", "")
    return staging.free_version(removal_id, staging.NodeCacheConfig.from_environment(name))


@worker_ready.connect
def _start_node_agent(sender: Any = None, **kwargs: Any) -> None:
    """A worker started with NODE_NAME is that host's node agent."""
    if os.environ.get("NODE_NAME"):
        agent.start_agent()


@worker_shutdown.connect
def _stop_node_agent(sender: Any = None, **kwargs: Any) -> None:
    if os.environ.get("NODE_NAME"):
        agent.stop_agent()
