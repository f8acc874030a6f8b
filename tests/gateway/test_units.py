"""The gateway's parts on their own: the admission and settlement scripts on real Redis (DB 9),
the stream relay, the writer's idempotence, and the in-process cache's invalidation rules."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
import redis

from gateway_app import admission
from gateway_app.cache import GatewayCache
from gateway_app.catalog import KeyEntry, Snapshot, TenantEntry
from gateway_app.config import GatewayConfig
from gateway_app.context import Context
from gateway_app.metering import Meter
from gateway_app.proxy import StreamRelay, Usage, read_usage
from gateway_app.writer import UsageWriter, persist
from serving_app.models.usage import UsageEvent, UsageHour, UsageMinute
from tests.factories import make_tenant
from tests.gateway.conftest import REDIS_URL

CONFIG = GatewayConfig(
    redis_url=REDIS_URL, fail_open=False, redis_timeout=1.0, max_body_bytes=1 << 20,
    key_ttl=60, negative_key_ttl=5, catalog_refresh=2, connect_timeout=1, upstream_timeout=60,
    upstream_retries=2, usage_stream="gw:unit-usage", event_buffer_max=100,
)
_ids = iter(range(10_000, 1_000_000))


def tenant(**limits) -> TenantEntry:
    fields = {"rpm": None, "tpm": None, "concurrency": None, "budget": None,
              "max_tokens": None, "max_prompt": None, **limits}
    return TenantEntry(id=next(_ids), slug="t", active=True, priority=2, **fields)


async def admit_many(t: TenantEntry, needs: list[int]):
    meter = Meter(CONFIG)
    try:
        return [await meter.admit(t, f"r{i}-{time.time()}", n) for i, n in enumerate(needs)]
    finally:
        await meter.redis.aclose()


def test_token_window_reserves_then_settles_to_the_real_count():
    t = tenant(tpm=100)

    async def scenario():
        meter = Meter(CONFIG)
        try:
            first, d1 = await meter.admit(t, "a", 80)
            assert first.admitted and d1.tpm_used == 80
            _, refused = await meter.admit(t, "b", 30)
            assert refused.code == admission.TPM and 0 < refused.wait_ms <= 60_000
            await meter.settle(first, 20, {"id": "a"})
            await meter.settle(first, 20, {"id": "a"})  # a second settle changes nothing
            second, d2 = await meter.admit(t, "b", 30)
            assert second.admitted and d2.tpm_used == 50
            _, too_big = await meter.admit(t, "c", 101)
            assert too_big.code == admission.TPM and too_big.wait_ms == -1
        finally:
            await meter.redis.aclose()

    asyncio.run(scenario())


def test_requests_per_minute_and_concurrency_leases():
    results = asyncio.run(admit_many(tenant(rpm=3), [1, 1, 1, 1]))
    assert [ticket.admitted for ticket, _ in results] == [True, True, True, False]
    refused = results[-1][1]
    assert refused.code == admission.RPM and 59_000 <= refused.wait_ms <= 60_000
    headers = admission.rate_headers(tenant(rpm=3), results[1][1])
    assert headers["x-ratelimit-remaining-requests"] == "1"

    t = tenant(concurrency=1)

    async def leases():
        meter = Meter(CONFIG)
        try:
            first, _ = await meter.admit(t, "x", 1)
            _, busy = await meter.admit(t, "y", 1)
            assert busy.code == admission.CONCURRENCY
            await meter.settle(first, 1, {"id": "x"})
            again, _ = await meter.admit(t, "y", 1)
            assert again.admitted
        finally:
            await meter.redis.aclose()

    asyncio.run(leases())


def test_monthly_budget_is_seeded_from_the_rollups_and_refuses_with_insufficient_quota():
    t = TenantEntry(id=next(_ids), slug="t", active=True, priority=2, rpm=None, tpm=None,
                    concurrency=None, budget=1000, max_tokens=None, max_prompt=None,
                    month_used=950)
    results = asyncio.run(admit_many(t, [40, 20]))
    assert results[0][0].admitted
    assert results[1][1].code == admission.BUDGET
    error = admission.refusal(t, results[1][1], 20)
    assert error.code == "insufficient_quota" and int(error.headers["retry-after"]) >= 1


def test_redis_unreachable_is_reported_not_swallowed():
    from gateway_app.metering import RedisUnavailable

    config = dataclasses.replace(CONFIG, redis_url="redis://127.0.0.1:1/0")

    async def scenario():
        meter = Meter(config)
        with pytest.raises(RedisUnavailable):
            await meter.admit(tenant(rpm=1), "z", 1)
        await meter.settle(None, 0, {"id": "z"})  # kept in memory, not lost
        assert len(meter.buffer) == 1

    asyncio.run(scenario())


def test_stream_relay_strips_the_usage_event_and_renames_the_model():
    async def scenario():
        relay = StreamRelay(None, strip_usage=True, engine_model="acme--style",
                            public_model="style")
        chunk = b'data: {"model":"acme--style","choices":[{"delta":{"content":"hi"}}]}\n\n'
        usage = b'data: {"model":"acme--style","choices":[],"usage":{"prompt_tokens":3,' \
                b'"completion_tokens":2,"total_tokens":5}}\n\n'
        stream = chunk + usage + b"data: [DONE]\n\n"
        out = b"".join(relay.feed(stream[i : i + 7]) for i in range(0, len(stream), 7))
        out += relay.flush()
        assert relay.usage == (3, 2, 0)
        assert b"usage" not in out
        assert out.count(b'"model":"style"') == 1 and b"acme--style" not in out
        assert out.endswith(b"data: [DONE]\n\n")

        keep = StreamRelay(None, strip_usage=False, engine_model="m", public_model="m")
        assert keep.feed(usage) is usage and keep.usage == (3, 2, 0)  # relayed untouched
        whole = StreamRelay(None, strip_usage=False, engine_model="m", public_model="m")
        assert whole.feed(chunk + chunk) == chunk + chunk and whole.usage is None

        # Usage on an event that also has a choice (continuous usage stats): only the usage
        # field goes, the choice stays.
        both = (b'data: {"model":"m","choices":[{"delta":{"content":"a"}}],"usage":'
                b'{"prompt_tokens":1,"completion_tokens":1}}\n\n')
        trim = StreamRelay(None, strip_usage=True, engine_model="m", public_model="m")
        out = trim.feed(chunk + both + b"data: [DONE]\n\n")
        assert trim.usage == (1, 1, 0) and b"usage" not in out
        assert out.startswith(chunk) and out.count(b'"content":"a"') == 1

    asyncio.run(scenario())


@pytest.mark.django_db
def test_writer_persists_each_event_once_with_rollups():
    t = make_tenant("meter")
    now = time.time()
    events = [
        {"id": f"req-{i}", "at": now, "tenant": t.pk, "key": None, "endpoint": "completions",
         "model": "m", "status": 200 if i else 429, "prompt": 3, "completion": 5,
         "latency_ms": 10.0 * (i + 1), "ttft_ms": None}
        for i in range(3)
    ]
    assert persist(events) == 3
    assert persist(events) == 0  # redelivered after a crash: nothing counted twice
    minute = UsageMinute.objects.get(tenant=t, model="m")
    hour = UsageHour.objects.get(tenant=t, model="m")
    for rollup in (minute, hour):
        assert (rollup.requests, rollup.errors, rollup.rate_limited) == (3, 1, 1)
        assert (rollup.prompt_tokens, rollup.completion_tokens) == (9, 15)
        assert rollup.latency_ms_max == 30.0
        assert (rollup.latency_le_10, rollup.latency_le_20, rollup.latency_le_32) == (1, 1, 1)
    assert UsageEvent.objects.count() == 3


def test_cache_applies_revocations_and_suspensions_from_messages():
    async def scenario():
        cache = GatewayCache(CONFIG)
        cache.snapshot = Snapshot(tenants={1: tenant(), 7: TenantEntry(
            id=7, slug="s", active=True, priority=2, rpm=None, tpm=None, concurrency=None,
            budget=None, max_tokens=None, max_prompt=None)})
        cache.keys["h"] = KeyEntry(id=3, tenant_id=7, fresh_until=time.monotonic() + 60)
        cache.apply(json.dumps({"type": "key", "hash": "h", "usable": False}))
        assert cache.keys["h"].id is None
        cache.apply(json.dumps({"type": "tenant", "id": 7, "status": "suspended"}))
        assert cache.snapshot.tenants[7].active is False
        # A snapshot read that began before the message cannot bring the tenant back.
        stale = Snapshot(tenants={7: dataclasses.replace(cache.snapshot.tenants[7], active=True)})
        cache._install(stale, started=time.monotonic() - 1)
        assert cache.snapshot.tenants[7].active is False

    asyncio.run(scenario())


def test_a_fresh_snapshot_older_than_a_catalog_message_is_re_read_on_a_miss():
    """A name missing from a snapshot read just before a deployment was announced is re-read,
    not answered 404 because the snapshot is young.

    Stand-in: `refresh_now` is replaced by a recorder, because what is tested is the cache's
    decision to re-read; the read itself (`load_snapshot`) is tested against the database in
    test_catalog.py and end to end in test_requests.py."""

    async def scenario():
        cache = GatewayCache(CONFIG)
        reads = []

        async def refresh_now(timeout: float = 5.0) -> None:
            reads.append(time.monotonic())

        cache.refresh_now = refresh_now
        cache.snapshot = Snapshot(loaded_at=time.monotonic())
        assert await cache.refresh_if_older() is False  # young, nothing announced since
        cache.apply(json.dumps({"type": "catalog"}))
        assert await cache.refresh_if_older() is True
        assert len(reads) == 1

    asyncio.run(scenario())


@pytest.mark.django_db
def test_usage_stream_writes_are_redis_round_trips_not_database_writes(django_assert_num_queries):
    """Settling a request touches Redis only."""

    async def scenario():
        meter = Meter(CONFIG)
        try:
            ticket, _ = await meter.admit(tenant(tpm=1000), "q", 10)
            await meter.settle(ticket, 5, {"id": "q"})
        finally:
            await meter.redis.aclose()

    client = redis.Redis.from_url(REDIS_URL)
    before = client.xlen(CONFIG.usage_stream)
    with django_assert_num_queries(0):
        asyncio.run(scenario())
    assert client.xlen(CONFIG.usage_stream) == before + 1
    client.close()


def test_the_usage_event_gives_each_stage_entered_its_time_until_the_next_one():
    ctx = Context("req-1", time.time(), 100.0)
    assert ctx.event()["stages"] == []  # refused before any stage (an unknown path)
    ctx.stages = [("authenticated", 100.0), ("validated", 100.002), ("charged", 100.0025)]
    ctx.ended = 100.0105
    assert ctx.event()["stages"] == [("authenticated", 2.0), ("validated", 0.5),
                                     ("charged", 8.0)]
    assert json.loads(json.dumps(ctx.event()))["stages"][2] == ["charged", 8.0]


def test_cached_prompt_tokens_are_read_from_the_engines_usage():
    """Engines started with --enable-prompt-tokens-details report the prompt tokens served from
    the prefix cache; the gateway records them (never more than the prompt)."""
    body = (b'{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":5,'
            b'"prompt_tokens_details":{"cached_tokens":32}}}')
    assert read_usage(body) == Usage(40, 5, 32)
    assert read_usage(b'{"usage":{"prompt_tokens":4,"completion_tokens":1,'
                      b'"prompt_tokens_details":null}}') == Usage(4, 1, 0)
    assert read_usage(b'{"usage":{"prompt_tokens":4,"completion_tokens":1,'
                      b'"prompt_tokens_details":{"cached_tokens":99}}}').cached == 4


@pytest.mark.django_db
def test_the_writer_stores_the_error_message_and_the_stages_of_a_request():
    """What the request log shows: the message the client got and the stages with their
    milliseconds; malformed stage entries are left out rather than failing the batch."""
    t = make_tenant()
    ctx = Context("req-story", time.time(), time.perf_counter())
    ctx.status, ctx.error_code = 404, "model_not_found"
    ctx.error_message = "The model `nope` does not exist or you do not have access to it."
    ctx.stages = [("authenticated", 100.0), ("validated", 100.002)]
    ctx.ended = 100.003
    event = json.loads(json.dumps({**ctx.event(), "tenant": t.pk}))
    assert event["message"] == ctx.error_message
    assert persist([event, {**event, "id": "req-odd", "stages": [["x"], "y", ["ok", 1]]}]) == 2
    row = UsageEvent.objects.get(request_id="req-story")
    assert (row.error_code, row.error_message) == ("model_not_found", ctx.error_message)
    assert row.stages == [["authenticated", 2.0], ["validated", 1.0]]
    assert UsageEvent.objects.get(request_id="req-odd").stages == [["ok", 1.0]]


@pytest.mark.django_db
def test_the_writer_skips_an_entry_deleted_while_it_was_pending_and_goes_on():
    """An entry of the writer's own pending list deleted from the stream (XDEL by an operator,
    or anything else that removes it) comes back from XREADGROUP as an id without fields
    (redis-py: an empty dict): the writer drops it as malformed, acknowledges it and stores what
    follows, instead of failing every round on it."""
    t = make_tenant("pending-gone")
    client = redis.Redis.from_url(REDIS_URL)
    stream = f"usage-test-{time.monotonic_ns()}"
    writer = UsageWriter(client, stream=stream, group="writers", consumer="w1")

    def event(i: int) -> dict:
        return {"id": f"gone-{stream}-{i}", "at": time.time(), "tenant": t.pk, "key": None,
                "endpoint": "completions", "model": "m", "status": 200, "prompt": 1,
                "completion": 1, "latency_ms": 1.0, "ttft_ms": None}

    try:
        gone = client.xadd(stream, {"e": json.dumps(event(0))})
        writer._ensure_group()
        assert client.xreadgroup("writers", "w1", {stream: ">"})  # read, not stored: pending
        client.xdel(stream, gone)
        client.xadd(stream, {"e": json.dumps(event(1))})
        handled = writer.drain(max_seconds=10)
        assert handled >= 1
        assert list(UsageEvent.objects.filter(tenant=t).values_list("request_id", flat=True)
                    ) == [f"gone-{stream}-1"]
        assert client.xpending(stream, "writers")["pending"] == 0
        assert client.xlen(stream) == 0
    finally:
        client.delete(stream)
        client.close()
