"""At most three CPU engines alive at once in a test run, across its parallel workers.

An engine here takes about 3 GB and 20-40 s of CPU to start, and the suite's workers run engine
chains side by side: unchecked, a run kept four engines alive for about eleven minutes and five
for six (docs/testing.md, "Engines alive at once"). Every engine a test starts is counted in
slots: `SLOTS` files in one folder that all the run's processes share (the controller makes it
and hands it to the workers through `FOLDER_ENV`; a run in one process makes its own). A slot
is taken with an exclusive `flock` on its file, so that a process that dies gives its slots back
with it.

- A test that starts engines itself (a cluster's node agents, an agent called in process)
  declares how many are alive at most at once, stopping ones included: `@pytest.mark.engines(N)`.
  Its slots are taken before its fixtures start and given back after they have stopped.
- A fixture that keeps an engine across tests (the session's shared engine, a module's) takes
  one slot for as long as the engine lives.

A process takes all the slots it asks for at once, or none: it first holds the run's queue (a
lock file of its own, taken blocking), collects free slots as other processes give them back,
then lets the queue go. Only the process at the head of the queue ever holds a partial set, and
what the others hold they give back without waiting for anything, so no wait is circular. A test
may not ask for more than `SLOTS` minus what its own process already keeps (the shared engine):
that would wait forever, and is refused at once instead.

The controller counts the engines alive every two seconds (`Census`) and the run's report says
how long each count lasted and how long each worker waited for slots.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil

SLOTS = 3
FOLDER_ENV = "TEST_ENGINE_SLOTS"
POLL_SECONDS = 0.5


class TooManyEngines(RuntimeError):
    """A test asked for more engines than the run may keep alive beside this process's own."""


class EngineSlots:
    """This process's view of the run's engine slots: what it holds, and how long it waited."""

    def __init__(self, folder: Path, slots: int = SLOTS) -> None:
        self.folder = folder
        self.slots = slots
        self.held: list[int] = []  # open file descriptors, each holding one slot's lock
        self.waited = 0.0  # seconds this process spent waiting for slots, in all

    def _open(self, name: str) -> int:
        return os.open(self.folder / name, os.O_RDWR | os.O_CREAT, 0o644)

    def _try_slot(self, index: int) -> int | None:
        fd = self._open(f"slot-{index}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def take(self, count: int, what: str) -> list[int]:
        """Wait until `count` slots are this process's; returns them (for `give`)."""
        if count + len(self.held) > self.slots:
            raise TooManyEngines(
                f"{what} starts {count} engines beside the {len(self.held)} this process keeps "
                f"alive: more than the {self.slots} a run may have at once (tests/engine_slots.py)")
        got: list[int] = []
        began = time.monotonic()
        queue = self._open("queue")
        try:
            fcntl.flock(queue, fcntl.LOCK_EX)  # the head of the queue, until the set is whole
            while True:
                for index in range(self.slots):
                    if len(got) == count:
                        break
                    fd = self._try_slot(index)
                    if fd is not None:
                        got.append(fd)
                if len(got) == count:
                    break
                time.sleep(POLL_SECONDS)
        finally:
            os.close(queue)  # closing the last descriptor of the file lets its lock go
        self.waited += time.monotonic() - began
        self.held.extend(got)
        (self.folder / f"waited-{os.getpid()}").write_text(f"{self.waited:.1f}")
        return got

    def give(self, taken: list[int]) -> None:
        for fd in taken:
            self.held.remove(fd)
            os.close(fd)

    @contextlib.contextmanager
    def holding(self, count: int, what: str) -> Iterator[None]:
        taken = self.take(count, what)
        try:
            yield
        finally:
            self.give(taken)


_slots: EngineSlots | None = None


def run_folder() -> Path:
    """The run's slot folder: the controller's, or this process's own when it runs alone."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder:
        folder = os.environ[FOLDER_ENV] = tempfile.mkdtemp(prefix="test-engine-slots-")
    return Path(folder)


def slots() -> EngineSlots:
    global _slots
    if _slots is None:
        _slots = EngineSlots(run_folder())
    return _slots


def waited_seconds(folder: Path) -> list[float]:
    """What each process of the run waited for slots, in all (those that ever took one)."""
    return [float(path.read_text() or 0) for path in folder.glob("waited-*")]


class Census(threading.Thread):
    """Every two seconds, how many engines (vLLM API servers of this checkout's engine
    environment) are alive: `seconds[n]` is how long n were."""

    def __init__(self, engine_python: Path, every: float = 2.0) -> None:
        super().__init__(daemon=True, name="engine-census")
        self.engine_python = str(engine_python)
        self.every = every
        self.seconds: Counter[int] = Counter()
        self._done = threading.Event()

    def alive(self) -> int:
        count = 0
        for process in psutil.process_iter(["cmdline", "status"]):
            command = process.info["cmdline"] or []
            if (process.info["status"] != psutil.STATUS_ZOMBIE and command
                    and command[0] == self.engine_python
                    and "vllm.entrypoints.openai.api_server" in command):
                count += 1
        return count

    def run(self) -> None:
        last = time.monotonic()
        while not self._done.wait(self.every):
            now = time.monotonic()
            self.seconds[self.alive()] += now - last
            last = now

    def stop(self) -> None:
        self._done.set()
        self.join(10)
