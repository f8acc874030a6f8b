"""The gateway's HTTP/1.1 client to the engines: keep-alive connections per engine, one request
in flight per connection, bodies relayed as they arrive.

Why not aiohttp's client here: per request it cost the gateway worker about a fifth of its CPU
(request and response objects, URL handling, timers, header multidicts) for what is always the
same request shape to the same few local engines. Responses are parsed by httptools (llhttp,
the parser uvicorn serves with), which also undoes chunked transfer encoding; only the
connection handling is here.

Bodies are read in one of two ways. `read()`/`chunks()` wake the calling task as bytes arrive
(a whole response, or a test). `stream_to(sink)` hands every read's body bytes, all of them in
one call, to `sink.data()` from the connection's own callback: a relayed stream then costs no
task wake-up, future or generator step per chunk, only the read, the sink's work and its write.
The sink stops the flow with `pause_reading()` while it cannot write (a slow client); the kernel
then holds the engine back.

Errors: `OSError` (refused, unreachable, `UpstreamDisconnected` when the engine closed the
connection before answering) and `TimeoutError` happen before any byte of the response and are
safe to retry elsewhere; `UpstreamBroken` is a response that stopped part-way.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

MAX_IDLE_PER_ENGINE = 256
# Idle connections older than this are not reused: the engine (uvicorn) closes them after 5 s,
# and one taken just as it does so would cost a retry.
IDLE_SECONDS = 4.0
READ_HIGH_WATER = 256 * 1024  # body bytes buffered for a reader before reading the engine pauses

# An engine's connections: (scheme, host, port).
EngineKey = tuple[str, str, int]


class Sink(Protocol):
    """Where `Response.stream_to` delivers a body: `data` once per read (never empty), then
    `end` once, with the error that stopped the response or None at its end."""

    def data(self, data: bytes) -> None: ...

    def end(self, error: BaseException | None) -> None: ...


class UpstreamDisconnected(ConnectionError):
    """The engine closed the connection before its response began."""


class UpstreamBroken(Exception):
    """The engine's response stopped before its end (connection lost, bad framing)."""


