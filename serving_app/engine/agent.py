"""The node agent: what a Celery worker on a GPU host does for the engines of its own node.

A worker started with NODE_NAME set (and `-Q node.<name>`) registers its Node, adopts the
engines that already run there, then keeps a heartbeat, supervises its engines and samples
their metrics and its GPUs from a background thread. The Celery tasks in `serving_app.tasks`
call `start_instance()`, `stop_instance()` and `sync_adapters()` here. Every step re-reads its
row and changes state with a conditional update, so a task delivered twice does no harm.

A multi-node instance (`Instance.multi_node`) is one group: the agent of its node runs the
leader and drives the group (its start first stops what is left of an earlier one and asks each
other node's agent to start its headless worker, `start_worker()`; its stop stops them all and
waits for them); each worker's own agent launches, supervises and stops that worker. A worker
that exits fails the group: its agent marks it failed, the leader's agent then stops the leader
and fails the instance, and the reconciler restarts the whole group.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import close_old_connections, connections
from django.utils import timezone

from serving_app import lifecycle, signals, storage
from serving_app.artifacts import peer, staging
from serving_app.engine import canary, environment, mps, scrape, startup, supervisor
from serving_app.engine.client import EngineClient
from serving_app.engine.launch import adapter_capacity, build_launch_spec
from serving_app.fleet.sync import store_inventory
from serving_app.modelfiles import (
    ModelFilesError,
    expected_module_shapes,
    read_adapter,
    read_model,
)
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
RUNNING_STATES = (State.STARTING, State.READY, State.UNHEALTHY)
LOG_TAIL_SECONDS = 5.0
STATE_CHECK_SECONDS = 1.0  # how often a start re-reads whether its instance is still starting
LOG_READ_SECONDS = 0.25  # how often a start reads its engine's new log lines
ORPHAN_GRACE_SECONDS = 2.0  # an EngineCore without its API server serves nothing: no long wait


@dataclass
class AgentConfig:
    name: str
    address: str
    engine_env: str
    gpus: str  # declared inventory ("" = none: a CPU host), or "nvml"
    engine_python: str = ""  # the engines' interpreter ("" = <engine_env>/bin/python)
    engine_pythonpath: str = ""  # folders put first on the engines' PYTHONPATH
    # With NVML: the GPUs this agent owns, by UUID (empty: every GPU of the host). NVML lists
    # every GPU whatever CUDA_VISIBLE_DEVICES says, so two agents on one host (a node each,
    # say, to run a multi-node group there) each name theirs.
    gpu_uuids: tuple[str, ...] = ()

    @property
    def queue(self) -> str:
        return f"node.{self.name}"

    @classmethod
    def from_environment(cls) -> AgentConfig | None:
        name = os.environ.get("NODE_NAME")
        if not name:
            return None
        return cls(
            name=name,
            address=os.environ.get("NODE_ADDRESS", "127.0.0.1"),
            engine_env=os.environ.get("NODE_ENGINE_ENV", settings.ENGINE_VENV),
            gpus=os.environ.get("NODE_GPUS", ""),
            engine_python=os.environ.get("NODE_ENGINE_PYTHON", ""),
            engine_pythonpath=os.environ.get("NODE_ENGINE_PYTHONPATH", ""),
            gpu_uuids=tuple(u.strip() for u in os.environ.get("NODE_GPU_UUIDS", "").split(",")
                            if u.strip()),
        )


def current_config() -> AgentConfig | None:
    return AgentConfig.from_environment()


# -- registration, inventory, heartbeat ---------------------------------------------------------
def register(config: AgentConfig) -> Node:
    python = environment.interpreter(config.engine_env, config.engine_python)
    node, _ = Node.objects.update_or_create(
        name=config.name,
        defaults={
            "queue": config.queue, "address": config.address, "engine_env": config.engine_env,
            "engine_python": python, "engine_pythonpath": config.engine_pythonpath,
            "agent_pid": os.getpid(), "last_heartbeat": timezone.now(),
        },
    )
    report_inventory(node, config)
    # Asking the interpreter imports torch (seconds): the agent serves meanwhile.
    threading.Thread(target=record_versions, args=(node.pk, python, config),
                     name="engine-versions", daemon=True).start()
    log.info("node agent %s registered (queue %s, pid %s)", node.name, node.queue, os.getpid())
    return node


def report_inventory(node: Node, config: AgentConfig) -> None:
    """Record the node's GPUs: read through NVML, or declared in NODE_GPUS for hosts without."""
    if not config.gpus:
        gpus = []
        source = Node.InventorySource.DECLARED
    elif config.gpus == "nvml":
        gpus = only_owned(inventory.parse_snapshot(inventory.read_nvml()), config.gpu_uuids)
        source = Node.InventorySource.NVML
    else:
        gpus = inventory.declared_inventory(config.gpus, host=config.name)
        source = Node.InventorySource.DECLARED
    store_inventory(node, gpus, source)


def only_owned(gpus: list[inventory.GpuInfo], uuids: Iterable[str]) -> list[inventory.GpuInfo]:
    """The GPUs of `gpus` this agent owns: those of `uuids` (every one when empty)."""
    owned = set(uuids)
    return [g for g in gpus if not owned or g.uuid in owned]


def record_versions(node_id: int, python: str, config: AgentConfig) -> dict[str, object]:
    """Record on the node what its engine interpreter (and NVML, on a GPU host) reports."""
    versions = environment.probe(python, config.engine_pythonpath)
    if config.gpus == "nvml":
        versions.update(_driver_versions())
    try:
        Node.objects.filter(pk=node_id).update(engine_versions=versions)
    finally:
        connections.close_all()  # this thread's own connection
    if versions.get("error"):
        log.warning("node %s: engine interpreter %s: %s", config.name, python, versions["error"])
    return versions


