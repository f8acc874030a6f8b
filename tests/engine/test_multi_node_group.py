"""A model across two node agents, end to end: a deployment whose tensor-parallel group spans
nodes (`allow_multi_node`) runs as one leader (node rank 0, the API server) on one agent's node
and a headless worker (node rank 1) on the other's, real CPU vLLM processes of vLLM's
multi-node executor meeting at the rendezvous the console chose. The worker's whole session is
killed with SIGKILL: its agent marks it failed, the leader's agent stops the leader, and the
reconciler restarts the group as one. A stop then leaves no process of the group on either
node. Both agents run on this one host (two "nodes" with their own queues); at most one group
(two engines) is alive at once.
"""

from __future__ import annotations

import os
import signal

import pytest

from serving_app.models import Instance, InstanceWorker
from serving_app.models.events import Event, Kind
from tests.api.helpers import as_user
from tests.engine.conftest import engine_sessions, wait_for
from tests.engine.test_engine_lifecycle import (
    START_TIMEOUT,
    complete,
    create_deployment,
    register_model,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.celery,
    # Two group starts on the CPU engine take about 4 minutes on this 2-core machine: more than
    # the CI run's budget allows (docs/testing.md, "What the test run costs"), so this file is
    # collected only with MULTI_NODE_TESTS=1 (tests/engine/conftest.py; a skip would fail CI).
    # The lost-worker path is also covered by tests/unit/test_group_supervision.py on every run.
]
State = Instance.State
Worker = InstanceWorker.State


def ready(deployment_id: int, restarts: int) -> Instance | None:
    return Instance.objects.select_related("node").filter(
        deployment_id=deployment_id, state=State.READY, restarts=restarts).first()


@pytest.mark.engines(2)
def test_a_group_across_two_agents_starts_restarts_and_stops_as_one(cluster, platform_admin,
                                                                      acme):
    # Rendezvous ports of this test's own range: the last ten of the engines'.
    low, high = int(cluster.env["ENGINE_PORT_MIN"]), int(cluster.env["ENGINE_PORT_MAX"])
    rendezvous = (high - 9, high)
    cluster.env.update(ENGINE_RENDEZVOUS_PORT_MIN=str(rendezvous[0]),
                       ENGINE_RENDEZVOUS_PORT_MAX=str(rendezvous[1]),
                       ENGINE_PORT_MAX=str(high - 10))
    assert low < high - 10
    cluster.start_control()
    cluster.start_agent("cpu-a")
    cluster.start_agent("cpu-b")
    register_model(platform_admin)
    deployment = create_deployment(platform_admin, tensor_parallel_size=2,
                                   allow_multi_node=True, max_loras=1)["id"]
    client = as_user(platform_admin)
    assert client.post(f"/api/v1/deployments/{deployment}/start/").status_code == 200

    first = wait_for(lambda: ready(deployment, 0), START_TIMEOUT, "the group ready")
    worker = first.workers.select_related("node").get()
    assert {first.node.name, worker.node.name} == {"cpu-a", "cpu-b"}
    assert (worker.node_rank, worker.state) == (1, Worker.RUNNING)
    assert "--headless" in worker.command and "--headless" not in first.command
    assert first.master_port is not None and rendezvous[0] <= first.master_port <= rendezvous[1]
    assert complete(first, "tiny-llama")["choices"][0]["text"] is not None
    # One session per node: the leader's and the worker's.
    assert engine_sessions(first.secret) == {first.pid, worker.pid}

    # The worker is lost: the group fails as one and is restarted as one.
    os.killpg(worker.pid, signal.SIGKILL)
    restarted = wait_for(lambda: ready(deployment, 1), START_TIMEOUT + 60,
                         "the group restarted and ready")
    assert restarted.pk == first.pk and restarted.pid != first.pid
    # Failed as a group (whichever agent saw it first: the worker's, or the leader's when the
    # leader exited on losing its worker), then restarted once.
    assert Event.objects.filter(kind=Kind.FAILED, instance_id=first.pk).exists()
    assert Event.objects.filter(kind=Kind.RESTARTING, instance_id=first.pk).count() == 1
    again = restarted.workers.get()
    assert again.state == Worker.RUNNING and again.pid != worker.pid
    assert engine_sessions(first.secret) == {restarted.pid, again.pid}
    assert complete(restarted, "tiny-llama")["choices"][0]["text"] is not None

    # A stop leaves nothing of the group on either node.
    assert client.post(f"/api/v1/deployments/{deployment}/stop/").status_code == 200
    wait_for(lambda: Instance.objects.filter(pk=first.pk, state=State.STOPPED).exists(), 90,
             "the group stopped")
    assert InstanceWorker.objects.get(pk=again.pk).state == Worker.STOPPED
    assert engine_sessions(first.secret) == set()
