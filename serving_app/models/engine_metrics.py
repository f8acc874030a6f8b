"""Engine metric samples: what each engine's own `/metrics` said, every
`ENGINE_METRICS_INTERVAL_SECONDS`, kept compact, pruned, and rolled up per hour.

A node agent scrapes its ready engines (`serving_app.engine.scrape`) and stores one
`EngineSample` per engine and scrape: the gauges as read (requests running and waiting, KV-cache
usage), the engine's counters as read and their increase since the previous scrape of the same
engine process (prompt and generation tokens, preemptions, prefix-cache queries and hits), and
the time-to-first-token and inter-token latency histograms of that interval. A histogram is kept
as its non-empty buckets only, `[[lower, upper, count], ...]` in seconds (`upper` None for the
engine's `+Inf` bucket), with its p50 and p95 in ms: a few numbers instead of the engine's forty
buckets, and buckets of several samples, engines or hours still add up exactly, so a chart's
percentile over a minute, an hour or a whole deployment is read off the summed buckets the way
Prometheus' `histogram_quantile` reads them.

Samples are kept for `ENGINE_SAMPLE_RETENTION_HOURS` (a day by default), hourly rollups
(`EngineHour`) for `ENGINE_ROLLUP_RETENTION_DAYS`; `serving.roll_up_engine_samples` (beat) rolls
finished hours up and prunes both, in that order, so no sample goes before its hour is rolled up.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import Max
from django.utils import timezone

__all__ = ["EngineHour", "EngineSample", "merge_buckets", "quantile_ms"]

Bucket = list[Any]  # [lower seconds, upper seconds or None for +Inf, count]

# The engine's counters a sample records twice: as read (`<name>_total`) and as the increase
# since the previous sample of the same engine process (`<name>`).
COUNTERS = ("prompt_tokens", "generation_tokens", "preemptions", "prefix_cache_queries",
            "prefix_cache_hits")
HISTOGRAMS = ("ttft", "itl")


def merge_buckets(*histograms: Iterable[Sequence[Any]]) -> list[Bucket]:
    """The bucket-wise sum of histograms stored as `[[lower, upper, count], ...]`."""
    counts: dict[tuple[float, float | None], float] = defaultdict(float)
    for histogram in histograms:
        for lower, upper, count in histogram or ():
            counts[(float(lower), None if upper is None else float(upper))] += count
    return [[lower, upper, count] for (lower, upper), count in
            sorted(counts.items(), key=lambda item: _order(item[0][1])) if count]


def _order(upper: float | None) -> float:
    return float("inf") if upper is None else upper


def quantile_ms(histogram: Iterable[Sequence[Any]], q: float) -> float | None:
    """The q-quantile (0 < q < 1) of a bucketed histogram, in ms; None when it is empty.

    As Prometheus' `histogram_quantile`: linear inside the bucket the rank falls in, and the
    largest finite bound when it falls in the `+Inf` bucket (the engine says nothing above it).
    """
    buckets = sorted(((float(lo), hi, float(n)) for lo, hi, n in histogram or () if n),
                     key=lambda b: _order(b[1]))
    total = sum(n for _, _, n in buckets)
    if not total:
        return None
    rank = q * total
    seen = 0.0
    for lower, upper, count in buckets:
        if seen + count >= rank:
            if upper is None:
                return lower * 1000
            return (lower + (float(upper) - lower) * (rank - seen) / count) * 1000
        seen += count
    return None  # not reached: the last bucket holds the rank


def sample_retention() -> timedelta:
    return timedelta(hours=settings.ENGINE_SAMPLE_RETENTION_HOURS)


def rollup_retention() -> timedelta:
    return timedelta(days=settings.ENGINE_ROLLUP_RETENTION_DAYS)


def hour_start(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


class EngineMetricsQuerySet(models.QuerySet[Any]):
    """Samples and rollups are read through the deployment or instance they belong to, which
    the caller has already read through `Deployment.objects.for_user()` (the API and console
    views); they hold no tenant data of their own beyond adapter names, which the API filters."""


class EngineSampleQuerySet(EngineMetricsQuerySet):
    def prune(self, now: datetime | None = None) -> int:
        """Delete the samples older than the retention; how many went (one indexed delete)."""
        cutoff = (now or timezone.now()) - sample_retention()
        deleted, _ = self.filter(at__lt=cutoff).delete()
        return deleted


class EngineSample(models.Model):
    """One scrape of one engine's `/metrics` (see the module docstring for the fields)."""

    instance = models.ForeignKey("serving_app.Instance", on_delete=models.CASCADE,
                                 related_name="engine_samples")
    deployment = models.ForeignKey("serving_app.Deployment", on_delete=models.CASCADE,
                                   related_name="+")
    at = models.DateTimeField(db_index=True)
    interval_seconds = models.FloatField(
        null=True, blank=True,
        help_text="Since the previous sample of the same engine process; empty for the first "
                  "(no increases or latencies then).",
    )
    requests_running = models.PositiveIntegerField(default=0)
    requests_waiting = models.PositiveIntegerField(default=0)
    kv_cache_usage = models.FloatField(default=0.0, help_text="0 to 1.")
    prompt_tokens_total = models.PositiveBigIntegerField(default=0)
    generation_tokens_total = models.PositiveBigIntegerField(default=0)
    preemptions_total = models.PositiveBigIntegerField(default=0)
    prefix_cache_queries_total = models.PositiveBigIntegerField(default=0)
    prefix_cache_hits_total = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    generation_tokens = models.PositiveBigIntegerField(default=0)
    preemptions = models.PositiveBigIntegerField(default=0)
    prefix_cache_queries = models.PositiveBigIntegerField(default=0)
    prefix_cache_hits = models.PositiveBigIntegerField(default=0)
    ttft_buckets = models.JSONField(default=list, blank=True)
    itl_buckets = models.JSONField(default=list, blank=True)
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p95_ms = models.FloatField(null=True, blank=True)
    itl_p50_ms = models.FloatField(null=True, blank=True)
    itl_p95_ms = models.FloatField(null=True, blank=True)
    active_adapters = models.JSONField(
        default=list, blank=True,
        help_text="LoRA adapters with requests in the engine (vLLM names them, not how many).",
    )

    objects = EngineSampleQuerySet.as_manager()

    class Meta:
        ordering = ["-at"]
        indexes = [
            models.Index(fields=["instance", "-at"], name="enginesample_instance_at"),
            models.Index(fields=["deployment", "-at"], name="enginesample_deployment_at"),
        ]

    def __str__(self) -> str:
        return f"{self.instance_id}@{self.at:%H:%M:%S}"

    def _per_second(self, count: int) -> float | None:
        return count / self.interval_seconds if self.interval_seconds else None

    @property
    def prompt_tokens_per_second(self) -> float | None:
        return self._per_second(self.prompt_tokens)

    @property
    def generation_tokens_per_second(self) -> float | None:
        return self._per_second(self.generation_tokens)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of the interval's prompt tokens found in the prefix cache (None: no queries)."""
        if not self.prefix_cache_queries:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