def _driver_versions() -> dict[str, object]:
    """The NVIDIA driver's and its CUDA's versions, through NVML."""
    try:
        snapshot = inventory.read_nvml()
    except inventory.NvmlUnavailable as exc:
        return {"driver_error": str(exc)}
    cuda = snapshot.get("cuda_driver_version")
    return {"driver": snapshot.get("driver_version"),
            "driver_cuda": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else cuda}


def heartbeat(config: AgentConfig) -> None:
    """Say this agent is alive; after its node was declared lost, say it is back.

    Nothing of a lost node runs on unaccounted for: its instances were asked to stop when it was
    declared lost, so the engines this agent still runs are stopped by those tasks (waiting in
    its queue, or sent again by the reconciler), never adopted next to their replacements.
    """
    Node.objects.filter(name=config.name).update(
        last_heartbeat=timezone.now(), agent_pid=os.getpid()
    )
    node = Node.objects.filter(name=config.name, lost_at__isnull=False).first()
    if node is not None and node.lost_at is not None and Node.objects.filter(
        pk=node.pk, lost_at=node.lost_at
    ).update(lost_at=None):
        away = (timezone.now() - node.lost_at).total_seconds()
        events.record(events.Kind.NODE_BACK,
                      f"Node {node.name} is back after being declared lost {away:.0f} s ago; "
                      "its replaced engines are stopped, not adopted.", node=node,
                      level=events.Level.WARNING, data={"lost_for_seconds": round(away)})
        log.warning("node %s is back after being declared lost %.0f s ago", node.name, away)


# -- adoption ---------------------------------------------------------------------------------
def adopt(config: AgentConfig) -> dict[str, int]:
    """Take back the engines of this node that survived an agent restart; never start twins.

    An engine still running with its instance's secret (in its environment) and port keeps its
    pid and state; one that is gone is marked failed for the reconciler to restart.
    """
    counts = {"adopted": 0, "lost": 0, "stopped": 0}
    for instance in Instance.objects.filter(
        node__name=config.name, state__in=(*RUNNING_STATES, State.DRAINING, State.STOPPING)
    ):
        if supervisor.is_engine_of(instance.pid, instance.secret, instance.port):
            if instance.state == State.STOPPING:
                stop_instance(instance.pk)
                counts["stopped"] += 1
            else:  # a draining one too: the reconciler stops it once it has drained
                counts["adopted"] += 1
                log.info("adopted %s (pid %s, port %s)", instance, instance.pid, instance.port)
            continue
        if instance.state in (State.STOPPING, State.DRAINING):
            instance.transition([instance.state], State.STOPPED, pid=None, port=None)
            counts["stopped"] += 1
            continue
        _fail(instance, "The engine was gone when the node agent restarted.",
              expected=RUNNING_STATES)
        counts["lost"] += 1
    for worker in InstanceWorker.objects.select_related("instance", "node").filter(
        node__name=config.name, state__in=InstanceWorker.LIVE_STATES
    ):
        if supervisor.is_engine_of(worker.pid, worker.instance.secret, None):
            if worker.state == Worker.STOPPING:
                stop_worker(worker.pk, config)
                counts["stopped"] += 1
            else:
                counts["adopted"] += 1
        elif worker.state == Worker.STOPPING:
            worker.transition([Worker.STOPPING], Worker.STOPPED, pid=None)
            counts["stopped"] += 1
        else:
            _fail_worker(worker, "The headless worker was gone when the node agent restarted.")
            counts["lost"] += 1
    return counts


# -- start --------------------------------------------------------------------------------------
def _choose_port(instance: Instance, config: AgentConfig) -> int:
    base_port = instance.engine_spec().base_port
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


def _claim_port(instance: Instance, config: AgentConfig) -> int:
    """Choose a port for the instance and record it, one start at a time on this node."""
    with _PORT_LOCK:
        port = _choose_port(instance, config)
        Instance.objects.filter(pk=instance.pk).update(port=port)
    instance.port = port
    return port


class StartError(Exception):
    """A reason an engine cannot be started, shown on the instance."""


def _stage_artifacts(instance: Instance, config: AgentConfig) -> None:
    """Fetch the instance's model files into this node's cache (verified) before its start;
    the engine is given the cache folder (serving_app/artifacts/staging.py)."""
    try:
        staging.stage_instance(instance, staging.NodeCacheConfig.from_environment(config.name))
    except staging.StagingError as exc:
        raise StartError(f"Staging {exc}") from exc


def _adapter_folder(adapter: LoraAdapter, node_name: str | None,
                    instance: Instance | None = None) -> Path:
    """The folder to give the engine: the adapter's version in this node's cache (fetched with
    its progress on `instance`, the one staging), or (legacy) its host path, checked."""
    if adapter.artifact_version_id and node_name:
        try:
            return staging.adapter_folder(
                adapter, staging.NodeCacheConfig.from_environment(node_name), instance)
        except staging.StagingError as exc:
            raise ModelFilesError(f"Staging {exc}") from exc
    return adapter.check_path()


def _preflight(instance: Instance) -> None:
    deployment = instance.deployment
    try:
        read_model(deployment.base_model.path, dummy=deployment.base_model.capacity_test)
    except ModelFilesError as exc:
        raise StartError(f"Base model {deployment.base_model.name}: {exc}") from exc


