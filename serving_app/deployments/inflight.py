"""Requests in flight per instance, cluster-wide, in the gateway's Redis.

The gateway keeps one sorted set per instance: a member per request routed there, scored by
when its lease expires (milliseconds, Redis's clock). Its admission script adds the member in
the same round trip that admits the request (a request of a tenant without limits adds it with
a write the request does not wait for) and its settlement script removes it in the round trip
that settles the request, so counting costs the request path no extra round trip. A member whose
gateway died before settling expires with its lease.

The control plane reads the count here (`count()`, `counts()`) to finish a drain; autoscaling
and fair sharing read the same number. The key is defined here, in the domain, so that the
gateway (which sits above it) and the reconciler name the same key.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import redis
from django.conf import settings

# Expired members are dropped, then the live ones counted, by Redis's own clock.
_COUNT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  out[i] = redis.call('ZCARD', KEYS[i])
end
return out
"""


def key(instance_id: int) -> str:
    """The sorted set of requests in flight on one instance."""
    return f"gw:{{i{instance_id}}}:inflight"


def client() -> redis.Redis:
    """A client of the gateway's Redis as the settings name it now (one per address, so a
    changed setting is followed)."""
    return _client_for(settings.GATEWAY["REDIS_URL"])


@lru_cache(maxsize=8)
def _client_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def _script() -> redis.commands.core.Script:
    return _script_for(settings.GATEWAY["REDIS_URL"])


@lru_cache(maxsize=8)
def _script_for(url: str) -> redis.commands.core.Script:
    return _client_for(url).register_script(_COUNT_LUA)


def counts(instance_ids: Iterable[int]) -> dict[int, int]:
    """Requests in flight on each instance. Raises `redis.RedisError` when Redis cannot be
    read: the caller decides what an unknown count means (a drain waits for its timeout)."""
    ids = list(instance_ids)
    if not ids:
        return {}
    replies = _script()(keys=[key(i) for i in ids])
    return {i: int(n) for i, n in zip(ids, replies, strict=True)}


def count(instance_id: int) -> int:
    """Requests in flight on one instance (see `counts()`)."""
    return counts([instance_id])[instance_id]
