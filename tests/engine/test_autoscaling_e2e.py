"""Autoscaling end to end: a real control worker with beat deciding from the engine metric
samples that real node agents store, real CPU vLLM engines, and a real gateway that every
request goes through (with a client that never retries).

One deployment whose engines run one sequence at a time, so that a burst of concurrent long
completions builds a queue (`requests_waiting`). Its policy: 1 to 2 instances on waiting
requests with a target of 1. The burst scales it to 2 (and stops: on two cores a busy engine
starves the start of the next); a second burst is spread over both instances without a change;
once it stops, idle over the down window, the deployment goes back to 1. The range is then
lowered to 0..2: idle, it goes to zero, and the first request after that is held by the
gateway while the deployment wakes, then served. Each change is an `autoscale` event with its
reason, and no request failed on the way. Three engine starts, at most two engines alive at
once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from benchmarks.gateway_bench import kill_group
from serving_app.models import Deployment, EngineSample, Instance
from serving_app.models.events import Event, Kind
from tenants_app.models import ApiKey, Tenant
from tests.api.helpers import as_user
from tests.engine.conftest import TEST_BROKER, Cluster, wait_for
from tests.engine.test_engine_lifecycle import (
    START_TIMEOUT,
    create_deployment,
    ready_instances,
    register_model,
)
from tests.gateway.conftest import Gateway, start_gateway

pytestmark = [pytest.mark.engine, pytest.mark.celery]
State = Instance.State
INTERVAL = 2  # seconds between engine samples, and between autoscaling rounds
BURST = 8  # concurrent clients: one runs, seven wait (two in the engine, five in the gateway)
UP_WINDOW, DOWN_WINDOW = 4, 10
UP_COOLDOWN, DOWN_COOLDOWN = 4, 10
WAITING = "waiting requests averages"


class Traffic:
    """Clients sending long completions through the gateway back to back until stopped; every
    reply's status is counted, and anything but a 200 (an exception too) is kept."""

    def __init__(self, gateway: Gateway, secret: str) -> None:
        self.http = httpx.Client(base_url=gateway.url, timeout=300,
                                 headers={"Authorization": f"Bearer {secret}"})
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def ask(self, max_tokens: int) -> httpx.Response | None:
        try:
            response = self.http.post("/v1/completions", json={
                "model": "tiny-llama", "prompt": "Tell me a long story", "max_tokens": max_tokens,
                "ignore_eos": True})
        except httpx.HTTPError as error:
            with self._lock:
                self.failures.append(repr(error))
            return None
        with self._lock:
            self.statuses[response.status_code] += 1
            if response.status_code != 200:
                self.failures.append(f"{response.status_code} {response.text}")
        return response

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.ask(max_tokens=200)

    def start(self, clients: int) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)
        assert not any(thread.is_alive() for thread in self._threads)


def decisions(deployment_id: int) -> list[Event]:
    return list(Event.objects.filter(kind=Kind.AUTOSCALE, deployment_id=deployment_id)
                .order_by("id"))


def replica_changes(deployment_id: int) -> list[list[int]]:
    return [entry.data["replicas"] for entry in decisions(deployment_id)]


def live(deployment_id: int) -> list[Instance]:
    return list(Instance.objects.filter(deployment_id=deployment_id)
                .exclude(state=State.STOPPED).order_by("pk"))


@pytest.fixture
def gateway(cluster: Cluster) -> Iterator[Gateway]:
    """A gateway on the cluster's database and broker (its wake task reaches the control
    worker), with a wake timeout above the slowest engine start seen here and a queue timeout
    above a burst's whole wait: seven requests of 200 tokens queue behind one engine that runs
    one at a time, over 30 s (the default) on a loaded machine, and the test is about scaling,
    not shedding."""
    cluster.env["GATEWAY_REDIS_URL"] = TEST_BROKER
    gw = start_gateway(cluster.env["DATABASE_URL"], CELERY_BROKER_URL=TEST_BROKER,
                       GATEWAY_REDIS_URL=TEST_BROKER,
                       GATEWAY_WAKE_TIMEOUT_SECONDS=str(START_TIMEOUT),
                       GATEWAY_FLOW_QUEUE_TIMEOUT_SECONDS=str(START_TIMEOUT))
    yield gw
    kill_group(gw.proc)


