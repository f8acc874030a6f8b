"""Starting an engine on this node: staging its files, then (only then) a port, the MPS daemon
it needs, the workers of its multi-node group and its GPUs' memory, the launch, and the wait
until it is ready (`readiness`). `start_instance()` is what the Celery task runs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from serving_app import lifecycle
from serving_app.artifacts import staging
from serving_app.engine import startup, supervisor
from serving_app.engine.adapters import usable_adapters
from serving_app.engine.config import AgentConfig, current_config
from serving_app.engine.failures import StartError, fail_instance, write_log
from serving_app.engine.groups import stop_workers, wait_workers_stopped
from serving_app.engine.launch import build_launch_spec
from serving_app.engine.node_mps import ensure_mps
from serving_app.engine.readiness import STATE_CHECK_SECONDS, cancel_start, wait_until_ready
from serving_app.enginespec import EngineSpec
from serving_app.modelfiles import ModelFilesError, read_model
from serving_app.models import (
    Deployment,
    Gpu,
    Instance,
    InstanceWorker,
    LoraAdapter,
    Node,
    canaries,
    events,
)
from serving_app.placement import inventory

log = logging.getLogger(__name__)
State = Instance.State
Worker = InstanceWorker.State


def start_instance(instance_id: int, config: AgentConfig | None = None) -> str:
    config = config or current_config()
    instance = (
        Instance.objects.select_related("deployment__base_model", "node", "revision")
        .filter(pk=instance_id).first()
    )
    if instance is None or config is None or instance.node is None:
        return "missing"
    if instance.node.name != config.name:
        return "not-mine"
    # Watched from before it leaves pending, so the supervision loop never judges an engine
    # that this task is still launching; and one task at a time per instance.
    with _watching_lock:
        if instance.pk in _watching:
            return "already starting"
        _watching.add(instance.pk)
    try:
        if instance.state == State.STARTING:
            return _resume_start(instance)
        return _start(instance, config)  # pending, or staging when its task was lost
    finally:
        _watching.discard(instance.pk)


_watching: set[int] = set()
_watching_lock = threading.Lock()


def start_in_progress(instance_id: int) -> bool:
    """Whether a start task of this agent is on the instance (launching its engine, or
    waiting for it): the supervision loop leaves such an instance to it."""
    return instance_id in _watching


def _resume_start(instance: Instance) -> str:
    """A start sent again for an instance still starting that no task here watches (the
    reconciler re-sends it when a start lasts too long: its task was lost). An engine of ours is
    watched until ready or past its start timeout (then stopped and failed, like any start);
    without one, the start was lost before the launch, and the instance fails to be restarted."""
    if supervisor.is_engine_of(instance.pid, instance.secret, instance.port):
        return wait_until_ready(instance)
    fail_instance(instance, "The engine's start was lost before it was launched.",
                  expected=[State.STARTING])
    return "failed"


def _stage(instance: Instance, config: AgentConfig, engine: EngineSpec, log_path: Path
           ) -> tuple[list[LoraAdapter], dict[str, str]] | str:
    """Staging, before anything of the node is held: the instance's model files and its
    deployment's adapters fetched into this node's cache and verified (progress on the
    instance), the model checked. The adapters that validate and the errors of those left out;
    or why the instance did not start ("failed": it names the artifact and the reason)."""
    if not instance.transition([State.PENDING, State.STAGING], State.STAGING, last_error="",
                               exit_code=None, health_failures=0, log_tail="", staging={},
                               canary={}):
        return f"skipped ({instance.state})"
    began = time.monotonic()
    try:
        _stage_artifacts(instance, config)
        preflight(instance)
    except StartError as exc:
        write_log(log_path, f"not started: {exc}")
        fail_instance(instance, str(exc), log_path=str(log_path), expected=[State.STAGING])
        return "failed"
    adapters, adapter_errors = usable_adapters(instance, log_path, engine)
    staged = Instance.objects.filter(pk=instance.pk).values_list("staging", flat=True).first()
    events.record(events.Kind.STAGED,
                  f"Instance #{instance.ordinal}'s files are verified in the cache of "
                  f"{config.name} ({time.monotonic() - began:.1f} s).", instance=instance,
                  data={"adapters": [a.engine_name for a in adapters],
                        "left_out": sorted(adapter_errors), "last": staged or {}})
    return adapters, adapter_errors


def _start(instance: Instance, config: AgentConfig) -> str:
    log_path = _log_path(instance)
    # The settings of the instance's own revision, whatever was edited since.
    engine = instance.engine_spec()
    staged = _stage(instance, config, engine, log_path)
    if isinstance(staged, str):
        return staged
    adapters, adapter_errors = staged
    # Only now is anything of the node taken: a port, the GPUs' memory, an engine process. A
    # stop that came during staging left the instance stopped: nothing is launched.
    if not instance.transition([State.STAGING], State.STARTING, started_at=timezone.now()):
        now = Instance.objects.filter(pk=instance.pk).values_list("state", flat=True).first()
        return f"cancelled ({now} while staging)"
    revision = instance.revision.number if instance.revision else None
    try:
        if engine.isolation_mode == Deployment.Isolation.MPS:
            ensure_mps(instance.node)
        port = _claim_port(instance, config, engine)
        if instance.multi_node:
            start_workers(instance)
    except StartError as exc:
        write_log(log_path, f"not started: {exc}")
        fail_instance(instance, str(exc), log_path=str(log_path))
        return "failed"
    # This node's GPUs (a multi-node instance holds those of every node of its group).
    gpus = [g for g in instance.gpus.all() if g.node_id == instance.node_id]
    spec = build_launch_spec(
        instance, engine_env=config.engine_env, host=config.address, gpus=gpus,
        adapters=adapters, python=config.engine_python, pythonpath=config.engine_pythonpath,
        cpu_cores=cpu_cores(instance.node, gpus), engine=engine,
    )
    sizing = GpuSizing(gpus)
    try:
        if not sizing.acquire(instance):
            return cancel_start(instance)
        try:
            launched = supervisor.launch(spec.argv, spec.process_env(), log_path)
        except OSError as exc:
            fail_instance(instance, f"Could not launch the engine: {exc}",
                          log_path=str(log_path))
            return "failed"
        # What is recorded is shown to operators: the command and environment without the
        # secret. The start counts from the launch (not from a wait for the GPU).
        launched_at = timezone.now()
        recorded = Instance.objects.filter(pk=instance.pk, state=State.STARTING).update(
            pid=launched.pid, log_path=launched.log_path, command=spec.argv,
            environment=spec.env, cpu_cores=spec.cpu_cores, startup={}, started_at=launched_at,
        )
        instance.pid = launched.pid
        instance.log_path = launched.log_path
        instance.started_at = launched_at
        instance.startup = {}
        if not recorded:
            # Stopped (or its node declared lost) while it was being launched: a stop that came
            # before the pid was recorded could not find this engine, so it goes now.
            return cancel_start(instance)
        events.record(events.Kind.STARTING,
                      f"Instance #{instance.ordinal} (revision {revision}) starting its engine.",
                      instance=instance, data={"pid": launched.pid, "port": port,
                                               "revision": revision})
        ready = wait_until_ready(instance, [a.engine_name for a in adapters], adapter_errors,
                                 on_memory_sized=sizing.release)
    finally:
        sizing.release()
    if ready == "ready":
        # Given on the command line and the engine came up: they loaded (an adapter whose
        # canary failed keeps that error).
        entries = Instance.objects.values_list("canary", flat=True).get(pk=instance.pk) or {}
        LoraAdapter.objects.filter(
            pk__in=[a.pk for a in adapters if canaries.passed(entries, a.engine_name)]
        ).update(last_error="")
    return ready


# -- a multi-node group: its workers asked for before the leader launches -------------------------
def start_workers(instance: Instance) -> None:
    """Before the leader launches: stop what is left of an earlier start of the group, then ask
    each worker's agent to start it. A `StartError` where the group cannot start."""
    stop_workers(instance)
    left = wait_workers_stopped(instance)
    if left:
        raise StartError(f"Workers of an earlier start still run: {', '.join(map(str, left))}.")
    workers = list(instance.workers.select_related("node"))
    gone = [w for w in workers if w.node is None or w.node.is_lost]
    if gone:
        raise StartError(f"The node of worker {gone[0]} is lost.")
    for worker in workers:
        assert worker.node is not None
        if worker.transition([Worker.STOPPED], Worker.PENDING, last_error="", exit_code=None,
                             pid=None):
            lifecycle.worker_task(lifecycle.START_WORKER, worker.pk, worker.node.queue)