class EngineHourQuerySet(EngineMetricsQuerySet):
    def roll_up(self, now: datetime | None = None) -> int:
        """Roll the finished hours that have samples and no rollup yet into `EngineHour` rows
        (one per instance and hour); how many rows were written. Idempotent: an hour rolled up
        twice is written with the same values. An hour counts as finished a minute after it
        ends, when its last scrape has been stored."""
        now = now or timezone.now()
        end = hour_start(now - timedelta(minutes=1))
        latest = self.aggregate(latest=Max("bucket"))["latest"]
        start = latest + timedelta(hours=1) if latest else None
        samples = EngineSample.objects.filter(at__lt=end)
        if start is not None:
            samples = samples.filter(at__gte=start)
        hours: dict[tuple[int, datetime], _HourTotals] = {}
        for sample in samples.order_by().iterator(chunk_size=2000):
            key = (sample.instance_id, hour_start(sample.at))
            totals = hours.get(key)
            if totals is None:
                totals = hours[key] = _HourTotals(sample.deployment_id)
            totals.add(sample)
        rows = [totals.row(instance_id, bucket) for (instance_id, bucket), totals in hours.items()]
        if not rows:
            return 0
        with transaction.atomic():
            EngineHour.objects.bulk_create(
                rows, update_conflicts=True, unique_fields=["instance", "bucket"],
                update_fields=[f.name for f in EngineHour._meta.concrete_fields
                               if f.name not in ("id", "instance", "bucket")],
            )
        return len(rows)

    def prune(self, now: datetime | None = None) -> int:
        cutoff = (now or timezone.now()) - rollup_retention()
        deleted, _ = self.filter(bucket__lt=cutoff).delete()
        return deleted


