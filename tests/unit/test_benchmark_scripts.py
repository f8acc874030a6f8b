"""Every benchmark starts the way the README runs it: as a script, from the console's venv, in
any working directory (one of them imported the project only when run as a module)."""

from __future__ import annotations

import dataclasses
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


@pytest.mark.django_db
def test_the_fairness_benchmark_reads_the_gateways_own_queue_statistics():
    """`fairness_bench.queue_waits` reads what the flow-control scripts count: here a budget of
    one and two requests of one tenant, the second of which waits."""
    from benchmarks.fairness_bench import pooled_waits, queue_waits
    from tenants_app.models import Tenant
    from tests.gateway.conftest import REDIS_URL
    from tests.gateway.test_flow_units import Engine, run, tenant

    row = Tenant.objects.create(slug="bench-queue", name="Queue")
    entry = dataclasses.replace(tenant(), id=row.pk)
    engines: list[Engine] = []

    async def scenario(meter):
        engine = Engine(meter, 1)
        engines.append(engine)
        await engine.send(entry)
        await engine.send(entry)
        await engine.finish()
        await engine.finish()

    run(scenario)
    waits = queue_waits(engines[0].deployment, REDIS_URL)
    assert set(waits) == {"bench-queue"}
    assert waits["bench-queue"]["dispatched"] == 2 and waits["bench-queue"]["waited"] == 1
    pooled = pooled_waits([waits, waits])
    assert pooled["bench-queue"]["dispatched"] == 4 and pooled["bench-queue"]["waited"] == 2
    assert pooled["bench-queue"]["mean_wait_ms"] == pooled["bench-queue"]["wait_ms"] / 4