@pytest.mark.engines(3)
def test_a_burst_scales_up_idle_scales_back_down_to_zero_and_a_request_wakes_it(
    cluster, gateway, platform_admin, acme
):
    cluster.env["ENGINE_METRICS_INTERVAL_SECONDS"] = str(INTERVAL)
    cluster.start_control()
    cluster.start_agent("cpu-a")
    cluster.start_agent("cpu-b")
    # No per-minute token limit: the burst asks for far more than the fixture's tenant allows.
    Tenant.objects.filter(pk=acme.tenant.pk).update(tokens_per_minute=None)
    _, secret = ApiKey.objects.create_key(tenant=acme.tenant, name="burst")
    register_model(platform_admin)
    deployment = create_deployment(platform_admin, max_num_seqs=1)["id"]
    client = as_user(platform_admin)
    response = client.post("/api/v1/autoscalers/", {
        "deployment": "chat", "enabled": True, "min_replicas": 1, "max_replicas": 2,
        "metric": "waiting", "target": 1, "up_window_seconds": UP_WINDOW,
        "down_window_seconds": DOWN_WINDOW, "up_cooldown_seconds": UP_COOLDOWN,
        "down_cooldown_seconds": DOWN_COOLDOWN}, format="json")
    assert response.status_code == 201, response.data
    policy = response.data["id"]
    assert client.post(f"/api/v1/deployments/{deployment}/start/").status_code == 200
    [first] = wait_for(lambda: ready_instances(deployment), START_TIMEOUT, "the first instance")
    traffic = Traffic(gateway, secret)
    time.sleep(1)  # beyond the gateway's catalog refresh (0.5 s): it knows the instance
    assert traffic.ask(max_tokens=4) is not None
    assert replica_changes(deployment) == []  # serving one request at a time needs no more

    # A burst: a queue builds on the one engine, and the deployment scales to 2. The burst
    # stops there: on two cores a busy engine starves the next one's start past its timeout.
    traffic.start(BURST)
    try:
        wait_for(lambda: replica_changes(deployment), 120, "a scale-up decision")
    finally:
        traffic.stop()
    assert replica_changes(deployment) == [[1, 2]]
    two = wait_for(lambda: len(ready_instances(deployment)) == 2 and ready_instances(deployment),
                   START_TIMEOUT, "two ready instances")
    [second] = [i for i in two if i.pk != first.pk]

    # Another burst, spread by the gateway over both: at the maximum, no change.
    traffic.start(BURST)
    try:
        wait_for(lambda: EngineSample.objects.filter(instance=second,
                                                     generation_tokens__gt=0).exists(),
                 60, "the second instance serving part of the burst")
        time.sleep(DOWN_WINDOW)  # a whole down window busy: rounds that must not scale down
    finally:
        traffic.stop()
    assert replica_changes(deployment) == [[1, 2]]

    # Idle over the down window: back to 1.
    wait_for(lambda: len(replica_changes(deployment)) == 2, 120, "a scale-down decision")
    assert replica_changes(deployment) == [[1, 2], [2, 1]]
    wait_for(lambda: len(live(deployment)) == 1, 60, "one instance left")

    # The range lowered to 0..2: idle, the deployment goes to zero, its last engine stopped.
    response = client.patch(f"/api/v1/autoscalers/{policy}/", {"min_replicas": 0},
                            format="json")
    assert response.status_code == 200, response.data
    wait_for(lambda: len(replica_changes(deployment)) == 3, 120, "a scale-to-zero decision")
    assert replica_changes(deployment) == [[1, 2], [2, 1], [1, 0]]
    wait_for(lambda: not live(deployment), 60, "every instance stopped")
    assert Deployment.objects.get(pk=deployment).replicas == 0

    # The first request wakes it: held by the gateway while an instance starts, then served.
    replies: list[tuple[httpx.Response | None, datetime]] = []
    held = threading.Thread(
        target=lambda: replies.append((traffic.ask(max_tokens=8), datetime.now(UTC))))
    held.start()
    wait_for(lambda: len(replica_changes(deployment)) == 4, 60, "the wake decision")
    held.join(START_TIMEOUT + 30)
    assert not held.is_alive()
    [(reply, answered)] = replies
    assert reply is not None and reply.status_code == 200, traffic.failures
    [woken] = ready_instances(deployment)
    assert woken.pk not in {first.pk, second.pk}
    assert woken.ready_at is not None and woken.ready_at <= answered  # held until it was ready

    # Every decision recorded with its figures and reason, in order.
    up, down, to_zero, wake = decisions(deployment)
    assert [e.data["replicas"] for e in (up, down, to_zero, wake)] == [
        [1, 2], [2, 1], [1, 0], [0, 1]]
    assert up.data["reason"].startswith(f"{WAITING} ")
    # Flow control (dispatch budget max_num_seqs + 2 = 3) keeps the rest of the burst in the
    # gateway's queue, which counts as waiting on the instance.
    assert "over 1 ready instance(s) against a target of 1" in up.data["reason"]
    queued = up.data["gateway_queued"]
    assert queued is not None
    assert up.data["values"][0] + queued > 1 and up.data["recommendation"] == 2
    if queued:
        assert up.data["reason"].endswith(f"({queued} of them waiting in the gateway's queue)")
    # (Idle by then or not, by a second: the reason may add that nothing was generated.)
    assert down.data["reason"].startswith(
        f"{WAITING} 0.00 over 2 ready instance(s) against a target of 1")
    assert down.data["values"] == [0, 0] and down.data["recommendation"] == 1
    assert to_zero.data["reason"] == (
        f"{WAITING} 0.00 over 1 ready instance(s) against a target of 1; nothing was "
        "generated over the down window")
    assert to_zero.data["recommendation"] == 0
    assert wake.data["reason"] == "a request arrived while at zero"

    # Not one request failed, from the first to the one that woke the deployment.
    assert traffic.failures == []
    assert set(traffic.statuses) == {200}
    assert traffic.statuses[200] >= BURST + 2, traffic.statuses
    print(f"{traffic.statuses[200]} requests through the gateway, all 200; decisions: "
          + "; ".join(f"{e.data['replicas']} {e.data['reason']}" for e in decisions(
              deployment)))
