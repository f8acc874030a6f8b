"""The upstream side: one connection pool per worker (`http1.Pool`), and the stream relay that
passes an engine's stream on to the client, reading the engine's usage out of it (and stripping
it when the client did not ask for it)."""

from __future__ import annotations

import asyncio
import json
import time
import types
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

from django.conf import settings

from gateway_app.config import GatewayConfig
from gateway_app.http1 import Pool, Response
from serving_app import pki

# Failures before the engine answered, which are safe to retry on another instance: refused,
# unreachable, closed before answering (`http1.UpstreamDisconnected`), and timeouts.
RETRYABLE = (OSError,)


class Upstream:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.pool: Pool | None = None

    async def start(self) -> None:
        # Engines answer only a caller with the console's certificate (docs/security.md).
        context = pki.shared_client_context() if settings.ENGINE_TLS else None
        self.pool = Pool(self.config.connect_timeout, self.config.upstream_timeout, context)

    async def stop(self) -> None:
        if self.pool is not None:
            self.pool.close()

    async def post(self, url: str, secret: str, body: bytes, request_id: str) -> Response:
        """Send the request; returns once the response headers are in."""
        assert self.pool is not None
        headers = (
            f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id}\r\n"
        ).encode("latin-1")
        return await self.pool.post(url, headers, body)

    async def tokenize(self, base_url: str, secret: str, payload: dict[str, Any]) -> int:
        """The engine's exact prompt token count (its /tokenize endpoint: no generation)."""
        assert self.pool is not None
        headers = f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
        resp = await self.pool.post(
            base_url + "/tokenize", headers.encode("latin-1"), json.dumps(payload).encode()
        )
        try:
            raw = await resp.read()
        finally:
            resp.close()
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if resp.status != 200 or not isinstance(data, dict) or "count" not in data:
            raise ValueError(f"tokenize answered {resp.status}")
        return int(data["count"])


_DECODER = json.JSONDecoder()


class Usage(NamedTuple):
    """The engine's token counts for one request; `cached`: prompt tokens served from the
    prefix cache (`prompt_tokens_details.cached_tokens`, which engines report when started with
    `--enable-prompt-tokens-details`), part of `prompt`."""

    prompt: int
    completion: int
    cached: int = 0

    @classmethod
    def of(cls, usage: dict[str, Any]) -> Usage:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        prompt = int(usage.get("prompt_tokens") or 0)
        return cls(prompt, int(usage.get("completion_tokens") or 0),
                   min(prompt, max(0, int(cached or 0))))


def read_usage(body: bytes) -> Usage | None:
    """The engine's token counts from a completion body. Only the `usage` object is decoded
    (the last `"usage":` in the body: inside a JSON string its quotes would be escaped)."""
    at = body.rfind(b'"usage":')
    if at < 0:
        return None
    try:
        usage, _ = _DECODER.raw_decode(body[at + 8 :].decode("utf-8", "replace").lstrip())
    except ValueError:
        return None
    if not isinstance(usage, dict):
        return None
    return Usage.of(usage)


DONE = b"data: [DONE]\n\n"


