"""Reading a CUDA engine's start from its log (serving_app/engine/startup.py), from the lines a
vLLM 0.26 engine wrote on an H200 (fixtures/, verbatim)."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from serving_app.engine import scrape
from serving_app.engine.startup import LAUNCH_MARKER, LogFollower, StartupProgress

FIXTURES = Path(__file__).parent / "fixtures"
LINES = (FIXTURES / "startup_llama3_8b_shape.log").read_text().splitlines()
EAGER = (FIXTURES / "startup_eager_mps_h100.log").read_text().splitlines()
URGENT = (FIXTURES / "urgent_scheduler_h200.log").read_text().splitlines()


def read_start(lines: list[str]) -> tuple[StartupProgress, list[str]]:
    """A start's progress fed line by line (a second apart), and the phases it went through."""
    progress = StartupProgress()
    seen: list[str] = []
    for number, line in enumerate(lines):
        progress.feed([line], at=float(number))
        if not seen or seen[-1] != progress.phase:
            seen.append(progress.phase)
    return progress, seen


def test_the_phases_of_an_h200_start_in_order_with_their_figures():
    progress, seen = read_start(LINES)
    assert seen == ["launching", "loading", "compiling", "profiling", "capturing", "warming",
                    "serving"]
    assert progress.figures == {
        "weights_gib": 13.1, "weights_seconds": 2.076821, "compile_seconds": 33.94,
        "kv_cache_gib": 17.9, "kv_cache_tokens": 146624, "max_concurrency": 35.8,
        "graph_capture_seconds": 12, "graph_capture_gib": 0.24, "init_engine_seconds": 62.5,
        # The memory split (the measured profile's terms): "Desired GPU memory utilization is
        # (0.23, 32.15 GiB). Actual usage is 13.1 GiB for weight, 0.93 GiB for peak activation,
        # 0.22 GiB for non-torch memory, and 0.24 GiB for CUDAGraph memory."
        "utilization": 0.23, "requested_gib": 32.15, "activation_gib": 0.93,
        "non_torch_gib": 0.22, "cuda_graph_gib": 0.24,
    }
    assert progress.label == "Starting the API server"
    # Each phase records when it was first seen; the dict round-trips through the JSON field.
    assert [p["phase"] for p in progress.phases] == seen[1:]
    again = StartupProgress.from_dict(progress.to_dict())
    assert again.phase == "serving" and again.figures == progress.figures


def test_the_consoles_scheduler_on_a_gpu_keeps_asynchronous_scheduling_on():
    """The GPU build's path of the scheduler plugin (issue 45), from an H200's engine with
    `urgent_batch_cap` 16: vLLM 0.26 loaded `AsyncUrgentBatchCapScheduler` and kept scheduling
    asynchronously (a CPU engine turns it off for any custom class); the start-up figures say
    both, and the instance page shows them."""
    progress, seen = read_start(URGENT)
    assert seen[-1] == "serving"
    assert progress.figures["async_scheduling"] == 1
    assert progress.figures["urgent_batch_cap"] == 16
    assert progress.figures["kv_cache_tokens"] == 169520
    # What the plugin logged once requests came (the lines the figures do not read): it acted,
    # preempted through vLLM's preemption, and let the batch go back once no urgent request was
    # left.
    assert any("console_scheduler.AsyncUrgentBatchCapScheduler" in line
               and "Using custom scheduler class" in line for line in URGENT)
    assert [line.split("console scheduler: ")[1].split(":")[0].split(" (")[0]
            for line in URGENT if "console scheduler: " in line][1:] == [
        "urgent requests", "preempted 1 request(s) of lower priority to keep 16 beside the "
        "urgent ones", "no urgent request left"]
    # A synchronous engine's word wins when it comes last (the CPU build with a custom class).
    progress.feed(["INFO [vllm.py:1109] Asynchronous scheduling is disabled."], at=99.0)
    assert progress.figures["async_scheduling"] == 0


def test_the_kv_cache_is_sized_once_its_size_is_logged_not_before():
    progress = StartupProgress()
    sized_at = None
    for number, line in enumerate(LINES):
        progress.feed([line], at=float(number))
        if sized_at is None and progress.memory_sized():
            sized_at = line
    assert sized_at is not None and "GPU KV cache size: 146,624 tokens" in sized_at


def test_a_line_no_pattern_knows_changes_nothing():
    progress = StartupProgress(phase="compiling")
    assert not progress.feed(["(EngineCore pid=1) INFO something vLLM 0.99 says"], at=1.0)
    assert progress.phase == "compiling" and progress.figures == {}


