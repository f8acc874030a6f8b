"""Flow control's scripts on real Redis, without an engine: the admission script queues beyond an
instance's dispatch budget, settlement hands the slot to the next waiter by band, then by the
tenants' virtual token counters; leaving the queue; the per-minute statistics."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import random
from collections import Counter

import redis

from gateway_app import flow
from gateway_app.catalog import InstanceEntry, TenantEntry
from gateway_app.metering import Meter
from serving_app.deployments import inflight
from serving_app.deployments.sharing import jain_index
from tests.gateway.conftest import REDIS_URL
from tests.gateway.test_units import CONFIG

_ids = iter(range(900_000, 2_000_000))


def tenant(priority: int = 2, weight: int = 1) -> TenantEntry:
    return TenantEntry(id=next(_ids), slug="t", active=True, priority=priority, rpm=None,
                       tpm=None, concurrency=None, budget=None, max_tokens=None, max_prompt=None,
                       weight=weight)


class Engine:
    """One deployment with instances of `budgets`, driven through a Meter like the gateway does:
    `send()` admits (or queues) a request, `finish()` settles the oldest one in flight."""

    def __init__(self, meter: Meter, *budgets: int) -> None:
        self.meter = meter
        self.deployment = next(_ids)
        self.instances = [InstanceEntry(next(_ids), self.deployment, "", "", frozenset(), b)
                          for b in budgets]
        self.slots: dict[str, flow.Slot] = {}
        self.futures: dict[str, asyncio.Future[int]] = {}
        self.running: list[str] = []  # in the order they were granted
        self.granted: list[TenantEntry] = []
        self._n = 0

    async def send(self, t: TenantEntry, prompt: int = 10, completion: int = 10) -> str:
        assert self.meter.flow is not None
        self._n += 1
        rid = f"r{self.deployment}-{self._n}"
        slot = self.meter.flow.slot(self.deployment, t, prompt, completion, self.instances,
                                    self.instances)
        self.futures[rid] = self.meter.flow.expect(rid)
        _, decision = await self.meter.admit(t, rid, prompt + completion, slot=slot)
        self.slots[rid] = slot
        if decision.instance > 0:
            self.meter.flow.forget(rid)
            self.futures.pop(rid)
            self._granted(rid, decision.instance)
        return rid

    def _granted(self, rid: str, instance: int) -> None:
        self.slots[rid].instance_id = instance
        self.running.append(rid)
        self.granted.append(self.slots[rid].tenant)

    async def finish(self, rid: str | None = None, prompt: int = 10, completion: int = 10):
        rid = rid or self.running[0]
        self.running.remove(rid)
        event = {"id": rid, "prompt": prompt, "completion": completion}
        await self.meter.settle(None, prompt + completion, event, slot=self.slots[rid])
        await self.collect()

    async def collect(self) -> None:
        """Take the grants the settlement pushed to this worker's list."""
        await asyncio.sleep(0)
        for _ in range(200):
            done = [r for r, f in self.futures.items() if f.done()]
            for rid in done:
                self._granted(rid, self.futures.pop(rid).result())
                assert self.meter.flow is not None
                self.meter.flow.forget(rid)
            if done or not self.futures:
                return
            await asyncio.sleep(0.01)

    def in_flight(self) -> list[int]:
        client = redis.Redis.from_url(REDIS_URL)
        try:
            return [client.zcard(inflight.key(i.id)) for i in self.instances]
        finally:
            client.close()


def run(scenario, **config) -> None:
    async def main():
        meter = Meter(dataclasses.replace(CONFIG, **config))
        meter.start()
        try:
            await scenario(meter)
        finally:
            await meter.stop()

    asyncio.run(main())


def test_requests_beyond_the_budget_wait_and_get_the_freed_slot():
    async def scenario(meter):
        engine = Engine(meter, 2, 1)
        a = tenant()
        for _ in range(5):
            await engine.send(a)
        assert engine.in_flight() == [2, 1]
        assert len(engine.running) == 3 and len(engine.futures) == 2
        for _ in range(5):
            await engine.finish()
            assert sum(engine.in_flight()) <= 3
            assert engine.in_flight()[0] <= 2 and engine.in_flight()[1] <= 1
        assert engine.in_flight() == [0, 0] and not engine.futures

    run(scenario)


