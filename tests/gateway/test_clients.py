"""The gateway's two request-path clients on their own: the pipelined Redis client against the
real Redis (DB 9), and the HTTP/1.1 engine client against small loopback servers that misbehave
on purpose (a server that never answers, one that closes idle connections, one that stops a
response half-way). Those servers are stand-ins for failure modes a real engine shows only by
chance; the real engine path is covered by test_sdk.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest
import redis

from gateway_app.http1 import Pool, UpstreamBroken, UpstreamDisconnected
from gateway_app.resp import (
    PipelinedRedis,
    RedisReplyError,
    RedisUnavailable,
    Script,
)
from tests.gateway.conftest import REDIS_URL


def run(coro):
    return asyncio.run(coro)


# -- Redis ---------------------------------------------------------------------------------------
def test_replies_come_back_in_order_under_concurrency_and_errors_stay_with_their_command():
    async def scenario():
        client = PipelinedRedis(REDIS_URL, 2.0)
        try:
            await client.execute("DEL", "gw:test:n")
            calls = [client.execute("INCR", "gw:test:n") for _ in range(200)]
            calls.insert(100, client.execute("INCR"))  # wrong arity: an error reply
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(results[100], RedisReplyError)
            numbers = [r for i, r in enumerate(results) if i != 100]
            assert numbers == list(range(1, 201))
        finally:
            await client.aclose()

    run(scenario())


def test_script_is_sent_in_full_when_redis_lost_its_cache():
    script = Script("return {tonumber(ARGV[1]) * 2, KEYS[1]}")

    async def scenario():
        client = PipelinedRedis(REDIS_URL, 2.0)
        try:
            await client.execute("SCRIPT", "FLUSH")
            assert await client.run_script(script, ["k"], [21]) == [42, b"k"]
            assert await client.execute("SCRIPT", "EXISTS", script.sha) == [1]
            assert await client.run_script(script, ["k"], [2]) == [4, b"k"]
        finally:
            await client.aclose()

    run(scenario())


def test_a_killed_connection_fails_its_commands_and_the_next_one_reconnects():
    admin = redis.Redis.from_url(REDIS_URL)

    async def scenario():
        name = f"test-{os.getpid()}-{time.monotonic_ns()}"
        client = PipelinedRedis(REDIS_URL, 2.0, name=name.encode())
        try:
            assert await client.execute("PING") == b"PONG"
            mine = [c for c in admin.client_list() if c["name"] == name]
            assert len(mine) == 1
            slow = asyncio.ensure_future(client.execute("BLPOP", "gw:test:never", 5))
            while not any(c["name"] == name and c["cmd"] == "blpop"
                          for c in admin.client_list()):
                await asyncio.sleep(0.01)  # until Redis has the BLPOP in hand
            admin.client_kill(mine[0]["addr"])
            with pytest.raises(RedisUnavailable):
                await slow
            assert await client.execute("PING") == b"PONG"
        finally:
            await client.aclose()
            admin.close()

    run(scenario())


def test_a_redis_that_never_answers_times_out_and_is_dropped():
    accepted = []

    async def scenario():
        server = await asyncio.start_server(
            lambda r, w: accepted.append(w), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        client = PipelinedRedis(f"redis://127.0.0.1:{port}/0", 0.3)
        try:
            started = time.monotonic()
            with pytest.raises(RedisUnavailable):
                await client.execute("PING")  # CLIENT SETNAME gets no answer either
            assert time.monotonic() - started < 2.0
            with pytest.raises(RedisUnavailable):
                await client.execute("PING")
            assert len(accepted) == 2  # the silent connection was dropped, a new one tried
        finally:
            await client.aclose()
            server.close()

    run(scenario())


def test_unreachable_redis_is_reported_quickly():
    async def scenario():
        client = PipelinedRedis("redis://127.0.0.1:1/0", 1.0)
        with pytest.raises(RedisUnavailable):
            await client.execute("PING")

    run(scenario())


# -- HTTP to the engines ---------------------------------------------------------------------
class Server:
    """A loopback HTTP/1.1 server whose answer to each request is `handler(n, writer)`."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests = 0
        self.closed = 0  # connections this server closed after an answer

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        with contextlib.suppress(Exception):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.requests += 1
                if await self.handler(self.requests, writer) == "close":
                    writer.close()
                    self.closed += 1
                    return


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def test_connections_are_kept_alive_and_reused():
    async def handler(n, writer):
        writer.write(ok(b'{"n":%d}' % n))

    async def scenario():
        async with Server(handler) as server:
            pool = Pool(1.0, 5.0)
            for i in range(1, 6):
                resp = await pool.post(server.url + "/v1/completions", b"", b"{}")
                assert resp.status == 200 and await resp.read() == b'{"n":%d}' % i
                resp.close()
            assert server.connections == 1
            pool.close()

    run(scenario())


