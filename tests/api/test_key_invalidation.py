"""Revoking a key (API, portal, the admin's bulk action, the queryset form) tells every gateway
worker at once (Redis pub/sub), so a revoked key stops working as soon as the change commits, not
when the workers' caches expire."""

from __future__ import annotations

import json
import time

import pytest
import redis
from django.test import Client
from django.urls import reverse

from audit_app.models import AuditLog
from gateway_app import invalidation
from serving_app.models import Instance
from tenants_app.models import ApiKey
from tests.api.helpers import as_user
from tests.factories import make_base_model, make_deployment
from tests.parallel import redis_url

pytestmark = pytest.mark.django_db

REDIS_URL = redis_url(14)


@pytest.fixture
def channel(settings):
    settings.GATEWAY = {**settings.GATEWAY, "REDIS_URL": REDIS_URL}
    invalidation._client.cache_clear()
    listener = redis.Redis.from_url(REDIS_URL).pubsub(ignore_subscribe_messages=True)
    listener.subscribe(invalidation.CHANNEL)
    yield listener
    listener.close()
    invalidation._client.cache_clear()


def key_messages(listener, keys, timeout: float = 10.0) -> list[dict]:
    """The key messages published for `keys`, one per key, in arrival order. Redis pub/sub is
    not per database, so messages of other test runs on this host are skipped."""
    hashes = {key.secret_hash for key in keys}
    found: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(found) < len(hashes):
        message = listener.get_message(timeout=max(0.0, deadline - time.monotonic()))
        if message is None:
            continue
        data = json.loads(message["data"])
        if data.get("type") == "key" and data.get("hash") in hashes:
            found.append(data)
    assert len(found) == len(hashes), f"published for {len(found)} of {len(hashes)} keys"
    return found


def test_api_revoke_publishes_the_key_as_unusable(acme, channel,
                                                  django_capture_on_commit_callbacks):
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    with django_capture_on_commit_callbacks(execute=True):
        response = as_user(acme.owner).post(f"/api/v1/api-keys/{key.pk}/revoke/")
    assert response.status_code == 200
    assert key_messages(channel, [key]) == [
        {"type": "key", "hash": key.secret_hash, "usable": False}]


def test_admin_bulk_revoke_publishes_every_selected_key(acme, platform_admin, channel,
                                                       django_capture_on_commit_callbacks):
    """The admin's "revoke selected keys" action: each key announced, each revoke audited."""
    keys = [ApiKey.objects.create_key(tenant=acme.tenant, name=f"k{i}")[0] for i in range(3)]
    client = Client()
    client.force_login(platform_admin)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("admin:tenants_app_apikey_changelist"), {
            "action": "revoke_keys", "_selected_action": [k.pk for k in keys[:2]]})
    assert response.status_code == 302
    published = sorted(key_messages(channel, keys[:2]), key=lambda m: m["hash"])
    expected = sorted(({"type": "key", "hash": k.secret_hash, "usable": False} for k in keys[:2]),
                      key=lambda m: m["hash"])
    assert published == expected
    assert AuditLog.objects.filter(action="revoke", via="admin").count() == 2
    assert ApiKey.objects.get(pk=keys[2].pk).revoked_at is None


def test_queryset_revoke_revokes_once_and_announces_each_key(acme, channel,
                                                            django_capture_on_commit_callbacks):
    first, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="a")
    second, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="b")
    first.revoke()
    with django_capture_on_commit_callbacks(execute=True):
        revoked = ApiKey.objects.for_tenant(acme.tenant).revoke()
    assert revoked == [second]  # the first was revoked already: announced again, not returned
    assert all(m["usable"] is False for m in key_messages(channel, [first, second]))
    assert not hasattr(ApiKey.objects, "revoke"), "the manager must not revoke every key"


def test_portal_revoke_publishes_the_key_as_unusable(acme, channel,
                                                     django_capture_on_commit_callbacks):
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    client = Client()
    client.force_login(acme.owner)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("portal:key-revoke", args=[acme.tenant.slug, key.pk]))
    assert response.status_code == 302
    assert key_messages(channel, [key]) == [
        {"type": "key", "hash": key.secret_hash, "usable": False}]


def catalog_messages(listener, timeout: float = 5.0) -> int:
    """How many catalog messages arrive within `timeout` (stops at the first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = listener.get_message(timeout=max(0.0, deadline - time.monotonic()))
        if message is not None and json.loads(message["data"]).get("type") == "catalog":
            return 1
    return 0


def test_an_instance_becoming_ready_or_leaving_ready_tells_the_gateway(
        tmp_path, acme, channel, django_capture_on_commit_callbacks):
    """`Instance.transition` is a conditional update (no post_save): the domain's
    `instance_routing_changed` signal is what reaches the gateway's receiver."""
    deployment = make_deployment(make_base_model(tmp_path), [acme.tenant])
    instance = Instance.objects.create(deployment=deployment, ordinal=0, state="starting")
    while channel.get_message(timeout=0.2) is not None:  # the create's own message
        pass
    with django_capture_on_commit_callbacks(execute=True):
        assert instance.transition(["starting"], "ready")
    assert catalog_messages(channel) == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert instance.transition(["ready"], "stopping")
    assert catalog_messages(channel) == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert instance.transition(["stopping"], "stopped")
    assert catalog_messages(channel, timeout=1.0) == 0
