"""Engine metric charts for a deployment (all its instances) or one instance.

Ranges up to the sample retention read `EngineSample`, longer ones the hourly `EngineHour`
rollups; both are folded into the range's bins in Python the same way. Per bin: each instance's
requests running and waiting and KV-cache usage (the mean of its samples); tokens per second
(each instance's increase over the time its samples cover, summed over the instances); and the
time to first token and inter-token latency p50/p95 of the whole scope, read off the summed
histogram buckets, so a percentile over two engines is the percentile of their requests
together, not an average of percentiles.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from serving_app.metering.figures import (
    Figure,
    _empty,
    _layout,
    add_series,
    colour_for,
    scale_to_data,
    times,
)
from serving_app.models import Deployment, Instance
from serving_app.models.engine_metrics import (
    COUNTERS,
    Bucket,
    EngineHour,
    EngineSample,
    merge_buckets,
    quantile_ms,
    sample_retention,
)

NO_SAMPLES = "No engine samples in this range"


@dataclass(frozen=True)
class EngineRange:
    key: str
    label: str
    span: timedelta
    bin_seconds: int

    @property
    def hourly(self) -> bool:
        """Whether the range reads the hourly rollups (it reaches past the sample retention)."""
        return self.span > sample_retention()

    def bins(self, now: datetime | None = None) -> list[datetime]:
        now = now or timezone.now()
        epoch = int((now - self.span).timestamp())
        start = datetime.fromtimestamp(epoch - epoch % self.bin_seconds, UTC)
        count = math.ceil((now - start).total_seconds() / self.bin_seconds)
        return [start + timedelta(seconds=i * self.bin_seconds) for i in range(max(count, 1))]


RANGES: dict[str, EngineRange] = {
    r.key: r
    for r in (
        EngineRange("15m", "Last 15 minutes", timedelta(minutes=15), 30),
        EngineRange("1h", "Last hour", timedelta(hours=1), 60),
        EngineRange("6h", "Last 6 hours", timedelta(hours=6), 5 * 60),
        EngineRange("24h", "Last 24 hours", timedelta(hours=24), 15 * 60),
        EngineRange("7d", "Last 7 days", timedelta(days=7), 3600),
        EngineRange("30d", "Last 30 days", timedelta(days=30), 6 * 3600),
    )
}
DEFAULT_RANGE = "1h"


def get_range(key: str | None) -> EngineRange:
    return RANGES.get(key or DEFAULT_RANGE, RANGES[DEFAULT_RANGE])


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Row:
    """A sample, or an hour of samples, in one shape: gauges as sums over `weight` samples."""

    instance_id: int
    at: datetime
    weight: int
    running: float
    waiting: float
    kv_cache_usage: float
    seconds: float
    counters: dict[str, int]
    ttft: list[Bucket]
    itl: list[Bucket]


def rows(scope: QuerySet[Instance], since: datetime, hourly: bool) -> Iterator[Row]:
    """The samples (or hourly rollups) of the scope's instances from `since` on."""
    if hourly:
        for hour in EngineHour.objects.filter(instance__in=scope, bucket__gte=since).order_by(
                "bucket").iterator(chunk_size=2000):
            n = hour.samples
            yield Row(hour.instance_id, hour.bucket, n, hour.requests_running_mean * n,
                      hour.requests_waiting_mean * n, hour.kv_cache_usage_mean * n, hour.seconds,
                      {name: getattr(hour, name) for name in COUNTERS}, hour.ttft_buckets,
                      hour.itl_buckets)
        return
    for s in EngineSample.objects.filter(instance__in=scope, at__gte=since).order_by(
            "at").iterator(chunk_size=2000):
        yield Row(s.instance_id, s.at, 1, s.requests_running, s.requests_waiting,
                  s.kv_cache_usage, s.interval_seconds or 0.0,
                  {name: getattr(s, name) for name in COUNTERS}, s.ttft_buckets, s.itl_buckets)


