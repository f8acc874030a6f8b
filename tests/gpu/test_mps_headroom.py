"""The headroom in an `mps` engine's pinned-memory limit against what its CUDA context was seen
to take on two GPUs (the fixtures are lines of those runs' engine logs, docs/gpu-runs/):

- H200, limit 5,750 MiB (the share alone, before the headroom): vLLM saw 5.45 GiB free and
  refused to start, wanting its share of 5.59 GiB;
- H100, limit 5,405 MiB (the share plus the headroom, as placed today): it saw 5.12 GiB free,
  wanted 4.75 GiB and served.

What the context takes is the limit less what vLLM saw free; the limit the placer sets for each
share must leave the share free after it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from serving_app.placement.placer import MPS_CONTEXT_HEADROOM_BYTES, mps_memory_limit

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = Path(__file__).resolve().parents[2] / "docs" / "gpu-runs"
MIB, GIB = 1024**2, 1024**3
H200_TOTAL = 150_754_820_096  # NVML's total on that H200 (h200_nvml_with_cpu_affinity.json)
H100_TOTAL = 85_520_809_984  # NVML's total on that H100 (the MPS run's node, main.log)
FREE = re.compile(r"Free memory on device (?:cuda:0 )?\(([\d.]+)/([\d.]+) GiB\) on startup.*?"
                  r"desired GPU memory utilization (?:is )?\(([\d.]+), ([\d.]+) GiB\)", re.I)


def seen(fixture: str) -> tuple[float, float, float]:
    """(free GiB, fraction, wanted GiB) from the engine's start-up line."""
    found = FREE.search((FIXTURES / fixture).read_text())
    assert found, fixture
    return float(found[1]), float(found[3]), float(found[4])


def limit_mib(spec: str) -> int:
    return int(re.fullmatch(r"0=(\d+)M", spec)[1])


def context_mib() -> dict[str, float]:
    """What the CUDA context took in each run: the limit it ran under less the free memory seen."""
    h200_free, _, _ = seen("mps_pinned_limit_free_memory.log")
    h100_free, _, _ = seen("mps_engine_within_pinned_limit_h100.log")
    return {"h200": 5750 - h200_free * 1024, "h100": 5405 - h100_free * 1024}


def test_the_h100_run_ran_under_the_limit_the_placer_sets_today():
    recorded = json.loads((RUNS / "2026-12-05-h100" / "mps.json").read_text())
    limits = {i["environment"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
              for rows in recorded["figures"]["instances"].values() for i in rows}
    assert limits == {mps_memory_limit([H100_TOTAL], 0.06)} == {"0=5405M"}
    assert f"{H100_TOTAL}" in (RUNS / "2026-12-05-h100" / "main.log").read_text()


def test_the_context_took_well_under_the_headroom_on_both_gpus():
    taken = context_mib()
    assert 100 < taken["h200"] < 250 and 100 < taken["h100"] < 250, taken
    assert max(taken.values()) * MIB < MPS_CONTEXT_HEADROOM_BYTES / 2


def test_each_share_is_free_after_the_context_under_the_placed_limit():
    taken = context_mib()
    for gpu, total, fixture in (("h200", H200_TOTAL, "mps_pinned_limit_free_memory.log"),
                                ("h100", H100_TOTAL, "mps_engine_within_pinned_limit_h100.log")):
        _, fraction, wanted_gib = seen(fixture)
        free_mib = limit_mib(mps_memory_limit([total], fraction)) - taken[gpu]
        assert free_mib >= wanted_gib * 1024, (gpu, free_mib, wanted_gib)


def test_without_the_headroom_the_h200_engine_would_be_refused_again():
    _, fraction, wanted_gib = seen("mps_pinned_limit_free_memory.log")
    share_only = int(H200_TOTAL * fraction) // MIB
    assert share_only == 5750  # the limit of the refused run
    assert share_only - context_mib()["h200"] < wanted_gib * 1024
