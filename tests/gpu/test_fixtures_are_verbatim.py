"""Every fixture the GPU-only branches are tested from is a verbatim excerpt of what a real GPU
run produced: each of its lines (each value, for the NVML snapshot) occurs in a file under
docs/gpu-runs/, where the whole outputs of those runs are kept (docs/gpu.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = Path(__file__).resolve().parents[2] / "docs" / "gpu-runs"


def _recorded() -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(RUNS.rglob("*")) if p.is_file())


@pytest.mark.parametrize("fixture", sorted(p.name for p in [*FIXTURES.glob("*.log"),
                                                             *FIXTURES.glob("*.txt")]))
def test_each_log_fixture_line_occurs_in_a_recorded_gpu_run(fixture):
    recorded = _recorded()
    lines = [line for line in (FIXTURES / fixture).read_text().splitlines() if line.strip()]
    assert lines, f"{fixture} is empty"
    missing = [line for line in lines if line not in recorded]
    assert not missing, f"{fixture}: not in docs/gpu-runs: {missing[:3]}"


def test_the_nvml_snapshot_fixture_is_a_recorded_snapshot():
    fixture = json.loads((FIXTURES / "h200_nvml_with_cpu_affinity.json").read_text())
    snapshots = [json.loads(p.read_text()) for p in RUNS.rglob("nvml-snapshot.json")]
    assert fixture in snapshots
