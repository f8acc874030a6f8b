"""Talking to Redis in the request path: admission (round trip 1) and settlement with the usage
event (round trip 2), plus the in-memory buffer that keeps events while Redis is unreachable.

A request that the gateway refuses before admission (bad key, bad body, unknown model) costs one
round trip: its event alone. A tenant without any limit skips admission.

The same two round trips keep the requests in flight per instance
(`serving_app.deployments.inflight`): admission adds the request to the set of the instance it goes
to, settlement removes it. A
request that skips admission is added with a write nobody waits for (`begin()`), on the same
pipelined connection as its later settlement, so Redis sees the two in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from gateway_app import admission, money
from gateway_app.admission import Decision
from gateway_app.catalog import TenantEntry
from gateway_app.config import GatewayConfig
from gateway_app.flow import FlowControl, Slot
from gateway_app.objectives import LatencyWatch
from gateway_app.resp import Arg, PipelinedRedis, RedisReplyError, RedisUnavailable, Script
from serving_app.deployments import inflight

log = logging.getLogger(__name__)

_NO_KEYS = ["gw:{none}:tpm", "gw:{none}:tpmv", "gw:{none}:tpms", "gw:{none}:conc", "gw:{none}:b"]
_NO_UNWRITTEN = "gw:{none}:u"
_NO_INSTANCE = "gw:{none}:i"
ADMIT_SCRIPT = Script(admission.ADMIT_LUA)
SETTLE_SCRIPT = Script(admission.SETTLE_LUA)
INFLIGHT_SCRIPT = Script(admission.INFLIGHT_LUA)
RESETTLE_SCRIPT = Script(money.RESETTLE_LUA)

__all__ = ["Meter", "RedisUnavailable", "Ticket"]


@dataclass(frozen=True, slots=True)
class Unsent:
    """A usage event kept in memory while Redis was unreachable, and its money budgets'
    settlement (`money.RESETTLE_LUA`: the keys, then the arguments), sent with it."""

    payload: str
    money_keys: tuple[str, ...] = ()
    money_args: tuple[Arg, ...] = ()


@dataclass(slots=True)
class Ticket:
    """What admission reserved, for settlement."""

    tenant: TenantEntry
    keys: list[str]
    request_id: str
    reserved: int
    admitted: bool
    money: money.MoneyTicket | None = None  # what its money budgets reserved


class Meter:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.redis = PipelinedRedis(config.redis_url, config.redis_timeout)
        self.buffer: deque[Unsent] = deque(maxlen=config.event_buffer_max)
        self._flusher: asyncio.Task[None] | None = None
        self._unawaited: set[asyncio.Task[Any]] = set()
        self.flow: FlowControl | None = None
        self.watch: LatencyWatch | None = None  # streamed latency objectives, under flow control
        if config.flow_control:
            self.flow = FlowControl(config)
            self.flow.redis_for_scripts = self.redis
            self.watch = LatencyWatch(self.redis)

    def start(self) -> None:
        self._flusher = asyncio.create_task(self._flush_loop(), name="gateway-event-flusher")
        if self.flow is not None:
            self.flow.start()
        if self.watch is not None:
            self.watch.start()

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(BaseException):
                await self._flusher
        await self._flush()
        if self.flow is not None:
            await self.flow.stop()
        if self.watch is not None:
            await self.watch.stop()
        await self.redis.aclose()

    async def admit(
        self, tenant: TenantEntry, request_id: str, need: int, instance_id: int | None = None,
        slot: Slot | None = None, limits: bool = True,
        money_ticket: money.MoneyTicket | None = None,
    ) -> tuple[Ticket, Decision]:
        """Admit the request against its tenant's limits and its money budgets
        (`money_ticket`), and, if admitted, count it in flight on `instance_id`; under flow
        control (`slot`), queue it for a slot on its deployment (`Decision.instance`: the one
        granted, or 0), the flow scripts counting it in flight on the instance they grant.
        `limits` False: the limits were charged by an admission before, this one only counts
        the request in flight or queues it."""
        keys = [*admission.tenant_keys(tenant.id),
                inflight.key(instance_id) if instance_id is not None else _NO_INSTANCE]
        args = admission.admit_args(
            tenant, request_id, need, self.config.window_ms, self.config.lease_ms,
            count_in_flight=instance_id is not None, limits=limits,
        )
        if slot is not None:
            assert self.flow is not None
            args += ["1", *self.flow.enter_args(slot)]
        else:
            args.append("0")
        if money_ticket is not None and limits:
            keys += money_ticket.keys
            args += money_ticket.admit_args
        else:
            money_ticket = None
        try:
            raw = await self.redis.run_script(ADMIT_SCRIPT, keys, args)
        except RedisReplyError as exc:
            raise RedisUnavailable(str(exc)) from exc
        decision = Decision(*(int(v) for v in raw))
        ticket = Ticket(tenant, keys, request_id, need, decision.code == admission.ADMIT,
                        money_ticket)
        return ticket, decision

    def begin(self, instance_id: int, request_id: str, moved_from: int | None = None) -> None:
        """Count a request that skipped admission in flight on `instance_id` (or move one that
        is retried there from `moved_from`), without waiting for Redis."""
        keys = [inflight.key(instance_id)]
        if moved_from is not None:
            keys.append(inflight.key(moved_from))
        task = asyncio.ensure_future(self.redis.run_script(
            INFLIGHT_SCRIPT, keys, [request_id, self.config.lease_ms]))
        self._unawaited.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._unawaited.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The count is low by one until the request settles (settlement removes nothing).
            log.warning("request not counted in flight: %s", task.exception())

    async def settle(self, ticket: Ticket | None, actual: int, event: dict[str, Any],
                     instance_id: int | None = None, slot: Slot | None = None,
                     cost: int = 0) -> None:
        """Replace the reservation by `actual` tokens (and its money budgets' by its `cost`,
        nano), free the lease, take the request out of `instance_id`'s in-flight set, append
        the event and, when the request holds a flow-control slot, free it and hand it to the
        next waiter (one script: one round trip, pipelined with every other request's on the
        connection). Unreachable Redis: the money counters keep the worst case until the
        period ends."""
        payload = json.dumps(event, separators=(",", ":"))
        request_id = event.get("id", "") if ticket is None else ticket.request_id
        counted = "1" if instance_id is not None else "0"
        instance_key = inflight.key(instance_id) if instance_id is not None else _NO_INSTANCE
        if ticket is not None and ticket.admitted:
            tenant = ticket.tenant
            keys = [*ticket.keys[1:6], self.config.usage_stream, ticket.keys[6], instance_key]
            flags = ["1" if tenant.tpm else "0", "1" if tenant.concurrency else "0",
                     "1" if tenant.budget else "0"]
            args: list[Arg] = [ticket.request_id, actual, ticket.reserved, *flags, payload,
                    admission.budget_ttl(), counted]
        else:
            keys = [*_NO_KEYS, self.config.usage_stream, _NO_UNWRITTEN, instance_key]
            args = [request_id, 0, 0, "0", "0", "0", payload, 1, counted]
        if slot is not None and slot.instance_id > 0:
            assert self.flow is not None
            args += ["1", *self.flow.settle_args(slot, event["prompt"], event["completion"])]
        else:
            args.append("0")
        reserved = ticket.money if ticket is not None and ticket.admitted else None
        if reserved is not None:
            keys += reserved.keys
            args += reserved.settle(cost)
        try:
            held = int(await self.redis.run_script(SETTLE_SCRIPT, keys, args))
            if held and slot is not None and self.flow is not None:
                self.flow.pump_after(slot, held)
        except (RedisUnavailable, RedisReplyError) as exc:
            # Leases expire and the token log slides on its own; the event must not be lost,
            # nor its cost to its money budgets.
            if not self.buffer:
                log.warning("usage events kept in memory, Redis unreachable: %s", exc)
            if reserved is None or ticket is None:
                self.buffer.append(Unsent(payload))
            else:
                self.buffer.append(Unsent(payload, (ticket.keys[2], *reserved.keys),
                                          (request_id, *reserved.settle(cost))))

    async def _flush(self) -> None:
        while self.buffer:
            batch = [self.buffer[i] for i in range(min(500, len(self.buffer)))]
            sends = []
            for unsent in batch:
                sends.append(self.redis.execute(b"XADD", self.config.usage_stream, b"*", b"e",
                                                unsent.payload))
                if unsent.money_keys:
                    sends.append(self.redis.run_script(RESETTLE_SCRIPT, list(unsent.money_keys),
                                                       list(unsent.money_args)))
            try:
                await asyncio.gather(*sends)
            except (RedisUnavailable, RedisReplyError):
                return
            for _ in batch:
                self.buffer.popleft()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.buffer:
                await self._flush()