@dataclass
class _Cell:
    weight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv: float = 0.0
    seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, row: Row) -> None:
        self.weight += row.weight
        self.running += row.running
        self.waiting += row.waiting
        self.kv += row.kv_cache_usage
        self.seconds += row.seconds
        for name, value in row.counters.items():
            self.counters[name] += value

    def mean(self, total: float) -> float | None:
        return total / self.weight if self.weight else None

    def rate(self, name: str) -> float | None:
        return self.counters[name] / self.seconds if self.seconds else None


@dataclass
class InstanceSeries:
    instance: Instance
    label: str
    running: list[float | None]
    waiting: list[float | None]
    kv_cache_usage: list[float | None]


@dataclass
class EngineSeries:
    bins: list[datetime]
    instances: list[InstanceSeries]
    prompt_tokens_per_second: list[float | None]
    generation_tokens_per_second: list[float | None]
    ttft_p50_ms: list[float | None]
    ttft_p95_ms: list[float | None]
    itl_p50_ms: list[float | None]
    itl_p95_ms: list[float | None]

    @property
    def has_data(self) -> bool:
        return any(v is not None for s in self.instances for v in s.running)


def labels(instances: list[Instance]) -> dict[int, str]:
    """"#<ordinal>" per instance; with the instance id as well where two share an ordinal (an
    old generation's and its replacement)."""
    ordinals: dict[int, int] = defaultdict(int)
    for instance in instances:
        ordinals[instance.ordinal] += 1
    return {i.pk: f"#{i.ordinal}" if ordinals[i.ordinal] == 1 else f"#{i.ordinal} ({i.pk})"
            for i in instances}