class Response:
    """One response: `status` and `headers` are set when it is returned; the body is read with
    `read()` or `chunks()`. `close()` hands a fully read connection back for reuse and aborts
    one still in the middle of a response (which is how the engine learns to stop)."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_size", "_waiter", "_done", "_error",
                 "_head", "_timer", "_keep_alive", "_draining", "_sink")

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._conn: _Connection | None = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._done = False
        self._error: BaseException | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._keep_alive = False
        self._draining = False
        self._sink: Sink | None = None

    # -- what the caller uses -------------------------------------------------------------------
    async def read(self) -> bytes:
        parts: list[bytes] = []
        async for chunk in self.chunks():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._size = 0
                if self._conn is not None:
                    self._conn.resume()
                yield data
                continue
            if self._error is not None:
                raise self._error
            if self._done:
                return
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def stream_to(self, sink: Sink | None) -> None:
        """Deliver the body to `sink` from now on, starting with what is buffered already;
        `None` stops delivery (the caller has what it needs: see `close(drain=...)`)."""
        self._sink = sink
        if sink is None:
            return
        if self._conn is not None:
            self._conn.resume()  # a reader that came late may have paused it
        self._deliver()
        if self._sink is not sink:  # it had all it needed
            return
        if self._error is not None:
            sink.end(self._error)
        elif self._done:
            sink.end(None)

    def pause_reading(self) -> None:
        """Stop reading from the engine (the sink cannot pass more on for now)."""
        if self._conn is not None:
            self._conn.pause()

    def resume_reading(self) -> None:
        if self._conn is not None:
            self._conn.resume()

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def close(self, drain: float = 0.0) -> None:
        """Done with the response. `drain`: the caller has all it needs (a stream's `[DONE]`)
        but the engine's end of message may still be on its way; wait up to that many seconds
        for it in the background, then keep the connection, rather than abort it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self._conn
        if conn is None:
            return
        if self._done and self._error is None and self._keep_alive:
            self._conn = None
            conn.release()
        elif drain and self._head.done() and self._error is None and not self._done:
            self._draining = True
            self._chunks.clear()
            self._timer = asyncio.get_running_loop().call_later(drain, _expire, self)
        else:
            self._conn = None
            conn.abort()

    # -- what the connection calls -----------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _got_head(self, status: int) -> None:
        self.status = status
        if not self._head.done():
            self._head.set_result(None)

    def _feed(self, data: bytes) -> None:
        if self._draining:
            return
        self._chunks.append(data)
        if self._sink is not None:
            return  # delivered once the whole read is parsed (`_deliver`)
        self._size += len(data)
        if self._size > READ_HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _deliver(self) -> None:
        """Everything one read brought, to the sink in one call."""
        chunks = self._chunks
        if chunks and self._sink is not None:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._size = 0
            self._sink.data(data)

    def _finish(self, keep_alive: bool) -> None:
        self._done = True
        self._keep_alive = keep_alive
        if self._draining:
            self._draining = False
            self.close()
            return
        if self._sink is not None:
            self._deliver()
            if self._sink is not None:
                self._sink.end(None)
            return
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._done:
            return
        if not self._head.done():
            self._head.set_exception(error)
            return
        self._error = error
        if self._sink is not None:
            self._sink.end(error)
            return
        self._wake()


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool, key: EngineKey) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.received_any = False
        self._paused = False

    # -- asyncio --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's (create_connection): a Transport.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing was asked: the engine is not speaking HTTP to us
            self.abort()
            return
        self.received_any = True
        response = self.response
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(UpstreamBroken(f"bad response from the engine: {exc}"))
            self.abort()
            return
        if response._sink is not None:
            response._deliver()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        response, self.response = self.response, None
        if response is None:
            return
        if not response._head.done():
            reason = f"the engine closed the connection ({exc or 'EOF'})"
            response._fail(
                UpstreamDisconnected(reason) if not self.received_any else UpstreamBroken(reason)
            )
        else:
            response._fail(UpstreamBroken(f"the engine's response stopped ({exc or 'EOF'})"))

    # -- httptools callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response._got_head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        if response is not None:
            response._finish(self.parser.should_keep_alive())

    # -- the pool's side ----------------------------------------------------------------------
    def start(self, request: bytes) -> Response:
        response = Response(self)
        self.response = response
        self.received_any = False
        assert self.transport is not None
        self.transport.write(request)
        return response

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def release(self) -> None:
        if self.closed or self.response is not None:
            self.abort()
            return
        self.resume()
        self.pool.put_back(self)

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def close(self) -> None:
        """An idle connection, closed politely (FIN rather than RST)."""
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class Pool:
    """Idle keep-alive connections per engine (`scheme://host:port`), most recent first."""

    def __init__(self, connect_timeout: float, timeout: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """`ssl_context`: what `https://` engines are called with (the gateway's: the console
        CA and its client certificate, `serving_app.pki`); one context for every connection,
        so a TLS handshake happens only when a connection opens, never per request."""
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self._idle: dict[EngineKey, deque[_Connection]] = {}
        self._targets: dict[str, tuple[EngineKey, bytes, bytes]] = {}
        self._ssl = ssl_context

    async def post(self, url: str, headers: bytes, body: bytes) -> Response:
        """Send `POST url` with `headers` (already encoded `Name: value\\r\\n` lines); returns
        once the response's status and headers are in (within `timeout` of the call)."""
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) > 10_000:  # instances come and go: keep the cache bounded
                self._targets.clear()
            target = self._targets[url] = _split(url)
        key, path, host_header = target
        request = b"".join((
            b"POST ", path, b" HTTP/1.1\r\nHost: ", host_header, b"\r\n", headers,
            b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body,
        ))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        for _attempt in range(2):
            conn = self._take(key)
            if conn is None:
                conn = await self._open(key)
            response = conn.start(request)
            response._timer = loop.call_at(deadline, _expire, response)
            try:
                await response._head
            except UpstreamDisconnected:
                response.close()
                if conn.reused:  # the engine closed an idle connection as we used it
                    continue
                raise
            except BaseException:
                response.close()
                raise
            return response
        raise UpstreamDisconnected("the engine closed the connection twice")

    def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()

    # -- connections ----------------------------------------------------------------------------
    def _take(self, key: EngineKey) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        too_old = asyncio.get_running_loop().time() - IDLE_SECONDS
        while idle and idle[0].idle_since < too_old:  # the oldest are at the left
            idle.popleft().close()
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    async def _open(self, key: EngineKey) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        conn = _Connection(self, key)
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        await asyncio.wait_for(
            loop.create_connection(lambda: conn, host, port, ssl=context), self.connect_timeout
        )
        return conn

    def put_back(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, deque())
        if len(idle) >= MAX_IDLE_PER_ENGINE:
            conn.abort()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)


def _expire(response: Response) -> None:
    response._fail(TimeoutError("the engine did not answer in time"))
    conn, response._conn = response._conn, None
    if conn is not None:
        conn.abort()


def _split(url: str) -> tuple[EngineKey, bytes, bytes]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an engine URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.scheme, parts.hostname, port), path.encode(), parts.netloc.encode()
