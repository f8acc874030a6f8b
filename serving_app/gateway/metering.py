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

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from serving_app.gateway import admission
from serving_app.gateway.admission import Decision
from serving_app.gateway.catalog import TenantEntry
from serving_app.gateway.config import GatewayConfig

log = logging.getLogger(__name__)

_NO_KEYS = ["gw:{none}:tpm", "gw:{none}:tpmv", "gw:{none}:tpms", "gw:{none}:conc", "gw:{none}:b"]


class RedisUnavailable(Exception):
    """Redis could not be reached within GATEWAY_REDIS_TIMEOUT_SECONDS."""


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
        # A bounded pool: past it, a request waits (up to the Redis timeout) for a connection
        # rather than opening one more.
        pool = aioredis.BlockingConnectionPool.from_url(
            config.redis_url,
            max_connections=256,
            timeout=config.redis_timeout,
            socket_timeout=config.redis_timeout,
            socket_connect_timeout=config.redis_timeout,
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        self._admit = self.redis.register_script(admission.ADMIT_LUA)
        self._settle = self.redis.register_script(admission.SETTLE_LUA)
        self.buffer: deque[str] = deque(maxlen=config.event_buffer_max)
        self._settles: list[tuple[list, list, str, asyncio.Future]] = []
        self._batches: set[asyncio.Task] = set()
        self._flusher: asyncio.Task | None = None

    def start(self) -> None:
        self._flusher = asyncio.create_task(self._flush_loop(), name="gateway-event-flusher")

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(BaseException):
                await self._flusher
        await self._flush()
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    async def admit(
        self, tenant: TenantEntry, request_id: str, need: int
    ) -> tuple[Ticket, Decision]:
        keys = admission.tenant_keys(tenant.id)
        args = admission.admit_args(
            tenant, request_id, need, self.config.window_ms, self.config.lease_ms
        )
        try:
            raw = await self._admit(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(str(exc)) from exc
        decision = Decision(*(int(v) for v in raw))
        ticket = Ticket(tenant, keys, request_id, need, decision.code == admission.ADMIT)
        return ticket, decision

    async def settle(self, ticket: Ticket | None, actual: int, event: dict[str, Any]) -> None:
        """Replace the reservation by `actual` tokens, free the lease, append the event.

        Settlements of requests that end in the same event-loop turn go to Redis in one
        pipeline (still one round trip each at most; fewer under load)."""
        payload = json.dumps(event, separators=(",", ":"))
        if ticket is not None and ticket.admitted:
            tenant = ticket.tenant
            keys = [*ticket.keys[1:6], self.config.usage_stream]
            flags = ["1" if tenant.tpm else "0", "1" if tenant.concurrency else "0",
                     "1" if tenant.budget else "0"]
            args = [ticket.request_id, actual, ticket.reserved, *flags, payload]
        else:
            keys = [*_NO_KEYS, self.config.usage_stream]
            args = ["", 0, 0, "0", "0", "0", payload]
        done = asyncio.get_running_loop().create_future()
        self._settles.append((keys, args, payload, done))
        if len(self._settles) == 1:
            asyncio.get_running_loop().call_soon(self._start_settle_batch)
        await done

    def _start_settle_batch(self) -> None:
        batch, self._settles = self._settles, []
        task = asyncio.ensure_future(self._settle_batch(batch))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _settle_batch(self, batch: list) -> None:
        try:
            if len(batch) == 1:
                keys, args, _, _ = batch[0]
                await self._settle(keys=keys, args=args)
            else:
                pipe = self.redis.pipeline(transaction=False)
                for keys, args, _, _ in batch:
                    await self._settle(keys=keys, args=args, client=pipe)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            # Leases expire and the token log slides on its own; the events must not be lost.
            log.warning("%d usage events kept in memory, Redis unreachable: %s", len(batch), exc)
            self.buffer.extend(payload for _, _, payload, _ in batch)
        finally:
            for *_, done in batch:
                if not done.done():
                    done.set_result(None)

    async def _flush(self) -> None:
        while self.buffer:
            batch = [self.buffer[i] for i in range(min(500, len(self.buffer)))]
            pipe = self.redis.pipeline(transaction=False)
            for payload in batch:
                pipe.xadd(self.config.usage_stream, {"e": payload})
            try:
                await pipe.execute()
            except (RedisError, OSError):
                return
            for _ in batch:
                self.buffer.popleft()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.buffer:
                await self._flush()