def test_equal_backlogged_tenants_alternate_however_many_each_sends():
    async def scenario(meter):
        engine = Engine(meter, 1)
        heavy, light = tenant(), tenant()
        await engine.send(heavy)
        for _ in range(12):
            await engine.send(heavy)
        for _ in range(4):
            await engine.send(light)
        while engine.running:
            await engine.finish()
        order = ["h" if t is heavy else "l" for t in engine.granted]
        # The first request ran alone. `light`, backlogged beside it, is lifted to the service
        # `heavy` has been settled (none yet), not to `heavy`'s counter, which includes that
        # request in flight: it goes next, then they alternate.
        assert order[:9] == ["h", "l", "h", "l", "h", "l", "h", "l", "h"]

    run(scenario)


def test_weights_share_dispatches_in_proportion():
    async def scenario(meter):
        engine = Engine(meter, 1)
        double, single = tenant(weight=2), tenant(weight=1)
        await engine.send(single)
        for _ in range(20):
            await engine.send(double)
            await engine.send(single)
        for _ in range(15):
            await engine.finish()
        # Counted from the first request, which ran alone (and was charged) before the queue.
        served = Counter("d" if t is double else "s" for t in engine.granted)
        assert abs(served["d"] - 2 * served["s"]) <= 1

    run(scenario)


def test_an_idle_tenant_is_lifted_and_cannot_bank_credit():
    async def scenario(meter):
        engine = Engine(meter, 1)
        busy, idle, other = tenant(), tenant(), tenant()
        # `busy` and `other` share the engine for a while; `idle` sends nothing.
        await engine.send(busy)
        for _ in range(10):
            await engine.send(busy)
            await engine.send(other)
        for _ in range(10):
            await engine.finish()
        # Now `idle` arrives: it is lifted to the lowest backlogged counter, so it alternates
        # with the others instead of taking every slot until it has caught up.
        for _ in range(6):
            await engine.send(idle)
        start = len(engine.granted)
        for _ in range(9):
            await engine.finish()
        after = Counter(id(t) for t in engine.granted[start:])
        assert after[id(idle)] <= 4

    run(scenario)


def test_a_tenant_arriving_when_nobody_waits_is_lifted_too():
    """With nobody waiting, a request is dispatched at once without queueing; it is still
    lifted to the counter of the band's last dispatch, so an idle tenant banks no credit there
    either."""
    async def scenario(meter):
        engine = Engine(meter, 1)
        early, late = tenant(), tenant()
        for _ in range(8):  # `early` alone, one at a time: never queued
            await engine.send(early)
            assert not engine.futures
            await engine.finish()
        await engine.send(late)  # nobody waits: dispatched at once, lifted to early's counter
        assert not engine.futures
        for _ in range(4):  # `late` queues first, so it is backlogged alone for a moment
            await engine.send(late)
        for _ in range(4):
            await engine.send(early)
        while engine.running:
            await engine.finish()
        order = ["e" if t is early else "l" for t in engine.granted[9:]]
        # Lifted, `late` alternates with `early`; had it kept its counter of 0 it would take
        # every slot until it had caught up with eight requests' worth.
        assert order[:6] in (["l", "e", "l", "e", "l", "e"], ["e", "l", "e", "l", "e", "l"])

    run(scenario)


