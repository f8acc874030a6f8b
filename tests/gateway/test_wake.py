"""Scale to zero through the gateway: a request for a deployment its autoscaler has scaled to
zero sends the wake task to the control queue, is held until an instance is ready, and is
served; when no instance is ready within the wake timeout it gets a 503 with `retry-after`.

Here the control worker and the node agent are played by the test, so that only the gateway's
part is under test: the wake task is taken off the broker's control queue and run
(`autoscaling.wake`, what the worker runs), and the instance is made ready on the mock
upstream as an agent would (a transition to ready, which tells the gateways at once).
"""

from __future__ import annotations

import base64
import json
import threading

import httpx
import pytest
import redis
from django.conf import settings
from django.db import transaction

from benchmarks.gateway_bench import kill_group
from serving_app import lifecycle
from serving_app.deployments import autoscaling
from serving_app.models import Deployment, Instance
from serving_app.models.autoscalers import Autoscaler
from tests.gateway.conftest import _test_database_url, make_world, start_gateway, wait_until
from tests.gateway.test_requests import Upstream

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def upstream():
    up = Upstream()
    yield up
    up.close()


@pytest.fixture
def broker():
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    take_wakes(client)
    yield client
    take_wakes(client)
    client.close()


def take_wakes(client: redis.Redis) -> list[int]:
    """Take every wake task off the control queue; the deployment ids they name."""
    woken = []
    for raw in client.lrange(lifecycle.CONTROL_QUEUE, 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] == lifecycle.WAKE_DEPLOYMENT:
            client.lrem(lifecycle.CONTROL_QUEUE, 1, raw)
            args, _, _ = json.loads(base64.b64decode(message["body"]))
            woken.append(args[0])
    return woken


def world_at_zero(port: int):
    """The gateway tests' world with its deployment scaled to zero by its autoscaler, committed
    at once (a gateway that read the catalog in between would still route to the instance)."""
    with transaction.atomic():
        world = make_world(port, "s")
        Autoscaler.objects.create(deployment=world.deployment, enabled=True, min_replicas=0,
                                  max_replicas=2)
        Deployment.objects.filter(pk=world.deployment.pk).update(replicas=0)
        Instance.objects.filter(pk=world.instance.pk).update(state=Instance.State.STOPPED)
    world.instance.refresh_from_db()
    return world


def ask(gateway, secret: str) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "tiny-llama", "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hello"}]})


def test_a_request_wakes_a_deployment_at_zero_and_is_served_once_it_is_ready(
        gateways, upstream, broker):
    world = world_at_zero(upstream.port)
    deployment = world.deployment
    replies: list[httpx.Response] = []
    held = threading.Thread(target=lambda: replies.append(ask(gateways[0], world.acme_secret)))
    held.start()
    woken: list[int] = []
    wait_until(lambda: woken.extend(take_wakes(broker)) or woken, 10, "the wake task")
    assert set(woken) == {deployment.pk}
    assert replies == []  # held while nothing is ready
    # The control worker's part, then the agent's.
    assert autoscaling.wake(deployment.pk) is True
    deployment.refresh_from_db()
    assert deployment.replicas == 1
    world.instance.refresh_from_db()
    assert world.instance.transition([Instance.State.STOPPED], Instance.State.READY)
    held.join(30)
    [reply] = replies
    assert reply.status_code == 200, reply.text
    assert upstream.generations == 1


def test_no_instance_within_the_wake_timeout_is_a_503_with_retry_after(upstream, broker):
    world = world_at_zero(upstream.port)
    deployment = world.deployment
    gateway = start_gateway(_test_database_url(), GATEWAY_WAKE_TIMEOUT_SECONDS="1.5")
    try:
        reply = ask(gateway, world.acme_secret)
    finally:
        kill_group(gateway.proc)
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["code"] == "model_not_ready"
    assert take_wakes(broker) == [deployment.pk]
    assert upstream.generations == 0
