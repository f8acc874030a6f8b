"""Telling every gateway worker that a key, a tenant or the serving catalog changed.

Called from the processes that change those rows (the management API, the admin, the engine
lifecycle). A message is published on Redis pub/sub after the surrounding transaction commits,
so a worker that reloads on receipt reads the committed row. Each worker's listener lives in
`gateway_app.cache`.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import redis
from django.conf import settings
from django.db import transaction

if TYPE_CHECKING:
    from tenants_app.models import ApiKey, Tenant

log = logging.getLogger(__name__)

CHANNEL = "gw:invalidate"


@lru_cache(maxsize=1)
def _client() -> redis.Redis:
    return redis.Redis.from_url(
        settings.GATEWAY["REDIS_URL"], socket_timeout=2.0, socket_connect_timeout=2.0
    )


def publish(message: dict[str, Any]) -> None:
    """Publish `message` to all workers once the current transaction (if any) commits."""
    payload = json.dumps(message)

    def send() -> None:
        try:
            _client().publish(CHANNEL, payload)
        except redis.RedisError as exc:
            # Workers still converge: cached keys expire after GATEWAY_KEY_CACHE_SECONDS and the
            # catalog is re-read every GATEWAY_CATALOG_REFRESH_SECONDS.
            log.warning("gateway invalidation %s not published: %s", payload, exc)

    transaction.on_commit(send)


def key_changed(key: ApiKey, *, deleted: bool = False) -> None:
    """A key was created, changed, revoked or deleted."""
    usable = False if deleted else key.is_usable()
    publish({"type": "key", "hash": key.secret_hash, "usable": usable})


def tenant_changed(tenant: Tenant, *, deleted: bool = False) -> None:
    """A tenant's status or limits changed (a suspension applies at once in every worker)."""
    status = "deleted" if deleted else tenant.status
    publish({"type": "tenant", "id": tenant.pk, "status": status})


def catalog_changed() -> None:
    """Deployments, adapters or instances changed: workers re-read the catalog now."""
    publish({"type": "catalog"})
