"""`/metrics` of a console running 4 uvicorn workers: requests spread over the workers by the
kernel, the usage writer stores their events, and every worker's scrape shows counters equal to
the requests sent. A real gateway and PostgreSQL; the engine is the instant upstream the
gateway tests use (no model output is needed to count requests). Uses Redis DB 9, like the
gateway tests: never run it beside them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from django.db import connection
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.gateway_bench import kill_group
from tests.gateway.conftest import (
    REDIS_URL,
    _test_database_url,
    drain_usage,
    make_world,
    start_gateway,
)
from tests.gateway.test_requests import Upstream

TOKEN = "prometheus-scrape-token"


def counters(url: str) -> dict[tuple[str, str], float]:
    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30)
    assert response.status_code == 200, response.text
    out = {}
    for family in text_string_to_metric_families(response.text):
        if family.name == "llm_console_requests":
            for sample in family.samples:
                out[(sample.labels["tenant"], sample.labels["model"])] = sample.value
    return out


def test_counters_equal_the_requests_sent_through_four_workers(transactional_db):
    if connection.vendor != "postgresql":
        pytest.skip("gateway processes need a shared database (PostgreSQL)")
    redis.Redis.from_url(REDIS_URL).flushdb()
    upstream = Upstream()
    world = make_world(upstream.port, "engine-secret")
    gateway = start_gateway(_test_database_url(), workers=4, METRICS_SCRAPE_TOKEN=TOKEN)
    try:
        def call(args: tuple[str, str]) -> int:
            secret, model = args
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4}
            response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                                  content=json.dumps(body),
                                  headers={"Authorization": f"Bearer {secret}",
                                           "Content-Type": "application/json"})
            return response.status_code

        sent = [(world.acme_secret, "tiny-llama")] * 60 + [(world.globex_secret, "tone")] * 25
        with ThreadPoolExecutor(max_workers=12) as pool:
            statuses = list(pool.map(call, sent))
        assert statuses.count(200) == len(sent)
        drain_usage()
        # Any worker answers the scrape with the same figures: they come from the rollups.
        for _ in range(4):
            assert counters(gateway.url) == {("acme", "tiny-llama"): 60, ("globex", "tone"): 25}
        refused = httpx.get(f"{gateway.url}/metrics", timeout=30)
        assert refused.status_code == 401
    finally:
        kill_group(gateway.proc)
        upstream.close()
