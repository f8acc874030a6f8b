"""Dispatch: everything between a request that may be served and the instance it is sent to, and
its settlement. One place owns the router's choice, the charge against the tenant's limits (the
meter's admission), the flow-control slot, the policy when Redis cannot be reached, re-routing
to the slot flow control granted, the in-flight counts, and waking a deployment scaled to zero.

Redis round trips. A request costs at most two that it waits for: admission and settlement
(`metering.py`). The limits stage's charge and the dispatch stage's slot (or in-flight count)
are one admission script: when nothing runs between the two stages that costs anything, the
charge is carried by the dispatch stage's round trip (`Charge.pending`); when the request has
guardrails, the charge is sent on its own before the guard stage, so that a request the guard
refuses (or whose guard model it asks) has counted against its sender, and dispatch then sends a
second admission that charges nothing and only takes the slot or counts the request in flight.

Redis unreachable: a tenant with limits is refused with 503 `limits_unavailable` unless the
gateway fails open (`GATEWAY_FAIL_OPEN`), then admitted unlimited; flow control is left out
(first come, first served), what a lost admission reply may have queued undone in the background.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from decimal import Decimal

from gateway_app import admission, money
from gateway_app.admission import Decision
from gateway_app.cache import GatewayCache
from gateway_app.catalog import InstanceEntry, KeyEntry, Route, Snapshot, Target, TenantEntry
from gateway_app.config import GatewayConfig
from gateway_app.context import Context, Receive, until_disconnect
from gateway_app.errors import GatewayError
from gateway_app.flow import FlowControl, Slot
from gateway_app.metering import Meter, RedisUnavailable, Ticket
from gateway_app.money import MoneyLimit
from gateway_app.routing import Router
from serving_app import lifecycle

log = logging.getLogger(__name__)

Candidate = tuple[InstanceEntry, Target]

# A request for a deployment scaled to zero: how often one worker re-sends the wake, and how
# often the held request looks for a ready instance.
WAKE_RESEND_SECONDS = 5.0
WAKE_POLL_SECONDS = 0.25


@dataclass(slots=True)
class Charge:
    """What the limits stage charged (or will: `pending`, carried by dispatch's admission)."""

    tenant: TenantEntry
    need: int  # the reservation: the most tokens the request can use
    prompt_tokens: int
    pending: bool  # the tenant has limits and they are charged with the dispatch admission
    money: money.MoneyTicket | None = None  # its hard money budgets' reservation


@dataclass(slots=True)
class Dispatched:
    """The instance the request goes to first, and the others it may be retried on (of the
    route as the catalog had it then)."""

    route: Route
    first: Candidate
    candidates: list[Candidate]


def routes_for(snapshot: Snapshot, key: KeyEntry, tenant: TenantEntry) -> dict[str, Route]:
    """The public names this key may call: its tenant's, narrowed to the key's allowed ones."""
    routes = snapshot.routes.get(tenant.id, {})
    if key.allowed:
        return {name: r for name, r in routes.items() if name in key.allowed}
    return routes


class Dispatcher:
    def __init__(self, config: GatewayConfig, cache: GatewayCache, meter: Meter,
                 router: Router) -> None:
        self.config = config
        self.cache = cache
        self.meter = meter
        self.router = router
        self._woken: dict[int, float] = {}  # deployment id -> when this worker last asked

    # -- the limits stage's charge ------------------------------------------------------------
    async def charge(self, ctx: Context, charge: Charge) -> None:
        """Charge the tenant's limits now, in an admission of their own."""
        try:
            ticket, decision = await self.meter.admit(charge.tenant, ctx.request_id, charge.need,
                                                      money_ticket=charge.money)
        except RedisUnavailable as exc:
            self._without_redis(ctx, exc)
            return
        self._charged(ctx, charge, ticket, decision, None)

    def _charged(self, ctx: Context, charge: Charge, ticket: Ticket, decision: Decision,
                 flow: FlowControl | None) -> None:
        ctx.rate_headers = admission.rate_headers(charge.tenant, decision)
        if not ticket.admitted:
            if flow is not None:
                flow.forget(ctx.request_id)
            if decision.code == admission.MONEY and charge.money is not None:
                raise money_refusal(charge.money, decision)
            raise admission.refusal(charge.tenant, decision, charge.need)
        ctx.ticket = ticket

    def _without_redis(self, ctx: Context, exc: RedisUnavailable) -> None:
        """Limits cannot be checked: refuse, or admit unlimited where the gateway fails open."""
        if not self.config.fail_open:
            raise GatewayError(
                503,
                "Rate limits cannot be checked right now; please retry.",
                code="limits_unavailable",
                headers={"retry-after": "1"},
            ) from exc
        log.warning("Redis unreachable, admitting %s unlimited (fail open)", ctx.request_id)

    # -- money budgets ---------------------------------------------------------------------------
    def money_ticket(self, route: Route, limits: list[MoneyLimit], prompt_tokens: int,
                     completion_tokens: int) -> money.MoneyTicket | None:
        """The request's worst-case cost to reserve on every hard budget covering it (its key's
        and its tenant's), charged with the tenant's other limits in the admission script.
        A model without a price card in force costs nothing and reserves nothing."""
        target = route.targets[0]
        now = time.time()
        price = self.cache.snapshot.prices.price_at(target.base_model_id,
                                                    target.adapter_id or None, now)
        if price is None:
            return None
        need = money.worst_case(price, prompt_tokens, completion_tokens)
        return money.ticket(limits, price, need, now)

    # -- which instances can serve it ----------------------------------------------------------
    async def ready(self, ctx: Context, route: Route, prompt_logprobs: str | None = None
                    ) -> tuple[Route, list[Candidate]]:
        """The ready instances that can serve the route (re-reading the catalog, and the route
        with it, once if there are none; waking a deployment scaled to zero); flow control
        narrows them to the first deployment serving the name. None ready: 503
        `model_not_ready`. A request that asks for its prompt's logprobs (through the field
        `prompt_logprobs` names) goes only to engines that compute them; none of the ready
        ones does: 400 `unsupported_parameter`."""
        found = self.router.candidates(self.cache.snapshot, route)
        if not found and await self.cache.refresh_if_older():
            if ctx.key is not None and ctx.tenant is not None:
                routes = routes_for(self.cache.snapshot, ctx.key, ctx.tenant)
                route = routes.get(ctx.model) or route
            found = self.router.candidates(self.cache.snapshot, route)
        target0 = route.targets[0]
        ctx.adapter = target0.adapter
        ctx.deployment_id = target0.deployment_id
        if not found and self._wakeable(route):
            found = await self._wake(route)
        if target0.flow and self.meter.flow is not None:
            found = [c for c in found if c[1].deployment_id == target0.deployment_id]
        if not found:
            raise GatewayError(
                503,
                f"The model `{ctx.model}` has no ready instance right now; please retry."
                + _unproven_note(self.cache.snapshot, route),
                code="model_not_ready",
                headers={"retry-after": "1"},
            )
        if prompt_logprobs is not None:
            found = computing_prompt_logprobs(found)
            if not found:
                raise prompt_logprobs_refusal(prompt_logprobs, ctx)
        return route, found

    def refuse_prompt_logprobs_early(self, ctx: Context, route: Route, param: str) -> None:
        """At validation, before anything is charged: a request for its prompt's logprobs
        (through the field `param` names) that none of the route's ready instances computes is
        refused now (400 `unsupported_parameter`), so a refused request costs its sender
        nothing. With none ready (a deployment scaled to zero, one starting) the dispatch stage
        decides, against the instances ready then (`ready`)."""
        found = self.router.candidates(self.cache.snapshot, route)
        if found and not computing_prompt_logprobs(found):
            raise prompt_logprobs_refusal(param, ctx)

    def _wakeable(self, route: Route) -> list[int]:
        wakeable = self.cache.snapshot.wakeable
        return sorted({t.deployment_id for t in route.targets if t.deployment_id in wakeable})

    async def _wake(self, route: Route) -> list[Candidate]:
        """A deployment its autoscaler may have scaled to zero: ask the control worker to bring
        it back (at most once every few seconds per deployment from this worker; the control
        worker's wake is idempotent) and hold the request until an instance is ready, at most
        the wake timeout. Returns the ready candidates, none if the timeout passed."""
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

    # -- the dispatch stage ------------------------------------------------------------------
    async def admit(self, ctx: Context, route: Route, charge: Charge, receive: Receive,
                    prompt_logprobs: str | None = None) -> Dispatched:
        """Choose the instance, take the flow-control slot (waiting in the deployment's queue
        for one when all are taken) and count the request in flight; the pending charge rides
        on the same admission. Returns where to send it. `prompt_logprobs`: as `ready`'s."""
        route, candidates = await self.ready(ctx, route, prompt_logprobs)
        target0 = route.targets[0]
        first = self.router.choose(candidates, set())
        assert first is not None
        instance_id = first[0].id
        flow = self.meter.flow if target0.flow else None
        slot = granted = None
        if flow is not None:
            slot = flow.slot(
                target0.deployment_id, charge.tenant, charge.prompt_tokens,
                charge.need - charge.prompt_tokens,
                self.cache.snapshot.instances.get(target0.deployment_id, ()),
                (inst for inst, _ in candidates),
            )
            granted = flow.expect(ctx.request_id)
        if charge.pending or slot is not None:
            await self._admit(ctx, charge, instance_id, flow, slot, granted, receive)
        if ctx.slot is not None and ctx.slot.instance_id > 0:
            # The flow scripts counted it in flight on the instance they granted: go there.
            chosen = self.router.choose(candidates, set(), prefer=ctx.slot.instance_id)
            assert chosen is not None
            first = chosen
        elif ctx.counted_on is None:
            self.meter.begin(instance_id, ctx.request_id)
            ctx.counted_on = instance_id
        return Dispatched(route, first, candidates)

    async def _admit(self, ctx: Context, charge: Charge, instance_id: int,
                     flow: FlowControl | None, slot: Slot | None,
                     granted: asyncio.Future[int] | None, receive: Receive) -> None:
        try:
            ticket, decision = await self.meter.admit(
                charge.tenant, ctx.request_id, charge.need,
                None if slot is not None else instance_id, slot, limits=charge.pending,
                money_ticket=charge.money)
        except RedisUnavailable as exc:
            if flow is not None and slot is not None:
                # No flow control without Redis: first come, first served. What admission
                # may have done before its reply was lost is undone in the background.
                flow.abandon(ctx.request_id, slot)
            if charge.pending:
                self._without_redis(ctx, exc)
            return
        if charge.pending:
            self._charged(ctx, charge, ticket, decision, flow)
        if flow is not None and slot is not None and granted is not None:
            ctx.slot = slot
            if decision.instance > 0:
                flow.forget(ctx.request_id)
                slot.instance_id = decision.instance
            else:
                await until_disconnect(self._wait_for_slot(ctx, flow, slot, granted), receive,
                                       ctx)
        else:
            ctx.counted_on = instance_id

    async def _wait_for_slot(self, ctx: Context, flow: FlowControl, slot: Slot,
                             granted: asyncio.Future[int]) -> None:
        """Wait in the deployment's queue until a settlement hands this request a slot. Past
        the queue timeout: 503 with retry-after. A client that goes away leaves the queue; a
        slot granted meanwhile is given back by this request's settlement."""
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

    # -- retries and settlement ----------------------------------------------------------------
    def next_choice(self, ctx: Context, dispatched: Dispatched,
                    tried: set[int]) -> Candidate | None:
        """The instance to send the request to: the first choice, then (after a failure) the
        granted slot's instance if not tried yet, else the least loaded of the others; the
        request's in-flight count moves with it."""
        if not tried:
            choice: Candidate | None = dispatched.first
        else:
            granted = ctx.slot.instance_id if ctx.slot is not None else 0
            choice = self.router.choose(dispatched.candidates, tried, prefer=granted)
        if choice is None:
            return None
        inst, target = choice
        tried.add(inst.id)
        ctx.instance_id, ctx.deployment_id = inst.id, target.deployment_id
        if ctx.counted_on is not None and ctx.counted_on != inst.id:
            self.meter.begin(inst.id, ctx.request_id, moved_from=ctx.counted_on)
            ctx.counted_on = inst.id
        return choice

    async def settle(self, ctx: Context) -> None:
        """The metered stage: the reservation replaced by the tokens used, the slot and the
        in-flight count given back, the usage event appended (one round trip)."""
        actual = ctx.prompt_tokens + ctx.completion_tokens
        reserved = ctx.ticket.money if ctx.ticket is not None else None
        cost = 0
        if reserved is not None:
            cost = money.nano(reserved.price.cost(ctx.prompt_tokens, ctx.cached_tokens,
                                                  ctx.completion_tokens))
        await self.meter.settle(ctx.ticket, actual, ctx.event(), ctx.counted_on, ctx.slot,
                                cost)

    async def record(self, ctx: Context) -> None:
        """A usage event of its own, with nothing reserved or counted (the guard model's
        call)."""
        await self.meter.settle(None, 0, ctx.event())


def money_refusal(reserved: money.MoneyTicket, decision: Decision) -> GatewayError:
    """OpenAI's answer to a spent quota: 429, type and code `insufficient_quota`, with
    `retry-after` the time to the period's end (a rolling window's next step)."""
    limit = reserved.limits[decision.money_at - 1]
    wait = max(1, math.ceil(reserved.ends[decision.money_at - 1] - time.time()))
    amount = Decimal(limit.amount) / money.NANO
    left = max(Decimal(0), Decimal(limit.amount - decision.money_spent) / money.NANO)
    message = (
        f"You exceeded your current quota: this {'key' if limit.key_id else 'tenant'}'s "
        f"budget of {amount.normalize():f} per {limit.label} has {left.normalize():f} "
        "left, and this request may cost up to "
        f"{(Decimal(reserved.reserved) / money.NANO).normalize():f}. Lower max_tokens, or wait "
        "for the next period; please check your plan and billing details.")
    return GatewayError(429, message, code="insufficient_quota",
                        error_type="insufficient_quota", headers={"retry-after": str(wait)})


def computing_prompt_logprobs(found: list[Candidate]) -> list[Candidate]:
    """The candidates whose engines compute a prompt's logprobs (`InstanceEntry.
    prompt_logprobs`)."""
    return [c for c in found if c[0].prompt_logprobs]


def prompt_logprobs_refusal(param: str, ctx: Context) -> GatewayError:
    """OpenAI's answer to a parameter the model does not support, for a request that asks for
    its prompt's logprobs where only CPU engines with LoRA on serve it (`InstanceEntry.
    prompt_logprobs`): they would die computing them beside other requests."""
    if param == "prompt_logprobs":
        what, instead = "'prompt_logprobs' is", "without 'prompt_logprobs'"
    elif ctx.endpoint == "chat.completions":
        what = "'echo' (which asks for the prompt's log probabilities on a chat) is"
        instead = "without 'echo'"
    else:
        what = "'echo' with 'logprobs' (which asks for the prompt's log probabilities) is"
        instead = "with 'echo' or 'logprobs', not both"
    return GatewayError(
        400,
        f"Unsupported parameter: {what} not supported with the model `{ctx.model}`. Its "
        "engines run on CPUs with LoRA enabled, where vLLM cannot compute a prompt's log "
        "probabilities while other requests share the batch. Send the request "
        f"{instead}.",
        param=param, code="unsupported_parameter",
    )


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
