"""What docs/gateway.md promises about the key cache and the leases, each checked on real Redis
(DB 9) and, for the key's expiry, through a real gateway process.

The upstream behind the gateway in the expiry test is `InstantUpstream` (an OpenAI-shaped
server in this process), because what is tested is the gateway's own refusal; the engine path
is tested in test_sdk.py and test_limits.py.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import redis

from gateway_app import admission
from gateway_app.cache import GatewayCache
from gateway_app.catalog import KeyEntry
from gateway_app.config import GatewayConfig
from gateway_app.metering import Meter
from tenants_app.models import ApiKey
from tests.gateway.conftest import REDIS_URL, make_world
from tests.gateway.test_requests import Upstream
from tests.gateway.test_units import CONFIG, tenant


class ShortLeases(GatewayConfig):
    """The test's configuration: leases of 300 ms instead of the upstream timeout + 30 s."""

    lease_ms = 300


def test_a_dead_gateways_concurrency_lease_expires_on_its_own():
    t = tenant(concurrency=1)
    config = ShortLeases(**{f: getattr(CONFIG, f) for f in CONFIG.__dataclass_fields__})

    async def scenario():
        meter = Meter(config)
        try:
            held, _ = await meter.admit(t, "held-by-a-dead-gateway", 1)
            assert held.admitted  # and never settled: its gateway died
            _, busy = await meter.admit(t, "next", 1)
            assert busy.code == admission.CONCURRENCY
            started = time.monotonic()
            while True:
                ticket, decision = await meter.admit(t, f"next-{time.monotonic()}", 1)
                if ticket.admitted:
                    break
                assert decision.code == admission.CONCURRENCY
                assert time.monotonic() - started < 10, "the lease never expired"
                await asyncio.sleep(0.05)
            assert time.monotonic() - started >= 0.2  # not before the lease ran out
        finally:
            await meter.redis.aclose()

    asyncio.run(scenario())


def test_every_cached_key_is_dropped_when_the_invalidation_subscription_drops():
    admin = redis.Redis.from_url(REDIS_URL)

    async def scenario():
        cache = GatewayCache(CONFIG)
        listener = asyncio.create_task(cache._listen_loop())
        try:
            await asyncio.wait_for(cache.subscribed.wait(), 10)
            cache.keys["h"] = KeyEntry(id=3, tenant_id=7, fresh_until=time.monotonic() + 60)
            admin.client_kill_filter(_type="pubsub")  # messages may be missed from now on
            deadline = time.monotonic() + 10
            while cache.subscribed.is_set():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await asyncio.wait_for(cache.subscribed.wait(), 10)  # back
            assert cache.keys == {}
        finally:
            listener.cancel()
            await cache.stop()

    try:
        asyncio.run(scenario())
    finally:
        admin.close()


@pytest.mark.django_db(transaction=True)
def test_a_cached_key_is_refused_once_its_expiry_passes(gateway):
    upstream = Upstream()
    try:
        world = make_world(upstream.port, "s")
        expires = datetime.now(UTC) + timedelta(seconds=3)
        ApiKey.objects.filter(pk=world.acme_key.pk).update(expires_at=expires)
        headers = {"Authorization": f"Bearer {world.acme_secret}"}
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}
        first = httpx.post(gateway.url + "/v1/completions", json=body, headers=headers,
                           timeout=30)
        assert first.status_code == 200, first.text  # the key is now cached in that worker
        deadline = time.monotonic() + 30
        while (r := httpx.post(gateway.url + "/v1/completions", json=body, headers=headers,
                               timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "the expired key kept working"
            time.sleep(0.2)
        assert datetime.now(UTC) >= expires
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        upstream.close()
