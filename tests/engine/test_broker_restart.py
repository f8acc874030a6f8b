"""The control plane across a broker restart: Celery's broker and result backend on a Redis of
the test's own, killed with SIGKILL (no persistence, as the machine's Redis runs) and started
again empty, with real Celery workers and a real CPU engine.

A start task lost with the broker while its node agent was stopped is sent again by the
reconciler (a pending instance is re-dispatched); a start in flight when the broker dies goes on
in its worker thread, and the node agent survives the lost connection (a worker holding an
unacknowledged message used to die of it, so tasks are acknowledged when they start). Either way
the instance ends ready, with exactly one engine, and the workers still take work.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from console.celery import app as celery_app
from serving_app.models import Instance
from tests.api.helpers import as_user
from tests.engine.conftest import Cluster, _reset_broker_pools, engine_sessions, wait_for
from tests.engine.test_engine_lifecycle import (
    START_TIMEOUT,
    complete,
    create_deployment,
    register_model,
)
from tests.redis_server import PrivateRedis

pytestmark = [pytest.mark.engine, pytest.mark.celery]
State = Instance.State
NODE = "cpu-a"
NODE_QUEUE = f"node.{NODE}"


@pytest.fixture
def broker(cluster: Cluster, tmp_path) -> Iterator[PrivateRedis]:
    """The cluster's broker and result backend, and this process's, on a private Redis."""
    folder = tmp_path / "broker"
    folder.mkdir()
    server = PrivateRedis(folder)
    server.start()
    cluster.env.update(CELERY_BROKER_URL=server.url, CELERY_RESULT_BACKEND=server.url)
    celery_app.conf.update(broker_url=server.url, result_backend=server.url)
    _reset_broker_pools()
    try:
        yield server
    finally:
        # Workers first, while their broker still answers (the cluster fixture then restores
        # this process's broker and kills any engine left).
        cluster.stop_all()
        server.stop()


def restart(server: PrivateRedis) -> None:
    """A crash and a start again: no persistence, so everything it held is gone."""
    server.kill()
    server.start()


@pytest.mark.engines(1)
def test_broker_restarts_lose_no_start_and_make_no_twin(broker, cluster, platform_admin, acme):
    cluster.start_control()
    cluster.start_agent(NODE)
    register_model(platform_admin)
    deployment = create_deployment(platform_admin)

    # (a) The node agent is stopped (its heartbeat is still recent, so the node keeps getting
    # placements): the start task waits in the agent's queue, and the broker dies with it.
    cluster.stop_process(f"agent-{NODE}")
    client = as_user(platform_admin)
    assert client.post(f"/api/v1/deployments/{deployment['id']}/start/").status_code == 200
    instance = wait_for(lambda: Instance.objects.filter(deployment_id=deployment["id"],
                                                        node__name=NODE).first(),
                        60, "the instance placed on the stopped agent's node")
    wait_for(lambda: broker.client().llen(NODE_QUEUE), 30, "the start task queued")
    assert Instance.objects.get(pk=instance.pk).state == State.PENDING
    restart(broker)
    # The start task is gone: only the reconciler's re-dispatch of the instance, still pending
    # (the re-dispatch comes 30 s after placement), can start it.
    assert not broker.client().llen(NODE_QUEUE)
    cluster.start_agent(NODE)
    starting = wait_for(lambda: Instance.objects.filter(pk=instance.pk, state=State.STARTING,
                                                        pid__isnull=False).first(),
                        90, "the lost start sent again and the engine launched")

    # (b) The broker dies while the engine is starting (the start task running, unacknowledged).
    restart(broker)
    ready = wait_for(lambda: Instance.objects.filter(pk=instance.pk, state=State.READY).first(),
                     START_TIMEOUT, "ready after the broker restarts")
    assert ready.pid == starting.pid
    for label in (f"agent-{NODE}", "control"):
        assert cluster.processes[label].poll() is None, cluster.log(label)[-4000:]
    assert engine_sessions(ready.secret) == {ready.pid}
    assert Instance.objects.filter(deployment_id=deployment["id"]).exclude(
        state=State.STOPPED).count() == 1
    assert complete(ready, "tiny-llama")["choices"][0]["text"]

    # The control plane still reaches the agent through the restarted broker: a stop arrives.
    assert client.post(f"/api/v1/deployments/{deployment['id']}/stop/").status_code == 200
    wait_for(lambda: Instance.objects.filter(pk=instance.pk, state=State.STOPPED).exists(), 60,
             "stopped")
    assert engine_sessions(ready.secret) == set()
