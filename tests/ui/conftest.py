"""Fixtures for the console and portal pages: their URLs, signed-in clients, rollup data."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.test import Client
from django.urls import NoReverseMatch, clear_url_caches, reverse
from django.utils import timezone

from serving_app.deployments import sharing
from serving_app.models.usage import LATENCY_BUCKETS_MS, UsageHour, UsageMinute, UsageTenSecond


@pytest.fixture(autouse=True)
def console_urls(settings):
    """Use tests/ui/urls.py while console/urls.py does not include the console yet."""
    try:
        reverse("console:overview")
        reverse("portal:home")
    except NoReverseMatch:
        settings.ROOT_URLCONF = "tests.ui.urls"
        clear_url_caches()
    yield
    clear_url_caches()


@pytest.fixture
def login():
    def build(user) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return build


def add_usage(tenant, model: str = "llama-mini", *, minutes_ago: int = 5, requests: int = 10,
              latency_ms: float = 300.0, errors: int = 0, rate_limited: int = 0,
              prompt: int = 100, completion: int = 50) -> None:
    """One ten-second, one minute and one hour rollup row, as the usage writer would leave
    them."""
    at = timezone.now() - timedelta(minutes=minutes_ago)
    bucket = next((b for b in LATENCY_BUCKETS_MS if latency_ms <= b), None)  # None: overflow
    counters = {
        "requests": requests, "errors": errors, "rate_limited": rate_limited,
        "prompt_tokens": prompt * requests, "completion_tokens": completion * requests,
        "latency_ms_total": latency_ms * requests, "latency_ms_max": latency_ms,
        "ttft_ms_total": latency_ms / 3 * requests, "ttft_count": requests,
    }
    if bucket is not None:
        counters[f"latency_le_{bucket}"] = requests
    for rollup, bucket_start in (
        (UsageTenSecond, at.replace(second=at.second - at.second % 10, microsecond=0)),
        (UsageMinute, at.replace(second=0, microsecond=0)),
        (UsageHour, at.replace(minute=0, second=0, microsecond=0)),
    ):
        row, _ = rollup.objects.get_or_create(bucket=bucket_start, tenant=tenant, model=model)
        for name, value in counters.items():
            if name == "latency_ms_max":
                row.latency_ms_max = max(row.latency_ms_max, value)
            else:
                setattr(row, name, getattr(row, name) + value)
        row.save()


@pytest.fixture
def usage():
    return add_usage


@contextmanager
def flow_minute(deployment_id: int, counters: dict[str, float],
                queued: dict[int, list[str]] | None = None) -> Iterator[None]:
    """This minute's flow-control counters of a deployment in the gateway's Redis, written as
    the gateway's scripts name them (and tenants' queued request ids), removed again after."""
    client = redis.Redis.from_url(settings.GATEWAY["REDIS_URL"])
    key = sharing.prefix(deployment_id)

    def clear() -> None:
        for stale in client.scan_iter(key + ":*"):
            client.delete(stale)

    clear()
    client.hset(f"{key}:m:{int(time.time() // 60)}", mapping=counters)
    for tenant_id, ids in (queued or {}).items():
        client.rpush(f"{key}:q:{tenant_id}", *ids)
    try:
        yield
    finally:
        clear()
        client.close()
