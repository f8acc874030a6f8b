"""Every benchmark starts the way the README runs it: as a script, from the console's venv, in
any working directory (one of them imported the project only when run as a module)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*_bench.py"))


def test_every_benchmark_is_found():
    assert len(SCRIPTS) >= 8


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_benchmark_runs_as_a_script(script, tmp_path):
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")
