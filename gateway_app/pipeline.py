"""The request pipeline: a completion passes these stages, in this order, each taking the value
the one before returned:

    authenticated  the API key and its tenant (`Caller`)
    validated      the body read and checked, the public name resolved (`Valid`)
    charged        the tenant's caps checked, the reservation counted against its limits
                   (`Charge`)
    guarded        the key's guardrails on the request (and the guard model's verdict)
    dispatched     the instance chosen, the flow-control slot taken (`Dispatched`)
    proxied        sent to the engine, the answer relayed
    metered        settled: the usage event, the reservation replaced by the tokens used

The guard runs after the sender's limits are charged, so a costly request counts against its
sender; a cheap one (read inline, no classifier) has its charge ride on dispatch's admission, as
an unguarded request's does, and is charged before a refusal answers. Each request's usage
event lists the stages it went through with their milliseconds
(`stages`); a refused one stops at the stage that refused it. `/v1/models` is authenticated
only. The ASGI app (`app.py`) runs the pipeline; dispatch (`dispatch.py`) owns everything
about Redis admission, flow control and in-flight counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from gateway_app import errors, guard_process
from gateway_app.cache import GatewayCache
from gateway_app.catalog import GuardEntry, KeyEntry, Route, TenantEntry
from gateway_app.config import GatewayConfig
from gateway_app.context import (
    ClientDisconnected,
    Context,
    Receive,
    Scope,
    Send,
    header,
    send_json,
    until_disconnect,
)
from gateway_app.dispatch import Candidate, Charge, Dispatched, Dispatcher, routes_for
from gateway_app.errors import GatewayError
from gateway_app.forward import Forwarder
from gateway_app.guard import RequestGuard
from gateway_app.metering import Meter
from gateway_app.proxy import Upstream
from gateway_app.routing import Router
from gateway_app.screen import Screen
from gateway_app.validation import ParsedRequest, parse_request
from tenants_app.models import KEY_PREFIX

log = logging.getLogger(__name__)

# In order; `metered` is the settlement every request gets, whatever stage it stopped at.
# A request whose body is at most this many bytes is guarded on the event loop (a thread hop
# costs more than reading it); a larger one in the worker's guard processes (`guard_process`).
INLINE_GUARD_BYTES = 32 * 1024

STAGES = ("authenticated", "validated", "charged", "guarded", "dispatched", "proxied")


@dataclass(slots=True)
class Caller:
    key: KeyEntry
    tenant: TenantEntry


@dataclass(slots=True)
class Valid:
    caller: Caller
    parsed: ParsedRequest
    route: Route
    guard: GuardEntry | None  # the key's guardrails (its effective policy), if it has any


class Pipeline:
    """One per worker process: the caches, the Redis client and the upstream session, started
    on the ASGI lifespan startup (or the first request)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.router = Router()
        self.cache = GatewayCache(config)
        self.meter = Meter(config)
        self.upstream = Upstream(config)
        self.dispatcher = Dispatcher(config, self.cache, self.meter, self.router)
        self.screen = Screen(self.cache, self.upstream, self.router, self.dispatcher)
        self.forwarder = Forwarder(config, self.upstream, self.router, self.dispatcher)
        # Started with the worker's first guarded request (`_guard_processes`).
        self.guard_pool: ProcessPoolExecutor | None = None
        self.guard_pool_ready: list[asyncio.Future[bool]] = []

    async def start(self) -> None:
        await self.upstream.start()
        self.cache.start()
        self.meter.start()
        if self.meter.flow is not None:
            cache = self.cache
            self.meter.flow.instances_of = lambda d: cache.snapshot.instances.get(d, ())
        if self.meter.watch is not None:
            self.meter.watch.snapshot = lambda: self.cache.snapshot

    async def stop(self) -> None:
        await self.cache.stop()
        await self.meter.stop()
        await self.upstream.stop()
        if self.guard_pool is not None:
            self.guard_pool.shutdown(wait=False, cancel_futures=True)

    # -- the stages ---------------------------------------------------------------------------
    async def completion(self, scope: Scope, receive: Receive, send: Send, ctx: Context) -> None:
        """The stages in order, each noted on the request as it begins (`Context.enter`)."""
        try:
            ctx.enter("authenticated")
            caller = await self.authenticate(scope, ctx)
            ctx.enter("validated")
            valid = await self.validate(scope, receive, ctx, caller)
            ctx.enter("charged")
            charge = await self.charge(ctx, valid)
            ctx.enter("guarded")
            charge = await self.guard(ctx, valid, charge)
            ctx.enter("dispatched")
            dispatched = await self.dispatch(ctx, valid, charge, receive)
            ctx.enter("proxied")
            await self.proxy(send, receive, ctx, valid, dispatched)
        finally:
            ctx.ended = time.perf_counter()

    async def models(self, scope: Scope, send: Send, ctx: Context, one: str) -> None:
        ctx.enter("authenticated")
        try:
            caller = await self.authenticate(scope, ctx)
        finally:
            ctx.ended = time.perf_counter()
        routes = routes_for(self.cache.snapshot, caller.key, caller.tenant)
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
        await send_json(send, 200, body, ctx.request_id, {})

    async def metered(self, ctx: Context) -> None:
        await self.dispatcher.settle(ctx)

    async def authenticate(self, scope: Scope, ctx: Context) -> Caller:
        auth = header(scope, b"authorization")
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
        return Caller(entry, tenant)

    async def validate(self, scope: Scope, receive: Receive, ctx: Context,
                       caller: Caller) -> Valid:
        raw = await _read_body(scope, receive, self.config.max_body_bytes)
        parsed = parse_request(ctx.endpoint, raw)
        ctx.model = parsed.model
        ctx.stream = parsed.stream
        route = routes_for(self.cache.snapshot, caller.key, caller.tenant).get(parsed.model)
        if route is None and await self.cache.refresh_if_older():
            route = routes_for(self.cache.snapshot, caller.key, caller.tenant).get(parsed.model)
        if route is None:
            raise errors.model_not_found(parsed.model)
        if parsed.prompt_logprobs is not None:
            self.dispatcher.refuse_prompt_logprobs_early(ctx, route, parsed.prompt_logprobs)
        guard = self.cache.snapshot.guard_for(caller.tenant.id, caller.key.id)
        return Valid(caller, parsed, route, guard)

    async def charge(self, ctx: Context, valid: Valid) -> Charge:
        """The tenant's caps on the request (completion tokens, prompt length), then its
        reservation counted against the tenant's limits: now, when the guard stage may cost
        something (a key with guardrails), else with dispatch's admission (one round trip;
        nothing runs between the two)."""
        tenant, parsed = valid.caller.tenant, valid.parsed
        max_tokens = self._completion_cap(ctx, tenant, parsed)
        prompt_tokens = parsed.prompt_upper
        if tenant.max_prompt is not None and parsed.prompt_upper > tenant.max_prompt:
            # The byte-based bound is above the cap: ask the engine's tokenizer for the exact
            # count before refusing (no generation; only for prompts this long).
            _, candidates = await self.dispatcher.ready(ctx, valid.route)
            prompt_tokens = await self._exact_prompt(parsed, candidates[0])
            if prompt_tokens > tenant.max_prompt:
                raise errors.invalid(
                    f"The prompt is {prompt_tokens} tokens long; this tenant's limit is "
                    f"{tenant.max_prompt} tokens.",
                    param="messages" if ctx.endpoint == "chat.completions" else "prompt",
                    code="context_length_exceeded",
                )
        ctx.reserved = need = _reservation(parsed, prompt_tokens, max_tokens, valid.route)
        limits = self.cache.snapshot.money_limits(tenant.id, valid.caller.key.id)
        reserve = None
        if limits:  # hard money budgets: charged in the same admission as the other limits
            reserve = self.dispatcher.money_ticket(valid.route, limits, prompt_tokens,
                                                   need - prompt_tokens)
        needed = tenant.admission_needed or reserve is not None
        # A guard that costs microseconds (read inline, no classifier) lets the charge ride on
        # dispatch's admission, as an unguarded request's does: one Redis round trip, not two.
        # Whatever it refuses is charged before the refusal answers (`guard`).
        costly = valid.guard is not None and not _cheap_guard(valid)
        charge = Charge(tenant, need, prompt_tokens, pending=needed and not costly,
                        money=reserve)
        if needed and costly:
            await self.dispatcher.charge(ctx, charge)
        return charge

    @staticmethod
    def _completion_cap(ctx: Context, tenant: TenantEntry, parsed: ParsedRequest) -> int | None:
        """The request's completion-token maximum under the tenant's cap (the cap itself when
        the request names none, written into the body)."""
        max_tokens = parsed.max_tokens
        if tenant.max_tokens is None:
            return max_tokens
        if max_tokens is not None and max_tokens > tenant.max_tokens:
            raise errors.invalid(
                f"{parsed.max_tokens_param} is too large: {max_tokens}. This tenant may ask "
                f"for at most {tenant.max_tokens} completion tokens per request.",
                param=parsed.max_tokens_param,
                code="invalid_value",
            )
        if max_tokens is None:
            max_tokens = tenant.max_tokens
            parsed.body["max_completion_tokens" if ctx.endpoint == "chat.completions"
                        else "max_tokens"] = max_tokens
        return max_tokens

    async def guard(self, ctx: Context, valid: Valid, charge: Charge) -> Charge:
        """The key's guardrails, before any engine call (the tokenizer's aside): a blocked
        prompt answers 400 here, a redacted one goes on with placeholders; then the policy's
        classifier (`screen.py`). A large request is read in a worker thread, off the event
        loop (`_read_input`)."""
        entry = valid.guard
        if entry is None:
            return charge
        ctx.guard = RequestGuard(entry)
        self._guard_processes()
        try:
            if valid.parsed.stream:
                ctx.guard.check_stream()
            ctx.guard.check_output_fields(valid.parsed.body)
            await self._read_input(ctx, ctx.guard, valid.parsed)
        except GatewayError:
            if charge.pending:  # a cheap guard's refusal still counts against the sender
                charge.pending = False
                await self.dispatcher.charge(ctx, charge)
            raise
        if entry.guard.policy.classifier is not None:
            await self.screen.classify(ctx, valid.parsed, entry.guard.policy.classifier)
        return charge

    def _guard_processes(self) -> ProcessPoolExecutor:
        """The worker's guard processes, started (and warmed: each sets Django up, seconds)
        with its first guarded request, so that a worker without guarded traffic has none."""
        if self.guard_pool is None:
            processes = self.config.guard_processes
            self.guard_pool = guard_process.pool(processes)
            self.guard_pool_ready = [asyncio.wrap_future(f)
                                     for f in guard_process.warm(self.guard_pool, processes)]
        return self.guard_pool

    async def _read_input(self, ctx: Context, guard: RequestGuard,
                          parsed: ParsedRequest) -> None:
        """The input rules on the request: inline for a small one, else in a guard process
        (`guard_process`: off this worker's GIL) within `guard_timeout`, a wait for a free
        process included (only the worker's first large request also waits for its processes
        to start, outside the bound); past it the request fails (503), unless the policy's
        classifier fails open, when it goes on unread (counted `input:failopen:TIMEOUT`). The
        process finishes what it took (the body cap, `GATEWAY_MAX_BODY_BYTES`, bounds it)."""
        if parsed.size <= INLINE_GUARD_BYTES:
            guard.input(ctx.endpoint, parsed.body)
            return
        pool = self._guard_processes()
        try:
            await asyncio.gather(*self.guard_pool_ready)
            work = asyncio.wrap_future(guard_process.submit(pool, guard.entry, ctx.endpoint,
                                                            parsed.body))
            check = await asyncio.wait_for(work, self.config.guard_timeout)
        except (TimeoutError, BrokenProcessPool) as exc:
            if isinstance(exc, BrokenProcessPool):  # a process died: start afresh next time
                log.warning("a guard process died: %s", exc)
                pool.shutdown(wait=False, cancel_futures=True)
                self.guard_pool = None
            classifier = guard.guard.policy.classifier
            if classifier is not None and classifier.fail_open:
                guard.counts["input:failopen:TIMEOUT"] += 1
                return
            guard.counts["input:block:TIMEOUT"] += 1
            raise GatewayError(
                503, "This key's guardrails could not check the request in time; send a "
                "shorter one.", code="guardrail_timeout") from None
        guard.take_input(check, ctx.endpoint, parsed.body)

    async def dispatch(self, ctx: Context, valid: Valid, charge: Charge,
                       receive: Receive) -> Dispatched:
        return await self.dispatcher.admit(ctx, valid.route, charge, receive,
                                           valid.parsed.prompt_logprobs)

    async def proxy(self, send: Send, receive: Receive, ctx: Context, valid: Valid,
                    dispatched: Dispatched) -> None:
        tenant, body = valid.caller.tenant, valid.parsed.body
        # Prefix-cache isolation: engines reuse cached blocks only between equal salts, so every
        # request carries its tenant's (or sharing group's); a client's own salt is mixed in.
        body["cache_salt"] = tenant.salt_for(body.get("cache_salt"))
        if valid.parsed.stream:
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
        body["model"] = dispatched.route.targets[0].upstream_model
        await until_disconnect(
            self.forwarder.forward(send, ctx, valid.parsed, dispatched, tenant.priority),
            receive, ctx,
        )

    async def _exact_prompt(self, parsed: ParsedRequest, candidate: Candidate) -> int:
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


def _cheap_guard(valid: Valid) -> bool:
    """Whether the key's guard costs microseconds on this request: read inline (no guard
    process) and no classifier (no guard model call)."""
    assert valid.guard is not None
    return (valid.parsed.size <= INLINE_GUARD_BYTES
            and valid.guard.guard.policy.classifier is None)


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    declared = header(scope, b"content-length")
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
