"""What a latency objective costs on a capacity curve (serving_app/frontier.py): worked examples,
then properties over random monotone curves (hypothesis). No database: the module is plain."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving_app import frontier
from serving_app.frontier import NONE, PART, WHOLE, Objectives, Point


def point(c: int, tok_s: float, ttft: float | None, tpot: float | None, e2e: float | None,
          failed: int = 0) -> Point:
    return Point(concurrency=c, completed=10, failed=failed, output_tokens=1280,
                 duration_s=1.0, tokens_per_s=tok_s, ttft_p50_ms=ttft, ttft_p95_ms=ttft,
                 tpot_p50_ms=tpot, tpot_p95_ms=tpot, e2e_p95_ms=e2e)


# Shaped like the H200's 8B curve (docs/gpu.md): throughput rises, every p95 rises with it.
CURVE = [point(1, 210, 20, 4.7, 620), point(8, 1548, 40, 4.9, 660),
         point(32, 4898, 90, 5.4, 780), point(64, 8438, 180, 5.9, 940),
         point(128, 12549, 400, 7.7, 1380)]


def test_no_objective_costs_nothing_the_whole_curve():
    cost = frontier.cost(CURVE, Objectives())
    assert (cost.reach, cost.tokens_per_s, cost.fraction, cost.concurrency) == \
        (WHOLE, 12549, 1.0, 128)


def test_objectives_every_level_meets_are_the_whole_curve():
    cost = frontier.cost(CURVE, Objectives(ttft_ms=400, tpot_ms=8, e2e_ms=2000))
    assert cost.reach == WHOLE and cost.fraction == 1.0 and cost.limited_by is None


def test_a_crossing_is_interpolated_between_the_levels_around_it():
    # TTFT p95 500 ms... 90 at 32 and 180 at 64: 135 ms is half way.
    cost = frontier.cost(CURVE, Objectives(ttft_ms=135))
    assert cost.reach == PART and cost.limited_by == "ttft"
    assert cost.concurrency == pytest.approx(48)
    assert cost.tokens_per_s == pytest.approx((4898 + 8438) / 2)
    assert cost.fraction == pytest.approx((4898 + 8438) / 2 / 12549)


def test_a_per_token_objective_alone_ends_the_curve():
    # 5.4 ms at 32, 5.9 at 64: 5.65 is half way.
    cost = frontier.cost(CURVE, Objectives(tpot_ms=5.65))
    assert (cost.reach, cost.limited_by) == (PART, "tpot")
    assert cost.concurrency == pytest.approx(48)


def test_the_tightest_of_several_objectives_ends_the_curve():
    # Per token 5.65 ms is half way from 32 to 64; end-to-end 700 ms a quarter of 8 to 32.
    cost = frontier.cost(CURVE, Objectives(tpot_ms=5.65, e2e_ms=690))
    assert cost.limited_by == "e2e"
    assert cost.concurrency == pytest.approx(8 + 24 * 0.25)
    assert cost.tokens_per_s == pytest.approx(1548 + 0.25 * (4898 - 1548))


def test_even_the_lowest_level_missing_is_none_of_the_curve():
    cost = frontier.cost(CURVE, Objectives(e2e_ms=500))
    assert (cost.reach, cost.tokens_per_s, cost.fraction, cost.concurrency, cost.limited_by) \
        == (NONE, 0.0, 0.0, None, "e2e")
    assert cost.peak_tokens_per_s == 12549


def test_a_level_meeting_again_above_a_miss_is_not_reached():
    noisy = [point(1, 100, 10, 5, 100), point(2, 180, 30, 5, 100), point(4, 300, 15, 5, 100)]
    cost = frontier.cost(noisy, Objectives(ttft_ms=20))
    assert cost.reach == PART
    assert cost.tokens_per_s == pytest.approx(100 + 0.5 * 80)


def test_the_best_throughput_before_the_crossing_wins_when_throughput_falls():
    falling = [point(1, 100, 10, 5, 100), point(2, 300, 12, 5, 100),
               point(4, 250, 14, 5, 100), point(8, 240, 40, 5, 100)]
    cost = frontier.cost(falling, Objectives(ttft_ms=30))
    assert (cost.tokens_per_s, cost.concurrency) == (300, 2)


def test_a_level_with_failed_requests_meets_no_bound():
    failing = [point(1, 100, 10, 5, 100), point(2, 150, 11, 5, 110, failed=3)]
    assert frontier.cost(failing, Objectives(ttft_ms=50)).tokens_per_s == 100
    assert frontier.cost(failing, Objectives()).tokens_per_s == 150  # no bound: not held


def test_an_unmeasured_figure_misses_its_bound():
    one_token = [point(1, 100, 10, None, 100)]
    assert frontier.cost(one_token, Objectives(tpot_ms=50)).reach == NONE
    assert frontier.cost(one_token, Objectives(ttft_ms=50)).reach == WHOLE


def test_a_curve_needs_a_point():
    with pytest.raises(ValueError):
        frontier.cost([], Objectives())


def test_summarise_measures_as_vllms_client_does():
    got = frontier.summarise(4, 2.0, ttfts_s=[0.1, 0.2, 0.3, 0.4],
                             e2els_s=[0.8, 0.9, 1.0, 1.1], output_lens=[8, 8, 8, 8], failed=1)
    assert (got.completed, got.failed, got.output_tokens, got.tokens_per_s) == (4, 1, 32, 16.0)
    assert got.ttft_p50_ms == pytest.approx(250)
    assert got.ttft_p95_ms == pytest.approx(385)  # numpy's linear interpolation
    assert got.tpot_p50_ms == pytest.approx(100)  # 0.7 s over 7 tokens, each request
    assert got.e2e_p95_ms == pytest.approx(1085)
    assert frontier.percentile([], 95) is None


# -- properties ------------------------------------------------------------------------------------
@st.composite
def curves(draw) -> list[Point]:
    """Monotone curves as engines draw them: every p95 rises with concurrency."""
    n = draw(st.integers(1, 8))
    levels = sorted(draw(st.sets(st.integers(1, 512), min_size=n, max_size=n)))
    steps = st.floats(0, 50, allow_nan=False)
    ttft = tpot = e2e = 0.0
    out = []
    for c in levels:
        ttft += draw(steps)
        tpot += draw(steps) / 10
        e2e += draw(steps) * 5
        out.append(point(c, draw(st.floats(1, 20000)), 10 + ttft, 1 + tpot, 100 + e2e))
    return out


bounds = st.one_of(st.none(), st.floats(1, 3000, allow_nan=False))
objectives = st.builds(Objectives, ttft_ms=bounds, tpot_ms=bounds, e2e_ms=bounds)


def interpolated(curve: list[Point], concurrency: float, field: str) -> float:
    for before, after in zip(curve, curve[1:], strict=False):
        if before.concurrency <= concurrency <= after.concurrency:
            t = (concurrency - before.concurrency) / (after.concurrency - before.concurrency)
            return getattr(before, field) + t * (getattr(after, field) - getattr(before, field))
    return getattr(curve[-1], field)


@settings(max_examples=300, deadline=None)
@given(curves(), objectives)
def test_the_cost_is_a_share_of_the_peak_at_a_point_meeting_every_bound(curve, wanted):
    cost = frontier.cost(curve, wanted)
    assert 0 <= cost.fraction <= 1 + 1e-9
    assert cost.tokens_per_s <= cost.peak_tokens_per_s + 1e-6
    if cost.concurrency is None:
        assert cost.reach == NONE and cost.tokens_per_s == 0
        return
    for _key, field, limit in wanted.bounds():
        assert interpolated(curve, cost.concurrency, field) <= limit + 1e-6


@settings(max_examples=300, deadline=None)
@given(curves(), objectives, st.sampled_from(["ttft_ms", "tpot_ms", "e2e_ms"]),
       st.floats(1, 3000, allow_nan=False))
def test_a_looser_or_dropped_objective_never_costs_more(curve, wanted, name, looser_by):
    tight = frontier.cost(curve, wanted)
    value = getattr(wanted, name)
    loose = Objectives(**{**vars(wanted), name: None if value is None else value + looser_by})
    dropped = Objectives(**{**vars(wanted), name: None})
    assert frontier.cost(curve, loose).tokens_per_s >= tight.tokens_per_s - 1e-6
    assert frontier.cost(curve, dropped).tokens_per_s >= tight.tokens_per_s - 1e-6


@settings(max_examples=200, deadline=None)
@given(curves())
def test_bounds_every_level_meets_are_the_whole_curve(curve):
    top = curve[-1]
    cost = frontier.cost(curve, Objectives(ttft_ms=top.ttft_p95_ms, tpot_ms=top.tpot_p95_ms,
                                           e2e_ms=top.e2e_p95_ms))
    assert cost.reach == WHOLE and cost.fraction == 1.0
