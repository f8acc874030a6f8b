"""The node agent: what a Celery worker on a GPU host does for the engines of its own node.

A worker started with NODE_NAME set (and `-Q node.<name>`) registers its Node, adopts the
engines that already run there, then keeps a heartbeat, supervises its engines and samples
their metrics and its GPUs from a background thread. The Celery tasks in `serving_app.tasks`
call `start_instance()`, `stop_instance()`, `start_worker()`, `stop_worker()` and
`sync_adapters()` through this module. Every step re-reads its row and changes state with a
conditional update, so a task delivered twice does no harm.

Each step has its module: `starting` (staging, the launch, `readiness` for the wait until
ready), `stopping`, `supervising`, `adapters` (checks, runtime loads, canaries), `node_mps` (the
node's MPS daemon), `failures` (how a failure is recorded), `config` (the agent's settings),
`capacity` (a capacity test: vLLM's benchmark client against one of this node's engines).

A multi-node instance (`Instance.multi_node`) is one group: the agent of its node runs the
leader and drives the group (its start first stops what is left of an earlier one and asks each
other node's agent to start its headless worker, `start_worker()`; its stop stops them all and
waits for them, `groups`); each worker's own agent launches, supervises and stops that worker
(`workers`). A worker that exits fails the group: its agent marks it failed, the leader's agent
then stops the leader and fails the instance, and the reconciler restarts the whole group.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable

from django.conf import settings
from django.db import close_old_connections, connections
from django.utils import timezone

from serving_app.artifacts import peer, staging
from serving_app.engine import environment, scrape, supervisor
from serving_app.engine.adapters import sync_adapters
from serving_app.engine.capacity import fail_interrupted, run_capacity_test
from serving_app.engine.config import AgentConfig, current_config
from serving_app.engine.failures import RUNNING_STATES, fail_instance, fail_worker
from serving_app.engine.starting import start_instance
from serving_app.engine.stopping import stop_instance
from serving_app.engine.supervising import refresh_log_tails, supervise_once
from serving_app.engine.workers import start_worker, stop_worker
from serving_app.fleet.sync import store_inventory
from serving_app.models import Instance, InstanceWorker, Node, events
from serving_app.placement import inventory

log = logging.getLogger(__name__)
State = Instance.State
Worker = InstanceWorker.State
LOG_TAIL_SECONDS = 5.0


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
        fail_instance(instance, "The engine was gone when the node agent restarted.",
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
            fail_worker(worker, "The headless worker was gone when the node agent restarted.")
            counts["lost"] += 1
    return counts


# -- the background loop --------------------------------------------------------------------------
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
    counts["capacity_tests_failed"] = fail_interrupted(config.name)
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


__all__ = ["AgentConfig", "adopt", "heartbeat", "register", "report_inventory",
           "run_capacity_test", "start_agent",
           "start_instance", "start_worker", "stop_agent", "stop_instance", "stop_worker",
           "supervise_once", "sync_adapters"]
