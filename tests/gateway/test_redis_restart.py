"""Metering across Redis restarts, against a Redis of the test's own that it kills (SIGKILL) and
starts again.

Without persistence (how the machine's Redis runs) a restart loses the stream and its consumer
group: the writer creates the group again by itself and carries on; what was lost is at most what
was in the stream unwritten at the kill. With the shipped `deploy/redis.conf` (AOF) nothing
acknowledged is lost.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx
import pytest
import redis
from django.db import connection

from benchmarks.gateway_bench import kill_group
from gateway_app import admission
from gateway_app.catalog import load_snapshot
from gateway_app.config import GatewayConfig
from gateway_app.metering import Meter
from gateway_app.writer import UsageWriter
from serving_app.models.usage import UsageEvent, UsageHour, month_start
from tests.factories import make_tenant
from tests.gateway.conftest import (
    ROOT,
    _test_database_url,
    make_world,
    start_gateway,
    wait_until,
)
from tests.redis_server import PrivateRedis

STREAM = "gw:usage"
GROUP = "usage-writer"
SHIPPED_CONFIG = ROOT / "deploy" / "redis.conf"


def event(request_id: str | None = None, **fields) -> dict:
    return {"id": request_id or uuid.uuid4().hex, "at": time.time(), "endpoint": "completions",
            "model": "tiny-llama", "status": 200, "prompt": 3, "completion": 2, **fields}


def append(server: PrivateRedis, *events: dict) -> None:
    client = server.client()
    for e in events:
        client.xadd(STREAM, {"e": json.dumps(e)})


def stored_ids() -> set[str]:
    return set(UsageEvent.objects.values_list("request_id", flat=True))


class RunningWriter:
    """`UsageWriter.run_forever()` in a thread, as `manage.py usage_writer` runs it."""

    def __init__(self, server: PrivateRedis) -> None:
        self.writer = UsageWriter(server.client(), stream=STREAM, group=GROUP, consumer="w1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.writer.run_forever(self._stop.is_set)
        finally:
            connection.close()

    def __enter__(self) -> UsageWriter:
        self._thread.start()
        return self.writer

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.django_db(transaction=True)
def test_writer_recreates_its_group_after_redis_restarts_empty_and_counts_replays_once(
    private_redis,
):
    before = [event() for _ in range(3)]
    with RunningWriter(private_redis) as writer:
        append(private_redis, *before)
        wait_until(lambda: stored_ids() == {e["id"] for e in before}, 30, "first events stored")

        private_redis.kill()
        private_redis.start()  # empty: stream and consumer group are gone
        after = [event() for _ in range(4)]
        # A gateway that lost the reply to its settle replays the event: stored once.
        append(private_redis, *after, before[0])
        expected = {e["id"] for e in before + after}
        wait_until(lambda: stored_ids() == expected, 60, "events after the restart stored")
        wait_until(lambda: private_redis.client().xlen(STREAM) == 0, 30, "stream emptied")
    assert writer.group_recreated == 1
    assert UsageEvent.objects.count() == len(expected)


@pytest.mark.django_db(transaction=True)
def test_writer_reads_every_entry_of_a_stream_that_vanished_and_came_back(private_redis):
    """The stream deleted and written again before the writer next reads: the new group starts
    at the stream's beginning, so the entries appended meanwhile are not skipped."""
    writer = UsageWriter(private_redis.client(), stream=STREAM, group=GROUP, consumer="w1")
    append(private_redis, event())
    assert writer.drain() == 1
    private_redis.client().delete(STREAM)
    meanwhile = [event() for _ in range(5)]
    append(private_redis, *meanwhile)  # XADD creates the stream again, without the group
    assert writer.drain() == 5
    assert {e["id"] for e in meanwhile} <= stored_ids()
    assert writer.group_recreated == 1


def meter_config(server: PrivateRedis) -> GatewayConfig:
    return GatewayConfig(
        redis_url=server.url, fail_open=False, redis_timeout=1.0, max_body_bytes=1 << 20,
        key_ttl=60, negative_key_ttl=5, catalog_refresh=2, connect_timeout=1,
        upstream_timeout=60, upstream_retries=2, usage_stream=STREAM, event_buffer_max=100,
    )