class StreamRelay:
    """Relays an engine's SSE stream to the client as it arrives, as an `http1.Sink`.

    What one read brought goes out in one write, from the upstream connection's callback (no
    task, future or generator step per chunk). Its bytes are only cut where the last whole
    event ends (a partial event waits for its end), and rewritten only where they must be: the
    engine's model name (an adapter's tenant-qualified name) is replaced by the public one the
    client used, and the event that carries `usage` (the gateway always asks for it:
    `include_usage`) is the only one parsed; it is dropped, or its `usage` removed, when the
    client did not ask for usage. Under a guardrail policy, `rewrite` (`guard.StreamGuard`)
    redacts each whole event's text first.

    Backpressure: the write is the ASGI server's `send`, run to completion on the spot when it
    can write at once. When it cannot (the client reads slowly and the server's buffer is full),
    reading from the engine pauses and the rest of that `send` goes on in a task; reading
    resumes once it has written. So at most one read's bytes wait in the gateway per stream.

    `done` is resolved at the stream's end: `[DONE]` relayed up to it (the final bytes are left
    in `final` for the caller to send as the response's last body), the engine's end of
    message, or with the error that broke the stream.
    """

    def __init__(self, send: Any, strip_usage: bool, engine_model: str, public_model: str,
                 rewrite: Callable[[bytes], bytes] | None = None) -> None:
        self.send = send
        self._rewrite = rewrite  # guardrails' output redaction of whole events, if any
        self.strip_usage = strip_usage
        self.pending = b""
        self.usage: Usage | None = None
        self.events = 0  # events relayed (an estimate of tokens if the engine's usage never came)
        self.first_at: float | None = None  # when the first body bytes arrived
        self.last_at: float | None = None  # when the last events were relayed
        self.final = b""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._from = f'"model":"{engine_model}"'.encode()
        self._to = f'"model":"{public_model}"'.encode()
        self._rename = engine_model != public_model
        self._response: Response | None = None
        self._writing: asyncio.Task[None] | None = None
        self._backlog: list[bytes] = []
        self._ending: list[BaseException | None] = []

    def start(self, response: Response) -> asyncio.Future[None]:
        self._response = response
        response.stream_to(self)
        return self.done

    def stop(self) -> None:
        """The request is over (the client left): deliver nothing more."""
        if self._response is not None:
            self._response.stream_to(None)
        if self._writing is not None:
            self._writing.cancel()

    # -- the cutting and rewriting ---------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        """The whole events that `chunk` completes, rewritten where they must be."""
        data = self.pending + chunk if self.pending else chunk
        if data.endswith(b"\n\n"):  # the usual case: the engine writes whole events
            complete, self.pending = data, b""
        else:
            cut = data.rfind(b"\n\n")
            if cut < 0:
                self.pending = data
                return b""
            complete, self.pending = data[: cut + 2], data[cut + 2 :]
        if self._rewrite is not None:
            complete = self._rewrite(complete)
        if b'"usage":{' in complete or b'"usage": {' in complete:
            complete = self._take_usage(complete)
        if self._rename:
            complete = complete.replace(self._from, self._to)
        return complete

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest

    def _take_usage(self, complete: bytes) -> bytes:
        """Read the usage from the events that carry it (the other events are not parsed), and
        drop or trim them when the client did not ask for usage."""
        kept: list[bytes] = []
        start = 0
        while True:
            at = complete.find(b'"usage":', start)
            if at < 0:
                break
            newline = complete.rfind(b"\n\n", start, at)
            begin = newline + 2 if newline >= 0 else start
            end = complete.find(b"\n\n", at) + 2
            event = complete[begin : end - 2]
            kept.append(complete[start:begin])
            kept.append(self._usage_event(event))
            start = end
        if self.strip_usage:
            kept.append(complete[start:])
            return b"".join(kept)
        return complete

    def _usage_event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event + b"\n\n"
        try:
            data = json.loads(event[6:])
        except ValueError:
            data = None
        usage = data.get("usage") if isinstance(data, dict) else None
        if not isinstance(usage, dict):
            return event + b"\n\n"
        self.usage = Usage.of(usage)
        if not self.strip_usage:
            return event + b"\n\n"
        if not data.get("choices"):
            return b""  # the usage-only event the client did not ask for
        data.pop("usage", None)
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    # -- the sink: called from the engine connection's callbacks ---------------------------------
    def data(self, data: bytes) -> None:
        if self.done.done():
            return
        if self.first_at is None:
            self.first_at = time.perf_counter()
        out = self.feed(data)
        if not out:
            return
        self.events += out.count(b"\n\ndata: ") + 1
        self.last_at = time.perf_counter()
        if out.endswith(DONE):
            # Complete: the caller answers now rather than at the engine's end of message.
            self.final = out
            assert self._response is not None
            self._response.stream_to(None)
            self.end(None)
            return
        self._write(out)

    def end(self, error: BaseException | None) -> None:
        if self._writing is not None:  # the end waits for what is being written
            self._ending.append(error)
            return
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)

    def _write(self, out: bytes) -> None:
        if self._writing is not None:
            self._backlog.append(out)
            return
        sending = self.send({"type": "http.response.body", "body": out, "more_body": True})
        try:
            waiting = sending.send(None)
        except StopIteration:
            return  # written
        except Exception as exc:
            self.end(exc)
            return
        # The client's connection is full: stop reading the engine until this write is done.
        assert self._response is not None
        self._response.pause_reading()
        self._writing = asyncio.ensure_future(_go_on(sending, waiting))
        self._writing.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[None]) -> None:
        self._writing = None
        error = None if task.cancelled() else task.exception()
        if task.cancelled() or self.done.done():
            return
        if error is not None:
            self.end(error)
            return
        backlog, self._backlog = self._backlog, []
        if backlog:
            self._write(b"".join(backlog))
            if self._writing is not None:
                return
        if self._response is not None:  # also at the end: the engine's end of message is
            self._response.resume_reading()  # still read, so that its connection is kept
        if self._ending:
            self.end(self._ending[0])


@types.coroutine
def _carry_on(coroutine: Any, waiting: Any) -> Generator[Any, Any, None]:
    """Go on with `coroutine`, begun outside any task and suspended on `waiting` (what it
    yielded): the rest of that `await`, for a task to run."""
    while True:
        try:
            value = yield waiting
        except BaseException as exc:
            try:
                waiting = coroutine.throw(exc)
            except StopIteration:
                return
        else:
            try:
                waiting = coroutine.send(value)
            except StopIteration:
                return


async def _go_on(coroutine: Any, waiting: Any) -> None:
    await _carry_on(coroutine, waiting)
