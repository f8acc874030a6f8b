"""Revoking a key through the API tells every gateway worker at once (Redis pub/sub), so a revoked
key stops working as soon as the change commits, not when the workers' caches expire."""

from __future__ import annotations

import json
import time

import pytest
import redis

from serving_app.gateway import invalidation
from tenants_app.models import ApiKey
from tests.api.helpers import as_user

pytestmark = pytest.mark.django_db

REDIS_URL = "redis://127.0.0.1:6379/14"


@pytest.fixture
def channel(settings):
    settings.GATEWAY_REDIS_URL = REDIS_URL
    invalidation._client.cache_clear()
    listener = redis.Redis.from_url(REDIS_URL).pubsub(ignore_subscribe_messages=True)
    listener.subscribe(invalidation.CHANNEL)
    yield listener
    listener.close()
    invalidation._client.cache_clear()


def next_message(listener, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = listener.get_message(timeout=max(0.0, deadline - time.monotonic()))
        if message is not None:
            return json.loads(message["data"])
    raise AssertionError("no invalidation message was published")


def test_api_revoke_publishes_the_key_as_unusable(acme, channel,
                                                  django_capture_on_commit_callbacks):
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    with django_capture_on_commit_callbacks(execute=True):
        response = as_user(acme.owner).post(f"/api/v1/api-keys/{key.pk}/revoke/")
    assert response.status_code == 200
    assert next_message(channel) == {"type": "key", "hash": key.secret_hash, "usable": False}
