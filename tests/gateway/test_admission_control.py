"""The admission controller (`gateway_app/objectives.py`) on real Redis, with the real admission
and settlement scripts and an injected clock: a tenant with latency objectives streams while
another floods the same deployment; the controller lowers the flood's budget while the streams
near their objective, holds it in the band below, and the flood gets the whole budget back once
the tenant with objectives is idle.

The latency traces are recorded stream shapes, not measured here: token gaps as a GPU engine
gives them alone (20 ms) and beside a flood (50 ms), with objectives between (TPOT 40 ms). No
engine runs: what is tested is what the gateway does with what it measures."""

from __future__ import annotations

import dataclasses
import time

import redis

from gateway_app.catalog import Snapshot
from gateway_app.objectives import LatencyWatch, Stream, floor_of
from serving_app.deployments import sharing
from tests.gateway.conftest import REDIS_URL
from tests.gateway.test_flow_units import Engine, run, tenant


class Trace:
    """A recorded stream: its tokens' times in seconds after the request began, read at the
    injected clock's time."""

    def __init__(self, start: float, first: float, gap_ms: list[float]) -> None:
        self.times = [start + first]
        for gap in gap_ms:
            self.times.append(self.times[-1] + gap / 1000)
        self.start = start
        self.now = start

    def seen(self) -> list[float]:
        return [t for t in self.times if t <= self.now]

    def stream(self, t) -> Stream:
        return Stream(t, self.start, lambda: self.seen()[0] if self.seen() else None,
                      lambda: self.seen()[-1] if self.seen() else None, lambda: len(self.seen()))


def redis_now_ms() -> int:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        seconds, micros = client.time()
        return seconds * 1000 + micros // 1000
    finally:
        client.close()


def test_the_floods_budget_falls_near_the_objective_holds_in_the_band_and_returns_when_idle():
    async def scenario(meter):
        engine = Engine(meter, 16)
        support = dataclasses.replace(tenant(), ttft_objective_ms=400, tpot_objective_ms=40)
        flood = tenant()
        deployment = engine.deployment
        snapshot = Snapshot(tenants={support.id: support, flood.id: flood},
                            instances={deployment: tuple(engine.instances)},
                            objectives={deployment: (support.id,)})
        clock = [0.0]
        watch = LatencyWatch(meter.redis, lambda: snapshot, lambda: clock[0])
        assert floor_of(16) == 2

        # The flood holds 12 of the 16 slots; customer service streams one answer.
        for _ in range(12):
            await engine.send(flood)
        asking = await engine.send(support)
        assert asking in engine.running
        # Beside the flood: first token at 300 ms (0.75 of 400), then 50 ms a token (1.25x).
        trace = Trace(0.0, 0.3, [50.0] * 40 + [32.0] * 40 + [20.0] * 200)
        base = redis_now_ms()
        budgets = []
        with watch.watching(deployment, trace.stream(support)):
            for step in range(1, 25):
                clock[0] = trace.now = 0.25 * step
                budgets.append((await watch.report(base + 250 * step))[deployment])
        # Lowering: halved each period while the tokens come at 50 ms (16, 8, 4, 2: the floor);
        # holding at the floor while they come at 32 ms (0.8 of the objective, in the band);
        # raised by 1 (1/16 of 16) a period once they come at 20 ms (0.5).
        # (The first period has no first token yet, and 250 ms is within the TTFT objective:
        # nothing measured, the budget holds.)
        assert budgets[:9] == [16, 8, 4, 2, 2, 2, 2, 2, 2], budgets
        assert budgets[9:14] == [2, 2, 2, 2, 2], budgets
        assert budgets[14:] == list(range(3, 13)), budgets

        # Held to the controller's budget: with 13 in flight the flood gets no slot, while
        # customer service's next request still goes at once (ahead of the flood's waiters).
        held = budgets[-1]
        assert held < 13
        for _ in range(3):
            await engine.send(flood)
        assert sum(engine.in_flight()) == 13
        second = await engine.send(support)
        assert second in engine.running and sum(engine.in_flight()) == 14

        state = sharing.admission_state(deployment)
        assert state is not None and state.active and state.budget == held
        assert state.tpot_objective_ms == 40 and state.ttft_objective_ms == 400
        assert [p.budget for p in state.history][:5] == [16, 8, 4, 2, 2]

        # Customer service goes idle: its requests settle, and past the idle time the flood's
        # next dispatches fill the whole budget again.
        for rid in (asking, second):
            engine.running.remove(rid)
            event = {"id": rid, "prompt": 10, "completion": 10}
            await meter.settle(None, 20, event, slot=engine.slots[rid])
        time.sleep(sharing.OBJECTIVE_IDLE_SECONDS + 0.1)
        await engine.send(flood)
        assert sum(engine.in_flight()) == 16
        idle = await watch.report()
        assert idle[deployment] == 16
        state = sharing.admission_state(deployment)
        assert state is not None and not state.active and state.budget == 16

    run(scenario)


def test_a_stream_without_a_first_token_past_its_objective_counts_as_a_miss():
    """Before its first token a stream is only a lower bound: it counts once past the
    objective (already missed), not before."""
    t = dataclasses.replace(tenant(), ttft_objective_ms=400)
    trace = Trace(0.0, 0.9, [20.0] * 10)
    stream = trace.stream(t)
    trace.now = 0.3
    assert stream.look(0.3).ratio == -1
    trace.now = 0.6
    assert stream.look(0.6).ratio == 1.5
    trace.now = 1.0
    assert stream.look(1.0).ttft_ms == 900.0
