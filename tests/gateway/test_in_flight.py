"""What draining needs from the gateway: a draining instance is out of every worker's routing,
and the requests in flight per instance are counted cluster-wide by the admission and
settlement scripts (real Redis, DB 9), where the control plane reads them
(`serving_app.deployments.inflight`)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from django.utils import timezone

from gateway_app import admission
from gateway_app.catalog import load_snapshot
from gateway_app.metering import Meter
from serving_app.deployments import inflight
from serving_app.models import Instance, Node
from tests.factories import make_base_model, make_deployment, make_tenant
from tests.gateway.conftest import REDIS_URL
from tests.gateway.test_units import CONFIG, tenant

_instances = iter(range(900_000, 1_000_000))


def run(scenario) -> None:
    async def wrapped():
        meter = Meter(CONFIG)
        try:
            await scenario(meter)
        finally:
            await asyncio.gather(*meter._unawaited, return_exceptions=True)
            await meter.redis.aclose()

    asyncio.run(wrapped())


async def unawaited_done(meter: Meter) -> None:
    await asyncio.gather(*meter._unawaited)


def test_an_admitted_request_counts_on_its_instance_until_it_settles():
    limited = tenant(tpm=1000, concurrency=5)
    instance = next(_instances)

    async def scenario(meter: Meter) -> None:
        first, _ = await meter.admit(limited, "a", 10, instance)
        second, _ = await meter.admit(limited, "b", 10, instance)
        assert first.admitted and second.admitted
        assert inflight.count(instance) == 2
        await meter.settle(first, 5, {"id": "a"}, instance)
        assert inflight.count(instance) == 1
        await meter.settle(second, 5, {"id": "b"}, instance)
        assert inflight.count(instance) == 0

    run(scenario)


def test_a_refused_request_is_not_in_flight():
    limited = tenant(tpm=10)
    instance = next(_instances)

    async def scenario(meter: Meter) -> None:
        refused, decision = await meter.admit(limited, "big", 50, instance)
        assert decision.code == admission.TPM and not refused.admitted
        assert inflight.count(instance) == 0

    run(scenario)


def test_a_request_without_limits_and_a_retried_one_are_counted_too():
    first, second = next(_instances), next(_instances)

    async def scenario(meter: Meter) -> None:
        meter.begin(first, "u")  # nobody waits for it
        await unawaited_done(meter)
        assert inflight.counts([first, second]) == {first: 1, second: 0}
        meter.begin(second, "u", moved_from=first)  # the first instance was unreachable
        await unawaited_done(meter)
        assert inflight.counts([first, second]) == {first: 0, second: 1}
        await meter.settle(None, 0, {"id": "u"}, second)
        assert inflight.counts([first, second]) == {first: 0, second: 0}

    run(scenario)


def test_a_request_whose_gateway_died_stops_counting_when_its_lease_expires():
    instance = next(_instances)
    client = redis.Redis.from_url(REDIS_URL)
    now_ms = int(time.time() * 1000)
    client.zadd(inflight.key(instance), {"settled-never": now_ms - 1, "live": now_ms + 60_000})
    assert inflight.count(instance) == 1


@pytest.mark.django_db
def test_a_draining_instance_is_out_of_the_catalog(tmp_path):
    acme = make_tenant("acme")
    deployment = make_deployment(make_base_model(tmp_path / "models"), [acme], name="chat",
                                 desired_state="running")
    node = Node.objects.create(name="n", queue="node.n", last_heartbeat=timezone.now())
    serving, leaving = (Instance.objects.create(deployment=deployment, node=node, port=port,
                                                state="ready", ordinal=port - 18000)
                        for port in (18000, 18001))
    leaving.transition(["ready"], "draining")
    entries = load_snapshot().instances[deployment.pk]
    assert [e.id for e in entries] == [serving.pk]
