"""How an engine's failure is recorded, for every step of the node agent: the instance (or a
multi-node group's worker) marked failed with the reason and its log's tail, nothing of its
process session left running, and a group failing as one. Also what a refused start raises and
the note the agent adds to an engine's log."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings

from serving_app import lifecycle
from serving_app.engine import supervisor
from serving_app.engine.groups import stop_workers
from serving_app.models import Instance, InstanceWorker, events

log = logging.getLogger(__name__)
State = Instance.State
Worker = InstanceWorker.State
# The states of an instance whose engine this node's agent runs (or is starting).
RUNNING_STATES = (State.STARTING, State.READY, State.UNHEALTHY)
ORPHAN_GRACE_SECONDS = 2.0  # an EngineCore without its API server serves nothing: no long wait


class StartError(Exception):
    """A reason an engine cannot be started, shown on the instance."""


def write_log(path: Path, line: str) -> None:
    """Add the agent's own line to an engine's log (why it was not started, an adapter left
    out), where an operator reads the engine's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(f"[node agent {time.strftime('%H:%M:%S')}] {line}\n")


def fail_instance(instance: Instance, reason: str, *, expected: Iterable[str] | None = None,
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


def group_failed(instance: Instance, expected: Iterable[str]) -> bool:
    """When a worker of the group has failed: stop the leader and fail the instance (which
    stops the other workers); the reconciler restarts the group as one. True if so."""
    failed = instance.workers.select_related("node").filter(state=Worker.FAILED).first()
    if failed is None:
        return False
    if instance.pid is not None:
        supervisor.stop(instance.pid, settings.ENGINE_STOP_GRACE_SECONDS)
    where = failed.node.name if failed.node is not None else "a node"
    fail_instance(instance, f"Its worker on {where} (node rank {failed.node_rank}) failed: "
                            f"{failed.last_error}", expected=expected)
    return True


def fail_worker(worker: InstanceWorker, reason: str, *, exit_code: int | None = None,
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
