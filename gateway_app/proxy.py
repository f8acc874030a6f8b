"""The upstream side: one connection pool per worker (`http1.Pool`), and the stream relay that
reads the engine's usage out of a stream (and strips it when the client did not ask for it)."""

from __future__ import annotations

import json
from typing import Any

from gateway_app.config import GatewayConfig
from gateway_app.http1 import Pool, Response

# Failures before the engine answered, which are safe to retry on another instance: refused,
# unreachable, closed before answering (`http1.UpstreamDisconnected`), and timeouts.
RETRYABLE = (OSError,)


class Upstream:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.pool: Pool | None = None

    async def start(self) -> None:
        self.pool = Pool(self.config.connect_timeout, self.config.upstream_timeout)

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


def read_usage(body: bytes) -> tuple[int, int] | None:
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
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


class StreamRelay:
    """Cuts the upstream byte stream into whole SSE events and forwards them as they complete.

    The gateway always asks the engine for usage (`include_usage`); the final usage-only event
    is dropped when the client did not ask for it. The engine's model name (an adapter's
    tenant-qualified name) is replaced by the public one the client used.
    """

    def __init__(self, strip_usage: bool, engine_model: str, public_model: str) -> None:
        self.strip_usage = strip_usage
        self.pending = b""
        self.usage: tuple[int, int] | None = None
        self._from = f'"model":"{engine_model}"'.encode()
        self._to = f'"model":"{public_model}"'.encode()
        self._rename = engine_model != public_model

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk if self.pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            return b""
        complete, self.pending = data[: cut + 2], data[cut + 2 :]
        if b'"usage":{' in complete or b'"usage": {' in complete:
            complete = self._take_usage(complete)
        if self._rename:
            complete = complete.replace(self._from, self._to)
        return complete

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest

    def _take_usage(self, complete: bytes) -> bytes:
        kept = []
        for event in complete.split(b"\n\n"):
            if not event:
                continue
            if b'"usage"' in event and event.startswith(b"data: {"):
                try:
                    data = json.loads(event[6:])
                except ValueError:
                    data = None
                usage = data.get("usage") if isinstance(data, dict) else None
                if isinstance(usage, dict):
                    self.usage = (
                        int(usage.get("prompt_tokens") or 0),
                        int(usage.get("completion_tokens") or 0),
                    )
                    if self.strip_usage:
                        if not data.get("choices"):
                            continue  # the usage-only event the client did not ask for
                        data.pop("usage", None)
                        event = b"data: " + json.dumps(data, separators=(",", ":")).encode()
            kept.append(event + b"\n\n")
        return b"".join(kept)