def reserved(engine: Engine) -> int:
    """Requests on the instance's reserved slots (the engine's first instance)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return client.zcard(f"gw:{{i{engine.instances[0].id}}}:reserve")
    finally:
        client.close()


def test_an_upper_band_takes_the_reserve_beyond_the_budget_and_a_lower_one_does_not():
    async def scenario(meter):
        engine = Engine(meter, 1)
        normal, high = tenant(priority=2), tenant(priority=1)
        for _ in range(3):
            await engine.send(normal)
        assert engine.in_flight() == [1] and len(engine.futures) == 2  # the budget holds
        for _ in range(4):
            await engine.send(high)
        # Two of high's go at once, on the two reserved slots; the rest wait with normal's.
        assert engine.granted == [normal, high, high]
        assert engine.in_flight() == [3] and reserved(engine) == 2 and len(engine.futures) == 4
        while engine.running:
            await engine.finish()
            assert engine.in_flight()[0] <= 3 and reserved(engine) <= 2
        assert Counter(id(t) for t in engine.granted) == {id(normal): 3, id(high): 4}
        assert reserved(engine) == 0

    run(scenario, flow_reserved_slots=2)


def test_a_flood_of_an_upper_band_through_the_reserve_does_not_starve_a_lower_band():
    """The reserved slots are the upper bands' on top of the budget: the budget's slot is still
    shared by the bands' weights, so a lower band progresses while an upper one floods."""
    async def scenario(meter):
        engine = Engine(meter, 1)
        normal, high = tenant(priority=2), tenant(priority=1)
        for _ in range(3):
            await engine.send(normal)
        for _ in range(6):
            await engine.send(high)
        for _ in range(24):  # high stays backlogged throughout
            await engine.finish()
            await engine.send(high)
        assert Counter(id(t) for t in engine.granted)[id(normal)] == 3

    run(scenario, flow_reserved_slots=2)


def test_strict_bands_serve_a_higher_band_first():
    async def scenario(meter):
        engine = Engine(meter, 1)
        low, high = tenant(priority=3), tenant(priority=1)
        await engine.send(low)
        for _ in range(4):
            await engine.send(low)
        for _ in range(4):
            await engine.send(high)
        for _ in range(5):
            await engine.finish()
        assert [t.priority for t in engine.granted[1:5]] == [1, 1, 1, 1]

    run(scenario, flow_strict=True)


def test_weighted_bands_let_a_lower_band_progress():
    async def scenario(meter):
        engine = Engine(meter, 1)
        low, high = tenant(priority=3), tenant(priority=1)
        await engine.send(low)
        for _ in range(12):
            await engine.send(low)
            await engine.send(high)
        for _ in range(10):
            await engine.finish()
        served = Counter(t.priority for t in engine.granted[1:11])
        # Band weights 4 (high) and 1 (low): about one low dispatch in five.
        assert served[3] >= 1 and served[1] >= 7

    run(scenario, flow_strict=False)


def test_a_waiter_that_leaves_is_not_granted_and_a_granted_one_is_told():
    async def scenario(meter):
        engine = Engine(meter, 1)
        a = tenant()
        await engine.send(a)
        gone = await engine.send(a)
        kept = await engine.send(a)
        # `gone` leaves the queue: not granted, and the next slot goes to `kept`.
        assert await meter.flow.leave(gone, engine.slots[gone]) == 0
        engine.futures.pop(gone)
        await engine.finish()
        assert engine.running == [kept]
        # A waiter granted just before it left learns its instance (to use it or give it back).
        late = await engine.send(a)
        engine.futures.pop(late)
        await engine.finish()
        instance = await meter.flow.leave(late, engine.slots[late])
        assert instance == engine.instances[0].id
        engine._granted(late, instance)
        await engine.finish(late)
        assert engine.in_flight() == [0]

    run(scenario)


def test_statistics_count_dispatches_waits_and_served_tokens():
    async def scenario(meter):
        engine = Engine(meter, 1)
        a = tenant()
        await engine.send(a)
        await engine.send(a)
        await engine.finish(prompt=5, completion=7)
        await engine.finish(prompt=5, completion=7)
        client = redis.Redis.from_url(REDIS_URL)
        try:
            stats: Counter[str] = Counter()
            for key in client.scan_iter(flow.prefix(engine.deployment) + ":m:*"):
                for field, value in client.hgetall(key).items():
                    stats[field.decode()] += float(value)
        finally:
            client.close()
        assert stats[f"n:{a.id}"] == 2 and stats[f"b:{a.id}"] == 1
        assert stats[f"s:{a.id}"] == 2 * (5 + 2 * 7)

    run(scenario)


async def settled(check) -> None:
    for _ in range(300):
        if check():
            return
        await asyncio.sleep(0.01)