def series(scope: QuerySet[Instance], erange: EngineRange,
           now: datetime | None = None) -> EngineSeries:
    bins = erange.bins(now)
    start, width, last = bins[0], erange.bin_seconds, len(bins) - 1
    cells: dict[int, list[_Cell]] = {}
    ttft: list[list[Bucket]] = [[] for _ in bins]
    itl: list[list[Bucket]] = [[] for _ in bins]
    for row in rows(scope, start, erange.hourly):
        index = min(max(int((row.at - start).total_seconds() // width), 0), last)
        per_bin = cells.get(row.instance_id)
        if per_bin is None:
            per_bin = cells[row.instance_id] = [_Cell() for _ in bins]
        per_bin[index].add(row)
        if row.ttft:
            ttft[index] = merge_buckets(ttft[index], row.ttft)
        if row.itl:
            itl[index] = merge_buckets(itl[index], row.itl)
    instances = list(scope.filter(pk__in=list(cells)).order_by("ordinal", "pk"))
    names = labels(instances)
    return EngineSeries(
        bins=bins,
        instances=[
            InstanceSeries(
                i, names[i.pk],
                running=[c.mean(c.running) for c in cells[i.pk]],
                waiting=[c.mean(c.waiting) for c in cells[i.pk]],
                kv_cache_usage=[c.mean(c.kv) for c in cells[i.pk]],
            )
            for i in instances
        ],
        prompt_tokens_per_second=_summed_rates(cells, "prompt_tokens", len(bins)),
        generation_tokens_per_second=_summed_rates(cells, "generation_tokens", len(bins)),
        ttft_p50_ms=[quantile_ms(b, 0.50) for b in ttft],
        ttft_p95_ms=[quantile_ms(b, 0.95) for b in ttft],
        itl_p50_ms=[quantile_ms(b, 0.50) for b in itl],
        itl_p95_ms=[quantile_ms(b, 0.95) for b in itl],
    )


def _summed_rates(cells: dict[int, list[_Cell]], name: str, count: int) -> list[float | None]:
    out: list[float | None] = []
    for index in range(count):
        rates = [r for per_bin in cells.values() if (r := per_bin[index].rate(name)) is not None]
        out.append(sum(rates) if rates else None)
    return out


def latest(scope: QuerySet[Instance]) -> list[dict[str, Any]]:
    """Each running instance's newest sample (within the sample retention), for the table."""
    since = timezone.now() - sample_retention()
    instances = list(scope.exclude(state__in=Instance.TERMINAL_STATES).order_by("ordinal", "pk"))
    names = labels(instances)
    out = []
    for instance in instances:
        sample = instance.engine_samples.filter(at__gte=since).order_by("-at").first()
        hit_rate = sample.prefix_cache_hit_rate if sample else None
        out.append({
            "instance": instance, "label": names[instance.pk], "sample": sample,
            "kv_percent": sample.kv_cache_usage * 100 if sample else None,
            "hit_percent": hit_rate * 100 if hit_rate is not None else None,
        })
    return out


def scope_of(deployment: Deployment | None = None,
             instance: Instance | None = None) -> QuerySet[Instance]:
    if instance is not None:
        return Instance.objects.filter(pk=instance.pk)
    if deployment is None:
        raise TypeError("engine metrics are read for a deployment or an instance")
    return Instance.objects.filter(deployment=deployment)


# ----------------------------------------------------------------------------- figures


def _line(fig: Figure, x: list[str], y: list[float | None], name: str, colour: str,
          dash: str | None = None, **extra: Any) -> None:
    add_series(fig, x, y, name, colour, dash=dash, **extra)


def queue_figure(s: EngineSeries) -> dict[str, Any]:
    x = times(s.bins)
    fig = Figure(_layout("Requests running and waiting", "requests"))
    for n, inst in enumerate(s.instances):
        colour = colour_for(n)
        _line(fig, x, inst.running, f"{inst.label} running", colour, legendgroup=inst.label)
        _line(fig, x, inst.waiting, f"{inst.label} waiting", colour, "dot",
              legendgroup=inst.label)
    return _empty(fig, s.has_data, NO_SAMPLES).to_plotly_json()


def kv_cache_figure(s: EngineSeries) -> dict[str, Any]:
    x = times(s.bins)
    layout = _layout("KV-cache usage", "share of the cache")
    layout["yaxis"].update(tickformat=".0%", range=[0, 1])
    fig = Figure(layout)
    for n, inst in enumerate(s.instances):
        _line(fig, x, inst.kv_cache_usage, inst.label, colour_for(n))
    return _empty(fig, s.has_data, NO_SAMPLES).to_plotly_json()


def latency_figure(s: EngineSeries) -> dict[str, Any]:
    x = times(s.bins)
    fig = Figure(_layout("Time to first token and inter-token latency", "ms"))
    for name, values, colour, dash in (
        ("TTFT p50", s.ttft_p50_ms, "#10b981", None),
        ("TTFT p95", s.ttft_p95_ms, "#f59e0b", None),
        ("ITL p50", s.itl_p50_ms, "#10b981", "dot"),
        ("ITL p95", s.itl_p95_ms, "#f59e0b", "dot"),
    ):
        _line(fig, x, values, name, colour, dash)
    scale_to_data(fig.layout, (*s.ttft_p95_ms, *s.itl_p95_ms, *s.ttft_p50_ms, *s.itl_p50_ms))
    has_data = any(v is not None for v in (*s.ttft_p50_ms, *s.itl_p50_ms))
    return _empty(fig, has_data, "No requests in this range").to_plotly_json()


def tokens_figure(s: EngineSeries) -> dict[str, Any]:
    x = times(s.bins)
    fig = Figure(_layout("Tokens per second", "tokens/s"))
    _line(fig, x, s.prompt_tokens_per_second, "prompt", "#4f46e5")
    _line(fig, x, s.generation_tokens_per_second, "generation", "#0ea5e9")
    has_data = any(v is not None for v in s.prompt_tokens_per_second)
    return _empty(fig, has_data, NO_SAMPLES).to_plotly_json()


CHARTS = ("queue", "kv_cache", "latency", "tokens")


def panel(scope: QuerySet[Instance], erange: EngineRange) -> dict[str, Any]:
    """The figures and the newest samples of a deployment's (or one instance's) engines."""
    s = series(scope, erange)
    return {
        "figures": {"queue": queue_figure(s), "kv_cache": kv_cache_figure(s),
                    "latency": latency_figure(s), "tokens": tokens_figure(s)},
        "rows": latest(scope),
    }
