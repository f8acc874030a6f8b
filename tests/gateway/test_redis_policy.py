"""GATEWAY_REDIS_FAILURE_POLICY with a real Redis that the test stops and starts again.

"closed": while Redis is down a tenant with limits gets OpenAI's 503 `limits_unavailable` and
no request reaches the engine; once Redis is back it is served again. "open": while Redis is
down requests are served without limits and their usage events wait in the worker's memory;
once Redis is back they are written to the usage stream, none lost.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from benchmarks.gateway_bench import kill_group
from tests.gateway.conftest import _test_database_url, make_world, start_gateway, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]
STREAM = "gw:usage"


def complete(url: str, secret: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})


def test_closed_policy_refuses_while_redis_is_down_and_serves_once_it_is_back(
    transactional_db, engine, private_redis
):
    world = make_world(engine.port, engine.secret, requests_per_minute=1000)
    gateway = start_gateway(_test_database_url(), GATEWAY_REDIS_URL=private_redis.url,
                            GATEWAY_REDIS_FAILURE_POLICY="closed",
                            GATEWAY_REDIS_TIMEOUT_SECONDS="0.5")
    try:
        assert complete(gateway.url, world.acme_secret).status_code == 200
        private_redis.stop()
        finished_before = engine.metric("vllm:request_success_total")
        refused = complete(gateway.url, world.acme_secret)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "limits_unavailable"
        assert refused.headers["retry-after"] == "1"
        assert engine.metric("vllm:request_success_total") == finished_before
        private_redis.start()
        deadline = time.monotonic() + 30
        while (status := complete(gateway.url, world.acme_secret).status_code) != 200:
            assert status == 503 and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        kill_group(gateway.proc)


def test_open_policy_serves_while_redis_is_down_and_replays_the_usage_events(
    transactional_db, engine, private_redis
):
    world = make_world(engine.port, engine.secret, requests_per_minute=1000)
    gateway = start_gateway(_test_database_url(), GATEWAY_REDIS_URL=private_redis.url,
                            GATEWAY_REDIS_FAILURE_POLICY="open",
                            GATEWAY_REDIS_TIMEOUT_SECONDS="0.5")
    try:
        assert complete(gateway.url, world.acme_secret).status_code == 200
        private_redis.stop()
        served_while_down = []
        for _ in range(3):
            response = complete(gateway.url, world.acme_secret)
            assert response.status_code == 200, response.text
            served_while_down.append(response.headers["x-request-id"])
        private_redis.start()  # empty: what it held before is gone
        client = private_redis.client()

        def replayed() -> set[str]:
            ids = set()
            for _, fields in client.xrange(STREAM):
                ids.add(json.loads(fields[b"e"])["id"])
            return ids

        wait_until(lambda: set(served_while_down) <= replayed(), 30, "usage events replayed")
    finally:
        kill_group(gateway.proc)
