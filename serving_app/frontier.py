"""An engine's latency-against-throughput curve, and what a latency objective costs on it.

A capacity test (`serving_app.models.capacity`) loads one engine at rising concurrency with
vLLM's own benchmark client; each level is a `Point`: output tokens per second and the p95s of
time to first token, time per output token and end-to-end latency (the frontier vLLM's
benchmark draws). A tenant's objectives (`Tenant.ttft_objective_ms`, `tpot_objective_ms`,
`latency_objective_ms`) are bounds on the same three p95s. What they cost is the throughput
the engine still gives while every bound holds (`cost()`).

Load rises from concurrency 1, and the gateway holds an objective by sending the engine fewer
requests (docs/gateway.md, "Latency objectives"), so the throughput an objective allows is the
best the curve gives from its lowest level up to where the first p95 crosses its bound, the
crossing interpolated linearly between the two measured levels around it. A level measured
above a miss that happens to meet the bounds again is noise in the measurement, not an
operating point the gateway can reach, and does not count. A level with a failed request meets
no bound (that request's latency is unknown).

Plain data in and out, no Django: the console's pages, the API and the tests call it alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# The three objectives: the key the API and forms use, the point's p95 it bounds, its label.
METRICS = (
    ("ttft", "ttft_p95_ms", "time to first token"),
    ("tpot", "tpot_p95_ms", "time per output token"),
    ("e2e", "e2e_p95_ms", "end-to-end latency"),
)
LABELS = {key: label for key, _, label in METRICS}

WHOLE = "whole"  # every level meets every bound: the curve's peak
PART = "part"  # up to a crossing
NONE = "none"  # even the lowest level misses


@dataclass(frozen=True)
class Point:
    """One concurrency level of a capacity test, as its requests measured it."""

    concurrency: int
    completed: int
    failed: int
    output_tokens: int
    duration_s: float
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    e2e_p95_ms: float | None


@dataclass(frozen=True)
class Objectives:
    """p95 bounds in milliseconds; None: no bound on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def bounds(self) -> list[tuple[str, str, float]]:
        """(key, the point's field, the bound) of each objective set."""
        limits = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2e": self.e2e_ms}
        return [(key, field, float(limit)) for key, field, _ in METRICS
                if (limit := limits[key]) is not None]


@dataclass(frozen=True)
class Cost:
    """What objectives cost on a curve: the highest output tokens per second at which every
    p95 still meets its bound, as a fraction of the curve's peak, and the concurrency there
    (interpolated; None when even the lowest level misses). `reach` is WHOLE, PART or NONE;
    `limited_by` names the objective that ends it (a key of METRICS)."""

    tokens_per_s: float
    fraction: float
    concurrency: float | None
    peak_tokens_per_s: float
    reach: str
    limited_by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks, as
    numpy's default (and vLLM's benchmark) computes it; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(concurrency: int, duration_s: float, *, ttfts_s: Sequence[float],
              e2els_s: Sequence[float], output_lens: Sequence[int], failed: int) -> Point:
    """A level's point from its successful requests' times (seconds, as vLLM's client reports
    them) and output lengths. A request's time per output token is its time after the first
    token over the tokens after the first (vLLM's TPOT); requests of one token have none."""
    tpots = [(e2e - ttft) / (n - 1) for ttft, e2e, n in zip(ttfts_s, e2els_s, output_lens,
                                                            strict=True) if n > 1]
    tokens = sum(output_lens)

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000

    return Point(
        concurrency=concurrency, completed=len(output_lens), failed=failed,
        output_tokens=tokens, duration_s=duration_s,
        tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        ttft_p50_ms=ms(percentile(ttfts_s, 50)), ttft_p95_ms=ms(percentile(ttfts_s, 95)),
        tpot_p50_ms=ms(percentile(tpots, 50)), tpot_p95_ms=ms(percentile(tpots, 95)),
        e2e_p95_ms=ms(percentile(e2els_s, 95)),
    )


def _value(point: Point, field: str) -> float | None:
    """A p95 of the point as a bound reads it: none where a request failed."""
    return None if point.failed else getattr(point, field)


def _missed(point: Point, bounds: list[tuple[str, str, float]]) -> list[tuple[str, str, float]]:
    return [(key, field, limit) for key, field, limit in bounds
            if (value := _value(point, field)) is None or value > limit]


def _crossing(before: float, after: float | None, limit: float) -> float:
    """Where, from 0 (the level that meets) to 1 (the level that misses), a p95 measured
    `before` and `after` reaches `limit`; 0 when the missing level has no measurement."""
    if after is None or after <= before:
        return 0.0
    return max(0.0, min(1.0, (limit - before) / (after - before)))


def cost(points: Iterable[Point], objectives: Objectives) -> Cost:
    """What `objectives` cost on the curve of `points` (any order; at least one)."""
    curve = sorted(points, key=lambda p: p.concurrency)
    if not curve:
        raise ValueError("a curve needs at least one point")
    peak = max(p.tokens_per_s for p in curve)
    bounds = objectives.bounds()
    missed = _missed(curve[0], bounds)
    if missed:
        return Cost(0.0, 0.0, None, peak, NONE, missed[0][0])
    best, at = curve[0].tokens_per_s, float(curve[0].concurrency)
    limited_by = None
    for before, after in zip(curve, curve[1:], strict=False):
        missed = _missed(after, bounds)
        if not missed:
            if after.tokens_per_s > best:
                best, at = after.tokens_per_s, float(after.concurrency)
            continue
        step, limited_by = min(
            (_crossing(getattr(before, field), _value(after, field), limit), key)
            for key, field, limit in missed)
        tokens = before.tokens_per_s + step * (after.tokens_per_s - before.tokens_per_s)
        if tokens > best:
            best = tokens
            at = before.concurrency + step * (after.concurrency - before.concurrency)
        break
    return Cost(best, best / peak if peak > 0 else 0.0, at, peak,
                WHOLE if limited_by is None else PART, limited_by)
