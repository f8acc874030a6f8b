"""Flow control end to end: the real CPU engine behind several gateway workers (the session's
two servers, three workers, and one more server with strict bands and a short queue timeout).

The fairness bound. Let B be the deployment's total dispatch budget (the sum over its ready
instances) and U the largest weighted charge of one request (`FLOW_INPUT_TOKEN_WEIGHT` x its
prompt bound + `FLOW_OUTPUT_TOKEN_WEIGHT` x its max_tokens). While two equal-weight tenants are
both backlogged, each dispatch goes to the one with the smaller virtual counter, so their
counters never differ by more than U; the tokens served (counted at completion) differ from the
counters only by the requests in flight at either end of a window, at most B each. So over any
window in which both stay backlogged, the weighted tokens served to each differ by at most
2 (B + 1) U.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import httpx
import pytest
import redis
from django.conf import settings

from benchmarks.gateway_bench import kill_group
from gateway_app import flow
from serving_app.deployments import inflight
from tests.gateway.conftest import REDIS_URL, World, _test_database_url, start_gateway

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

PROMPT = "Tell me a story about a lighthouse keeper."
MAX_TOKENS = 256
FLOOD_MAX_TOKENS = 32  # the flood's completions (test_equal_backlogged_...)
IN_WEIGHT, OUT_WEIGHT = 1.0, 2.0  # the settings' defaults


@pytest.fixture(scope="module")
def strict_gateway(django_db_setup, django_db_blocker, gateways):
    """Strict bands and a 15 s queue timeout, two workers: long enough for eight requests
    served one at a time on a loaded machine (3 s timed the last ones out), short enough for
    the timeout test to wait it out."""
    gw = start_gateway(_test_database_url(), workers=2, GATEWAY_FLOW_BANDS="strict",
                       GATEWAY_FLOW_QUEUE_TIMEOUT_SECONDS="15")
    yield gw
    kill_group(gw.proc)


@pytest.fixture(scope="module")
def flood_gateways(django_db_setup, django_db_blocker):
    """Three workers over two servers, like `gateways`, whose queue timeout outlasts the flood's
    waits: 24 closed-loop clients of one tenant share about half of a budget of 2, so each of
    their requests waits about 48 / (completions per second) in the queue, over the default
    30 s when the engine is slow (the test is about who is served, not about timeouts). In a
    clean clone's run, the shared engine (at the idle scheduling class, on two busy cores) once
    made an acme request wait past 300 s with 128-token completions."""
    url = _test_database_url()
    servers = [start_gateway(url, workers=2, GATEWAY_FLOW_QUEUE_TIMEOUT_SECONDS="600")]
    try:
        servers.append(start_gateway(url, workers=1, GATEWAY_FLOW_QUEUE_TIMEOUT_SECONDS="600"))
        yield servers
    finally:
        for gw in servers:
            kill_group(gw.proc)


def set_budget(world: World, budget: int, flow_control: bool = True) -> None:
    world.deployment.dispatch_budget = budget
    world.deployment.flow_control = flow_control
    world.deployment.save()


def wait_for(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def let_gateways_reload() -> None:
    """Every worker re-reads the catalog every 0.5 s here (and on the change's invalidation)."""
    time.sleep(1.5)


def queued(world: World, tenant_id: int) -> int:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return client.llen(f"{flow.prefix(world.deployment.pk)}:q:{tenant_id}")
    finally:
        client.close()


def block_instance(world: World, member: str = "blocker") -> None:
    """Take the instance's whole budget of 1 with a request that never settles."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.zadd(inflight.key(world.instance.pk), {member: time.time() * 1000 + 600_000})
    finally:
        client.close()


def unblock_instance(world: World, member: str = "blocker") -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.zrem(inflight.key(world.instance.pk), member)
    finally:
        client.close()


def request_body(max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens,
            "ignore_eos": True}


def flood(urls: list[str], clients: dict[str, int], completions: int,
          watch=None) -> list[tuple[str, float, int, int]]:
    """Closed-loop clients (`clients`: secret -> how many) spread over the gateway `urls`, until
    `completions` requests have completed in all. Returns (secret, finished, prompt,
    completion tokens) per request, in completion order."""
    done: list[tuple[str, float, int, int]] = []
    stop = asyncio.Event()

    async def client(secret: str, url: str, http: httpx.AsyncClient) -> None:
        headers = {"Authorization": f"Bearer {secret}"}
        while not stop.is_set():
            r = await http.post(url + "/v1/completions", json=request_body(FLOOD_MAX_TOKENS),
                                headers=headers)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            done.append((secret, time.monotonic(), usage["prompt_tokens"],
                         usage["completion_tokens"]))
            if len(done) >= completions:
                stop.set()

    async def main() -> None:
        # As long as the gateways' queue timeout: on a loaded machine an acme request waits
        # for about 48 completions (module docstring of `flood_gateways`).
        async with httpx.AsyncClient(timeout=600) as http:
            tasks = []
            n = 0
            for secret, count in clients.items():
                for _ in range(count):
                    tasks.append(asyncio.ensure_future(client(secret, urls[n % len(urls)], http)))
                    n += 1
            # Once enough have completed, the clients' requests still waiting or running go
            # away (as a client that disconnects: the gateway drops them from its queue and the
            # engine aborts them) rather than being served one budget at a time for nothing:
            # up to one per client, 31 more requests than the 75 counted.
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            stopped.cancel()
            for result in results:  # a client's failure (an error answer, a timeout) fails
                if isinstance(result, BaseException) and not isinstance(
                        result, asyncio.CancelledError):
                    raise result

    if watch is not None:
        watch.start()
    try:
        asyncio.run(main())
    finally:
        if watch is not None:
            watch.stop()
    return done


class Watch:
    """Samples, every 200 ms, the requests the engine runs and queues and the gateway's count of
    requests dispatched to the instance; keeps the largest of each, and counts the samples where
    a tenant had no request waiting (`idle`: the premise "backlogged" did not hold)."""

    def __init__(self, engine, world: World) -> None:
        self.engine = engine
        self.world = world
        self.engine_max = 0.0
        self.gateway_max = 0
        self.idle: Counter[int] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        client = redis.Redis.from_url(REDIS_URL)
        key = inflight.key(self.world.instance.pk)
        try:
            while not self._stop.is_set():
                metrics = self.engine.metrics()
                running = (metrics.get("vllm:num_requests_running", 0.0)
                           + metrics.get("vllm:num_requests_waiting", 0.0))
                self.engine_max = max(self.engine_max, running)
                self.gateway_max = max(self.gateway_max, client.zcard(key))
                for tenant in (self.world.acme, self.world.globex):
                    if not client.llen(f"{flow.prefix(self.world.deployment.pk)}:q:{tenant.pk}"):
                        self.idle[tenant.pk] += 1
                time.sleep(0.2)
        finally:
            client.close()


def weighted_served(done, secret: str, window: slice) -> float:
    """Weighted tokens served to `secret` by the completions in `window` (both tenants were
    backlogged throughout: after the first completions, before the clients stop)."""
    return sum(IN_WEIGHT * p + OUT_WEIGHT * c for s, _, p, c in done[window] if s == secret)


def test_equal_backlogged_tenants_are_served_within_the_bound_and_fcfs_is_not(
    world, engine, flood_gateways
):
    """acme floods with 24 concurrent clients, globex with 8, both always backlogged, through
    three gateway workers. With flow control (budget 2) their weighted tokens served differ by
    at most 2 (B + 1) U (module docstring); first come first served (flow control off for the
    deployment) gives acme about three times globex's and exceeds it. Flow control never had
    more than the budget at the engine (its own running + waiting counts, and the gateway's)."""
    budget = 2
    set_budget(world, budget)
    urls = [g.url for g in flood_gateways]
    let_gateways_reload()
    clients = {world.acme_secret: 24, world.globex_secret: 8}
    prompt_bound = len(PROMPT.encode()) + 16  # what admission reserves (docs/gateway.md)
    charge = IN_WEIGHT * prompt_bound + OUT_WEIGHT * FLOOD_MAX_TOKENS
    bound = 2 * (budget + 1) * charge
    window = slice(15, 75)

    watch = Watch(engine, world)
    done = flood(urls, clients, 75, watch)
    difference = abs(weighted_served(done, world.acme_secret, window)
                     - weighted_served(done, world.globex_secret, window))
    shares = [sum(1 for s, *_ in done[window] if s == secret) for secret in clients]
    assert difference <= bound, (difference, bound, shares, watch.idle)
    assert watch.gateway_max <= budget
    assert watch.engine_max <= budget

    set_budget(world, budget, flow_control=False)
    let_gateways_reload()
    fcfs_watch = Watch(engine, world)
    fcfs = flood(urls, clients, 75, fcfs_watch)
    fcfs_difference = abs(weighted_served(fcfs, world.acme_secret, window)
                          - weighted_served(fcfs, world.globex_secret, window))
    print("served difference: flow control", difference, "FCFS", fcfs_difference, "bound", bound)
    assert fcfs_difference > bound, (fcfs_difference, bound)
    assert fcfs_watch.engine_max > budget  # the check above can see a budget exceeded


def ordered_completions(url: str, world: World, first: tuple[str, int],
                        then: tuple[str, int]) -> list[str]:
    """With the instance's one slot taken, queue `first` (secret, count) then `then`, free the
    slot, and return the secrets in completion order (budget 1: one at a time, so completion
    order is dispatch order)."""
    block_instance(world)
    order: list[str] = []

    async def one(http: httpx.AsyncClient, secret: str) -> None:
        r = await http.post(url + "/v1/completions", json=request_body(8),
                            headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 200, r.text
        order.append(secret)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.ensure_future(one(http, first[0])) for _ in range(first[1])]
            await asyncio.to_thread(wait_for, lambda: queued(world, world.acme.pk) == first[1],
                                    "the first tenant's requests queued")
            tasks += [asyncio.ensure_future(one(http, then[0])) for _ in range(then[1])]
            await asyncio.to_thread(
                wait_for, lambda: queued(world, world.globex.pk) == then[1],
                "the second tenant's requests queued")
            unblock_instance(world)
            # Freeing the slot by hand settles nothing: one more request's admission hands out
            # the free slot (to the best waiter, not necessarily itself).
            tasks.append(asyncio.ensure_future(one(http, then[0])))
            await asyncio.gather(*tasks)

    asyncio.run(main())
    return order


def test_strict_bands_serve_the_higher_band_first(world, strict_gateway):
    world.acme.priority_tier = 3  # low
    world.acme.save()
    world.globex.priority_tier = 2  # normal (the upper bands' reserve would let it pass)
    world.globex.save()
    set_budget(world, 1)
    let_gateways_reload()
    order = ordered_completions(strict_gateway.url, world, (world.acme_secret, 4),
                                (world.globex_secret, 4))
    assert order[:5] == [world.globex_secret] * 5


def test_weighted_bands_let_the_low_band_progress(world, gateways):
    world.acme.priority_tier = 3  # low: band weight 1
    world.acme.save()
    world.globex.priority_tier = 2  # normal: band weight 2
    world.globex.save()
    set_budget(world, 1)
    let_gateways_reload()
    order = ordered_completions(gateways[0].url, world, (world.acme_secret, 4),
                                (world.globex_secret, 4))
    first_low = order.index(world.acme_secret)
    last_high = len(order) - 1 - order[::-1].index(world.globex_secret)
    assert first_low < last_high, order


def test_an_upper_band_request_uses_the_reserve_beyond_the_budget(world, strict_gateway):
    """With the instance's budget of 1 taken, a request of the high tier is dispatched at once
    on one of the slots reserved for the upper bands (GATEWAY_FLOW_RESERVED_SLOTS, 2 by
    default), while a normal one waits for the budget."""
    world.globex.priority_tier = 1  # high
    world.globex.save()
    set_budget(world, 1)
    let_gateways_reload()
    block_instance(world)
    try:
        async def main() -> tuple[int, int]:
            async with httpx.AsyncClient(timeout=60) as http:
                normal = asyncio.ensure_future(http.post(
                    strict_gateway.url + "/v1/completions", json=request_body(8),
                    headers={"Authorization": f"Bearer {world.acme_secret}"}))
                await asyncio.to_thread(wait_for, lambda: queued(world, world.acme.pk) == 1,
                                        "the normal request queued")
                high = await http.post(strict_gateway.url + "/v1/completions",
                                       json=request_body(8),
                                       headers={"Authorization": f"Bearer {world.globex_secret}"})
                assert high.status_code == 200, high.text
                assert queued(world, world.acme.pk) == 1  # still waiting for the budget
                unblock_instance(world)
                # Freeing the slot by hand settles nothing: one more request's admission hands
                # it out, to the waiter (the first in its band) or to itself.
                more = await http.post(strict_gateway.url + "/v1/completions",
                                       json=request_body(8),
                                       headers={"Authorization": f"Bearer {world.acme_secret}"})
                return (await normal).status_code, more.status_code

        assert asyncio.run(main()) == (200, 200)
    finally:
        unblock_instance(world)


def test_a_request_past_its_queue_timeout_gets_503_with_retry_after(world, strict_gateway):
    set_budget(world, 1)
    let_gateways_reload()
    block_instance(world)
    try:
        r = httpx.post(strict_gateway.url + "/v1/completions", json=request_body(),
                       headers={"Authorization": f"Bearer {world.acme_secret}"}, timeout=60)
    finally:
        unblock_instance(world)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "queue_timeout"
    assert r.json()["error"]["type"] == "server_error"
    assert int(r.headers["retry-after"]) >= 1
    assert queued(world, world.acme.pk) == 0


def test_a_client_that_disconnects_leaves_the_queue(world, strict_gateway):
    """The request leaves the queue when its client goes away: its usage event says so (499
    client_disconnected, where the queue timeout would have recorded 503 queue_timeout)."""
    set_budget(world, 1)
    let_gateways_reload()
    stream = redis.Redis.from_url(REDIS_URL)
    last = stream.xrevrange(settings.GATEWAY["USAGE_STREAM"], count=1)
    since = last[0][0] if last else b"0"
    block_instance(world)
    try:
        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                task = asyncio.ensure_future(http.post(
                    strict_gateway.url + "/v1/completions", json=request_body(),
                    headers={"Authorization": f"Bearer {world.acme_secret}"}))
                await asyncio.to_thread(wait_for, lambda: queued(world, world.acme.pk) == 1,
                                        "the request queued")
                task.cancel()  # closes the connection

        asyncio.run(main())
        wait_for(lambda: queued(world, world.acme.pk) == 0, "the request left the queue")
    finally:
        unblock_instance(world)
    events = [json.loads(fields[b"e"]) for _, fields in
              stream.xrange(settings.GATEWAY["USAGE_STREAM"], min=b"(" + since)]
    stream.close()
    mine = [e for e in events if e["tenant"] == world.acme.pk]
    assert [(e["status"], e["error"]) for e in mine] == [(499, "client_disconnected")]
    # The slot is free again and serves the next request at once.
    r = httpx.post(strict_gateway.url + "/v1/completions", json=request_body(),
                   headers={"Authorization": f"Bearer {world.acme_secret}"}, timeout=30)
    assert r.status_code == 200
