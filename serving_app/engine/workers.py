"""A multi-node group's headless worker, on its own node: this node's agent launches it while
its group starts, stops it, and fails it (and with it the group) when its process exits. It
serves nothing itself; its leader's agent drives the group (`starting`, `groups`)."""

from __future__ import annotations

import logging
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from serving_app.artifacts import staging
from serving_app.engine import supervisor
from serving_app.engine.config import AgentConfig, current_config
from serving_app.engine.failures import StartError, clear_orphans, fail_worker, write_log
from serving_app.engine.launch import build_launch_spec
from serving_app.engine.starting import cpu_cores, preflight
from serving_app.models import Instance, InstanceWorker

log = logging.getLogger(__name__)
State = Instance.State
Worker = InstanceWorker.State


def _worker_log_path(worker: InstanceWorker) -> Path:
    instance = worker.instance
    return settings.ENGINE_LOG_DIR / (f"{instance.deployment.name}-{instance.pk}-"
                                      f"rank{worker.node_rank}.log")


def start_worker(worker_id: int, config: AgentConfig | None = None) -> str:
    """Launch the headless worker of a multi-node instance on this node, while its group is
    starting. It serves nothing itself: it is running once its process is, and the group is
    ready when the leader's API answers."""
    config = config or current_config()
    worker = (InstanceWorker.objects.select_related(
        "node", "instance__deployment__base_model", "instance__node", "instance__revision")
        .filter(pk=worker_id).first())
    if worker is None or config is None or worker.node is None:
        return "missing"
    if worker.node.name != config.name:
        return "not-mine"
    instance = worker.instance
    if instance.state != State.STARTING:
        worker.transition([Worker.PENDING], Worker.STOPPED)
        return f"skipped (instance {instance.state})"
    if not worker.transition([Worker.PENDING], Worker.STARTING, started_at=timezone.now(),
                             last_error="", exit_code=None, log_tail=""):
        return f"skipped ({worker.state})"
    log_path = _worker_log_path(worker)
    try:
        version = instance.model_version or instance.deployment.base_model.artifact_version
        if version is not None:
            folder = staging.stage_version(
                version, staging.NodeCacheConfig.from_environment(config.name))
            instance.deployment.base_model.path = str(folder)
        preflight(instance)
    except (StartError, staging.StagingError) as exc:
        write_log(log_path, f"not started: {exc}")
        fail_worker(worker, str(exc), log_path=str(log_path))
        return "failed"
    gpus = list(worker.gpus.all())
    # Every adapter of the deployment counts for its LoRA slots: never fewer than the
    # leader's, which sizes them by the adapters it could load.
    spec = build_launch_spec(
        instance, engine_env=config.engine_env, host=config.address, gpus=gpus,
        python=config.engine_python, pythonpath=config.engine_pythonpath,
        cpu_cores=cpu_cores(worker.node, gpus), node_rank=worker.node_rank,
        environment=worker.environment,
    )
    try:
        launched = supervisor.launch(spec.argv, spec.process_env(), log_path)
    except OSError as exc:
        fail_worker(worker, f"Could not launch the worker: {exc}", log_path=str(log_path))
        return "failed"
    if not InstanceWorker.objects.filter(pk=worker.pk, state=Worker.STARTING).update(
        state=Worker.RUNNING, state_changed_at=timezone.now(), pid=launched.pid,
        log_path=launched.log_path, command=spec.argv, environment=spec.env,
    ):
        # Stopped while it was being launched: a stop that came before the pid was recorded
        # could not find it, so it goes now.
        supervisor.stop(launched.pid, settings.ENGINE_STOP_GRACE_SECONDS)
        return "cancelled"
    log.info("%s launched (pid %s)", worker, launched.pid)
    return "running"


def stop_worker(worker_id: int, config: AgentConfig | None = None) -> str:
    """Stop the headless worker and every process of its session on this node."""
    config = config or current_config()
    worker = (InstanceWorker.objects.select_related("node", "instance")
              .filter(pk=worker_id).first())
    if worker is None or config is None:
        return "missing"
    if worker.node is not None and worker.node.name != config.name:
        return "not-mine"
    if worker.state == Worker.STOPPED:
        return "already stopped"
    if worker.state != Worker.STOPPING and not worker.transition(
        [Worker.PENDING, Worker.STARTING, Worker.RUNNING, Worker.FAILED], Worker.STOPPING
    ):
        return f"skipped ({worker.state})"
    how = "gone"
    if worker.pid and supervisor.is_engine_of(worker.pid, worker.instance.secret, None):
        how = supervisor.stop(worker.pid, settings.ENGINE_STOP_GRACE_SECONDS)
    else:
        clear_orphans(worker.pid)
    tail = supervisor.log_tail(worker.log_path) if worker.log_path else worker.log_tail
    worker.transition([Worker.STOPPING], Worker.STOPPED, pid=None, log_tail=tail)
    log.info("%s stopped (%s)", worker, how)
    return how


def supervise_workers(config: AgentConfig) -> None:
    """This node's headless workers: one whose process exited fails (and with it its group);
    one whose group no longer runs (stopped or failed while its stop task was lost) stops."""
    for worker in InstanceWorker.objects.select_related("instance", "node").filter(
        node__name=config.name, state=Worker.RUNNING
    ):
        if not supervisor.is_alive(worker.pid):
            code = supervisor.exit_code(worker.pid) if worker.pid else None
            fail_worker(worker, f"The headless worker exited (exit code {code}).",
                        exit_code=code)
        elif worker.instance.state in (State.STOPPING, State.STOPPED, State.FAILED,
                                       State.CRASH_LOOP):
            stop_worker(worker.pk, config)
