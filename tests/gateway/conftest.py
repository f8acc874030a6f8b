"""Fixtures for the gateway: gateway servers as uvicorn subprocesses against the test database,
and committed domain rows they can see. The real vLLM engine behind them is the session's shared
one (`engine`, tests/conftest.py and tests/engines.py).

Gateway processes read the database themselves, so tests that use them need committed rows
(`transactional_db`). Redis DB 9 holds the gateway's limits and usage stream here; it is flushed
at the start of the session (only that DB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest
import redis
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings

from benchmarks.gateway_bench import free_port, kill_group
from serving_app.models import BaseModel, Deployment, Instance, LoraAdapter, Node, canaries
from tenants_app.models import ApiKey, Tenant
from tests.engines import (  # noqa: F401 (re-exported: the gateway tests import them here)
    ENGINE_SECRET,
    ENGINE_VENV,
    MODELS,
    PRIVATE_MODEL,
    ROOT,
    Engine,
    wait_until,
)
from tests.parallel import redis_url
from tests.redis_server import PrivateRedis

# DB 9 unless the environment names another (so that parallel checkouts do not share one).
REDIS_URL = os.environ.get("GATEWAY_TEST_REDIS_URL", redis_url(9))
MAX_BODY = 64 * 1024


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _gateway_redis():
    """The test process publishes invalidations and runs the writer against Redis DB 9."""
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    with override_settings(GATEWAY={**settings.GATEWAY, "REDIS_URL": REDIS_URL}):
        yield client
    client.close()


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen

    def client(self, key: str, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kwargs)


def start_gateway(database_url: str, workers: int = 1, **env_extra: str) -> Gateway:
    env = {**os.environ, "DATABASE_URL": database_url, "GATEWAY_REDIS_URL": REDIS_URL,
           "GATEWAY_CATALOG_REFRESH_SECONDS": "0.5", "GATEWAY_MAX_BODY_BYTES": str(MAX_BODY),
           "LOG_LEVEL": "WARNING", **env_extra}
    for attempt in range(3):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "console.asgi:application", "--host", "127.0.0.1",
             "--port", str(port), "--workers", str(workers), "--loop", "uvloop", "--http",
             "httptools", "--no-access-log", "--log-level", "warning"],
            cwd=ROOT, env=env, start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda u=url: httpx.get(u + "/v1/models", timeout=2).status_code == 401,
                       60, "gateway start", proc)
        except RuntimeError:
            # Exit 3: uvicorn could not bind, the port free_port found having been taken before
            # it did (seen once in a clean clone: "address already in use"). Another port.
            if proc.poll() == 3 and attempt < 2:
                continue
            raise
        return Gateway(url, proc)
    raise AssertionError("unreachable")


def _test_database_url() -> str:
    s = connection.settings_dict
    user = s.get("USER") or "postgres"
    return f"postgres://{user}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


@pytest.fixture(scope="session")
def gateways(django_db_setup, django_db_blocker):
    """Two gateway servers (2 workers and 1 worker) on the session's test database."""
    if connection.vendor != "postgresql":
        pytest.skip("gateway processes need a shared database (PostgreSQL)")
    url = _test_database_url()
    first = start_gateway(url, workers=2)
    try:
        second = start_gateway(url, workers=1)
    except Exception:
        kill_group(first.proc)
        raise
    yield first, second
    kill_group(second.proc)
    kill_group(first.proc)


@pytest.fixture
def gateway(gateways) -> Gateway:
    return gateways[0]


@dataclass
class World:
    base: BaseModel
    acme: Tenant
    globex: Tenant
    deployment: Deployment
    instance: Instance
    acme_key: ApiKey
    acme_secret: str
    globex_secret: str


def canaries_passed(names: list[str]) -> dict[str, dict]:
    """`Instance.canary` with a passed canary for each of `names`."""
    entries: dict[str, dict] = {}
    for name in names:
        entries = canaries.record(entries, name, ok=True)
    return entries