def serve(server: PrivateRedis, tenant_id: int, requests: list[tuple[int, int]]) -> list[int]:
    """Admit and settle requests (reserved, actual tokens) for the tenant as the catalog now
    sees it, like the gateway does; returns the admission codes."""
    entry = load_snapshot().tenants[tenant_id]

    async def scenario() -> list[int]:
        meter = Meter(meter_config(server))
        codes = []
        try:
            for reserved, actual in requests:
                rid = uuid.uuid4().hex
                ticket, decision = await meter.admit(entry, rid, reserved)
                codes.append(decision.code)
                if ticket.admitted:
                    await meter.settle(ticket, actual, event(
                        rid, tenant=tenant_id, prompt=actual, completion=0))
        finally:
            await meter.redis.aclose()
        return codes

    return asyncio.run(scenario())


def spent(server: PrivateRedis, tenant_id: int) -> int:
    return int(server.client().get(admission.tenant_keys(tenant_id)[5]) or 0)


@pytest.mark.django_db(transaction=True)
def test_budget_lost_with_redis_is_reseeded_from_postgres_plus_what_the_stream_still_holds(
    private_redis,
):
    acme = make_tenant("acme", monthly_token_budget=1000)
    UsageHour.objects.create(bucket=month_start(), tenant=acme, model="m", prompt_tokens=300,
                             completion_tokens=0)
    writer = UsageWriter(private_redis.client(), stream=STREAM, group=GROUP, consumer="w1")
    assert serve(private_redis, acme.pk, [(50, 40)]) == [admission.ADMIT]
    writer.drain()  # 40 tokens in PostgreSQL now
    assert serve(private_redis, acme.pk, [(100, 60), (30, 25)]) == [admission.ADMIT] * 2
    assert spent(private_redis, acme.pk) == 300 + 40 + 60 + 25  # 85 still in the stream

    # The counter is lost but the stream kept its 85 unwritten tokens: counted in the seed.
    private_redis.client().delete(admission.tenant_keys(acme.pk)[5])
    assert serve(private_redis, acme.pk, [(10, 10)]) == [admission.ADMIT]
    assert spent(private_redis, acme.pk) == 300 + 40 + 85 + 10

    # Everything stored, then Redis restarts empty: PostgreSQL alone has it all.
    writer.drain()
    assert not private_redis.client().keys("*unwritten*")
    private_redis.kill()
    private_redis.start()
    assert serve(private_redis, acme.pk, [(5, 5)]) == [admission.ADMIT]
    assert spent(private_redis, acme.pk) == 300 + 40 + 85 + 10 + 5
    # No second month's budget: what is left refuses a request larger than it.
    assert serve(private_redis, acme.pk, [(1000 - 440 + 1, 1)]) == [admission.BUDGET]


@pytest.mark.django_db(transaction=True)
def test_a_request_admitted_before_a_redis_loss_is_charged_its_tokens_after_the_reseed(
    private_redis,
):
    """Its reservation went with the old counter: settling must not take it back from the new
    one (that would hand the tenant the reservation as extra budget)."""
    from gateway_app.metering import RedisUnavailable

    acme = make_tenant("acme", monthly_token_budget=1000)
    UsageHour.objects.create(bucket=month_start(), tenant=acme, model="m", prompt_tokens=200,
                             completion_tokens=0)
    entry = load_snapshot().tenants[acme.pk]

    async def scenario() -> None:
        meter = Meter(meter_config(private_redis))
        try:
            in_flight, _ = await meter.admit(entry, "in-flight", 300)
            assert spent(private_redis, acme.pk) == 200 + 300
            private_redis.kill()
            private_redis.start()
            try:
                other, _ = await meter.admit(entry, "after", 50)
            except RedisUnavailable:  # the old connection, found dead (a request refused)
                other, _ = await meter.admit(entry, "after", 50)  # re-seeds: 200 + 50
            await meter.settle(in_flight, 120, event("in-flight", tenant=acme.pk))
            assert spent(private_redis, acme.pk) == 200 + 50 + 120
            await meter.settle(other, 40, event("after", tenant=acme.pk))
            assert spent(private_redis, acme.pk) == 200 + 120 + 40
        finally:
            await meter.redis.aclose()

    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_a_full_redis_refuses_admission_and_still_lets_the_writer_empty_the_stream(tmp_path):
    """Redis over `maxmemory` with `noeviction` (the shipped policy): writes that need memory are
    refused (OOM), so admission cannot record the request and raises RedisUnavailable, which the
    gateway turns into the failure policy's answer (closed: 503 `limits_unavailable`). Nothing
    is evicted, and the writer can still store and delete what the stream holds."""
    from gateway_app.metering import RedisUnavailable

    server = PrivateRedis(tmp_path, SHIPPED_CONFIG)
    server.start()
    try:
        client = server.client()
        acme = make_tenant("acme", requests_per_minute=100, monthly_token_budget=10_000)
        assert serve(server, acme.pk, [(20, 10), (20, 10)]) == [admission.ADMIT] * 2
        assert int(client.get(admission.tenant_keys(acme.pk)[6])) == 20  # unwritten tokens
        client.mset({f"filler:{i}": "x" * 1000 for i in range(2000)})
        client.config_set("maxmemory", "1mb")  # now well over it: Redis is full
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set("one-more", "x")
        with pytest.raises(RedisUnavailable, match="maxmemory"):
            serve(server, acme.pk, [(20, 10)])
        assert client.xlen(STREAM) == 2  # nothing evicted

        writer = UsageWriter(client, stream=STREAM, group=GROUP, consumer="w1")
        assert writer.drain() == 2
        assert client.xlen(STREAM) == 0 and UsageEvent.objects.count() == 2
        assert not client.exists(admission.tenant_keys(acme.pk)[6])
    finally:
        server.stop()