def adapter_problem(adapter: LoraAdapter, deployment: Deployment, max_lora_rank: int,
                    node_name: str | None = None,
                    staging_for: Instance | None = None) -> tuple[str, str] | None:
    """Why the engines of `deployment` started with `max_lora_rank` must not be given `adapter`
    now, or None if they may.

    A shared engine exits at start on one bad `--lora-modules` entry (a rank above its
    max_lora_rank, tensors that do not match the base model, unreadable files), taking every
    tenant on it down; so each adapter is checked here, as its files are now (they may have
    changed since it was registered), and one that fails is left out. Returns (what the
    adapter's tenant is shown, the detail for the engine log): a problem with the host path
    itself is shown to tenants as the generic message only.
    """
    if adapter.base_model_id != deployment.base_model_id:
        message = f"It is an adapter for {adapter.base_model}, not {deployment.base_model}."
        return message, message
    try:
        folder = _adapter_folder(adapter, node_name, staging_for)
        info = read_adapter(str(folder))
    except ValidationError as exc:
        detail = "; ".join(exc.messages)
        return storage.GENERIC_PATH_ERROR, detail
    except ModelFilesError as exc:
        return (storage.GENERIC_PATH_ERROR if exc.host_path else str(exc)), str(exc)
    if info.rank > max_lora_rank:
        message = f"Its rank {info.rank} is above the deployment's max_lora_rank {max_lora_rank}."
        return message, message
    base = deployment.base_model
    if base.hidden_size:
        expected = expected_module_shapes(base)
        for module, shapes in info.module_shapes.items():
            if module in expected and any(s != expected[module] and s[1] for s in shapes):
                message = (f"Its {module} shapes do not match the base model {base.name}: it "
                           "was trained for another model.")
                return message, message
    adapter.path = str(folder)  # the engine is given the folder that was checked (in memory)
    return None


def usable_adapters(instance: Instance, log_path: Path) -> tuple[list[LoraAdapter],
                                                                 dict[str, str]]:
    """The deployment's adapters that validate, and an error for each one left out (also set
    on the adapter's `last_error`, and written to the engine log with its detail)."""
    deployment = instance.deployment
    max_lora_rank = instance.engine_spec().max_lora_rank
    good: list[LoraAdapter] = []
    errors: dict[str, str] = {}
    for adapter in deployment.adapters.select_related("tenant", "base_model"):
        problem = adapter_problem(adapter, deployment, max_lora_rank,
                                  instance.node.name if instance.node else None, instance)
        if problem is None:
            good.append(adapter)
            continue
        shown, detail = problem
        message = f"Left out of {instance} at its start: {shown}"
        errors[adapter.engine_name] = message
        LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
        _write_log(log_path, f"adapter {adapter.engine_name} left out: {detail}")
    return good, errors


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


def _resume_start(instance: Instance) -> str:
    """A start sent again for an instance still starting that no task here watches (the
    reconciler re-sends it when a start lasts too long: its task was lost). An engine of ours is
    watched until ready or past its start timeout (then stopped and failed, like any start);
    without one, the start was lost before the launch, and the instance fails to be restarted."""
    if supervisor.is_engine_of(instance.pid, instance.secret, instance.port):
        return wait_until_ready(instance)
    _fail(instance, "The engine's start was lost before it was launched.",
          expected=[State.STARTING])
    return "failed"


