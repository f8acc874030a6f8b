"""The gateway's ASGI app: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

A raw ASGI app (no framework in the request path). One instance per worker process holds the
caches, the Redis client and the shared upstream session; they start on the ASGI lifespan
startup or, where the server sends none, on the first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gateway_app import admission, errors
from gateway_app.cache import GatewayCache
from gateway_app.catalog import GuardTarget, KeyEntry, Route, Snapshot, TenantEntry
from gateway_app.config import GatewayConfig
from gateway_app.errors import GatewayError
from gateway_app.flow import Slot
from gateway_app.guard import RequestGuard, refusal
from gateway_app.http1 import UpstreamBroken
from gateway_app.metering import Meter, RedisUnavailable, Ticket
from gateway_app.proxy import RETRYABLE, StreamRelay, Upstream, read_usage
from gateway_app.routing import Router
from gateway_app.validation import ParsedRequest, encode_body, parse_request
from guardrails_app import classifier
from guardrails_app.policy import Classifier
from serving_app import lifecycle
from tenants_app.models import KEY_PREFIX

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions"}
JSON = b"application/json"
# A request for a deployment scaled to zero: how often one worker re-sends the wake, and how
# often the held request looks for a ready instance.
WAKE_RESEND_SECONDS = 5.0
WAKE_POLL_SECONDS = 0.25


class ClientDisconnected(Exception):
    pass


@dataclass(slots=True)
class Context:
    """Everything the usage event of one request records."""

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
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reserved: int = 0
    ttft_ms: float | None = None
    ticket: Ticket | None = None
    counted_on: int | None = None  # the instance whose in-flight set holds this request
    slot: Slot | None = None  # flow control
    complete: bool = False  # the last byte of the response is being sent
    rate_headers: dict[str, str] = field(default_factory=dict)
    guard: RequestGuard | None = None  # the key's guardrails, if it has any

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
            "stream": self.stream,
            "prompt": self.prompt_tokens,
            "completion": self.completion_tokens,
            "reserved": self.reserved,
            "ttft_ms": self.ttft_ms,
            "latency_ms": round((time.perf_counter() - self.started) * 1000.0, 3),
        }
        if self.guard is not None and self.guard.counts:
            # What guardrails did: counts per direction, action and category, never the text.
            event["guardrails"] = dict(self.guard.counts)
        return event


class GatewayApp:
    def __init__(self) -> None:
        self.config: GatewayConfig | None = None
        self.cache: GatewayCache | None = None
        self.meter: Meter | None = None
        self.upstream: Upstream | None = None
        self.router = Router()
        self._started = False
        self._pid = os.getpid()
        self._woken: dict[int, float] = {}  # deployment id -> when this worker last asked

    # -- scale to zero ------------------------------------------------------------------------
    def _wakeable(self, route: Route) -> list[int]:
        assert self.cache
        wakeable = self.cache.snapshot.wakeable
        return sorted({t.deployment_id for t in route.targets if t.deployment_id in wakeable})

    async def _wake(self, route: Route) -> list:
        """A deployment its autoscaler may have scaled to zero: ask the control worker to bring
        it back (at most once every few seconds per deployment from this worker; the control
        worker's wake is idempotent) and hold the request until an instance is ready, at most
        the wake timeout. Returns the ready candidates, none if the timeout passed."""
        assert self.cache and self.config
        now = time.monotonic()
        for deployment_id in self._wakeable(route):
            if now - self._woken.get(deployment_id, -WAKE_RESEND_SECONDS) >= WAKE_RESEND_SECONDS:
                self._woken[deployment_id] = now
                try:
                    await asyncio.to_thread(lifecycle.wake_deployment, deployment_id)
                except Exception:  # noqa: BLE001 - the broker is down: answer as without
                    log.warning("could not ask for deployment %s to wake", deployment_id,
                                exc_info=True)
                    return []
        deadline = now + self.config.wake_timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(WAKE_POLL_SECONDS)
            # Readiness is announced through the invalidation channel; the re-read is a backstop.
            await self.cache.refresh_if_older(1.0)
            candidates = self.router.candidates(self.cache.snapshot, route)
            if candidates:
                return candidates
        return []

    # -- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)

    async def lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        if self._started:
            return
        self._started = True
        self.config = GatewayConfig.from_settings()
        self.cache = GatewayCache(self.config)
        self.meter = Meter(self.config)
        self.upstream = Upstream(self.config)
        await self.upstream.start()
        self.cache.start()
        self.meter.start()
        if self.meter.flow is not None:
            cache = self.cache
            self.meter.flow.instances_of = lambda d: cache.snapshot.instances.get(d, ())

    async def shutdown(self) -> None:
        if not self._started:
            return
        self._started = False
        assert self.cache and self.meter and self.upstream
        await self.cache.stop()
        await self.meter.stop()
        await self.upstream.stop()

    # -- requests ---------------------------------------------------------------------------
    async def handle(self, scope: dict, receive, send) -> None:
        if not self._started:
            await self.startup()
        ctx = Context(os.urandom(12).hex(), time.time(), time.perf_counter())
        ctx.request_id = "req-" + ctx.request_id
        method = scope["method"]
        path = scope["path"]
        try:
            endpoint = ENDPOINTS.get(path)
            if endpoint is not None:
                ctx.endpoint = endpoint
                if method != "POST":
                    raise GatewayError(405, f"Method {method} not allowed on {path}; use POST.")
                await self.completion(scope, receive, send, ctx)
            elif path == "/v1/models" or path.startswith("/v1/models/"):
                ctx.endpoint = "models"
                if method != "GET":
                    raise GatewayError(405, f"Method {method} not allowed on {path}; use GET.")
                await self.models(scope, send, ctx, path[len("/v1/models/") :])
            else:
                raise GatewayError(404, f"Invalid URL ({method} {path})")
        except GatewayError as err:
            ctx.status = err.status
            ctx.error_code = err.code or err.error_type
            await self._send_error(send, ctx, err)
        except ClientDisconnected:
            ctx.status = 499
            ctx.error_code = "client_disconnected"
        except Exception:
            log.exception("gateway request %s failed", ctx.request_id)
            ctx.status = 500
            ctx.error_code = "internal_error"
            with contextlib.suppress(Exception):
                await self._send_error(
                    send, ctx, GatewayError(500, "The gateway failed to handle the request.")
                )
        finally:
            assert self.meter is not None
            actual = ctx.prompt_tokens + ctx.completion_tokens
            await self.meter.settle(ctx.ticket, actual, ctx.event(), ctx.counted_on,
                                    ctx.slot)

    async def _send_error(self, send, ctx: Context, err: GatewayError) -> None:
        headers = {**ctx.rate_headers, **err.headers}
        await _send_json(send, err.status, err.body(), ctx.request_id, headers)

    async def _authenticate(self, scope: dict, ctx: Context) -> tuple[KeyEntry, TenantEntry]:
        assert self.cache is not None
        auth = _header(scope, b"authorization")
        if not auth or not auth[:7].lower() == "bearer ":
            raise GatewayError(
                401,
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        secret = auth[7:].strip()
        if not secret.startswith(KEY_PREFIX):
            raise _bad_key(secret)
        if not await self.cache.ready():
            raise GatewayError(503, "The gateway is starting; please retry.", code="unavailable")
        try:
            entry = await self.cache.key(secret)
        except Exception as exc:  # the database is down and this key was never seen
            log.warning("key lookup failed: %s", exc)
            raise GatewayError(
                503, "Keys cannot be checked right now; please retry.", code="unavailable"
            ) from exc
        if entry.id is None or (entry.expires_at is not None and entry.expires_at <= time.time()):
            raise _bad_key(secret)
        tenant = self.cache.snapshot.tenants.get(entry.tenant_id or 0)
        if tenant is None or not tenant.active:
            raise GatewayError(
                401, "This API key's tenant is suspended.", code="account_deactivated"
            )
        ctx.key, ctx.tenant = entry, tenant
        return entry, tenant

    def _catalog(self, key: KeyEntry, tenant: TenantEntry) -> dict[str, Route]:
        assert self.cache is not None
        routes = self.cache.snapshot.routes.get(tenant.id, {})
        if key.allowed:
            return {name: r for name, r in routes.items() if name in key.allowed}
        return routes

    async def models(self, scope: dict, send, ctx: Context, one: str) -> None:
        key, tenant = await self._authenticate(scope, ctx)
        routes = self._catalog(key, tenant)
        if one:
            ctx.model = one
            route = routes.get(one)
            if route is None:
                raise errors.model_not_found(one)
            body = json.dumps(_model_card(route)).encode()
        else:
            data = [_model_card(r) for r in sorted(routes.values(), key=lambda r: r.public_name)]
            body = json.dumps({"object": "list", "data": data}).encode()
        ctx.status = 200
        await _send_json(send, 200, body, ctx.request_id, {})

    async def completion(self, scope: dict, receive, send, ctx: Context) -> None:
        assert self.cache and self.meter and self.config
        key, tenant = await self._authenticate(scope, ctx)
        raw = await _read_body(scope, receive, self.config.max_body_bytes)
        parsed = parse_request(ctx.endpoint, raw)
        ctx.model = parsed.model
        ctx.stream = parsed.stream
        route = self._catalog(key, tenant).get(parsed.model)
        if route is None and await self.cache.refresh_if_older():
            route = self._catalog(key, tenant).get(parsed.model)
        if route is None:
            raise errors.model_not_found(parsed.model)
        entry = self.cache.snapshot.guard_for(tenant.id, key.id)
        if entry is not None:
            # Before admission and before any engine call (the tokenizer's included): a blocked
            # prompt answers 400 here, a redacted one goes on with placeholders.
            ctx.guard = RequestGuard(entry)
            if parsed.stream:
                ctx.guard.check_stream()
            ctx.guard.input(ctx.endpoint, parsed.body)
            if entry.guard.policy.classifier is not None:
                await self._classify(ctx, parsed, entry.guard.policy.classifier)
        candidates = self.router.candidates(self.cache.snapshot, route)
        if not candidates and await self.cache.refresh_if_older():
            route = self._catalog(key, tenant).get(parsed.model) or route
            candidates = self.router.candidates(self.cache.snapshot, route)
        target0 = route.targets[0]
        ctx.adapter = target0.adapter
        ctx.deployment_id = target0.deployment_id
        if not candidates and self._wakeable(route):
            candidates = await self._wake(route)
        flow = self.meter.flow if target0.flow else None
        if flow is not None:
            # Flow control is per deployment: the first one serving the name.
            candidates = [c for c in candidates if c[1].deployment_id == target0.deployment_id]
        if not candidates:
            raise GatewayError(
                503,
                f"The model `{parsed.model}` has no ready instance right now; please retry."
                + _unproven_note(self.cache.snapshot, route),
                code="model_not_ready",
                headers={"retry-after": "1"},
            )
        body = parsed.body
        # Per-tenant caps, checked before anything is reserved or sent.
        max_tokens = parsed.max_tokens
        if tenant.max_tokens is not None:
            if max_tokens is not None and max_tokens > tenant.max_tokens:
                raise errors.invalid(
                    f"{parsed.max_tokens_param} is too large: {max_tokens}. This tenant may ask "
                    f"for at most {tenant.max_tokens} completion tokens per request.",
                    param=parsed.max_tokens_param,
                    code="invalid_value",
                )
            if max_tokens is None:
                max_tokens = tenant.max_tokens
                body["max_completion_tokens" if ctx.endpoint == "chat.completions"
                     else "max_tokens"] = max_tokens
        prompt_tokens = parsed.prompt_upper
        if tenant.max_prompt is not None and parsed.prompt_upper > tenant.max_prompt:
            # The byte-based bound is above the cap: ask the engine's tokenizer for the exact
            # count before refusing (no generation; only for prompts this long).
            prompt_tokens = await self._exact_prompt(parsed, candidates[0])
            if prompt_tokens > tenant.max_prompt:
                raise errors.invalid(
                    f"The prompt is {prompt_tokens} tokens long; this tenant's limit is "
                    f"{tenant.max_prompt} tokens.",
                    param="messages" if ctx.endpoint == "chat.completions" else "prompt",
                    code="context_length_exceeded",
                )
        ctx.reserved = need = _reservation(parsed, prompt_tokens, max_tokens, route)
        # The instance is chosen before admission, which counts the request in flight there.
        first = self.router.choose(candidates, set())
        assert first is not None
        instance_id = first[0].id

        slot = None
        granted: asyncio.Future[int] | None = None
        if flow is not None:
            slot = flow.slot(
                target0.deployment_id, tenant, prompt_tokens, need - prompt_tokens,
                self.cache.snapshot.instances.get(target0.deployment_id, ()),
                (inst for inst, _ in candidates),
            )
            granted = flow.expect(ctx.request_id)
        if tenant.admission_needed or slot is not None:
            try:
                ticket, decision = await self.meter.admit(
                    tenant, ctx.request_id, need, None if slot is not None else instance_id, slot)
            except RedisUnavailable as exc:
                if flow is not None and slot is not None:
                    # No flow control without Redis: first come, first served. What admission
                    # may have done before its reply was lost is undone in the background.
                    flow.abandon(ctx.request_id, slot)
                    slot = None
                if tenant.admission_needed and not self.config.fail_open:
                    raise GatewayError(
                        503,
                        "Rate limits cannot be checked right now; please retry.",
                        code="limits_unavailable",
                        headers={"retry-after": "1"},
                    ) from exc
                if tenant.admission_needed:
                    log.warning("Redis unreachable, admitting %s unlimited (fail open)",
                                ctx.request_id)
            else:
                ctx.rate_headers = admission.rate_headers(tenant, decision)
                if not ticket.admitted:
                    if flow is not None:
                        flow.forget(ctx.request_id)
                    raise admission.refusal(tenant, decision, need)
                if tenant.admission_needed:
                    ctx.ticket = ticket
                if flow is not None and slot is not None and granted is not None:
                    ctx.slot = slot
                    if decision.instance > 0:
                        flow.forget(ctx.request_id)
                        slot.instance_id = decision.instance
                    else:
                        await _until_disconnect(self._wait_for_slot(ctx, slot, granted),
                                                receive, ctx)
                elif tenant.admission_needed:
                    ctx.counted_on = instance_id
        if ctx.slot is not None and ctx.slot.instance_id > 0:
            # The flow scripts counted it in flight on the instance they granted: go there.
            first = self.router.choose(candidates, set(), prefer=ctx.slot.instance_id)
            assert first is not None
        elif ctx.counted_on is None:
            self.meter.begin(instance_id, ctx.request_id)
            ctx.counted_on = instance_id

        # Prefix-cache isolation: engines reuse cached blocks only between equal salts, so every
        # request carries its tenant's (or sharing group's); a client's own salt is mixed in.
        body["cache_salt"] = tenant.salt_for(body.get("cache_salt"))
        if parsed.stream:
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
        body["model"] = target0.upstream_model
        await _until_disconnect(
            self._proxy(send, ctx, parsed, route, candidates, tenant, first), receive, ctx
        )

    async def _classify(self, ctx: Context, parsed: ParsedRequest, setting: Classifier) -> None:
        """The classifier stage, before admission to the tenant's engine: ask the policy's
        guard deployment for a verdict on the request's text (after redaction), waiting at
        most the policy's timeout. A blocking verdict answers the 400 naming the category;
        no verdict (timeout, no ready instance, an answer that is not a verdict) blocks only
        when the policy fails closed. The guard call is its own usage event (`endpoint:
        guard`, its tokens and time) of the tenant whose request it judged; the verdict is
        counted on the request's event (`input:block|pass|failopen:CLASSIFIER`)."""
        assert self.cache and self.upstream and self.meter and ctx.guard
        target = self.cache.snapshot.guard_models.get(setting.deployment)
        instances = self.cache.snapshot.instances.get(setting.deployment, ())
        verdict: str | None = None
        if target is not None and instances:
            call = Context(ctx.request_id + "-guard", time.time(), time.perf_counter(),
                           endpoint="guard", tenant=ctx.tenant, key=ctx.key,
                           model=target.public_name, deployment_id=target.deployment_id)
            inst = min(instances, key=lambda i: self.router.in_flight.get(i.id, 0))
            call.instance_id = inst.id
            text = ctx.guard.judged_text(ctx.endpoint, parsed.body)
            request = target.spec.request(target.upstream_model, text)
            if ctx.tenant is not None:  # prefix-cache isolation on the guard engine too
                request["cache_salt"] = ctx.tenant.cache_salt
            body = encode_body(request)
            self.router.acquire(inst.id)
            try:
                verdict = await asyncio.wait_for(
                    self._ask_guard(call, inst.url, inst.secret, body, target),
                    setting.timeout_ms / 1000.0)
            except TimeoutError:
                call.status, call.error_code = 504, "guard_timeout"
            except Exception as exc:  # noqa: BLE001 - unreachable or broken: no verdict
                log.warning("guard model instance %s failed: %r", inst.id, exc)
                call.status, call.error_code = 502, "guard_unreachable"
            finally:
                self.router.release(inst.id)
            await self.meter.settle(None, 0, call.event())
        decision = classifier.decide(target.spec if target is not None else None, verdict,
                                     fail_open=setting.fail_open)
        outcome = ("block" if decision.blocked is not None
                   else "failopen" if decision.failed_open else "pass")
        ctx.guard.counts[f"input:{outcome}:{classifier.CATEGORY}"] += 1
        if decision.blocked is not None:
            raise refusal(decision.blocked)

    async def _ask_guard(self, call: Context, url: str, secret: str, body: bytes,
                         target: GuardTarget) -> str | None:
        assert self.upstream is not None
        resp = await self.upstream.post(url + "/v1/chat/completions", secret, body,
                                        call.request_id)
        try:
            raw = await resp.read()
        finally:
            resp.close()
        call.status = resp.status
        usage = read_usage(raw) if resp.status == 200 else None
        if usage:
            call.prompt_tokens, call.completion_tokens = usage
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        verdict = target.spec.verdict(answer) if resp.status == 200 else None
        if verdict is None:
            call.error_code = "guard_no_verdict"
        return verdict

    async def _wait_for_slot(self, ctx: Context, slot: Slot, granted: asyncio.Future[int]) -> None:
        """Wait in the deployment's queue until a settlement hands this request a slot. Past
        the queue timeout: 503 with retry-after. A client that goes away leaves the queue; a
        slot granted meanwhile is given back by this request's settlement."""
        assert self.meter is not None and self.meter.flow is not None and self.config
        flow = self.meter.flow
        try:
            slot.instance_id = await asyncio.wait_for(
                asyncio.shield(granted), self.config.flow_queue_timeout
            )
        except TimeoutError:
            slot.instance_id = await flow.leave(ctx.request_id, slot)
            if not slot.instance_id:
                wait = max(1, round(self.config.flow_queue_timeout / 10))
                raise GatewayError(
                    503,
                    "The model's engines are at capacity and this request waited "
                    f"{self.config.flow_queue_timeout:g}s in the queue; please retry.",
                    code="queue_timeout",
                    headers={"retry-after": str(wait), "retry-after-ms": str(wait * 1000)},
                ) from None
        except asyncio.CancelledError:
            slot.instance_id = await flow.leave(ctx.request_id, slot)
            raise
        finally:
            flow.forget(ctx.request_id)

    async def _exact_prompt(self, parsed: ParsedRequest, candidate) -> int:
        assert self.upstream is not None
        inst, target = candidate
        body = parsed.body
        try:
            if parsed.endpoint == "chat.completions":
                return await self.upstream.tokenize(
                    inst.url, inst.secret,
                    {"model": target.upstream_model, "messages": body["messages"]},
                )
            prompts = body["prompt"]
            if isinstance(prompts, str):
                prompts = [prompts]
            if prompts and isinstance(prompts[0], int):
                return len(prompts)
            longest = 0
            for prompt in prompts:
                if isinstance(prompt, list):
                    longest = max(longest, len(prompt))
                    continue
                count = await self.upstream.tokenize(
                    inst.url, inst.secret, {"model": target.upstream_model, "prompt": prompt}
                )
                longest = max(longest, count)
            return longest
        except Exception as exc:  # cannot count: keep the conservative bound
            log.warning("tokenize failed, keeping the prompt estimate: %s", exc)
            return parsed.prompt_upper

    async def _proxy(
        self, send, ctx: Context, parsed: ParsedRequest, route: Route, candidates, tenant,
        first,
    ) -> None:
        assert self.upstream is not None and self.config is not None and self.meter is not None
        body = parsed.body
        encoded: dict[bool, bytes] = {}
        tried: set[int] = set()
        granted = ctx.slot.instance_id if ctx.slot is not None else 0
        while True:
            choice = (first if not tried
                      else self.router.choose(candidates, tried, prefer=granted))
            if choice is None:
                raise GatewayError(
                    503, f"No instance of `{parsed.model}` could be reached; please retry.",
                    code="upstream_unavailable",
                )
            inst, target = choice
            tried.add(inst.id)
            ctx.instance_id, ctx.deployment_id = inst.id, target.deployment_id
            if ctx.counted_on is not None and ctx.counted_on != inst.id:
                self.meter.begin(inst.id, ctx.request_id, moved_from=ctx.counted_on)
                ctx.counted_on = inst.id
            if target.priority not in encoded:
                if target.priority:
                    body["priority"] = tenant.priority
                else:
                    body.pop("priority", None)
                encoded[target.priority] = encode_body(body)
            retry_left = len(tried) <= self.config.upstream_retries
            self.router.acquire(inst.id)
            try:
                try:
                    resp = await self.upstream.post(
                        inst.url + parsed.upstream_path, inst.secret, encoded[target.priority],
                        ctx.request_id,
                    )
                except (*RETRYABLE, TimeoutError) as exc:
                    log.warning("instance %s unreachable: %r", inst.id, exc)
                    if retry_left:
                        continue
                    raise GatewayError(
                        502, "The engine could not be reached.", code="upstream_unreachable"
                    ) from exc
                except UpstreamBroken as exc:  # it began answering: not safe to send twice
                    log.warning("response head from instance %s broke: %r", inst.id, exc)
                    raise GatewayError(
                        502, "The engine's response ended early.", code="upstream_broken"
                    ) from exc
                if resp.status == 503 and retry_left:
                    resp.close()
                    continue
                try:
                    await self._relay(send, ctx, parsed, route, resp)
                finally:
                    resp.close(drain=1.0 if ctx.complete else 0.0)
                return
            finally:
                self.router.release(inst.id)

    async def _relay(self, send, ctx: Context, parsed: ParsedRequest, route: Route, resp) -> None:
        engine_model = parsed.body["model"]
        base_headers = [(b"x-request-id", ctx.request_id.encode())] + [
            (k.encode(), v.encode()) for k, v in ctx.rate_headers.items()
        ]
        if resp.status != 200 or not parsed.stream:
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
                    ctx.prompt_tokens, ctx.completion_tokens = usage
                if ctx.guard is not None and ctx.guard.rewrites_output:
                    raw = ctx.guard.output_body(ctx.endpoint, raw)
                if engine_model != route.public_name:
                    raw = raw.replace(
                        f'"model":"{engine_model}"'.encode(),
                        f'"model":"{route.public_name}"'.encode(),
                    )
            else:
                ctx.error_code = "upstream_error"
                raw = errors.normalize_upstream_error(resp.status, raw)
            await send({
                "type": "http.response.start",
                "status": resp.status,
                "headers": [(b"content-type", JSON), (b"content-length", str(len(raw)).encode()),
                            *base_headers],
            })
            ctx.complete = True
            await send({"type": "http.response.body", "body": raw})
            return

        ctx.status = 200
        rewrite = (ctx.guard.stream(ctx.endpoint)
                   if ctx.guard is not None and ctx.guard.rewrites_output else None)
        relay = StreamRelay(send, not parsed.wants_usage, engine_model, route.public_name,
                            rewrite)
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"), *base_headers],
        })
        try:
            await relay.start(resp)
        except asyncio.CancelledError:
            # The client went away: the engine's count if it came, else what was relayed so far
            # (an estimate).
            relay.stop()
            if relay.usage:
                ctx.prompt_tokens, ctx.completion_tokens = relay.usage
            else:
                ctx.prompt_tokens = min(ctx.reserved, parsed.prompt_upper)
                ctx.completion_tokens = max(0, relay.events - 1)
            raise
        except Exception as exc:
            log.warning("stream from instance %s broke: %r", ctx.instance_id, exc)
            ctx.status, ctx.error_code = 502, "upstream_stream_broken"
            message = errors.error_body("The engine's stream ended early.", "server_error", None)
            await send({"type": "http.response.body", "body": b"data: " + message + b"\n\n",
                        "more_body": True})
        finally:
            if relay.first_at is not None:
                ctx.ttft_ms = round((relay.first_at - ctx.started) * 1000.0, 3)
        if relay.usage:
            ctx.prompt_tokens, ctx.completion_tokens = relay.usage
        ctx.complete = True
        await send({"type": "http.response.body", "body": relay.final + relay.flush()})


