"""Stopping an engine on this node: every process of its session (SIGTERM, then SIGKILL after
the grace period), its port freed, the workers of its multi-node group stopped and waited for,
and the node's MPS daemon stopped with its last `mps` engine. `stop_instance()` is what the
Celery task runs."""

from __future__ import annotations

import logging

from django.conf import settings

from serving_app.engine import supervisor
from serving_app.engine.config import AgentConfig, current_config
from serving_app.engine.failures import clear_orphans
from serving_app.engine.groups import stop_workers, wait_workers_stopped
from serving_app.engine.node_mps import stop_mps_if_unused
from serving_app.models import Deployment, Instance, events

log = logging.getLogger(__name__)
State = Instance.State


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
        stop_mps_if_unused(instance.node)
    return how