def _stage(instance: Instance, config: AgentConfig, log_path: Path
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
        _preflight(instance)
    except StartError as exc:
        _write_log(log_path, f"not started: {exc}")
        _fail(instance, str(exc), log_path=str(log_path), expected=[State.STAGING])
        return "failed"
    adapters, adapter_errors = usable_adapters(instance, log_path)
    staged = Instance.objects.filter(pk=instance.pk).values_list("staging", flat=True).first()
    events.record(events.Kind.STAGED,
                  f"Instance #{instance.ordinal}'s files are verified in the cache of "
                  f"{config.name} ({time.monotonic() - began:.1f} s).", instance=instance,
                  data={"adapters": [a.engine_name for a in adapters],
                        "left_out": sorted(adapter_errors), "last": staged or {}})
    return adapters, adapter_errors


def _start(instance: Instance, config: AgentConfig) -> str:
    log_path = _log_path(instance)
    staged = _stage(instance, config, log_path)
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
        if instance.engine_spec().isolation_mode == Deployment.Isolation.MPS:
            _ensure_mps(instance.node)
        port = _claim_port(instance, config)
        if instance.multi_node:
            start_workers(instance)
    except StartError as exc:
        _write_log(log_path, f"not started: {exc}")
        _fail(instance, str(exc), log_path=str(log_path))
        return "failed"
    # The settings of the instance's own revision, whatever was edited since; this node's
    # GPUs (a multi-node instance holds those of every node of its group).
    gpus = [g for g in instance.gpus.all() if g.node_id == instance.node_id]
    spec = build_launch_spec(
        instance, engine_env=config.engine_env, host=config.address, gpus=gpus,
        adapters=adapters, python=config.engine_python,
        pythonpath=config.engine_pythonpath, cpu_cores=cpu_cores(instance.node, gpus),
    )
    sizing = GpuSizing(gpus)
    try:
        if not sizing.acquire(instance):
            return _cancel_start(instance)
        try:
            launched = supervisor.launch(spec.argv, spec.process_env(), log_path)
        except OSError as exc:
            _fail(instance, f"Could not launch the engine: {exc}", log_path=str(log_path))
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
            return _cancel_start(instance)
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


# -- one engine sizing its memory per GPU at a time ---------------------------------------------
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


def wait_until_ready(instance: Instance, adapters: list[str] | None = None,
                     adapter_errors: dict[str, str] | None = None,
                     on_memory_sized: Callable[[], None] | None = None) -> str:
    """Poll /health, then send canary generations, until ready, the process exits, or the start
    stops making progress.

    A CUDA engine takes minutes to start (weights, torch.compile, CUDA graphs, kernel JIT): its
    start fails when its log has said nothing new for ENGINE_START_TIMEOUT_SECONDS, or when it
    has lasted ENGINE_START_MAX_SECONDS in all, whichever comes first; while it logs progress it
    is left to finish. Its phase and the figures it logs are recorded on the instance
    (`startup`, `serving_app.engine.startup`); `on_memory_sized` is called once the engine has
    allocated its KV cache (or its start ends).

    Once /health answers 200, the base model's canary generation must pass before the instance
    is ready (serving_app/engine/canary.py); a failed one is tried again with backoff, and the
    start fails when it has kept failing for ENGINE_START_TIMEOUT_SECONDS (the log's silence no
    longer counts then: every canary request is a log line). The adapters' canaries are sent
    once the base model's passed; one that fails leaves its adapter out of routing on this
    instance, not the instance (the supervision loop tries it again).
    """
    client = EngineClient(instance.base_url, instance.secret)
    base = instance.deployment.base_model.name
    entries: dict[str, Any] = {}
    canary_deadline: float | None = None  # set when /health first answers 200
    next_probe = time.monotonic()
    started = instance.started_at or timezone.now()
    elapsed = (timezone.now() - started).total_seconds()
    now = time.monotonic()
    hard_deadline = now + max(1.0, settings.ENGINE_START_MAX_SECONDS - elapsed)
    quiet_limit = settings.ENGINE_START_TIMEOUT_SECONDS
    silent_deadline = now + max(1.0, quiet_limit - elapsed)
    follower = startup.LogFollower.from_last_launch(instance.log_path) if instance.log_path \
        else None
    progress = startup.StartupProgress.from_dict(instance.startup)
    next_state_check = time.monotonic() + STATE_CHECK_SECONDS
    next_log_read = time.monotonic()
    while time.monotonic() < min(hard_deadline, silent_deadline):
        if not supervisor.is_alive(instance.pid):
            code = supervisor.exit_code(instance.pid) if instance.pid is not None else None
            _fail(instance, f"The engine exited during start (exit code {code}).",
                  exit_code=code, expected=[State.STARTING])
            return "failed"
        if follower is not None and time.monotonic() >= next_log_read:
            next_log_read = time.monotonic() + LOG_READ_SECONDS
            lines = follower.new_lines()
            if lines and canary_deadline is None:
                # Any new line is progress: the start goes on while the engine logs.
                silent_deadline = time.monotonic() + quiet_limit
                seconds = (timezone.now() - started).total_seconds()
                if progress.feed(lines, seconds):
                    Instance.objects.filter(pk=instance.pk, state=State.STARTING).update(
                        startup={**progress.to_dict(), "updated": timezone.now().isoformat()})
                if on_memory_sized is not None and progress.memory_sized():
                    on_memory_sized()
        if time.monotonic() >= next_state_check:
            next_state_check = time.monotonic() + STATE_CHECK_SECONDS
            if not Instance.objects.filter(pk=instance.pk, state=State.STARTING).exists():
                return _cancel_start(instance)
            if instance.multi_node and _group_failed(instance, expected=[State.STARTING]):
                return "failed"
        if time.monotonic() >= next_probe and client.healthy(timeout=2.0):
            result = canary.probe(client, base)
            entries = canaries.record(entries, base, result.ok, result.error)
            if not result.ok:
                if canary_deadline is None:
                    canary_deadline = time.monotonic() + quiet_limit
                    silent_deadline = canary_deadline
                Instance.objects.filter(pk=instance.pk, state=State.STARTING).update(
                    canary=entries)
                attempts = int(entries[base]["attempts"])
                log.warning("%s: canary failed for the base model (attempt %s): %s", instance,
                            attempts, result.error)
                next_probe = time.monotonic() + canaries.backoff_seconds(attempts)
                continue
            if adapters is None:
                adapters = [a.engine_name for a in instance.deployment.adapters.all()]
            entries = probe_adapters(instance, client, adapters, entries)
            if follower is not None:
                progress.feed(follower.new_lines(), (timezone.now() - started).total_seconds())
            if instance.transition([State.STARTING], State.READY, ready_at=timezone.now(),
                                   loaded_adapters=adapters, canary=entries,
                                   adapter_errors=adapter_errors or {}, health_failures=0,
                                   startup={**progress.to_dict(), "ready": True}):
                log.info("%s ready on port %s (pid %s)", instance, instance.port, instance.pid)
                seconds = (timezone.now() - started).total_seconds()
                events.record(events.Kind.READY,
                              f"Instance #{instance.ordinal} ready after {seconds:.0f} s.",
                              instance=instance, data={"seconds": round(seconds, 1),
                                                       "figures": progress.figures})
                _refresh_log_tail(instance)
                return "ready"
            return _cancel_start(instance)
        time.sleep(0.1)
    if follower is not None:  # what it logged last, for the reason
        progress.feed(follower.new_lines(), (timezone.now() - started).total_seconds())
    if instance.pid is not None:
        supervisor.stop(instance.pid, settings.ENGINE_STOP_GRACE_SECONDS)
    if canary_deadline is not None and time.monotonic() < hard_deadline:
        error = (entries.get(base) or {}).get("error")
        reason = (f"The base model's canary generation kept failing for {quiet_limit:g} s "
                  f"after /health answered 200 (ENGINE_START_TIMEOUT_SECONDS): {error}")
    elif time.monotonic() >= hard_deadline:
        reason = (f"The engine did not become ready within "
                  f"{settings.ENGINE_START_MAX_SECONDS:g} s (ENGINE_START_MAX_SECONDS); its "
                  f"start had reached: {progress.label.lower()}.")
    else:
        reason = (f"The engine did not become ready within {quiet_limit:g} s of its last log "
                  f"line (ENGINE_START_TIMEOUT_SECONDS); its start had reached: "
                  f"{progress.label.lower()}.")
    _fail(instance, reason, expected=[State.STARTING])
    return "failed"


def _cancel_start(instance: Instance) -> str:
    """The instance left `starting` while its engine was being started (stopped, or moved off a
    node declared lost): the engine this task launched must not run on unaccounted for."""
    state = Instance.objects.filter(pk=instance.pk).values_list("state", flat=True).first()
    if state in (State.READY, State.UNHEALTHY):
        return f"no longer starting ({state})"  # adopted as ready by the supervision loop
    how = supervisor.stop(instance.pid, settings.ENGINE_STOP_GRACE_SECONDS) if instance.pid \
        else "gone"
    log.info("%s left starting (%s) during its start: its engine %s", instance, state, how)
    return f"cancelled ({state})"


def _write_log(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(f"[node agent {time.strftime('%H:%M:%S')}] {line}\n")


def _fail(instance: Instance, reason: str, *, expected: Iterable[str] | None = None,
          exit_code: int | None = None, log_path: str | None = None) -> bool:
    clear_orphans(instance.pid)
    path = log_path or instance.log_path
    tail = supervisor.log_tail(path) if path else ""
    changed = instance.transition(
        expected or [State.STARTING, State.READY, State.UNHEALTHY], State.FAILED,
        last_error=reason, log_tail=tail, exit_code=exit_code, pid=None,
        **({"log_path": path} if path else {}),
    )
    if changed:
        log.warning("%s failed: %s", instance, reason)
        events.record(events.Kind.FAILED, f"Instance #{instance.ordinal} failed.",
                      instance=instance, level=events.Level.ERROR,
                      data={"error": reason, "exit_code": exit_code})
        lifecycle.deployment_changed(instance.deployment_id)
    if instance.multi_node:
        stop_workers(instance)  # the group fails as one: nothing of it runs on
    return changed


def clear_orphans(pid: int | None) -> None:
    """With the engine's leader gone (it exited, or was killed with SIGKILL), stop what is left
    of its session: its EngineCore and workers, orphaned, would go on holding memory and cores.
    A pid that is alive is left alone here (it is ours and stopped elsewhere, or a recycled pid
    that is not ours)."""
    if pid and not supervisor.is_alive(pid):
        supervisor.stop(pid, grace_seconds=ORPHAN_GRACE_SECONDS)


def _refresh_log_tail(instance: Instance) -> None:
    if instance.log_path:
        Instance.objects.filter(pk=instance.pk).update(log_tail=supervisor.log_tail(instance.log_path))


# -- stop ----------------------------------------------------------------------------------------
def stop_instance(instance_id: int, config: AgentConfig | None = None) -> str:
    config = config or current_config()
    instance = Instance.objects.select_related("node").filter(pk=instance_id).first()
    if instance is None or config is None:
        return "missing"
    if instance.node is not None and instance.node.name != config.name:
        return "not-mine"
    if instance.state == State.STOPPED:
        return "already stopped"
    if instance.state != State.STOPPING and not instance.transition(
        [State.PENDING, State.STAGING, State.STARTING, State.READY, State.UNHEALTHY, State.FAILED,
         State.CRASH_LOOP, State.DRAINING], State.STOPPING,
    ):
        return f"skipped ({instance.state})"
    how = "gone"
    if instance.pid and supervisor.is_engine_of(instance.pid, instance.secret, instance.port):
        how = supervisor.stop(instance.pid, settings.ENGINE_STOP_GRACE_SECONDS)
    else:
        clear_orphans(instance.pid)
    if instance.port:
        supervisor.wait_port_free(instance.port, config.address, timeout=10)
    if instance.multi_node:
        stop_workers(instance)
        left = wait_workers_stopped(instance)
        if left:
            how += f"; {len(left)} worker(s) still stopping ({', '.join(map(str, left))})"
    tail = supervisor.log_tail(instance.log_path) if instance.log_path else instance.log_tail
    if instance.transition([State.STOPPING], State.STOPPED, pid=None, port=None, log_tail=tail,
                           loaded_adapters=[]):
        events.record(events.Kind.STOPPED, f"Instance #{instance.ordinal} stopped ({how}).",
                      instance=instance)
    log.info("%s stopped (%s)", instance, how)
    if instance.node is not None and instance.engine_spec().isolation_mode == \
            Deployment.Isolation.MPS:
        _stop_mps_if_unused(instance.node)
    return how


# -- multi-node groups: the leader's side --------------------------------------------------------
GROUP_SETTLE_MARGIN_SECONDS = 10.0  # beyond a stop's own grace and kill wait


def stop_workers(instance: Instance) -> int:
    """Ask the agent of every worker of the group that may have a process to stop it; a
    worker that has none is simply marked stopped. Returns how many stops were asked for."""
    asked = 0
    for worker in instance.workers.select_related("node").exclude(state=Worker.STOPPED):
        if worker.state == Worker.PENDING or (worker.state == Worker.FAILED
                                              and worker.pid is None):
            worker.transition([worker.state], Worker.STOPPED)
            continue
        if worker.state != Worker.STOPPING:
            worker.transition([worker.state], Worker.STOPPING)
        if worker.node is not None:
            lifecycle.worker_task(lifecycle.STOP_WORKER, worker.pk, worker.node.queue)
            asked += 1
    return asked


def wait_workers_stopped(instance: Instance, timeout: float | None = None
                         ) -> list[InstanceWorker]:
    """Wait until no worker of the group has a process; returns those still stopping then.
    A worker on a node declared lost is not waited for: its stop waits in that node's queue,
    and its agent stops it when it is back."""
    if timeout is None:
        timeout = (settings.ENGINE_STOP_GRACE_SECONDS + supervisor.KILL_WAIT_SECONDS
                   + GROUP_SETTLE_MARGIN_SECONDS)
    deadline = time.monotonic() + timeout
    while True:
        left = [w for w in instance.workers.select_related("node")
                .exclude(state=Worker.STOPPED)
                if w.node is not None and not w.node.is_lost]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


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


def _group_failed(instance: Instance, expected: Iterable[str]) -> bool:
    """When a worker of the group has failed: stop the leader and fail the instance (which
    stops the other workers); the reconciler restarts the group as one. True if so."""
    failed = instance.workers.select_related("node").filter(state=Worker.FAILED).first()
    if failed is None:
        return False
    if instance.pid is not None:
        supervisor.stop(instance.pid, settings.ENGINE_STOP_GRACE_SECONDS)
    where = failed.node.name if failed.node is not None else "a node"
    _fail(instance, f"Its worker on {where} (node rank {failed.node_rank}) failed: "
                    f"{failed.last_error}", expected=expected)
    return True


# -- multi-node groups: a worker's side -----------------------------------------------------------
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
        _preflight(instance)
    except (StartError, staging.StagingError) as exc:
        _write_log(log_path, f"not started: {exc}")
        _fail_worker(worker, str(exc), log_path=str(log_path))
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
        _fail_worker(worker, f"Could not launch the worker: {exc}", log_path=str(log_path))
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


def _fail_worker(worker: InstanceWorker, reason: str, *, exit_code: int | None = None,
                 log_path: str | None = None) -> bool:
    """Mark the worker failed, with nothing of its session left running; the leader's agent
    then fails the group."""
    clear_orphans(worker.pid)
    path = log_path or worker.log_path
    tail = supervisor.log_tail(path) if path else ""
    changed = worker.transition(
        [Worker.STARTING, Worker.RUNNING], Worker.FAILED, last_error=reason, log_tail=tail,
        exit_code=exit_code, pid=None, **({"log_path": path} if path else {}))
    if changed:
        instance = worker.instance
        where = worker.node.name if worker.node is not None else "?"
        log.warning("%s failed: %s", worker, reason)
        events.record(events.Kind.FAILED,
                      f"Instance #{instance.ordinal}: its worker on {where} (node rank "
                      f"{worker.node_rank}) failed; the group is stopped and restarted.",
                      instance=instance, level=events.Level.ERROR,
                      data={"error": reason, "exit_code": exit_code, "node": where,
                            "node_rank": worker.node_rank})
    return changed


def supervise_workers(config: AgentConfig) -> None:
    """This node's headless workers: one whose process exited fails (and with it its group);
    one whose group no longer runs (stopped or failed while its stop task was lost) stops."""
    for worker in InstanceWorker.objects.select_related("instance", "node").filter(
        node__name=config.name, state=Worker.RUNNING
    ):
        if not supervisor.is_alive(worker.pid):
            code = supervisor.exit_code(worker.pid) if worker.pid else None
            _fail_worker(worker, f"The headless worker exited (exit code {code}).",
                         exit_code=code)
        elif worker.instance.state in (State.STOPPING, State.STOPPED, State.FAILED,
                                       State.CRASH_LOOP):
            stop_worker(worker.pk, config)


# -- the node's MPS daemon -------------------------------------------------------------------
def _ensure_mps(node: Node | None) -> None:
    """The MPS daemon an `mps` engine needs, started if it is not running; a `StartError` with
    the reason where none can run (the engine is then never started unisolated)."""
    try:
        state = mps.ensure_running()
    except mps.MpsError as exc:
        if node is not None:
            Node.objects.filter(pk=node.pk).update(mps={**mps.status(), "error": str(exc)})
        raise StartError(str(exc)) from exc
    if node is not None:
        Node.objects.filter(pk=node.pk).update(mps=state)


def supervise_mps(config: AgentConfig) -> None:
    """While the node's MPS daemon is recorded as running, ask it again: the node's page then
    shows its servers as engines connect (the daemon starts one with its first client, so it
    has none when it was started: seen on an H100) and a daemon that stopped answering."""
    node = Node.objects.filter(name=config.name).only("pk", "mps").first()
    if node is not None and (node.mps or {}).get("running"):
        Node.objects.filter(pk=node.pk).update(mps=mps.status())


def _stop_mps_if_unused(node: Node) -> None:
    """Stop the node's MPS daemon once no `mps` engine of the node runs or starts."""
    still = [i for i in Instance.objects.filter(node=node, state__in=(*RUNNING_STATES,
                                                                      State.PENDING))
             if i.engine_spec().isolation_mode == Deployment.Isolation.MPS]
    if not still:
        Node.objects.filter(pk=node.pk).update(mps=mps.stop())


# -- runtime adapters ----------------------------------------------------------------------
def sync_adapters(instance_id: int, config: AgentConfig | None = None) -> dict[str, str]:
    """Load the deployment's adapters that the engine lacks and unload those it should not have.

    A load that fails leaves the engine serving; the error goes on the adapter and the instance.
    """
    config = config or current_config()
    # Two syncs of one instance (the reconciler's and a periodic one, on this agent's threads)
    # would each read, change and write the instance's adapter lists: one at a time, each
    # reading what the previous one wrote.
    with _sync_lock(instance_id):
        return _sync_adapters(instance_id, config)


_sync_locks: dict[int, threading.Lock] = {}
_sync_locks_guard = threading.Lock()


def _sync_lock(instance_id: int) -> threading.Lock:
    with _sync_locks_guard:
        return _sync_locks.setdefault(instance_id, threading.Lock())


def _sync_adapters(instance_id: int, config: AgentConfig | None) -> dict[str, str]:
    instance = (Instance.objects.select_related("deployment__base_model", "node", "revision")
                .filter(pk=instance_id).first())
    if instance is None or config is None or instance.state != State.READY:
        return {}
    if instance.node is None or instance.node.name != config.name:
        return {}
    wanted = {a.engine_name: a for a in
              instance.deployment.adapters.select_related("tenant", "base_model")}
    loaded = set(instance.loaded_adapters)
    errors = dict(instance.adapter_errors)
    entries = dict(instance.canary or {})
    routable_before = instance.routable_adapters
    capacity = adapter_capacity(instance.command, instance.gpus.all())
    max_lora_rank = instance.engine_spec().max_lora_rank
    client = EngineClient(instance.base_url, instance.secret)
    outcome: dict[str, str] = {}
    # Unloads first: they free slots for the loads.
    for name in sorted(loaded - set(wanted)):
        reply = client.unload_adapter(name)
        if reply.ok or reply.status == 404:
            loaded.discard(name)
            entries.pop(name, None)
            outcome[name] = "unloaded"
    for name, adapter in wanted.items():
        if name in loaded or (name in errors and not errors[name].startswith(NO_FREE_SLOT)):
            continue  # a load that failed is not retried on this engine; a refusal is
        if capacity is not None and len(loaded) >= capacity:
            message = (f"{NO_FREE_SLOT} on {instance}: a CPU engine keeps its last LoRA slot "
                       f"spare (a full last slot would apply this adapter to other tenants' "
                       f"base-model requests), so it holds at most {capacity} adapter(s); "
                       f"restart the deployment to start with a slot for every adapter.")
            errors[name] = message
            outcome[name] = "refused"
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
            continue
        problem = adapter_problem(adapter, instance.deployment, max_lora_rank,
                                  instance.node.name)
        if problem is not None:
            message = f"Not loaded into {instance}: {problem[0]}"
            errors[name] = message
            outcome[name] = "failed"
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
            log.warning("adapter %s not loaded into %s: %s", name, instance, problem[1])
            continue
        reply = client.load_adapter(name, adapter.path)
        if reply.ok:
            loaded.add(name)
            errors.pop(name, None)
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error="")
            # Loaded is not routable: its canary generation says whether it serves.
            entries = probe_adapters(instance, client, [name], entries)
            outcome[name] = "loaded" if canaries.passed(entries, name) else "canary failed"
        else:
            message = f"Loading into {instance} failed (HTTP {reply.status}): {reply.text[:500]}"
            errors[name] = message
            outcome[name] = "failed"
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
    for name in list(errors):
        if name not in wanted:
            errors.pop(name)
    for name in list(entries):
        if name not in loaded and name != instance.deployment.base_model.name:
            entries.pop(name)
    if Instance.objects.filter(pk=instance.pk, state=State.READY).update(
        loaded_adapters=sorted(loaded), adapter_errors=errors, canary=entries
    ):
        instance.loaded_adapters, instance.canary = sorted(loaded), entries
        if instance.routable_adapters != routable_before:
            signals.instance_routing_changed.send(sender=Instance, instance=instance)
    return outcome


NO_FREE_SLOT = "No free adapter slot"


# -- canaries -----------------------------------------------------------------------------------
def probe_adapters(instance: Instance, client: EngineClient, names: Iterable[str],
                   entries: dict[str, Any]) -> dict[str, Any]:
    """Send each adapter in `names` its canary generation on `instance`'s engine; returns
    `entries` with the results. An adapter whose canary fails is out of routing on this instance
    until one passes (`Instance.routable_adapters`); its tenant reads why on the adapter."""
    adapters: dict[str, LoraAdapter] | None = None
    for name in names:
        result = canary.probe(client, name)
        was = entries.get(name) or {}
        entries = canaries.record(entries, name, result.ok, result.error)
        if result.ok == bool(was.get("ok")) and (was or result.ok):
            continue  # no change to tell (a failure tried again, or a pass confirmed)
        if adapters is None:
            adapters = {a.engine_name: a for a in
                        instance.deployment.adapters.select_related("tenant")}
        adapter = adapters.get(name)
        if result.ok:
            if was:  # it had failed: it enters routing now
                events.record(events.Kind.CANARY_PASSED,
                              f"Canary passed for adapter {name} on instance "
                              f"#{instance.ordinal}: it is routed there now.", instance=instance)
                if adapter is not None:
                    LoraAdapter.objects.filter(pk=adapter.pk,
                                               last_error__startswith=CANARY_FAILED).update(
                        last_error="")
            continue
        message = (f"{CANARY_FAILED} on {instance}: {result.error}; it is not routed there "
                   "until a canary passes (tried again with backoff).")
        log.warning("%s: canary failed for adapter %s: %s", instance, name, result.error)
        events.record(events.Kind.CANARY_FAILED,
                      f"Canary failed for adapter {name} on instance #{instance.ordinal}: "
                      f"{result.error}", instance=instance, level=events.Level.WARNING,
                      data={"adapter": name, "error": result.error})
        if adapter is not None:
            LoraAdapter.objects.filter(pk=adapter.pk).update(last_error=message)
    return entries


CANARY_FAILED = "Canary generation failed"


def retry_canaries(instance: Instance) -> list[str]:
    """Try again the canaries of a ready instance's adapters that are due (failed, their backoff
    over, or never sent); returns the names tried. Skipped while a sync of the instance runs
    (it sends its own canaries); the gateway hears at once when an adapter enters routing."""
    if not canaries.due(instance.canary or {}, instance.loaded_adapters or []):
        return []
    lock = _sync_lock(instance.pk)
    if not lock.acquire(blocking=False):
        return []
    try:
        fresh = (Instance.objects.select_related("deployment__base_model", "node")
                 .filter(pk=instance.pk, state=State.READY).first())
        if fresh is None:
            return []
        entries = fresh.canary or {}
        names = canaries.due(entries, fresh.loaded_adapters or [])
        client = EngineClient(fresh.base_url, fresh.secret)
        before = fresh.routable_adapters
        entries = probe_adapters(fresh, client, names, entries)
        Instance.objects.filter(pk=fresh.pk, state=State.READY).update(canary=entries)
        fresh.canary = entries
        if fresh.routable_adapters != before:
            signals.instance_routing_changed.send(sender=Instance, instance=fresh)
        return names
    finally:
        lock.release()


# -- supervision --------------------------------------------------------------------------------
def supervise_once(config: AgentConfig) -> None:
    """Health-check this node's engines: a dead process or repeated failed checks is a failure."""
    threshold = settings.ENGINE_HEALTH_FAILURES
    supervise_workers(config)
    supervise_mps(config)
    for instance in Instance.objects.select_related("node").filter(
        node__name=config.name, state__in=(State.READY, State.UNHEALTHY)
    ):
        if instance.multi_node and _group_failed(instance,
                                                 expected=[State.READY, State.UNHEALTHY]):
            continue
        if not supervisor.is_alive(instance.pid):
            code = supervisor.exit_code(instance.pid) if instance.pid else None
            _fail(instance, f"The engine process exited (exit code {code}).", exit_code=code,
                  expected=[State.READY, State.UNHEALTHY])
            continue
        if EngineClient(instance.base_url, instance.secret).healthy(timeout=2.0):
            if instance.state == State.UNHEALTHY or instance.health_failures:
                instance.transition([State.UNHEALTHY, State.READY], State.READY,
                                    health_failures=0)
            if instance.state == State.READY:
                retry_canaries(instance)
            continue
        failures = instance.health_failures + 1
        if failures >= threshold:
            if instance.pid is not None:
                supervisor.stop(instance.pid, settings.ENGINE_STOP_GRACE_SECONDS)
            _fail(instance, f"The engine failed {failures} health checks in a row.",
                  expected=[State.READY, State.UNHEALTHY])
        else:
            instance.transition([State.READY, State.UNHEALTHY], State.UNHEALTHY,
                                health_failures=failures)
    # Instances adopted while starting have no task watching them.
    for instance in Instance.objects.filter(node__name=config.name, state=State.STARTING):
        if instance.pk in _watching or instance.pid is None:
            continue  # a start task is on it (or, without a pid, still launching it)
        if not supervisor.is_alive(instance.pid):
            _fail(instance, "The engine exited during start.", expected=[State.STARTING])
        elif EngineClient(instance.base_url, instance.secret).healthy(timeout=2.0):
            # Ready once its base model's canary passes (tried again with backoff); only the
            # adapters it was started with: the start may have left some out.
            client = EngineClient(instance.base_url, instance.secret)
            base = instance.deployment.base_model.name
            entries = instance.canary or {}
            if not canaries.passed(entries, base):
                if not canaries.due(entries, [base]):
                    continue
                result = canary.probe(client, base)
                entries = canaries.record(entries, base, result.ok, result.error)
                if not result.ok:
                    Instance.objects.filter(pk=instance.pk, state=State.STARTING).update(
                        canary=entries)
                    continue
            command = " ".join(instance.command or [])
            adapters = [a.engine_name for a in instance.deployment.adapters.all()
                        if a.engine_name in command]
            entries = probe_adapters(instance, client, adapters, entries)
            instance.transition([State.STARTING], State.READY, ready_at=timezone.now(),
                                loaded_adapters=adapters, canary=entries)


_watching: set[int] = set()
_watching_lock = threading.Lock()
_log_sizes: dict[int, int] = {}


def refresh_log_tails(config: AgentConfig) -> int:
    """Copy the tail of each running engine's log to its instance when the log has grown."""
    updated = 0
    for pk, path in Instance.objects.filter(
        node__name=config.name, state__in=RUNNING_STATES
    ).exclude(log_path="").values_list("pk", "log_path"):
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        if _log_sizes.get(pk) == size:
            continue
        _log_sizes[pk] = size
        Instance.objects.filter(pk=pk).update(log_tail=supervisor.log_tail(path))
        updated += 1
    return updated


class AgentLoop(threading.Thread):
    """Heartbeat, supervision, GPU inventory and engine metrics, in the background of the node
    agent's worker process."""

    def __init__(self, config: AgentConfig) -> None:
        super().__init__(name=f"node-agent-{config.name}", daemon=True)
        self.config = config
        self.stopping = threading.Event()

    def run(self) -> None:
        last_heartbeat = 0.0
        last_logs = 0.0
        last_inventory = last_metrics = time.monotonic()
        while not self.stopping.is_set():
            close_old_connections()
            try:
                now = time.monotonic()
                if now - last_heartbeat >= settings.NODE_HEARTBEAT_SECONDS:
                    heartbeat(self.config)
                    last_heartbeat = now
                if now - last_inventory >= settings.NODE_INVENTORY_SECONDS:
                    node = Node.objects.get(name=self.config.name)
                    report_inventory(node, self.config)
                    last_inventory = now
                supervise_once(self.config)
                if now - last_logs >= LOG_TAIL_SECONDS:
                    refresh_log_tails(self.config)
                    last_logs = now
                if now - last_metrics >= settings.ENGINE_METRICS_INTERVAL_SECONDS:
                    scrape.scrape_node(self.config.name)
                    last_metrics = now
            except Exception:  # keep supervising whatever one round hit
                log.exception("node agent loop")
            self.stopping.wait(settings.ENGINE_SUPERVISE_SECONDS)


_loop: AgentLoop | None = None


def start_agent() -> AgentLoop | None:
    """Called when a worker with NODE_NAME set is ready: register, adopt, supervise."""
    global _loop
    config = current_config()
    if config is None:
        return None
    close_old_connections()
    register(config)
    counts = adopt(config)
    log.info("node agent %s on %s: %s", config.name, socket.gethostname(), counts)
    _loop = AgentLoop(config)
    _loop.start()
    _serve_cache_to_peers(config)
    return _loop


def _serve_cache_to_peers(config: AgentConfig) -> None:
    """With NODE_PEER_PORT set, other nodes fetch the files of this node's cache from it
    (serving_app/artifacts/peer.py) before asking the console."""
    port = os.environ.get("NODE_PEER_PORT")
    if port and port.isdigit():
        peer.PeerServer(staging.NodeCacheConfig.from_environment(config.name),
                        host=os.environ.get("NODE_PEER_HOST", config.address), port=int(port),
                        advertise=config.address).start()


def stop_agent() -> None:
    if _loop is not None:
        _loop.stopping.set()


__all__ = ["AgentConfig", "Gpu", "adopt", "register", "start_agent", "start_instance",
           "stop_agent", "stop_instance", "supervise_once", "sync_adapters"]
