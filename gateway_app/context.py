"""One request on its way through the gateway: what its usage event records (`Context`), the ASGI
types the stages pass around, and the helpers every stage shares (a header's value, a JSON
answer, running work until the client goes away)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gateway_app.catalog import KeyEntry, TenantEntry
from gateway_app.flow import Slot
from gateway_app.guard import RequestGuard
from gateway_app.metering import Ticket
from gateway_app.proxy import Usage

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"


class ClientDisconnected(Exception):
    pass


@dataclass(slots=True)
class Context:
    """Everything the usage event of one request records, and what the stages hand on to
    settlement (the ticket, the instance counting it in flight, the flow-control slot)."""

    request_id: str
    arrived: float
    started: float
    endpoint: str = "unknown"
    tenant: TenantEntry | None = None
    key: KeyEntry | None = None
    model: str = ""
    adapter: str = ""
    deployment_id: int | None = None
    instance_id: int | None = None
    status: int = 0
    error_code: str = ""
    error_message: str = ""  # what the client was told, without the text it sent
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, served from the engine's prefix cache
    reserved: int = 0
    ttft_ms: float | None = None
    ticket: Ticket | None = None
    counted_on: int | None = None  # the instance whose in-flight set holds this request
    slot: Slot | None = None  # flow control
    complete: bool = False  # the last byte of the response is being sent
    rate_headers: dict[str, str] = field(default_factory=dict)
    guard: RequestGuard | None = None  # the key's guardrails, if it has any
    # The pipeline's stages this request entered, in order, each with when it began; the last
    # one is where a refused or failed request stopped (`pipeline.STAGES`); `ended`: when the
    # pipeline returned or raised.
    stages: list[tuple[str, float]] = field(default_factory=list)
    ended: float = 0.0

    def take_usage(self, usage: Usage) -> None:
        """The engine's counts, as its `usage` reported them."""
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = usage

    def enter(self, stage: str) -> None:
        self.stages.append((stage, time.perf_counter()))

    def event(self) -> dict[str, Any]:
        event: dict[str, Any] = {
            "id": self.request_id,
            "at": self.arrived,
            "tenant": self.tenant.id if self.tenant else None,
            "key": self.key.id if self.key else None,
            "endpoint": self.endpoint,
            "model": self.model,
            "adapter": self.adapter,
            "deployment": self.deployment_id,
            "instance": self.instance_id,
            "status": self.status,
            "error": self.error_code,
            "message": self.error_message,
            "stream": self.stream,
            "prompt": self.prompt_tokens,
            "completion": self.completion_tokens,
            "cached": self.cached_tokens,
            "reserved": self.reserved,
            "ttft_ms": self.ttft_ms,
            "latency_ms": round((time.perf_counter() - self.started) * 1000.0, 3),
            "stages": self._stage_times(),
        }
        if self.guard is not None and self.guard.counts:
            # What guardrails did: counts per direction, action and category, never the text.
            event["guardrails"] = dict(self.guard.counts)
        if self.guard is not None and self.guard.fields:
            # Which detector fired on which field, and what it did; never the value.
            event["guardrail_fields"] = self.guard.fields.records()
        return event


    def _stage_times(self) -> list[tuple[str, float]]:
        """Each stage entered with its milliseconds (until the next began, the last until the
        pipeline ended)."""
        marks = self.stages
        if not marks:
            return []
        ends = [began for _, began in marks[1:]]
        ends.append(self.ended or time.perf_counter())
        return [(name, round((end - began) * 1000.0, 3))
                for (name, began), end in zip(marks, ends, strict=True)]


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def send_json(send: Send, status: int, body: bytes, request_id: str,
                    headers: dict[str, str]) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", JSON), (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", request_id.encode()),
                    *((k.encode(), v.encode()) for k, v in headers.items())],
    })
    await send({"type": "http.response.body", "body": body})


async def until_disconnect(work: Coroutine[Any, Any, None], receive: Receive,
                           ctx: Context) -> None:
    """Run `work`; if the client disconnects first, cancel it (which closes the upstream
    request, and vLLM aborts a request whose connection closes). The watcher cancels this task
    itself (one task per request, not two); a disconnect after the response is complete
    (`ctx.complete`) is not one."""
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not ctx.complete:
                    gone = True
                    current.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await work
    except asyncio.CancelledError:
        if gone:
            current.uncancel()
            raise ClientDisconnected from None
        raise
    finally:
        watcher.cancel()