# -- what a start takes: a port, the model's files, cores -----------------------------------------
def _choose_port(instance: Instance, config: AgentConfig, engine: EngineSpec) -> int:
    base_port = engine.base_port
    if base_port:
        port = base_port + instance.ordinal
        if not supervisor.port_is_free(port, config.address):
            raise StartError(f"Port {port} is already in use on {config.name}.")
        return port
    taken = set(
        Instance.objects.filter(node__name=config.name, port__isnull=False)
        .exclude(pk=instance.pk).exclude(state=State.STOPPED)
        .values_list("port", flat=True)
    )
    low, high = settings.ENGINE_PORT_RANGE
    for port in range(low, high + 1):
        if port not in taken and supervisor.port_is_free(port, config.address):
            return port
    raise StartError(f"No free port in {low}-{high} on {config.name}.")


# An agent runs its tasks in threads: two starts at once on this node must not both find the
# same port free before either has recorded it (the second engine would fail to bind, and its
# health check would reach the first one's engine).
_PORT_LOCK = threading.Lock()


def _claim_port(instance: Instance, config: AgentConfig, engine: EngineSpec) -> int:
    """Choose a port for the instance (running `engine`, its settings) and record it, one
    start at a time on this node."""
    with _PORT_LOCK:
        port = _choose_port(instance, config, engine)
        Instance.objects.filter(pk=instance.pk).update(port=port)
    instance.port = port
    return port


