"""The deployment page's flow-control panel: its budget and, per tenant, the queue, waits and
served against entitled share from the gateway's counters in Redis, with Jain's index."""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings
from django.urls import reverse

from serving_app import sharing
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db


def test_the_deployment_page_shows_shares_waits_and_the_fairness_index(
    platform_admin, acme, globex, base_model, login
):
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                                 max_num_seqs=8)
    client = redis.Redis.from_url(settings.GATEWAY["REDIS_URL"])
    key = sharing.prefix(deployment.pk)
    for stale in client.scan_iter(key + ":*"):
        client.delete(stale)
    a, g = acme.tenant.pk, globex.tenant.pk
    client.hset(f"{key}:m:{int(time.time() // 60)}", mapping={
        f"n:{a}": 4, f"w:{a}": 1000, f"b:{a}": 4, f"s:{a}": 300,
        f"n:{g}": 1, f"w:{g}": 0, f"b:{g}": 1, f"s:{g}": 100,
    })
    client.rpush(f"{key}:q:{g}", "r1")
    try:
        page = login(platform_admin).get(
            reverse("console:deployment-detail", args=[deployment.pk])).content.decode()
    finally:
        for stale in client.scan_iter(key + ":*"):
            client.delete(stale)
        client.close()
    assert "each instance is sent at most 10 requests at a time" in page  # 8 + allowance 2
    # (300 + 100)^2 / (2 (300^2 + 100^2)) = 0.8
    assert "Jain's index over the backlogged tenants: <strong>0.800</strong>" in page
    assert "250 ms" in page and "75%" in page and "25%" in page
