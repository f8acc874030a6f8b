"""The demo's traffic lasts what it is given (DEMO_TRAFFIC_SECONDS, default 90): its requests are
spread over the time instead of sent as fast as the engine answers (issue #26: 600 requests
took about 25 s). Tested on a simulated clock: nothing here sleeps."""

from __future__ import annotations

import pytest
from django.core.management.base import CommandError

from serving_app.management.commands.demo_traffic import Command, Pacer


class SimulatedClock:
    """Time that passes only when slept (or when a simulated request takes it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


def _turns(pacer: Pacer, clock: SimulatedClock, request_seconds: float = 0.0) -> list[float]:
    """When each request was sent, relative to the start, each taking `request_seconds`."""
    sent = []
    while pacer.wait_turn():
        sent.append(clock.now - pacer.start)
        clock.now += request_seconds
    return sent


def test_requests_are_spread_over_the_whole_time():
    clock = SimulatedClock()
    sent = _turns(Pacer(90, 600, clock=clock, sleep=clock.sleep), clock, request_seconds=0.01)
    assert len(sent) == 600
    assert sent[0] == 0
    gaps = [b - a for a, b in zip(sent[:-1], sent[1:], strict=True)]
    assert min(gaps) == pytest.approx(max(gaps)) == pytest.approx(90 / 600)
    assert 90 - 90 / 600 - 1e-9 <= sent[-1] < 90  # the last one near the end, not at 25 s


def test_a_slow_engine_gets_requests_back_to_back_and_none_after_the_end():
    clock = SimulatedClock()
    sent = _turns(Pacer(10, 600, clock=clock, sleep=clock.sleep), clock, request_seconds=0.5)
    assert len(sent) == 20  # 10 s of 0.5 s requests, fewer than asked
    assert all(t < 10 for t in sent)
    assert clock.now - 1000.0 == pytest.approx(10)


def test_once_every_request_had_its_turn_there_is_none_more():
    clock = SimulatedClock()
    pacer = Pacer(1, 4, clock=clock, sleep=clock.sleep)
    assert _turns(pacer, clock) == pytest.approx([0, 0.25, 0.5, 0.75])
    assert pacer.wait_turn() is False


def _options(*args: str) -> dict:
    return vars(Command().create_parser("manage.py", "demo_traffic").parse_args(args))


def test_the_time_defaults_to_demo_traffic_seconds_else_90(monkeypatch):
    monkeypatch.delenv("DEMO_TRAFFIC_SECONDS", raising=False)
    assert _options()["seconds"] == 90
    monkeypatch.setenv("DEMO_TRAFFIC_SECONDS", "2.5")
    assert _options()["seconds"] == 2.5
    assert _options("--seconds", "7")["seconds"] == 7


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_time_that_is_not_positive_is_refused(value):
    with pytest.raises(CommandError, match="--seconds"):
        _options("--seconds", value)
