"""The headroom in an `mps` engine's pinned-memory limit against what its CUDA context was seen
to take on two GPUs (the fixtures are lines of those runs' engine logs, docs/gpu-runs/):

- H200, limit 5,750 MiB (the share alone, before the headroom): vLLM saw 5.45 GiB free and
  refused to start, wanting its share of 5.59 GiB;
- H100, two engines, limit 5,405 MiB each (the share plus the headroom, as placed today): they
  saw 5.12 and 5.01 GiB free, wanted 4.75 GiB and served.

What the context takes is the limit less what vLLM saw free; the limit the placer sets for each
share must leave the share free after it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from serving_app.placement.placer import MPS_CONTEXT_HEADROOM_BYTES, mps_memory_limit

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = Path(__file__).resolve().parents[2] / "docs" / "gpu-runs"
MIB = 1024**2
H200_TOTAL = 150_754_820_096  # NVML's total on that H200 (h200_nvml_with_cpu_affinity.json)
H100_TOTAL = 85_520_809_984  # NVML's total on that H100 (the MPS run's node, main.log)
FREE = re.compile(r"Free memory on device (?:cuda:0 )?\(([\d.]+)/([\d.]+) GiB\) on startup.*?"
                  r"desired GPU memory utilization (?:is )?\(([\d.]+), ([\d.]+) GiB\)", re.I)
# (GPU, its total, the limit the engine ran under in MiB, the fixture of its start-up lines)
RUNS_SEEN = (("h200", H200_TOTAL, 5750, "mps_pinned_limit_free_memory.log"),
             ("h100", H100_TOTAL, 5405, "mps_engine_within_pinned_limit_h100.log"))


def seen(fixture: str) -> list[tuple[float, float, float]]:
    """(free GiB, fraction, wanted GiB) from each engine's start-up line."""
    found = [(float(m[1]), float(m[3]), float(m[4]))
             for m in FREE.finditer((FIXTURES / fixture).read_text())]
    assert found, fixture
    return found


def limit_mib(spec: str) -> int:
    return int(re.fullmatch(r"0=(\d+)M", spec)[1])


def engines() -> list[tuple[str, int, float, float, float]]:
    """Per engine seen: its GPU, the GPU's total, its fraction, the share it wanted (MiB) and
    what its CUDA context took (MiB): the limit it ran under less the free memory it saw."""
    return [(gpu, total, fraction, wanted * 1024, limit - free * 1024)
            for gpu, total, limit, fixture in RUNS_SEEN
            for free, fraction, wanted in seen(fixture)]


def test_the_h100_run_ran_under_the_limit_the_placer_sets_today():
    recorded = json.loads((RUNS / "2026-12-05-h100" / "mps.json").read_text())
    limits = {i["environment"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
              for rows in recorded["figures"]["instances"].values() for i in rows}
    assert limits == {mps_memory_limit([H100_TOTAL], 0.06)} == {"0=5405M"}
    assert f"{H100_TOTAL}" in (RUNS / "2026-12-05-h100" / "main.log").read_text()
    assert [e[0] for e in engines()] == ["h200", "h100", "h100"]


def test_the_context_took_less_than_the_headroom_on_both_gpus():
    taken = [round(e[4]) for e in engines()]
    assert taken == [169, 162, 275]
    assert max(taken) * MIB < MPS_CONTEXT_HEADROOM_BYTES


def test_each_share_is_free_after_the_context_under_the_placed_limit():
    for gpu, total, fraction, wanted, taken in engines():
        free = limit_mib(mps_memory_limit([total], fraction)) - taken
        assert free >= wanted, (gpu, free, wanted)


def test_without_the_headroom_the_h200_engine_would_be_refused_again():
    gpu, total, fraction, wanted, taken = engines()[0]
    share_only = int(total * fraction) // MIB
    assert (gpu, share_only) == ("h200", 5750)  # the limit of the refused run
    assert share_only - taken < wanted
