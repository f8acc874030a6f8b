"""The proxied stage: send the request to the instance dispatch chose, retry another where the
engine could not be reached (or answered 503 before doing anything), and relay the answer:
whole, or as a stream of server-sent events, with the public model name, the guardrails' output
checks and the usage the engine reported."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway_app import errors
from gateway_app.config import GatewayConfig
from gateway_app.context import JSON, Context, Send
from gateway_app.dispatch import Dispatched, Dispatcher
from gateway_app.errors import GatewayError
from gateway_app.http1 import Response, UpstreamBroken
from gateway_app.objectives import Stream
from gateway_app.proxy import RETRYABLE, StreamRelay, Upstream, read_usage
from gateway_app.routing import Router
from gateway_app.validation import ParsedRequest, encode_body

log = logging.getLogger(__name__)


class Forwarder:
    def __init__(self, config: GatewayConfig, upstream: Upstream, router: Router,
                 dispatcher: Dispatcher) -> None:
        self.config = config
        self.upstream = upstream
        self.router = router
        self.dispatcher = dispatcher

    async def forward(self, send: Send, ctx: Context, parsed: ParsedRequest,
                      dispatched: Dispatched, priority: int) -> None:
        """`priority`: the tenant's, sent to the deployments that schedule by priority."""
        body = parsed.body
        encoded: dict[bool, bytes] = {}
        tried: set[int] = set()
        while True:
            choice = self.dispatcher.next_choice(ctx, dispatched, tried)
            if choice is None:
                raise GatewayError(
                    503, f"No instance of `{parsed.model}` could be reached; please retry.",
                    code="upstream_unavailable",
                )
            inst, target = choice
            if target.priority not in encoded:
                if target.priority:
                    body["priority"] = priority
                else:
                    body.pop("priority", None)
                encoded[target.priority] = encode_body(body)
            retry_left = len(tried) <= self.config.upstream_retries
            self.router.acquire(inst.id)
            try:
                resp = await self._post(ctx, inst.url + parsed.upstream_path, inst.secret,
                                        encoded[target.priority], inst.id, retry_left)
                if resp is None or (resp.status == 503 and retry_left):
                    if resp is not None:
                        resp.close()
                    continue
                try:
                    await self._relay(send, ctx, parsed, dispatched, resp)
                finally:
                    resp.close(drain=1.0 if ctx.complete else 0.0)
                return
            finally:
                self.router.release(inst.id)

    async def _post(self, ctx: Context, url: str, secret: str, body: bytes, instance_id: int,
                    retry_left: bool) -> Response | None:
        """The engine's response head; None when it could not be reached and another instance
        may be tried."""
        try:
            return await self.upstream.post(url, secret, body, ctx.request_id)
        except (*RETRYABLE, TimeoutError) as exc:
            log.warning("instance %s unreachable: %r", instance_id, exc)
            if retry_left:
                return None
            raise GatewayError(
                502, "The engine could not be reached.", code="upstream_unreachable"
            ) from exc
        except UpstreamBroken as exc:  # it began answering: not safe to send twice
            log.warning("response head from instance %s broke: %r", instance_id, exc)
            raise GatewayError(
                502, "The engine's response ended early.", code="upstream_broken"
            ) from exc

    async def _relay(self, send: Send, ctx: Context, parsed: ParsedRequest,
                     dispatched: Dispatched, resp: Response) -> None:
        base_headers = [(b"x-request-id", ctx.request_id.encode())] + [
            (k.encode(), v.encode()) for k, v in ctx.rate_headers.items()
        ]
        if resp.status != 200 or not parsed.stream:
            await self._whole(send, ctx, parsed, dispatched, resp, base_headers)
        else:
            await self._stream(send, ctx, parsed, dispatched, resp, base_headers)

    async def _whole(self, send: Send, ctx: Context, parsed: ParsedRequest,
                     dispatched: Dispatched, resp: Response,
                     base_headers: list[tuple[bytes, bytes]]) -> None:
        engine_model = parsed.body["model"]
        public_name = dispatched.route.public_name
        try:
            raw = await resp.read()
        except TimeoutError as exc:
            raise GatewayError(
                504, "The engine did not finish in time.", code="upstream_timeout"
            ) from exc
        except UpstreamBroken as exc:
            log.warning("response from instance %s broke: %r", ctx.instance_id, exc)
            raise GatewayError(
                502, "The engine's response ended early.", code="upstream_broken"
            ) from exc
        ctx.status = resp.status
        if resp.status == 200:
            usage = read_usage(raw)
            if usage:
                ctx.take_usage(usage)
            if ctx.guard is not None and ctx.guard.rewrites_output:
                raw = ctx.guard.output_body(ctx.endpoint, raw)
            if engine_model != public_name:
                raw = raw.replace(
                    f'"model":"{engine_model}"'.encode(),
                    f'"model":"{public_name}"'.encode(),
                )
        else:
            ctx.error_code = "upstream_error"
            raw = errors.normalize_upstream_error(resp.status, raw)
            ctx.error_message = errors.message_of(raw)
        await send({
            "type": "http.response.start",
            "status": resp.status,
            "headers": [(b"content-type", JSON), (b"content-length", str(len(raw)).encode()),
                        *base_headers],
        })
        ctx.complete = True
        await send({"type": "http.response.body", "body": raw})

    def _watched(self, ctx: Context, relay: StreamRelay) -> contextlib.AbstractContextManager[None]:
        """The admission controller watches the streams of tenants with latency objectives on
        flow-controlled deployments (`gateway_app/objectives.py`)."""
        watch = self.dispatcher.meter.watch
        tenant = ctx.tenant
        if watch is None or ctx.slot is None or tenant is None or not tenant.has_objective:
            return contextlib.nullcontext()
        stream = Stream(tenant, ctx.started, lambda: relay.first_at, lambda: relay.last_at,
                        lambda: relay.events)
        return watch.watching(ctx.slot.deployment_id, stream)

    async def _stream(self, send: Send, ctx: Context, parsed: ParsedRequest,
                      dispatched: Dispatched, resp: Response,
                      base_headers: list[tuple[bytes, bytes]]) -> None:
        ctx.status = 200
        rewrite = (ctx.guard.stream(ctx.endpoint)
                   if ctx.guard is not None and ctx.guard.rewrites_output else None)
        relay = StreamRelay(send, not parsed.wants_usage, parsed.body["model"],
                            dispatched.route.public_name, rewrite)
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"), *base_headers],
        })
        try:
            with self._watched(ctx, relay):
                await relay.start(resp)
        except asyncio.CancelledError:
            # The client went away: the engine's count if it came, else what was relayed so far
            # (an estimate).
            relay.stop()
            if relay.usage:
                ctx.take_usage(relay.usage)
            else:
                ctx.prompt_tokens = min(ctx.reserved, parsed.prompt_upper)
                ctx.completion_tokens = max(0, relay.events - 1)
            raise
        except Exception as exc:
            log.warning("stream from instance %s broke: %r", ctx.instance_id, exc)
            ctx.status, ctx.error_code = 502, "upstream_stream_broken"
            ctx.error_message = "The engine's stream ended early."
            message = errors.error_body(ctx.error_message, "server_error", None)
            await send({"type": "http.response.body", "body": b"data: " + message + b"\n\n",
                        "more_body": True})
        finally:
            if relay.first_at is not None:
                ctx.ttft_ms = round((relay.first_at - ctx.started) * 1000.0, 3)
        if relay.usage:
            ctx.take_usage(relay.usage)
        ctx.complete = True
        await send({"type": "http.response.body", "body": relay.final + relay.flush()})
