"""A multi-node group's workers, from its leader's agent: asking each worker's agent to stop it,
and waiting until none has a process. (The leader's start asks for its workers in `starting`;
a failed worker fails the group in `failures`; each worker's own side is `workers`.)"""

from __future__ import annotations

import time

from django.conf import settings

from serving_app import lifecycle
from serving_app.engine import supervisor
from serving_app.models import Instance, InstanceWorker

Worker = InstanceWorker.State
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
