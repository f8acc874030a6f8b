"""Waiting for a launched engine to become ready: its process alive, its log making progress,
/health answering, then the base model's canary generation passing (and the adapters' sent),
within the start's time limits; or the start cancelled when its instance stopped starting."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.utils import timezone

from serving_app.engine import canary, startup, supervisor
from serving_app.engine.adapters import probe_adapters
from serving_app.engine.client import EngineClient
from serving_app.engine.failures import fail_instance, group_failed
from serving_app.models import Instance, canaries, events

log = logging.getLogger(__name__)
State = Instance.State
STATE_CHECK_SECONDS = 1.0  # how often a start re-reads whether its instance is still starting
LOG_READ_SECONDS = 0.25  # how often a start reads its engine's new log lines


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
    watch = StartWatch.begin(instance)
    next_probe = next_log_read = time.monotonic()
    next_state_check = time.monotonic() + STATE_CHECK_SECONDS
    while time.monotonic() < watch.deadline:
        if not supervisor.is_alive(instance.pid):
            code = supervisor.exit_code(instance.pid) if instance.pid is not None else None
            fail_instance(instance, f"The engine exited during start (exit code {code}).",
                          exit_code=code, expected=[State.STARTING])
            return "failed"
        if time.monotonic() >= next_log_read:
            next_log_read = time.monotonic() + LOG_READ_SECONDS
            watch.read_log(on_memory_sized)
        if time.monotonic() >= next_state_check:
            next_state_check = time.monotonic() + STATE_CHECK_SECONDS
            if not Instance.objects.filter(pk=instance.pk, state=State.STARTING).exists():
                return cancel_start(instance)
            if instance.multi_node and group_failed(instance, expected=[State.STARTING]):
                return "failed"
        if time.monotonic() >= next_probe and client.healthy(timeout=2.0):
            result = canary.probe(client, watch.base)
            watch.entries = canaries.record(watch.entries, watch.base, result.ok, result.error)
            if result.ok:
                return _become_ready(watch, client, adapters, adapter_errors)
            next_probe = watch.base_canary_failed(result.error)
            continue
        time.sleep(0.1)
    return _time_out(watch)


@dataclass
class StartWatch:
    """What the wait for one engine keeps between its rounds: the engine's log as read so far
    and the start's progress it shows, the canary entries, and when the start gives up.

    `hard_deadline` is ENGINE_START_MAX_SECONDS after the start began; `silent_deadline` is
    ENGINE_START_TIMEOUT_SECONDS (`quiet_limit`) after the engine's last new log line, until its
    base model's canary first fails (after /health answered 200): from then on `canary_deadline`
    (the same limit after that failure) holds, and the log no longer counts."""

    instance: Instance
    base: str  # the base model's name: its canary is sent first
    started: datetime
    quiet_limit: float
    hard_deadline: float
    silent_deadline: float
    follower: startup.LogFollower | None
    progress: startup.StartupProgress
    entries: dict[str, Any] = field(default_factory=dict)
    canary_deadline: float | None = None

    @classmethod
    def begin(cls, instance: Instance) -> StartWatch:
        started = instance.started_at or timezone.now()
        elapsed = (timezone.now() - started).total_seconds()
        now = time.monotonic()
        quiet_limit = settings.ENGINE_START_TIMEOUT_SECONDS
        return cls(
            instance=instance, base=instance.deployment.base_model.name, started=started,
            quiet_limit=quiet_limit,
            hard_deadline=now + max(1.0, settings.ENGINE_START_MAX_SECONDS - elapsed),
            silent_deadline=now + max(1.0, quiet_limit - elapsed),
            follower=(startup.LogFollower.from_last_launch(instance.log_path)
                      if instance.log_path else None),
            progress=startup.StartupProgress.from_dict(instance.startup),
        )

    @property
    def deadline(self) -> float:
        return min(self.hard_deadline, self.silent_deadline)

    def seconds(self) -> float:
        """How long the start has lasted."""
        return (timezone.now() - self.started).total_seconds()

    def read_log(self, on_memory_sized: Callable[[], None] | None) -> None:
        """Read the engine's new log lines: the progress they show is recorded on the instance,
        and `on_memory_sized` called once the engine has allocated its KV cache."""
        if self.follower is None:
            return
        lines = self.follower.new_lines()
        if lines and self.canary_deadline is None:
            # Any new line is progress: the start goes on while the engine logs.
            self.silent_deadline = time.monotonic() + self.quiet_limit
            if self.progress.feed(lines, self.seconds()):
                Instance.objects.filter(pk=self.instance.pk, state=State.STARTING).update(
                    startup={**self.progress.to_dict(), "updated": timezone.now().isoformat()})
            if on_memory_sized is not None and self.progress.memory_sized():
                on_memory_sized()

    def read_last_lines(self) -> None:
        """Feed what the engine logged since the last read (its last word, when the start
        ends)."""
        if self.follower is not None:
            self.progress.feed(self.follower.new_lines(), self.seconds())

    def base_canary_failed(self, error: str) -> float:
        """Record a failed canary of the base model (its first failure starts the canary's own
        deadline); returns when to send the next one."""
        if self.canary_deadline is None:
            self.canary_deadline = time.monotonic() + self.quiet_limit
            self.silent_deadline = self.canary_deadline
        Instance.objects.filter(pk=self.instance.pk, state=State.STARTING).update(
            canary=self.entries)
        attempts = int(self.entries[self.base]["attempts"])
        log.warning("%s: canary failed for the base model (attempt %s): %s", self.instance,
                    attempts, error)
        return time.monotonic() + canaries.backoff_seconds(attempts)


def _become_ready(watch: StartWatch, client: EngineClient, adapters: list[str] | None,
                  adapter_errors: dict[str, str] | None) -> str:
    """The base model's canary passed: the adapters' canaries sent, the instance made ready;
    or, where it left `starting` meanwhile, its engine stopped."""
    instance = watch.instance
    if adapters is None:
        adapters = [a.engine_name for a in instance.deployment.adapters.all()]
    entries = probe_adapters(instance, client, adapters, watch.entries)
    watch.read_last_lines()
    if instance.transition([State.STARTING], State.READY, ready_at=timezone.now(),
                           loaded_adapters=adapters, canary=entries,
                           adapter_errors=adapter_errors or {}, health_failures=0,
                           startup={**watch.progress.to_dict(), "ready": True}):
        log.info("%s ready on port %s (pid %s)", instance, instance.port, instance.pid)
        seconds = watch.seconds()
        events.record(events.Kind.READY,
                      f"Instance #{instance.ordinal} ready after {seconds:.0f} s.",
                      instance=instance, data={"seconds": round(seconds, 1),
                                               "figures": watch.progress.figures})
        _refresh_log_tail(instance)
        return "ready"
    return cancel_start(instance)


def _time_out(watch: StartWatch) -> str:
    """The start ran out of time: its engine stopped, the instance failed with which limit it
    passed and how far the start had got."""
    instance = watch.instance
    watch.read_last_lines()  # what it logged last, for the reason
    if instance.pid is not None:
        supervisor.stop(instance.pid, settings.ENGINE_STOP_GRACE_SECONDS)
    if watch.canary_deadline is not None and time.monotonic() < watch.hard_deadline:
        error = (watch.entries.get(watch.base) or {}).get("error")
        reason = (f"The base model's canary generation kept failing for "
                  f"{watch.quiet_limit:g} s after /health answered 200 "
                  f"(ENGINE_START_TIMEOUT_SECONDS): {error}")
    elif time.monotonic() >= watch.hard_deadline:
        reason = (f"The engine did not become ready within "
                  f"{settings.ENGINE_START_MAX_SECONDS:g} s (ENGINE_START_MAX_SECONDS); its "
                  f"start had reached: {watch.progress.label.lower()}.")
    else:
        reason = (f"The engine did not become ready within {watch.quiet_limit:g} s of its last "
                  f"log line (ENGINE_START_TIMEOUT_SECONDS); its start had reached: "
                  f"{watch.progress.label.lower()}.")
    fail_instance(instance, reason, expected=[State.STARTING])
    return "failed"


def cancel_start(instance: Instance) -> str:
    """The instance left `starting` while its engine was being started (stopped, or moved off a
    node declared lost): the engine this task launched must not run on unaccounted for."""
    state = Instance.objects.filter(pk=instance.pk).values_list("state", flat=True).first()
    if state in (State.READY, State.UNHEALTHY):
        return f"no longer starting ({state})"  # adopted as ready by the supervision loop
    how = supervisor.stop(instance.pid, settings.ENGINE_STOP_GRACE_SECONDS) if instance.pid \
        else "gone"
    log.info("%s left starting (%s) during its start: its engine %s", instance, state, how)
    return f"cancelled ({state})"


def _refresh_log_tail(instance: Instance) -> None:
    if instance.log_path:
        Instance.objects.filter(pk=instance.pk).update(log_tail=supervisor.log_tail(instance.log_path))