def _stage_artifacts(instance: Instance, config: AgentConfig) -> None:
    """Fetch the instance's model files into this node's cache (verified) before its start;
    the engine is given the cache folder (serving_app/artifacts/staging.py)."""
    try:
        staging.stage_instance(instance, staging.NodeCacheConfig.from_environment(config.name))
    except staging.StagingError as exc:
        raise StartError(f"Staging {exc}") from exc


def preflight(instance: Instance) -> None:
    """Check the base model's files (as staged) before an engine is launched on them."""
    deployment = instance.deployment
    try:
        read_model(deployment.base_model.path, dummy=deployment.base_model.capacity_test)
    except ModelFilesError as exc:
        raise StartError(f"Base model {deployment.base_model.name}: {exc}") from exc


def cpu_cores(node: Node | None, gpus: list[Gpu]) -> list[int]:
    """The cores an engine on `gpus` is pinned to: the node's CPU binding when set (a CPU list,
    or "off" for none), else the cores nearest its GPUs (NVML's CPU affinity; a MIG device's
    is its parent GPU's). None for a CPU engine without a binding."""
    binding = node.cpu_binding if node is not None else ""
    if binding == "off":
        return []
    if binding:
        return inventory.parse_cpulist(binding)
    cores: set[int] = set()
    for gpu in gpus:
        text = gpu.cpu_affinity or (gpu.parent.cpu_affinity if gpu.parent is not None else "")
        if text:
            cores.update(inventory.parse_cpulist(text))
    return sorted(cores)


def _log_path(instance: Instance) -> Path:
    return settings.ENGINE_LOG_DIR / f"{instance.deployment.name}-{instance.pk}.log"


# -- one engine sizing its memory per GPU at a time -----------------------------------------------
_sizing_locks: dict[str, threading.Lock] = {}
_sizing_locks_guard = threading.Lock()


class GpuSizing:
    """Hold the GPUs of a starting engine until it has sized its KV cache.

    vLLM sizes its KV cache from what it measures while profiling: the GPU memory its own
    process added, whoever else allocates meanwhile. Three engines started at once on one H200
    measured each other's allocations: one logged "Available KV cache memory: -14.42 GiB" and
    exited, another failed too (docs/gpu.md, "Sharing a GPU"). So on a whole GPU (a MIG device
    has memory of its own) one engine of this agent at a time goes from launch to its KV cache
    allocated (`startup.memory_sized()`); the next one waits, its instance showing why."""

    def __init__(self, gpus: Iterable[Gpu]) -> None:
        uuids = sorted({g.uuid for g in gpus if g.parent_id is None})
        with _sizing_locks_guard:
            self.locks = [_sizing_locks.setdefault(u, threading.Lock()) for u in uuids]
        self.held: list[threading.Lock] = []

    def acquire(self, instance: Instance) -> bool:
        """Wait for the GPUs; False when the instance stopped starting meanwhile."""
        for lock in self.locks:
            queued = False
            while not lock.acquire(timeout=STATE_CHECK_SECONDS):
                if not queued:
                    queued = True
                    Instance.objects.filter(pk=instance.pk, state=State.STARTING).update(
                        startup=startup.StartupProgress(phase="queued").to_dict())
                if not Instance.objects.filter(pk=instance.pk, state=State.STARTING).exists():
                    self.release()
                    return False
            self.held.append(lock)
        return True

    def release(self) -> None:
        while self.held:
            self.held.pop().release()