def test_a_slot_nobody_waits_for_is_given_back():
    """A request whose admission's reply was lost goes on without flow control: the slot it was
    granted at admission, or later through its worker's list, is freed and handed on."""
    async def scenario(meter):
        engine = Engine(meter, 1)
        meter.flow.instances_of = lambda _: engine.instances
        a = tenant()
        first = await engine.send(a)
        lost = await engine.send(a)  # waits; then its worker forgets it, as after a lost reply
        meter.flow.forget(lost)
        engine.futures.pop(lost)
        third = await engine.send(a)
        await engine.finish(first)  # grants `lost`, whose worker gives the slot back: to `third`
        await settled(lambda: third not in engine.futures or engine.futures[third].done())
        await engine.collect()
        assert engine.running == [third]
        # Granted at admission and then abandoned: freed in the background.
        await engine.finish(third)
        abandoned = await engine.send(a)
        assert engine.running == [abandoned] and engine.in_flight() == [1]
        engine.running.clear()
        meter.flow.abandon(abandoned, engine.slots[abandoned])
        await settled(lambda: engine.in_flight() == [0])
        assert engine.in_flight() == [0]
        # Neither given-back slot still counts as a request of `a` in flight.
        await settled(lambda: not holds(engine)[0])
        assert holds(engine) == ({}, {}, [])

    run(scenario)


def holds(engine: Engine) -> tuple[dict, dict, list]:
    """The deployment's requests in flight as flow control holds them: per tenant the sum of
    their charges, per request its tenant and charge, the requests by lease expiry."""
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        key = flow.prefix(engine.deployment)
        return (client.hgetall(f"{key}:c"), client.hgetall(f"{key}:cr"),
                client.zrange(f"{key}:cx", 0, -1))
    finally:
        client.close()


def counter(engine: Engine, t: TenantEntry) -> float:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return float(client.hget(f"{flow.prefix(engine.deployment)}:v", t.id) or 0)
    finally:
        client.close()


def test_holds_follow_the_requests_in_flight_and_are_let_go_at_settlement():
    async def scenario(meter):
        engine = Engine(meter, 2)
        a, b = tenant(), tenant(weight=2)
        first = await engine.send(a, prompt=10, completion=30)
        await engine.send(b, prompt=10, completion=30)
        await engine.send(a)  # waits
        charge = engine.slots[first].charge  # 10 + 2 x 30
        by_tenant, by_request, expiring = holds(engine)
        assert by_tenant == {str(a.id): f"{charge:g}", str(b.id): f"{charge / 2:g}"}  # b: weight 2
        assert by_request[first] == f"{a.id}|{charge:g}" and len(expiring) == 2
        await engine.finish(first)  # hands the slot to a's waiter, charged 10 + 2 x 10
        assert holds(engine)[0] == {str(a.id): "30", str(b.id): f"{charge / 2:g}"}
        while engine.running:
            await engine.finish()
        assert holds(engine) == ({}, {}, [])

    run(scenario)


def test_a_hold_whose_lease_expired_is_let_go_and_its_late_settlement_changes_nothing():
    """A gateway that dies never settles its requests: their holds expire with their leases,
    so the level others are lifted to does not stay low; a settlement that does come later
    (a request that outlived its lease) is not taken off twice."""
    async def scenario(meter):
        engine = Engine(meter, 2)
        a, b = tenant(), tenant()
        lost = await engine.send(a)  # charged 30; its gateway "dies"
        client = redis.Redis.from_url(REDIS_URL)
        try:  # its lease runs out: the expiry of its slot and of its hold pass
            client.zadd(inflight.key(engine.instances[0].id), {lost: 1})
            client.zadd(f"{flow.prefix(engine.deployment)}:cx", {lost: 1})
        finally:
            client.close()
        for _ in range(4):  # two dispatched, two wait: `a` is backlogged, its counter 90
            await engine.send(a)
        assert counter(engine, a) == 90
        assert holds(engine)[0] == {str(a.id): "90"}  # not swept before a lift needs it
        await engine.send(b)  # lifted to a's settled service: 90 less 60 in flight
        assert counter(engine, b) == 30
        assert holds(engine)[0] == {str(a.id): "60"} and lost not in holds(engine)[1]
        await engine.finish(lost, prompt=10, completion=0)  # settles late, at 10 of its 30
        assert counter(engine, a) == 70  # its counter is corrected, its holds not again
        assert holds(engine)[0] == {str(a.id): "60"}

    run(scenario)


