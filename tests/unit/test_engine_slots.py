"""The suite's engine slots (tests/engine_slots.py): at most three engines alive at once across
processes, taken all at once or not at all, given back by a process that dies."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.engine_slots import EngineSlots, TooManyEngines

ROOT = Path(__file__).resolve().parents[2]
# Another process of the run: takes N slots, says so, and holds them until its stdin closes.
HOLDER = (
    "import sys; from pathlib import Path; from tests.engine_slots import EngineSlots\n"
    "slots = EngineSlots(Path(sys.argv[1])); slots.take(int(sys.argv[2]), 'holder')\n"
    "print('held', flush=True); sys.stdin.read()\n"
)


def holder(folder: Path, count: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(count)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def taken_within(slots: EngineSlots, count: int, seconds: float) -> list[int] | None:
    """`slots.take(count)` from a thread: what it took, or None if it still waits."""
    result: list[list[int]] = []
    thread = threading.Thread(target=lambda: result.append(slots.take(count, "test")),
                              daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


def test_a_process_waits_until_another_gives_its_slots_back(tmp_path):
    other = holder(tmp_path, 2)
    slots = EngineSlots(tmp_path)
    assert slots.take(1, "one beside two") and len(slots.held) == 1
    waiting = threading.Thread(target=slots.take, args=(1, "a fourth"), daemon=True)
    waiting.start()
    waiting.join(1.5)
    assert waiting.is_alive(), "a fourth engine's slot was handed out"
    other.stdin.close()  # the holder ends: its locks go with it
    other.wait(10)
    waiting.join(10)
    assert not waiting.is_alive() and len(slots.held) == 2


def test_a_killed_holder_gives_its_slots_back(tmp_path):
    other = holder(tmp_path, 3)
    slots = EngineSlots(tmp_path)
    waiting = threading.Thread(target=slots.take, args=(3, "all three"), daemon=True)
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive() and slots.held == []
    other.kill()
    other.wait(10)
    waiting.join(10)
    assert not waiting.is_alive() and len(slots.held) == 3


def test_the_head_of_the_queue_collects_its_set_before_anyone_else_takes_one(tmp_path):
    other = holder(tmp_path, 2)
    big, small = EngineSlots(tmp_path), EngineSlots(tmp_path)
    # Wants all three: holds the queue and the free slot while it waits for the other two.
    wants_all = threading.Thread(target=big.take, args=(3, "all three"), daemon=True)
    wants_all.start()
    time.sleep(1.0)
    assert wants_all.is_alive() and len(big.held) == 0
    assert taken_within(small, 1, 1.0) is None, "a later, smaller request went first"
    other.stdin.close()
    other.wait(10)
    wants_all.join(10)
    assert not wants_all.is_alive() and len(big.held) == 3
    big.give(list(big.held))
    assert len(small.held) in (0, 1)  # the smaller request gets its slot once the queue moves


def test_asking_beyond_what_this_process_keeps_is_refused_at_once(tmp_path):
    slots = EngineSlots(tmp_path)
    shared = slots.take(1, "the shared engine")
    with pytest.raises(TooManyEngines, match="beside the 1 this process keeps"):
        slots.take(3, "a rollout")
    assert len(slots.held) == 1
    slots.give(shared)
    with slots.holding(3, "a rollout"):
        assert len(slots.held) == 3
    assert slots.held == []
