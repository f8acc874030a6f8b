"""Talking to Redis in the request path: admission (round trip 1) and settlement with the usage
event (round trip 2), plus the in-memory buffer that keeps events while Redis is unreachable.

A request that the gateway refuses before admission (bad key, bad body, unknown model) costs one
round trip: its event alone. A tenant without any limit skips admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from gateway_app import admission
from gateway_app.admission import Decision
from gateway_app.catalog import TenantEntry
from gateway_app.config import GatewayConfig
from gateway_app.flow import FlowControl, Slot
from gateway_app.resp import PipelinedRedis, RedisReplyError, RedisUnavailable, Script

log = logging.getLogger(__name__)

_NO_KEYS = ["gw:{none}:tpm", "gw:{none}:tpmv", "gw:{none}:tpms", "gw:{none}:conc", "gw:{none}:b"]
_NO_UNWRITTEN = "gw:{none}:u"
ADMIT_SCRIPT = Script(admission.ADMIT_LUA)
SETTLE_SCRIPT = Script(admission.SETTLE_LUA)

__all__ = ["Meter", "RedisUnavailable", "Ticket"]


@dataclass(slots=True)
class Ticket:
    """What admission reserved, for settlement."""

    tenant: TenantEntry
    keys: list[str]
    request_id: str
    reserved: int
    admitted: bool


class Meter:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.redis = PipelinedRedis(config.redis_url, config.redis_timeout)
        self.buffer: deque[str] = deque(maxlen=config.event_buffer_max)
        self._flusher: asyncio.Task[None] | None = None
        self.flow: FlowControl | None = None
        if config.flow_control:
            self.flow = FlowControl(config)
            self.flow.redis_for_scripts = self.redis

    def start(self) -> None:
        self._flusher = asyncio.create_task(self._flush_loop(), name="gateway-event-flusher")
        if self.flow is not None:
            self.flow.start()

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(BaseException):
                await self._flusher
        await self._flush()
        if self.flow is not None:
            await self.flow.stop()
        await self.redis.aclose()

    async def admit(
        self, tenant: TenantEntry, request_id: str, need: int, slot: Slot | None = None
    ) -> tuple[Ticket, Decision]:
        """Admit the request against its tenant's limits and, under flow control (`slot`),
        queue it for a slot on its deployment (`Decision.instance`: the one granted, or 0)."""
        keys = admission.tenant_keys(tenant.id)
        args = admission.admit_args(
            tenant, request_id, need, self.config.window_ms, self.config.lease_ms
        )
        if slot is not None:
            assert self.flow is not None
            args += ["1", *self.flow.enter_args(slot)]
        try:
            raw = await self.redis.run_script(ADMIT_SCRIPT, keys, args)
        except RedisReplyError as exc:
            raise RedisUnavailable(str(exc)) from exc
        decision = Decision(*(int(v) for v in raw))
        ticket = Ticket(tenant, keys, request_id, need, decision.code == admission.ADMIT)
        return ticket, decision

    async def settle(self, ticket: Ticket | None, actual: int, event: dict[str, Any],
                     slot: Slot | None = None) -> None:
        """Replace the reservation by `actual` tokens, free the lease, append the event and,
        when the request holds a flow-control slot, free it and hand it to the next waiter (one
        script: one round trip, pipelined with every other request's on the connection)."""
        payload = json.dumps(event, separators=(",", ":"))
        if ticket is not None and ticket.admitted:
            tenant = ticket.tenant
            keys = [*ticket.keys[1:6], self.config.usage_stream, ticket.keys[6]]
            flags = ["1" if tenant.tpm else "0", "1" if tenant.concurrency else "0",
                     "1" if tenant.budget else "0"]
            args = [ticket.request_id, actual, ticket.reserved, *flags, payload,
                    admission.budget_ttl()]
        else:
            keys = [*_NO_KEYS, self.config.usage_stream, _NO_UNWRITTEN]
            args = [event.get("id", ""), 0, 0, "0", "0", "0", payload, 1]
        args.append("0")  # ARGV[9]: reserved (per-instance in-flight counting)
        if slot is not None and slot.instance_id > 0:
            assert self.flow is not None
            args += ["1", *self.flow.settle_args(slot, event["prompt"], event["completion"])]
        else:
            args.append("0")
        try:
            await self.redis.run_script(SETTLE_SCRIPT, keys, args)
        except (RedisUnavailable, RedisReplyError) as exc:
            # Leases expire and the token log slides on its own; the event must not be lost.
            if not self.buffer:
                log.warning("usage events kept in memory, Redis unreachable: %s", exc)
            self.buffer.append(payload)

    async def _flush(self) -> None:
        while self.buffer:
            batch = [self.buffer[i] for i in range(min(500, len(self.buffer)))]
            try:
                await asyncio.gather(*(
                    self.redis.execute(b"XADD", self.config.usage_stream, b"*", b"e", payload)
                    for payload in batch
                ))
            except (RedisUnavailable, RedisReplyError):
                return
            for _ in batch:
                self.buffer.popleft()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.buffer:
                await self._flush()
