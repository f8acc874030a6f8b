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
def test_the_fairness_benchmark_reads_the_gateways_own_queue_statistics(settings):
    """`fairness_bench.queue_waits` reads what the flow-control scripts count: here a budget of
    one and two requests of one tenant, the second of which waits."""
    import redis

    from benchmarks.fairness_bench import pooled_waits, queue_waits
    from serving_app.deployments.sharing import prefix
    from tenants_app.models import Tenant
    from tests.gateway.conftest import REDIS_URL
    from tests.gateway.test_flow_units import Engine, run, tenant

    def clear(engine: Engine) -> None:
        with redis.Redis.from_url(REDIS_URL) as client:
            for pattern in (prefix(engine.deployment) + "*", f"gw:{{i{engine.instances[0].id}}}:*"):
                for key in client.scan_iter(pattern):
                    client.delete(key)

    row = Tenant.objects.create(slug="bench-queue", name="Queue")
    entry = dataclasses.replace(tenant(), id=row.pk)
    engines: list[Engine] = []

    async def scenario(meter):
        engine = Engine(meter, 1)
        engines.append(engine)
        clear(engine)  # ids repeat from one test process to the next
        await engine.send(entry)
        await engine.send(entry)
        await engine.finish()
        await engine.finish()

    run(scenario)
    settings.GATEWAY = {**settings.GATEWAY, "REDIS_URL": REDIS_URL}  # the benchmark's Redis
    waits = queue_waits(engines[0].deployment)
    assert set(waits) == {"bench-queue"}
    assert waits["bench-queue"]["dispatched"] == 2 and waits["bench-queue"]["waited"] == 1
    pooled = pooled_waits([waits, waits])
    assert pooled["bench-queue"]["dispatched"] == 4 and pooled["bench-queue"]["waited"] == 2
    assert pooled["bench-queue"]["mean_wait_ms"] == pooled["bench-queue"]["wait_ms"] / 4


@pytest.mark.django_db
def test_the_fairness_benchmark_reads_the_gateways_time_to_first_bytes():
    """`fairness_bench.engine_ttfts` reads the gateway's usage events: streamed requests only,
    per tenant, in seconds (as vLLM's per-request detail) for the same percentiles."""
    import json

    import redis

    from benchmarks.fairness_bench import USAGE_STREAM, engine_ttfts, pooled_ttfts
    from tenants_app.models import Tenant
    from tests.gateway.conftest import REDIS_URL

    row = Tenant.objects.create(slug="bench-ttft", name="TTFT")
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(USAGE_STREAM)
    try:
        for ttft, stream in ((10.0, True), (30.0, True), (500.0, False)):
            client.xadd(USAGE_STREAM, {"e": json.dumps(
                {"tenant": row.pk, "stream": stream, "ttft_ms": ttft})})
        samples = engine_ttfts(REDIS_URL)
    finally:
        client.delete(USAGE_STREAM)
        client.close()
    assert samples == {"bench-ttft": [0.010, 0.030]}
    # Percentiles in milliseconds, as the benchmark prints vLLM's.
    assert pooled_ttfts([samples, samples])["bench-ttft"] == {
        "n": 4, "p50": pytest.approx(30.0), "p95": pytest.approx(30.0)}
    assert pooled_ttfts([{"bench-ttft": [0.001 * i for i in range(1, 101)]}])["bench-ttft"] == {
        "n": 100, "p50": pytest.approx(51.0), "p95": pytest.approx(96.0)}
