"""Large requests' input rules in processes of their own, so that reading a megabyte of
adversarial text never holds the gateway worker's GIL while its event loop serves other
requests (docs/guardrails.md, "Bounded cost").

Each gateway worker has a small pool (`GATEWAY_GUARD_PROCESSES`) of `spawn`ed processes (a
fork of a process running an event loop and threads could copy a lock held at that moment),
started with the worker. A compiled policy cannot cross the process boundary (RE2 programs do
not pickle): the process compiles it from what the catalog compiled it from
(`GuardEntry.source`), cached as the catalog caches it. The body goes there pickled; what
comes back is `RequestGuard.read_input`'s `InputCheck` without its fields (their setters
write into the process's copy of the body): the worker finds them again in its own body
(`RequestGuard.take_input`).
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import django

from gateway_app.catalog import GuardEntry, compiled
from gateway_app.guard import InputCheck, RequestGuard

Source = tuple[str, tuple[tuple[str, str, str, str, str, bool], ...]]


def pool(processes: int) -> ProcessPoolExecutor:
    """The worker's guard processes, each with Django set up (the catalog's models)."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=django.setup)


def warm(executor: ProcessPoolExecutor, processes: int) -> list[Future[bool]]:
    """Start every process now (each imports Django and the detectors: seconds) rather than
    on the first large request, whose time bound would pass while they start."""
    return [executor.submit(ready) for _ in range(processes)]


def ready() -> bool:
    return True


def read_input(source: Source, salt: bytes, endpoint: str, body: dict[str, Any]
               ) -> InputCheck:
    """`RequestGuard.read_input` in a guard process, for the policy compiled from `source`."""
    check = RequestGuard(GuardEntry(compiled(*source), salt, source)).read_input(endpoint,
                                                                                   body)
    check.fields = []
    return check


def submit(executor: ProcessPoolExecutor, entry: GuardEntry, endpoint: str,
           body: dict[str, Any]) -> Future[InputCheck]:
    """`read_input` for `entry`'s policy in one of `executor`'s processes."""
    return executor.submit(read_input, entry.source, entry.salt, endpoint, body)