class Traffic:
    """Completions through the gateway in a loop until stopped; keeps the ids of the successful
    ones (200) and fails on any answer but 200 or the closed policy's 503."""

    def __init__(self, url: str, secret: str) -> None:
        self.url, self.secret = url, secret
        self.served: list[str] = []
        self.refused = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": "tiny-llama", "prompt": "Redis is", "max_tokens": 2}
        try:
            with httpx.Client(base_url=self.url, timeout=60,
                              headers={"Authorization": f"Bearer {self.secret}"}) as http:
                while not self._stop.is_set():
                    r = http.post("/v1/completions", json=body)
                    if r.status_code == 200:
                        self.served.append(r.headers["x-request-id"])
                    else:
                        assert r.status_code == 503, r.text
                        assert r.json()["error"]["code"] == "limits_unavailable"
                        self.refused += 1
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def until_served(self, n: int) -> None:
        target = len(self.served) + n
        wait_until(lambda: self.error is not None or len(self.served) >= target, 120,
                   f"{n} more requests served")
        assert self.error is None, self.error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert self.error is None, self.error


def _crash_under_traffic(engine, server: PrivateRedis, *, pause_first: bool):
    """Traffic through a gateway and a running writer; Redis SIGKILLed under it and started
    again. Returns (served ids, ids unwritten in the stream at the kill, budget key, writer)."""
    world = make_world(engine.port, engine.secret, requests_per_minute=100_000,
                       monthly_token_budget=10**9)
    gateway = start_gateway(_test_database_url(), GATEWAY_REDIS_URL=server.url,
                            GATEWAY_REDIS_FAILURE_POLICY="closed",
                            GATEWAY_REDIS_TIMEOUT_SECONDS="0.5")
    try:
        with RunningWriter(server) as writer:
            traffic = Traffic(gateway.url, world.acme_secret).start()
            try:
                traffic.until_served(5)
                client = server.client()
                if pause_first:
                    # Hold every write (they get no reply: the gateway keeps those events) so
                    # that what the stream holds now is exactly what the kill can lose.
                    client.client_pause(60_000, all=False)
                unwritten = {json.loads(f[b"e"])["id"] for _, f in client.xrange(STREAM)}
                server.kill()
                server.start()
                traffic.until_served(5)
            finally:
                traffic.stop()
            served = set(traffic.served)
            wait_until(lambda: served - unwritten <= stored_ids(), 60, "served events stored")
            # The lag goes back to zero: nothing left unwritten in the stream.
            wait_until(lambda: server.client().xlen(STREAM) == 0, 60, "stream emptied")
    finally:
        kill_group(gateway.proc)
    return served, unwritten, admission.tenant_keys(world.acme.pk)[5], writer


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_redis_killed_with_the_shipped_settings_loses_no_usage_event_nor_budget(
    engine, tmp_path
):
    server = PrivateRedis(tmp_path, SHIPPED_CONFIG)
    server.start()
    try:
        served, _, budget_key, writer = _crash_under_traffic(engine, server, pause_first=False)
        stored = stored_ids()
        assert served <= stored  # every successful response has its event, once (unique id)
        assert writer.group_recreated == 0  # the AOF brought the consumer group back
        assert not server.client().keys("*unwritten*")

        # With nothing in flight, a tenant's remaining budget is the same after a crash.
        before = int(server.client().get(budget_key))
        server.kill()
        server.start()
        assert int(server.client().get(budget_key)) == before
    finally:
        server.stop()


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_redis_killed_without_persistence_loses_at_most_the_unwritten_events(
    engine, private_redis
):
    served, unwritten, _, writer = _crash_under_traffic(engine, private_redis, pause_first=True)
    lost = served - stored_ids()
    assert lost <= unwritten
    assert writer.group_recreated >= 1  # it recovered by itself