def _reservation(
    parsed: ParsedRequest, prompt_tokens: int, max_tokens: int | None, route: Route
) -> int:
    """The most tokens this request can use: prompts plus every completion at its maximum,
    never more than each sequence's context length allows."""
    context = max((t.max_model_len for t in route.targets), default=0)
    sequences = parsed.num_prompts * parsed.n
    completion = max_tokens if max_tokens is not None else (context or 32768)
    need = prompt_tokens + sequences * completion
    if context:
        need = min(need, sequences * context)
    return max(1, need)


def _model_card(route: Route) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": route.public_name,
        "object": "model",
        "created": route.created,
        "owned_by": route.owned_by,
    }
    if route.parent:
        card["parent"] = route.parent
    return card


def _bad_key(secret: str) -> GatewayError:
    shown = (secret[:8] + "*" * 4 + secret[-4:]) if len(secret) > 16 else "****"
    return GatewayError(
        401, f"Incorrect API key provided: {shown}.", code="invalid_api_key"
    )


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _unproven_note(snapshot: Snapshot, route: Route) -> str:
    """Why an adapter with no ready instance is out: loaded, but its canary generation failed
    (serving_app/engine/canary.py); the tenant's adapter page shows the engine's error."""
    for target in route.targets:
        for inst in snapshot.instances.get(target.deployment_id, ()):
            if target.adapter and target.adapter in inst.unproven:
                return (" The adapter is loaded but its test generation failed, so it is not "
                        "served until one passes (retried automatically; the adapter's last "
                        "error says why).")
    return ""


async def _read_body(scope: dict, receive, limit: int) -> bytes:
    declared = _header(scope, b"content-length")
    too_large = GatewayError(
        413,
        f"The request body is larger than the {limit} bytes this gateway accepts.",
        code="request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _send_json(send, status: int, body: bytes, request_id: str, headers: dict) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", JSON), (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", request_id.encode()),
                    *((k.encode(), v.encode()) for k, v in headers.items())],
    })
    await send({"type": "http.response.body", "body": body})


async def _until_disconnect(work, receive, ctx: Context) -> None:
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


application = GatewayApp()
