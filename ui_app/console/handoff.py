"""A secret shown once after a redirect (post/redirect/get): the POST puts it in a one-time
Redis entry that lives a few minutes and is read once (GETDEL), bound to the user who made it,
and redirects to a page naming the entry; a reload of that page finds nothing, and nothing is
made again. The secret is never written to the session table or any other row."""

from __future__ import annotations

import json
import secrets
from functools import lru_cache
from typing import Any

import redis
from django.conf import settings

HANDOFF_SECONDS = 120


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def put(kind: str, user_id: int | None, payload: dict[str, Any]) -> str | None:
    """Keep `payload` for `user_id`'s next page; the entry's name, or None without Redis."""
    name = secrets.token_urlsafe(16)
    try:
        _client(settings.REDIS_URL).set(f"handoff:{kind}:{name}",
                                        json.dumps({"user": user_id, **payload}),
                                        ex=HANDOFF_SECONDS)
    except redis.RedisError:
        return None
    return name


def take(kind: str, user_id: int | None, name: str) -> dict[str, Any] | None:
    """The payload of entry `name`, once, if it is `user_id`'s (None otherwise)."""
    if not name or user_id is None:
        return None
    try:
        raw = _client(settings.REDIS_URL).getdel(f"handoff:{kind}:{name}")
    except redis.RedisError:
        return None
    data = json.loads(raw) if raw else None
    if not isinstance(data, dict) or data.pop("user", None) != user_id:
        return None
    return data