def test_two_equal_closed_loop_tenants_converge_to_equal_service_after_the_ramp():
    """The H200 pair (docs/gpu.md): equal tenants with 48 and 16 clients that each send again as
    soon as an answer ends, budget 32, the second tenant arriving 2 s after the first has taken
    every slot. The engine is simulated (each request is served in 1.5-1.9 s of simulated time,
    a GPU engine's pace for 256 / 256); admission, settlement and the slot hand-over are the real
    scripts on real Redis, charged as the gateway charges (a byte-based prompt bound of 1,500,
    settled at the real 256). No slot is taken back from a request, so the second tenant ramps up
    as slots free. It is lifted to the service the first has been settled, not to the first's
    counter, which holds the reservations of its 32 requests in flight (most of it given back at
    settlement): so it takes the freed slots until the two hold as much, and over the first
    11.6 s after it arrives (the H200 run's window) service is already even. (Lifted to the
    counter, it took every other freed slot while the first's refunds kept it ahead: Jain 0.875
    over that window, as the H200 run measured, and 0.984 over 60 s. Now 0.975 and 0.997.)"""
    async def scenario(meter):
        rng = random.Random(7)
        engine = Engine(meter, 32)
        first, second = tenant(), tenant()
        events: list[tuple[float, int, str]] = []
        timed: set[str] = set()
        now = 0.0
        seq = itertools.count()

        def serve_granted() -> None:
            for rid in engine.running:
                if rid not in timed:
                    timed.add(rid)
                    heapq.heappush(events, (now + rng.uniform(1.5, 1.9), next(seq), rid))

        for _ in range(48):
            await engine.send(first, prompt=1500, completion=256)
        serve_granted()
        arrival, end = 2.0, 62.0
        heapq.heappush(events, (arrival, next(seq), ""))
        done: dict[str, list[float]] = {"first": [], "second": []}
        while events:
            now, _, rid = heapq.heappop(events)
            if now > end:
                break
            if not rid:  # the second tenant's 16 clients start
                for _ in range(16):
                    await engine.send(second, prompt=1500, completion=256)
                serve_granted()
                continue
            t = engine.slots[rid].tenant
            await engine.finish(rid, prompt=256, completion=256)
            done["first" if t is first else "second"].append(now)
            await engine.send(t, prompt=1500, completion=256)
            serve_granted()

        def jain(since: float, until: float) -> tuple[float, list[int]]:
            """Jain's index over the completions in [since, until], and those counts."""
            counts = [sum(since <= s <= until for s in ends) for ends in done.values()]
            return jain_index(counts) or 0.0, counts

        # The second's requests take 1.5 s: nothing of it can end in the window's first 1.5 s.
        short, whole = jain(arrival, arrival + 11.6), jain(arrival, end)
        assert short[0] >= 0.95, short
        assert whole[0] >= 0.99, whole
        # Once ramped up (the last 30 s), the second holds about 15 of its 16 clients' slots: a
        # slot it frees goes to a waiter of the first before its client has sent again.
        late = jain(end - 30, end)
        assert late[0] >= 0.99, late

    run(scenario)


class WaveEngine(Engine):
    """The engine of a saturated pair, simulated in time (`now`, seconds) while the scripts run
    on real Redis under the same clock (`FlowControl.clock`). Grants are read from this
    worker's wake list after each script (its wake loop is stopped), and the pump a hold asks
    for runs when the hold has passed in simulated time, not in real time: the replay is
    deterministic."""

    def __init__(self, meter: Meter, budget: int, base_ms: int) -> None:
        super().__init__(meter, budget)
        assert meter.flow is not None
        self.now = 0.0
        meter.flow.clock = lambda: base_ms + int(self.now * 1000)
        self.holds: list[int] = []
        meter.flow.pump_after = lambda slot, ms: self.holds.append(ms)
        self.client = redis.Redis.from_url(REDIS_URL)

    async def collect(self) -> None:
        assert self.meter.flow is not None
        key = self.meter.flow.wake_key
        with self.client.pipeline() as pipe:
            pipe.lrange(key, 0, -1)
            pipe.delete(key)
            messages, _ = pipe.execute()
        for message in messages:
            rid, inst, _ = message.decode().split(" ", 2)
            self.futures.pop(rid)
            self.meter.flow.forget(rid)
            self._granted(rid, int(inst))


