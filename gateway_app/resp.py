"""The request path's Redis client: one pipelined connection per worker.

Why not redis-py's asyncio client here: at one request per connection checkout it spent about a
third of a gateway worker's CPU (pool checkout, per-command timeouts, retries, encoders) on the
two scripts each request runs. This client keeps one connection, writes every command as it is
asked for (commands from concurrent requests coalesce into one write per event-loop turn) and
matches the replies in order. RESP is encoded and parsed by hiredis, the C parser redis-py itself
uses; only the connection handling is here. The rest of the project (writer, pub/sub, tests)
uses redis-py.

Failure model: a command that gets no reply within `timeout` fails with `RedisUnavailable`; the
connection is then dropped if nothing at all came back on it meanwhile (a dead peer), and the
next command reconnects. A broken connection fails every command waiting on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import hiredis

CLIENT_NAME = b"llm-console-gateway"
GRACE_SECONDS = 0.05

# A command's word or argument: hiredis sends str as UTF-8 and numbers as their text (anything
# else fails with TypeError).
Arg = str | int | float | bytes

# hiredis's stub types pack_command's argument as a one-element tuple (it takes the whole
# command, any length) and leaves the bytes it returns untyped. The same function, typed.
_pack_command = cast("Callable[[tuple[Arg, ...]], bytes]", hiredis.pack_command)


class RedisUnavailable(Exception):
    """Redis could not be reached, or did not answer within the timeout."""


class RedisReplyError(Exception):
    """Redis answered with an error (a script error, a wrong type)."""


class Script:
    """A Lua script run with EVALSHA, sent in full (EVAL) the first time Redis lacks it."""

    def __init__(self, source: str) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()


class _Protocol(asyncio.Protocol):
    def __init__(self, on_lost: Callable[[_Protocol], None]) -> None:
        self.reader = hiredis.Reader()
        # A reply's shape is its command's (a Lua script's: its table's); callers convert it.
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.received = 0  # replies so far: a timed-out command checks whether the peer is alive
        self.closed = False
        self._on_lost = on_lost
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's (create_connection, create_unix_connection): a Transport.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, data: bytes, future: asyncio.Future[Any]) -> None:
        if self.closed:
            future.set_exception(RedisUnavailable("connection lost"))
            return
        self.waiting.append(future)
        self._out.append(data)
        if len(self._out) == 1:
            asyncio.get_running_loop().call_soon(self._write)

    def _write(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.closed:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            reply = self.reader.gets()
            if reply is False:
                return
            self.received += 1
            future = self.waiting.popleft()
            if future.done():  # timed out or cancelled: its reply is dropped, order is kept
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(RedisReplyError(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        error = RedisUnavailable(f"connection lost: {exc or 'closed by the server'}")
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        self._on_lost(self)

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()


class PipelinedRedis:
    def __init__(self, url: str, timeout: float, name: bytes = CLIENT_NAME) -> None:
        self.timeout = timeout
        self.name = name
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}")
        self._scheme = parts.scheme
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 6379
        self._path = unquote(parts.path) if parts.scheme == "unix" else ""
        query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
        db = query.get("db") or (parts.path.strip("/") if parts.scheme != "unix" else "")
        self._db = int(db or 0)
        self._username = unquote(parts.username) if parts.username else None
        self._password = unquote(parts.password) if parts.password else None
        self._conn: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    # -- commands -----------------------------------------------------------------------------
    async def execute(self, *args: Arg) -> Any:
        conn = self._conn if self._conn is not None else await self._connect()
        return await self._send(conn, _pack_command(args))

    async def run_script(self, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """EVALSHA `script` (EVAL when Redis lost its script cache)."""
        conn = self._conn if self._conn is not None else await self._connect()
        try:
            return await self._send(
                conn, _pack_command((b"EVALSHA", script.sha, len(keys), *keys, *args))
            )
        except RedisReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        # Redis lost its script cache (a restart, SCRIPT FLUSH): EVAL caches it again.
        conn = self._conn if self._conn is not None else await self._connect()
        return await self._send(
            conn, _pack_command((b"EVAL", script.source, len(keys), *keys, *args))
        )

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    # -- connection -----------------------------------------------------------------------------
    async def _send(self, conn: _Protocol, data: bytes) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        seen = conn.received
        conn.send(data, future)
        timer = loop.call_later(self.timeout, self._expire, conn, future, seen)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, conn: _Protocol, future: asyncio.Future[Any], seen: int,
                second_look: bool = False) -> None:
        if future.done():
            return
        if not second_look:
            # After the whole process was held up (a busy or paused host), due timers run
            # before the event loop reads its sockets: the reply may be waiting unread. Judge
            # only after the loop has polled once more.
            asyncio.get_running_loop().call_later(
                GRACE_SECONDS, self._expire, conn, future, seen, True
            )
            return
        future.set_exception(RedisUnavailable(f"no reply from Redis within {self.timeout}s"))
        if conn.received == seen:  # nothing came back at all since: treat the peer as dead
            conn.abort()

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        protocol = _Protocol(self._lost)
        try:
            if self._scheme == "unix":
                opened = loop.create_unix_connection(lambda: protocol, self._path)
            else:
                context = ssl.create_default_context() if self._scheme == "rediss" else None
                opened = loop.create_connection(
                    lambda: protocol, self._host, self._port, ssl=context
                )
            await asyncio.wait_for(opened, self.timeout)
        except (OSError, TimeoutError) as exc:
            raise RedisUnavailable(f"cannot connect to Redis: {exc!r}") from exc
        try:
            if self._password is not None:
                auth = [self._password] if self._username is None else [
                    self._username, self._password]
                await self._send(protocol, _pack_command((b"AUTH", *auth)))
            if self._db:
                await self._send(protocol, _pack_command((b"SELECT", self._db)))
            # So that operators can tell the gateway's connections apart in CLIENT LIST.
            await self._send(protocol, _pack_command((b"CLIENT", b"SETNAME", self.name)))
        except RedisReplyError as exc:
            protocol.abort()
            raise RedisUnavailable(f"Redis refused the connection: {exc}") from exc
        except BaseException:
            protocol.abort()
            raise
        self._conn = protocol
        return protocol

    def _lost(self, conn: _Protocol) -> None:
        if self._conn is conn:
            self._conn = None