def test_chunked_stream_is_relayed_chunk_by_chunk():
    """The server sends its second chunk only after the client has read the first: a client that
    waited for the whole body would never get it (and the server would give up waiting)."""

    async def scenario():
        first_read = asyncio.Event()
        waited_out = []

        async def handler(n, writer):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for i, part in enumerate((b"data: 1\n\n", b"data: 2\n\n")):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                if n == 1 and i == 0:
                    try:
                        await asyncio.wait_for(first_read.wait(), 5.0)
                    except TimeoutError:
                        waited_out.append(True)
            writer.write(b"0\r\n\r\n")

        async with Server(handler) as server:
            pool = Pool(1.0, 10.0)
            resp = await pool.post(server.url + "/x", b"", b"{}")
            seen = []
            async for chunk in resp.chunks():
                seen.append(chunk)
                first_read.set()
            assert seen == [b"data: 1\n\n", b"data: 2\n\n"]
            assert waited_out == []  # the first chunk arrived before the server was done
            resp.close()
            resp = await pool.post(server.url + "/x", b"", b"{}")  # same connection again
            await resp.read()
            resp.close()
            assert server.connections == 1
            pool.close()

    run(scenario())


def test_an_idle_connection_the_engine_closed_is_replaced_without_an_error():
    async def handler(n, writer):
        writer.write(ok(b"{}"))
        await writer.drain()
        return "close" if n == 1 else None  # like a keep-alive timeout on the engine's side

    async def scenario():
        async with Server(handler) as server:
            pool = Pool(1.0, 5.0)
            for _ in range(3):
                resp = await pool.post(server.url + "/x", b"", b"{}")
                assert resp.status == 200
                await resp.read()
                resp.close()
                while server.closed < min(server.requests, 1):
                    await asyncio.sleep(0.01)  # until the engine side has closed the first
            assert server.requests == 3 and server.connections == 2
            pool.close()

    run(scenario())


def test_refused_silent_and_broken_engines_fail_with_the_documented_errors():
    async def silent(n, writer):
        await asyncio.sleep(10)

    async def broken(n, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial\"")
        await writer.drain()
        return "close"

    async def hang_up(n, writer):
        return "close"

    async def half_head(n, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-")
        await writer.drain()
        return "close"

    async def scenario():
        pool = Pool(0.5, 0.5)
        with pytest.raises(OSError):
            await pool.post("http://127.0.0.1:1/x", b"", b"{}")
        async with Server(silent) as server:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await pool.post(server.url + "/x", b"", b"{}")
            assert time.monotonic() - started < 2.0
        async with Server(hang_up) as server:
            with pytest.raises(UpstreamDisconnected):
                await pool.post(server.url + "/x", b"", b"{}")
        async with Server(half_head) as server:
            with pytest.raises(UpstreamBroken):  # it began answering: not retried
                await pool.post(server.url + "/x", b"", b"{}")
        async with Server(broken) as server:
            resp = await pool.post(server.url + "/x", b"", b"{}")
            with pytest.raises(UpstreamBroken):
                await resp.read()
            resp.close()
        pool.close()

    run(scenario())


def test_closing_a_response_half_way_closes_the_connection_so_the_engine_stops():
    closed = asyncio.Event

    async def scenario():
        gone = closed()

        async def endless(n, writer):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            try:
                for _ in range(100):
                    writer.write(b"6\r\ndata:\n\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.05)
            except ConnectionError:
                pass
            gone.set()
            return "close"

        async with Server(endless) as server:
            pool = Pool(1.0, 10.0)
            resp = await pool.post(server.url + "/x", b"", b"{}")
            async for _chunk in resp.chunks():
                break
            resp.close()
            await asyncio.wait_for(gone.wait(), 3.0)
            pool.close()

    run(scenario())


def test_a_stream_closed_at_its_last_event_keeps_the_connection_once_the_end_arrives():
    async def handler(n, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"e\r\ndata: [DONE]\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")

    async def scenario():
        async with Server(handler) as server:
            pool = Pool(1.0, 5.0)
            resp = await pool.post(server.url + "/x", b"", b"{}")
            async for chunk in resp.chunks():
                assert chunk.endswith(b"data: [DONE]\n\n")
                break
            resp.close(drain=1.0)
            while not any(pool._idle.values()):
                await asyncio.sleep(0.01)  # until the chunked end arrived and freed it
            resp = await pool.post(server.url + "/x", b"", b"{}")
            await resp.read()
            resp.close()
            assert server.connections == 1
            pool.close()

    run(scenario())
