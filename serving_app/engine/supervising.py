"""Supervising this node's engines, each round of the agent's loop: a dead process or repeated
failed health checks fails its instance (a multi-node group fails as one), an unhealthy engine
that answers again is ready again, due canaries are tried again, an engine adopted while it was
starting is made ready once its canary passes; the headless workers and the MPS daemon are
checked too, and the engines' log tails copied to their instances."""

from __future__ import annotations

import os

from django.conf import settings
from django.utils import timezone

from serving_app.engine import canary, supervisor
from serving_app.engine.adapters import probe_adapters, retry_canaries
from serving_app.engine.client import EngineClient
from serving_app.engine.config import AgentConfig
from serving_app.engine.failures import RUNNING_STATES, fail_instance, group_failed
from serving_app.engine.node_mps import supervise_mps
from serving_app.engine.starting import start_in_progress
from serving_app.engine.workers import supervise_workers
from serving_app.models import Instance, canaries

State = Instance.State


def supervise_once(config: AgentConfig) -> None:
    """Health-check this node's engines: a dead process or repeated failed checks is a failure."""
    threshold = settings.ENGINE_HEALTH_FAILURES
    supervise_workers(config)
    supervise_mps(config)
    for instance in Instance.objects.select_related("node").filter(
        node__name=config.name, state__in=(State.READY, State.UNHEALTHY)
    ):
        if instance.multi_node and group_failed(instance,
                                                expected=[State.READY, State.UNHEALTHY]):
            continue
        if not supervisor.is_alive(instance.pid):
            code = supervisor.exit_code(instance.pid) if instance.pid else None
            fail_instance(instance, f"The engine process exited (exit code {code}).",
                          exit_code=code, expected=[State.READY, State.UNHEALTHY])
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
            fail_instance(instance, f"The engine failed {failures} health checks in a row.",
                          expected=[State.READY, State.UNHEALTHY])
        else:
            instance.transition([State.READY, State.UNHEALTHY], State.UNHEALTHY,
                                health_failures=failures)
    _finish_adopted_starts(config)


def _finish_adopted_starts(config: AgentConfig) -> None:
    """The engines adopted while starting (no task watches them): failed when they exit,
    ready once they answer and their base model's canary passes."""
    for instance in Instance.objects.filter(node__name=config.name, state=State.STARTING):
        if start_in_progress(instance.pk) or instance.pid is None:
            continue  # a start task is on it (or, without a pid, still launching it)
        if not supervisor.is_alive(instance.pid):
            fail_instance(instance, "The engine exited during start.",
                          expected=[State.STARTING])
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
