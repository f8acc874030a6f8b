"""Each worker's in-process view: the catalog snapshot and the key cache, kept current through
Redis pub/sub (`invalidation.CHANNEL`) and a periodic re-read.

Nothing here queries the database in the request path once a key has been seen: a cached key is
served while a background task re-reads it after GATEWAY_KEY_CACHE_SECONDS (stale while
revalidating, so a database outage does not take authentication down), and the snapshot is
replaced by a background task. A revocation or a suspension is applied on receipt of its
message, before any re-read, and a re-read that started before the message cannot undo it.
After the subscription drops and comes back, everything cached is dropped, since messages may
have been missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aioredis

from gateway_app import catalog, invalidation
from gateway_app.catalog import KeyEntry, Snapshot
from gateway_app.config import GatewayConfig

log = logging.getLogger(__name__)

MAX_KEYS = 200_000


class GatewayCache:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.snapshot = Snapshot()
        self.keys: dict[str, KeyEntry] = {}
        self._key_loads: dict[str, asyncio.Task[KeyEntry]] = {}
        # Changes learnt from messages, with when they arrived, so that an older re-read that
        # lands afterwards cannot bring back what they removed.
        self._key_changed_at: dict[str, float] = {}
        self._tenant_status: dict[int, tuple[bool, float]] = {}
        self._catalog_changed_at = 0.0  # the last catalog or tenant message
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateway-db")
        self._refresh_wanted = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._first_snapshot = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.subscribed = asyncio.Event()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._refresh_loop(), name="gateway-catalog-refresh"),
            asyncio.create_task(self._listen_loop(), name="gateway-invalidation-listener"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def ready(self, timeout: float = 10.0) -> bool:
        """Wait for the first snapshot (a worker that just started has none)."""
        if self._first_snapshot.is_set():
            return True
        try:
            await asyncio.wait_for(self._first_snapshot.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # -- keys -------------------------------------------------------------------------------
    async def key(self, secret: str) -> KeyEntry:
        digest = hashlib.sha256(secret.encode()).hexdigest()
        entry = self.keys.get(digest)
        now = time.monotonic()
        if entry is not None:
            if entry.fresh_until > now:
                return entry
            if entry.id is not None:
                self._load_key(secret, digest)  # serve it while it is re-read
                return entry
        return await self._load_key(secret, digest)

    def _load_key(self, secret: str, digest: str) -> asyncio.Task[KeyEntry]:
        task = self._key_loads.get(digest)
        if task is None:
            task = asyncio.create_task(self._read_key(secret, digest))
            self._key_loads[digest] = task
            task.add_done_callback(lambda _t: self._key_loads.pop(digest, None))
        return task

    async def _read_key(self, secret: str, digest: str) -> KeyEntry:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            entry = await loop.run_in_executor(
                self._executor,
                catalog.load_key,
                secret,
                self.config.key_ttl,
                self.config.negative_key_ttl,
            )
        except Exception as exc:
            stale = self.keys.get(digest)
            if stale is not None and stale.id is not None:
                log.warning("key re-read failed, serving the cached key: %s", exc)
                # Retry in a few seconds rather than at every request.
                self.keys[digest] = dataclasses.replace(stale, fresh_until=time.monotonic() + 5)
                return stale
            raise
        changed = self._key_changed_at.get(digest)
        if changed is not None and changed >= started:
            # A message arrived while we were reading: what we read may predate it.
            return self.keys.get(digest) or KeyEntry(id=None, fresh_until=0.0)
        if entry.tenant_id is not None and entry.tenant_id not in self.snapshot.tenants:
            await self.refresh_now()  # a tenant created after our last snapshot
        if len(self.keys) >= MAX_KEYS:
            self.keys = {k: v for k, v in self.keys.items() if v.id is not None}
        self.keys[digest] = entry
        return entry

    # -- snapshot ---------------------------------------------------------------------------
    async def refresh_now(self, timeout: float = 5.0) -> None:
        """Re-read the catalog and wait for it (used when something is missing from it)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        self._refresh_wanted.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), timeout)

    async def refresh_if_older(self, seconds: float = 0.25) -> bool:
        """Re-read a catalog older than `seconds`, or older than the last change announced
        (when a name or an instance is missing: it may have just been added). Bounded, so bad
        requests cannot hammer the database."""
        loaded = self.snapshot.loaded_at
        if time.monotonic() - loaded < seconds and loaded > self._catalog_changed_at:
            return False
        await self.refresh_now()
        return True

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = time.monotonic()
            waiters, self._waiters = self._waiters, []
            self._refresh_wanted.clear()
            try:
                snapshot = await loop.run_in_executor(self._executor, catalog.load_snapshot)
            except Exception as exc:  # keep serving from the last snapshot
                log.warning("catalog refresh failed, keeping the last one: %s", exc)
            else:
                self._install(snapshot, started)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._refresh_wanted.wait(), self.config.catalog_refresh)
            await asyncio.sleep(0.05)  # coalesce bursts of messages

    def _install(self, snapshot: Snapshot, started: float) -> None:
        for tenant_id, (active, at) in list(self._tenant_status.items()):
            if at >= started and tenant_id in snapshot.tenants:
                snapshot.tenants[tenant_id] = dataclasses.replace(
                    snapshot.tenants[tenant_id], active=active
                )
            elif at < started - 60:
                del self._tenant_status[tenant_id]
        snapshot.loaded_at = started  # what it shows is at least this recent
        self.snapshot = snapshot
        self._first_snapshot.set()
        cutoff = time.monotonic() - 60
        self._key_changed_at = {k: t for k, t in self._key_changed_at.items() if t > cutoff}

    # -- invalidation -----------------------------------------------------------------------
    async def _listen_loop(self) -> None:
        backoff = 0.1
        first = True
        while True:
            client = aioredis.Redis.from_url(
                self.config.redis_url, socket_connect_timeout=2.0, health_check_interval=10
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(invalidation.CHANNEL)
                if not first:  # messages may have been missed while we were away
                    self.keys.clear()
                    self._refresh_wanted.set()
                first = False
                backoff = 0.1
                self.subscribed.set()
                while True:
                    message = await pubsub.get_message(timeout=5.0)
                    if message is not None and message.get("type") == "message":
                        self.apply(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.subscribed.clear()
                log.warning("gateway invalidation listener lost Redis: %s", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                    await client.aclose()

    def apply(self, raw: bytes | str) -> None:
        try:
            message: dict[str, Any] = json.loads(raw)
        except ValueError:
            return
        now = time.monotonic()
        kind = message.get("type")
        if kind == "key":
            digest = str(message.get("hash"))
            self._key_changed_at[digest] = now
            if message.get("usable"):
                self.keys.pop(digest, None)
            else:
                self.keys[digest] = KeyEntry(
                    id=None, fresh_until=now + max(self.config.negative_key_ttl, 1.0)
                )
        elif kind == "tenant":
            tenant_id = int(message.get("id") or 0)
            active = message.get("status") == "active"
            self._tenant_status[tenant_id] = (active, now)
            self._catalog_changed_at = now
            current = self.snapshot.tenants.get(tenant_id)
            if current is not None:
                self.snapshot.tenants[tenant_id] = dataclasses.replace(current, active=active)
            self._refresh_wanted.set()
        elif kind == "catalog":
            self._catalog_changed_at = now
            self._refresh_wanted.set()