def saturated_pair(hold_ms: int, seconds: float = 40.0) -> dict[str, list[float]]:
    """Two equal tenants with 192 and 64 clients on one engine of 128 sequences at the shipped
    budget (128 + 2), as the GPU run of issue 44 sets them (256 / 256, charged a prompt bound
    of 1,500): every request served in 1.8 s plus 0-20 ms (requests of one length end in waves)
    and each client sending again 5-30 ms after its answer. The second tenant starts 2 s after
    the first. Returns each tenant's completion times."""
    done: dict[str, list[float]] = {"first": [], "second": []}

    async def scenario(meter):
        await meter.flow.stop()  # the replay reads the wake list itself
        base = redis.Redis.from_url(REDIS_URL).time()
        engine = WaveEngine(meter, 130, base[0] * 1000 + base[1] // 1000)
        rng = random.Random(11)
        first, second = tenant(), tenant()
        events: list[tuple[float, int, str, object]] = []
        timed: set[str] = set()
        seq = itertools.count()

        def at(when: float, kind: str, what: object) -> None:
            heapq.heappush(events, (when, next(seq), kind, what))

        def serve_granted() -> None:
            for rid in engine.running:
                if rid not in timed:
                    timed.add(rid)
                    at(engine.now + 1.8 + rng.uniform(0, 0.02), "done", rid)

        async def send(t) -> None:
            await engine.send(t, prompt=1500, completion=256)
            serve_granted()

        for _ in range(192):
            await send(first)
        for _ in range(64):
            at(2.0, "send", second)
        while events:
            when, _, kind, what = heapq.heappop(events)
            if when > seconds:
                break
            engine.now = when
            if kind == "send":
                await send(what)
            elif kind == "pump":
                await meter.flow.pump(what)
                await engine.collect()
                serve_granted()
            else:
                slot = engine.slots[what]
                await engine.finish(what, prompt=256, completion=256)
                serve_granted()
                done["first" if slot.tenant is first else "second"].append(when)
                at(when + rng.uniform(0.005, 0.030), "send", slot.tenant)
                for ms in engine.holds:
                    at(when + ms / 1000, "pump", slot)
                engine.holds.clear()
        engine.client.close()

    run(scenario, flow_settled_hold_ms=hold_ms)
    return done


def test_a_saturated_pair_with_waves_and_client_gaps_shares_equally_at_full_throughput():
    """Issue 44's pair: 192 and 64 clients of two equal tenants against 128 sequences, at the
    shipped budget and settled-slot hold. The smaller tenant has fewer clients (64) than its
    half of the 130 slots, so fair is all of its clients served; at full throughput every slot
    is busy. Without the hold (GATEWAY_FLOW_SETTLED_HOLD_MS=0) a slot it settles goes to a
    waiter of the larger tenant before its client has sent again, and its next request then
    waits for the next wave, 1.8 s later: it holds fewer slots than it has clients (measured
    2026-12-06: Jain 0.973 of the fair shares, 1,461 and 1,009 completions; with the hold
    0.999, 1,254 and 1,152, at 0.985 of every slot always busy)."""
    done = saturated_pair(hold_ms=50)
    since, until = 6.0, 40.0  # after the smaller tenant's first wave
    counts = [sum(since <= s <= until for s in ends) for ends in done.values()]
    # Each tenant's completions over its fair share: the larger's half of the slots (66 of
    # 130 with the other's 64) and all of the smaller's 64 clients, each client's cycle a
    # request (1.81 s on average) and its gap (17.5 ms on average).
    cycles = (until - since) / 1.8275
    index = jain_index(c / f for c, f in zip(counts, [cycles * 66, cycles * 64], strict=True))
    assert index is not None and index >= 0.99, (index, counts)
    # Full throughput: first come first served keeps every slot busy (130 slots, 1.81 s a
    # request); the hold leaves a slot idle only for a client's gap, when it takes it.
    assert sum(counts) >= 0.97 * 130 * (until - since) / 1.81, counts