def test_phases_never_go_back():
    progress = StartupProgress()
    progress.feed([line for line in LINES if "Starting vLLM server" in line], at=5.0)
    progress.feed([line for line in LINES if "Loading model" in line], at=6.0)
    assert progress.phase == "serving"


def test_the_follower_reads_the_last_launch_and_whole_lines_only(tmp_path):
    log = tmp_path / "engine.log"
    log.write_bytes(b"\n" + LAUNCH_MARKER + b"old ===\nold line\n\n" + LAUNCH_MARKER
                    + b"new ===\n" + LINES[0].encode() + b"\npartial")
    follower = LogFollower.from_last_launch(str(log))
    first = follower.new_lines()
    assert first[-1] == LINES[0] and "old line" not in first
    with log.open("ab") as handle:  # tqdm redraws with a carriage return: each is a line
        handle.write(b" end\rCapturing CUDA graphs 50%\rCapturing CUDA graphs 100%\n")
    assert follower.new_lines() == ["partial end", "Capturing CUDA graphs 50%",
                                    "Capturing CUDA graphs 100%"]
    assert follower.new_lines() == []


def test_an_h200_engines_metrics_are_read_like_a_cpu_engines():
    """The `/metrics` of the Llama-2-7B-shaped engine on the H200 (vLLM 0.26), idle."""
    reading = scrape.parse((FIXTURES / "engine_metrics_h200.txt").read_text())
    assert reading.gauges["requests_running"] == 0.0
    assert reading.gauges["requests_waiting"] == 0.0
    assert set(reading.counters) == set(scrape.COUNTER_FAMILIES)
    # Every histogram the samples use is there, with its +Inf bucket.
    for name, buckets in reading.histograms.items():
        assert float("inf") in buckets, name


def test_the_last_launch_is_found_from_the_end_across_blocks(tmp_path):
    log = tmp_path / "engine.log"
    # Two launches, the second's marker straddling a 64-byte block boundary, requests between.
    body = LAUNCH_MARKER + b"first ===\n" + b"GET /health 200\n" * 20
    second = len(body) + (64 - len(body) % 64) - 5
    body += b"x" * (second - len(body)) + LAUNCH_MARKER + b"second ===\nafter\n"
    log.write_bytes(body)
    follower = LogFollower.from_last_launch(str(log), block=64)
    assert follower.offset == second
    assert follower.new_lines() == [(LAUNCH_MARKER + b"second ===").decode(), "after"]
    empty = tmp_path / "none.log"
    empty.write_bytes(b"no marker here\n")
    assert LogFollower.from_last_launch(str(empty), block=4).offset == 0
    assert LogFollower.from_last_launch(str(tmp_path / "missing.log")).offset == 0


def test_an_eager_start_under_mps_has_no_compile_or_graph_phase():
    """`--enforce-eager` (the MPS scenario's 1B engines on an H100): no torch.compile and no
    CUDA graphs logged; the phases skip them and the figures are those the run recorded
    (docs/gpu-runs/2026-12-05-h100/mps.json)."""
    progress, seen = read_start(EAGER)
    assert seen == ["launching", "loading", "profiling", "warming", "serving"]
    assert progress.figures == {
        "weights_gib": 1.84, "weights_seconds": 2.050519, "kv_cache_gib": 2.25,
        "kv_cache_tokens": 73632, "max_concurrency": 35.95, "init_engine_seconds": 88.16,
        "utilization": 0.06, "requested_gib": 4.75, "activation_gib": 0.5, "non_torch_gib": 0.16,
        "cuda_graph_gib": 0.0, "async_scheduling": 1,
    }


def _longest_silence(lines: list[str]) -> float:
    """The longest time between two consecutive timestamped lines of an engine's log."""
    stamps = [datetime.strptime(m[1], "%m-%d %H:%M:%S") for line in lines
              if (m := re.search(r" (\d\d-\d\d \d\d:\d\d:\d\d) \[", line))]
    return max((b - a).total_seconds() for a, b in zip(stamps, stamps[1:], strict=False))


def test_the_default_start_timeout_outlasts_the_longest_silence_of_a_real_gpu_start(settings):
    """A start fails after ENGINE_START_TIMEOUT_SECONDS of log silence; the longest silences
    seen on the GPUs were the kernel JIT after the KV cache was sized: 80 s for the eager 1B
    engine under MPS on the H100. The default leaves at least as much again."""
    eager = _longest_silence(EAGER)
    assert eager == 80.0
    assert max(eager, _longest_silence(LINES)) * 2 <= settings.ENGINE_START_TIMEOUT_SECONDS