class _HourTotals:
    """What one instance's samples of one hour add up to."""

    def __init__(self, deployment_id: int) -> None:
        self.deployment_id = deployment_id
        self.samples = 0
        self.seconds = 0.0
        self.sums: dict[str, float] = defaultdict(float)
        self.maxima: dict[str, float] = defaultdict(float)
        self.counters: dict[str, int] = defaultdict(int)
        self.buckets: dict[str, list[Bucket]] = {name: [] for name in HISTOGRAMS}
        self.adapters: dict[str, int] = defaultdict(int)

    def add(self, sample: EngineSample) -> None:
        self.samples += 1
        self.seconds += sample.interval_seconds or 0.0
        for gauge in ("requests_running", "requests_waiting", "kv_cache_usage"):
            value = float(getattr(sample, gauge))
            self.sums[gauge] += value
            self.maxima[gauge] = max(self.maxima[gauge], value)
        for name in COUNTERS:
            self.counters[name] += getattr(sample, name)
        for name in HISTOGRAMS:
            self.buckets[name] = merge_buckets(self.buckets[name],
                                               getattr(sample, f"{name}_buckets"))
        for adapter in sample.active_adapters or ():
            self.adapters[adapter] += 1

    def row(self, instance_id: int, bucket: datetime) -> EngineHour:
        means = {f"{gauge}_mean": self.sums[gauge] / self.samples for gauge in self.sums}
        maxima = {f"{gauge}_max": value for gauge, value in self.maxima.items()}
        return EngineHour(
            instance_id=instance_id, deployment_id=self.deployment_id, bucket=bucket,
            samples=self.samples, seconds=self.seconds, **means, **maxima, **self.counters,
            ttft_buckets=self.buckets["ttft"], itl_buckets=self.buckets["itl"],
            adapter_samples=dict(self.adapters),
        )


class EngineHour(models.Model):
    """One instance's engine samples of one hour, summed (counters, histogram buckets) and
    averaged (gauges, with their maxima): what charts longer than the sample retention read."""

    instance = models.ForeignKey("serving_app.Instance", on_delete=models.CASCADE,
                                 related_name="engine_hours")
    deployment = models.ForeignKey("serving_app.Deployment", on_delete=models.CASCADE,
                                   related_name="+")
    bucket = models.DateTimeField(help_text="Start of the hour (UTC).")
    samples = models.PositiveIntegerField(default=0)
    seconds = models.FloatField(default=0.0, help_text="Time the counters' increases cover.")
    requests_running_mean = models.FloatField(default=0.0)
    requests_running_max = models.FloatField(default=0.0)
    requests_waiting_mean = models.FloatField(default=0.0)
    requests_waiting_max = models.FloatField(default=0.0)
    kv_cache_usage_mean = models.FloatField(default=0.0)
    kv_cache_usage_max = models.FloatField(default=0.0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    generation_tokens = models.PositiveBigIntegerField(default=0)
    preemptions = models.PositiveBigIntegerField(default=0)
    prefix_cache_queries = models.PositiveBigIntegerField(default=0)
    prefix_cache_hits = models.PositiveBigIntegerField(default=0)
    ttft_buckets = models.JSONField(default=list, blank=True)
    itl_buckets = models.JSONField(default=list, blank=True)
    adapter_samples = models.JSONField(
        default=dict, blank=True, help_text="Per LoRA adapter, the samples it had requests in."
    )

    objects = EngineHourQuerySet.as_manager()

    class Meta:
        ordering = ["-bucket"]
        constraints = [
            models.UniqueConstraint(fields=["instance", "bucket"], name="unique_engine_hour"),
        ]
        indexes = [
            models.Index(fields=["deployment", "-bucket"], name="enginehour_deployment_bucket"),
        ]

    def __str__(self) -> str:
        return f"{self.instance_id}@{self.bucket:%Y-%m-%d %H:00}"