def make_world(upstream_port: int, secret: str, **acme_limits) -> World:
    # One transaction: a gateway re-reads its catalog every 0.5 s here, and one read between
    # the deployment's creation and its adapters' would show the deployment without them.
    with transaction.atomic():
        return _make_world(upstream_port, secret, **acme_limits)


def _make_world(upstream_port: int, secret: str, **acme_limits) -> World:
    base = BaseModel(name="tiny-llama", path=str(MODELS / "tiny-llama"))
    base.full_clean()
    base.save()
    acme = Tenant.objects.create(slug="acme", name="Acme", **acme_limits)
    globex = Tenant.objects.create(slug="globex", name="Globex")
    style = LoraAdapter(tenant=acme, base_model=base, name="style",
                        path=str(MODELS / "tiny-llama-lora-a"))
    tone = LoraAdapter(tenant=globex, base_model=base, name="tone",
                       path=str(MODELS / "tiny-llama-lora-b"))
    for adapter in (style, tone):
        adapter.full_clean()
        adapter.save()
    deployment = Deployment.objects.create(
        name="tiny", base_model=base, desired_state="running", max_model_len=1024
    )
    deployment.tenants.set([acme, globex])
    deployment.adapters.set([style, tone])
    node = Node.objects.create(name="local", queue="node.local", address="127.0.0.1")
    # As the node agent records a started engine: both adapters loaded, their canary passed.
    loaded = [style.engine_name, tone.engine_name]
    instance = Instance.objects.create(
        deployment=deployment, node=node, port=upstream_port, state="ready", secret=secret,
        loaded_adapters=loaded, canary=canaries_passed(loaded),
    )
    acme_key, acme_secret = ApiKey.objects.create_key(tenant=acme, name="acme-key")
    _, globex_secret = ApiKey.objects.create_key(tenant=globex, name="globex-key")
    return World(base, acme, globex, deployment, instance, acme_key, acme_secret, globex_secret)


def add_private_deployment(world: World) -> Deployment:
    """A running deployment that serves acme alone (`PRIVATE_MODEL`), on the world's engine."""
    private = BaseModel.objects.create(name=PRIVATE_MODEL, path=world.base.path)
    deployment = Deployment.objects.create(
        name="tiny-private", base_model=private, desired_state="running", max_model_len=1024
    )
    deployment.tenants.set([world.acme])
    Instance.objects.create(
        deployment=deployment, node=world.instance.node, port=world.instance.port,
        state="ready", secret=world.instance.secret,
    )
    return deployment


@pytest.fixture
def world(transactional_db, engine) -> World:
    return make_world(engine.port, engine.secret)


def drain_usage(*request_ids: str) -> None:
    """Persist what the gateways appended to the usage stream (the batch writer's work), once
    the events of `request_ids` are in it: a gateway appends a request's event after its answer
    went out, so the client can read the answer first."""
    from gateway_app.writer import UsageWriter

    for request_id in request_ids:
        usage_event(request_id)

    writer = UsageWriter(redis.Redis.from_url(REDIS_URL), consumer="tests")
    writer.drain(max_seconds=30)


def usage_event(request_id: str) -> dict:
    """The request's usage event, as the gateway appended it to the usage stream."""
    client = redis.Redis.from_url(REDIS_URL)
    found: list[dict] = []

    def appended() -> bool:
        for _, fields in client.xrange(settings.GATEWAY["USAGE_STREAM"]):
            event = json.loads(fields[b"e"])
            if event["id"] == request_id:
                found.append(event)
        return bool(found)

    wait_until(appended, 10, f"the usage event of {request_id}")
    client.close()
    assert len(found) == 1, f"{request_id} was metered {len(found)} times"
    return found[0]


def stages_of(resp: httpx.Response) -> list[str]:
    stages = usage_event(resp.headers["x-request-id"])["stages"]
    assert all(ms >= 0 for _, ms in stages)
    return [name for name, _ in stages]
