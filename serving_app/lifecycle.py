"""The one place that queues background work: by task name, once the current transaction commits.

Nothing else queues Celery work, and nothing here imports a task module: `serving_app/tasks.py`
imports the node agent and the reconciler, which queue work themselves, so importing the tasks
back would be an import cycle (and `gateway_app/tasks.py` sits above the domain). A task is
named here and registered under that name by its module; the worker that consumes the queue runs
it. Sending after commit means a worker never reads a row older than the change that asked for it.
"""

from __future__ import annotations

from typing import Any

from celery import current_app
from django.db import transaction

CONTROL_QUEUE = "control"

# Task names: `<app>.<what it does>`, registered by `serving_app.tasks`.
START_INSTANCE = "serving.start_instance"
STOP_INSTANCE = "serving.stop_instance"
SYNC_ADAPTERS = "serving.sync_adapters"
# A multi-node instance's headless worker, on its own node's queue (started and stopped by the
# leader's agent, which runs START_INSTANCE and STOP_INSTANCE of the group).
START_WORKER = "serving.start_worker"
STOP_WORKER = "serving.stop_worker"
RECONCILE_DEPLOYMENT = "serving.reconcile_deployment"
RECONCILE_ALL = "serving.reconcile_all"
REMOVE_ADAPTER_FILES = "serving.remove_adapter_files"
ROLL_UP_ENGINE_SAMPLES = "serving.roll_up_engine_samples"  # scheduled by beat
AUTOSCALE = "serving.autoscale"  # scheduled by beat
WAKE_DEPLOYMENT = "serving.wake_deployment"
IMPORT_ARTIFACT = "serving.import_artifact"  # S3 and Hugging Face imports (control queue)
IMPORT_NODE_FOLDER = "serving.import_node_folder"  # on the node's own queue
STAGE_VERSION = "serving.stage_version"  # on the node's own queue: fetch into its cache
FREE_CACHED_VERSION = "serving.free_cached_version"  # on the node's own queue: a deleted adapter
RUN_CAPACITY_TEST = "serving.run_capacity_test"  # on the node's queue of the instance measured
EXPIRE_ABANDONED_UPLOADS = "serving.expire_abandoned_uploads"  # scheduled by beat
# Registered by `gateway_app.tasks` (scheduled by beat).
DRAIN_USAGE_EVENTS = "gateway_app.drain_usage_events"
PRUNE_USAGE_ROLLUPS = "gateway_app.prune_usage_rollups"
# Registered by `alerts_app.tasks` (evaluation scheduled by beat).
EVALUATE_ALERTS = "alerts.evaluate"
DELIVER_NOTIFICATION = "alerts.deliver_notification"
# Registered by `backups_app.tasks` (scheduled by beat every BACKUP_INTERVAL_MINUTES).
BACK_UP_DATABASE = "backups.back_up_database"
NODE_TASKS = (START_INSTANCE, STOP_INSTANCE, SYNC_ADAPTERS)
WORKER_TASKS = (START_WORKER, STOP_WORKER)


def enqueue(name: str, *args: Any, queue: str = CONTROL_QUEUE,
            countdown: float | None = None) -> None:
    """Queue task `name` with `args` on `queue` once the current transaction (if any) commits,
    to run no sooner than `countdown` seconds from then.

    A signature by name, not an imported task: in a process that registered the task (a worker,
    or any process with `CELERY_TASK_ALWAYS_EAGER`) it runs through the task's own `apply_async`,
    elsewhere it is sent by name."""
    options: dict[str, Any] = {"queue": queue}
    if countdown:
        options["countdown"] = countdown
    signature = current_app.signature(name, args=args, **options)
    transaction.on_commit(signature.apply_async)


def deployment_changed(deployment_id: int) -> None:
    """Reconcile the deployment as soon as the change that called this commits."""
    enqueue(RECONCILE_DEPLOYMENT, deployment_id)


def nodes_changed() -> None:
    """A node was cordoned or set to drain: run the reconciler's whole round (it moves the
    instances of draining nodes) once the change commits."""
    enqueue(RECONCILE_ALL)


def instance_task(name: str, instance_id: int, node_queue: str) -> None:
    """Ask the node agent consuming `node_queue` to run `name` (one of NODE_TASKS) on an
    instance, once the change that called this commits."""
    if name not in NODE_TASKS:
        raise ValueError(f"{name} is not a node agent task")
    enqueue(name, instance_id, queue=node_queue)


def worker_task(name: str, worker_id: int, node_queue: str) -> None:
    """Ask the node agent consuming `node_queue` to start or stop (one of WORKER_TASKS) the
    headless worker of a multi-node instance it runs, once the change that called this
    commits."""
    if name not in WORKER_TASKS:
        raise ValueError(f"{name} is not a worker task")
    enqueue(name, worker_id, queue=node_queue)


def node_folder_import(import_id: int, node_queue: str) -> None:
    """Ask the node agent consuming `node_queue` to import a folder of its host as an artifact
    version, once the change that called this commits."""
    enqueue(IMPORT_NODE_FOLDER, import_id, queue=node_queue)


def stage_version(version_id: int, node_queue: str) -> None:
    """Ask the node agent consuming `node_queue` to fetch an artifact version into its cache
    ahead of any instance needing it, once the change that called this commits."""
    enqueue(STAGE_VERSION, version_id, queue=node_queue)


def free_cached_version(removal_id: int, node_queue: str) -> None:
    """Ask the node agent consuming `node_queue` to drop a deleted adapter's version from its
    cache (kept while an engine of its own still has the adapter), once the change commits."""
    enqueue(FREE_CACHED_VERSION, removal_id, queue=node_queue)


def capacity_test(test_id: int, node_queue: str) -> None:
    """Ask the node agent consuming `node_queue` (the node of the instance measured) to run a
    capacity test, once the change that queued it commits."""
    enqueue(RUN_CAPACITY_TEST, test_id, queue=node_queue)


def artifact_import(import_id: int) -> None:
    """Run an S3 or Hugging Face import on the control worker once the change commits."""
    enqueue(IMPORT_ARTIFACT, import_id)


def adapter_files_released() -> None:
    """Try to remove a deleted adapter's files once the deletion commits (the reconciler tries
    again each round while an engine still has the adapter)."""
    enqueue(REMOVE_ADAPTER_FILES)


def wake_deployment(deployment_id: int) -> None:
    """Ask the control worker to bring a deployment scaled to zero back (a request waits for
    it): sent at once, outside any transaction (the gateway calls it)."""
    current_app.signature(WAKE_DEPLOYMENT, args=(deployment_id,), queue=CONTROL_QUEUE) \
        .apply_async(expires=60)


def backup_requested(backup_id: int) -> None:
    """Run the queued backup on the control worker once the request that recorded it commits."""
    enqueue(BACK_UP_DATABASE, backup_id)
