"""Health of PostgreSQL, Redis and the usage writer: `/healthz`, `/readyz`, `/api/v1/health/`,
the overview's metering cards and the console's "degraded" banner, against a Redis of the test's
own (stopped to make it unreachable)."""

from __future__ import annotations

import json
import time

import pytest
from django.conf import settings
from django.test import Client, override_settings

from gateway_app.writer import UsageWriter
from serving_app.metering import health
from tests.factories import make_user
from tests.redis_server import PrivateRedis

STREAM = "gw:usage"


@pytest.fixture
def redis_for_health(tmp_path, monkeypatch):
    """A Redis of this test's own: these tests stop it, so they need no shared lock."""
    server = PrivateRedis(tmp_path)
    server.start()
    monkeypatch.setattr(health, "_cached", None)
    try:
        gateway = {**settings.GATEWAY, "REDIS_URL": server.url, "USAGE_STREAM": STREAM}
        with override_settings(GATEWAY=gateway,
                               HEALTH_WRITER_MAX_LAG_SECONDS=60.0,
                               HEALTH_CHECK_TIMEOUT_SECONDS=0.5):
            yield server
    finally:
        server.stop()


@pytest.fixture
def staff(db):
    return make_user("root", staff=True)


def staff_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def old_event(server, age_seconds: float) -> None:
    """An event appended `age_seconds` ago and never stored (stream ids carry their time)."""
    at_ms = int((time.time() - age_seconds) * 1000)
    server.client().xadd(STREAM, {"e": json.dumps({"id": f"old-{at_ms}", "at": at_ms / 1000,
                                                   "status": 200})}, id=f"{at_ms}-0")


@pytest.mark.django_db
def test_probes_and_api_report_healthy_with_an_empty_stream(redis_for_health, staff):
    client = Client()
    assert client.get("/healthz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.content
    assert ready.json()["writer"] == {"ok": True, "error": "", "stream_length": 0,
                                      "lag_seconds": 0.0, "max_lag_seconds": 60.0}
    assert client.get("/api/v1/health/").status_code in (401, 403)
    tenant_user = Client()
    tenant_user.force_login(make_user("someone"))
    assert tenant_user.get("/api/v1/health/").status_code == 403
    body = staff_client(staff).get("/api/v1/health/").json()
    assert body["healthy"] and body["database"]["ok"] and body["redis"]["ok"]
    page = staff_client(staff).get("/")
    assert page.status_code == 200 and b"Degraded" not in page.content


@pytest.mark.django_db
def test_a_writer_behind_makes_readyz_fail_and_the_console_show_the_lag(
    redis_for_health, staff
):
    old_event(redis_for_health, 120)
    ready = Client().get("/readyz")
    assert ready.status_code == 503
    writer = ready.json()["writer"]
    assert not writer["ok"] and writer["stream_length"] == 1 and writer["lag_seconds"] >= 120
    page = staff_client(staff).get("/").content.decode()
    assert "Degraded:" in page and "Metering is behind: 1 usage events" in page
    assert "Usage events unwritten" in page

    # The writer catches up: healthy again.
    UsageWriter(redis_for_health.client(), stream=STREAM, consumer="t").drain()
    health._cached = None
    assert Client().get("/readyz").status_code == 200
    assert "Degraded" not in staff_client(staff).get("/").content.decode()


@pytest.mark.django_db
def test_redis_unreachable_makes_readyz_fail_and_every_console_page_show_the_banner(
    redis_for_health, staff
):
    redis_for_health.stop()
    ready = Client().get("/readyz")
    assert ready.status_code == 503
    body = ready.json()
    assert body["database"]["ok"] and not body["redis"]["ok"] and not body["writer"]["ok"]
    assert Client().get("/healthz").status_code == 200  # liveness does not depend on Redis
    client = staff_client(staff)
    for url in ("/", "/tenants/", "/deployments/"):
        page = client.get(url).content.decode()
        assert "Degraded:" in page and "Redis is unreachable" in page, url
    redis_for_health.start()
    health._cached = None
    assert Client().get("/readyz").status_code == 200


@pytest.mark.django_db
def test_the_writers_probe_exits_nonzero_while_it_is_behind(redis_for_health):
    from django.core.management import CommandError, call_command

    call_command("usage_writer", check=True)  # healthy: returns
    old_event(redis_for_health, 120)
    with pytest.raises(CommandError, match="Metering is behind"):
        call_command("usage_writer", check=True)
