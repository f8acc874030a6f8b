"""Dashboard queries over the usage rollups (`UsageTenSecond`, `UsageMinute`, `UsageHour`) and
`GpuSample`.

Every chart is one aggregate query grouped by rollup bucket (and tenant), folded into the
range's display bins in Python. The last 15 minutes read the ten-second rollup (a 90-second
burst is nine bars, not two), the last hour and day the per-minute one, longer ranges the
per-hour one, so a 30-day chart reads at most 720 buckets per tenant and model.
Percentiles come from the rollups' latency histogram (`LATENCY_BUCKETS_MS`, log-spaced),
interpolated linearly inside a bucket; above the last bound the bucket's maximum latency is the
upper end.

Every usage query takes `tenants`, an already-scoped Tenant queryset (`Tenant.objects.for_user(
user)`, `.for_tenant(t)`, or `.all()` for a platform admin's view): there is no default, and ids
or None are refused, so no forgotten argument can show one tenant everyone's usage.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import BigIntegerField, F, FloatField, Func, Max, QuerySet, Sum, Value
from django.db.models.functions import Cast
from django.utils import timezone

from serving_app.models import Deployment, Gpu, GpuSample, LoraAdapter
from serving_app.models.usage import (
    LATENCY_FIELDS,
    GuardrailHour,
    GuardrailMinute,
    UsageHour,
    UsageMinute,
    UsageRollup,
    UsageTenSecond,
    histogram_quantile,
)
from serving_app.placement.inventory import GIB
from serving_app.units import format_seconds
from tenants_app.models import Tenant

HIST_FIELDS = LATENCY_FIELDS
COUNTERS = (
    "requests",
    "errors",
    "rate_limited",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms_total",
    "ttft_ms_total",
    "ttft_count",
    *HIST_FIELDS,
)
USAGE_COUNTERS = ("requests", "errors", "rate_limited", "prompt_tokens", "completion_tokens")


@dataclass(frozen=True)
class TimeRange:
    """A dashboard's time range: how far back, which rollup it reads, how wide a bin is."""

    key: str
    label: str
    span: timedelta
    rollup: type[UsageRollup]
    bin_seconds: int

    def bounds(self, now: datetime | None = None) -> tuple[datetime, datetime]:
        """The first bin's start (aligned to the bin width) and now."""
        now = now or timezone.now()
        start = now - self.span
        epoch = int(start.timestamp())
        aligned = epoch - epoch % self.bin_seconds
        return datetime.fromtimestamp(aligned, UTC), now

    @property
    def bin_label(self) -> str:
        """One bar's width, as the dashboards state it: "10 s", "1 min", "6 h"."""
        return f"{self.bin_seconds} s" if self.bin_seconds < 60 else format_seconds(
            self.bin_seconds)

    def bins(self, now: datetime | None = None) -> list[datetime]:
        start, end = self.bounds(now)
        count = math.ceil((end - start).total_seconds() / self.bin_seconds)
        return [start + timedelta(seconds=i * self.bin_seconds) for i in range(max(count, 1))]


RANGES: dict[str, TimeRange] = {
    r.key: r
    for r in (
        TimeRange("15m", "Last 15 minutes", timedelta(minutes=15), UsageTenSecond, 10),
        TimeRange("1h", "Last hour", timedelta(hours=1), UsageMinute, 60),
        TimeRange("6h", "Last 6 hours", timedelta(hours=6), UsageMinute, 5 * 60),
        TimeRange("24h", "Last 24 hours", timedelta(hours=24), UsageMinute, 15 * 60),
        TimeRange("7d", "Last 7 days", timedelta(days=7), UsageHour, 3600),
        TimeRange("30d", "Last 30 days", timedelta(days=30), UsageHour, 6 * 3600),
    )
}
DEFAULT_RANGE = "1h"


def get_range(key: str | None, tenants: QuerySet[Tenant] | None = None) -> TimeRange:
    """The range `key` names; without one, the smallest that holds the scope's latest usage
    (`default_range`), or the last hour when no scope is given."""
    if key in RANGES:
        return RANGES[key]
    return default_range(tenants) if tenants is not None else RANGES[DEFAULT_RANGE]


def default_range(tenants: QuerySet[Tenant], now: datetime | None = None) -> TimeRange:
    """The window follows the data: the smallest range that reaches the scope's latest usage
    and, when shorter than an hour, holds all of the last hour's, so that a short burst fills a
    chart (a 90-second burst: the last 15 minutes in ten-second bars) instead of two bars of an
    hour; the last hour without usage at all, the longest range when the latest is older than
    every range."""
    now = now or timezone.now()
    latest = (UsageHour.objects.in_scope(_tenants(tenants)).order_by()
              .aggregate(latest=Max("bucket"))["latest"])
    if latest is None:
        return RANGES[DEFAULT_RANGE]
    if latest >= now - timedelta(hours=2):  # the hour rollup's bucket starts up to an hour back
        minute = (UsageMinute.objects.in_scope(tenants).filter(bucket__gte=latest).order_by()
                  .aggregate(latest=Max("bucket"))["latest"])
        latest = minute or latest
    for trange in RANGES.values():
        start = trange.bounds(now)[0]
        if start <= latest and (trange.span >= HOUR or _holds_the_hour(trange, tenants, now)):
            return trange
    return list(RANGES.values())[-1]


HOUR = timedelta(hours=1)


def _holds_the_hour(trange: TimeRange, tenants: QuerySet[Tenant], now: datetime) -> bool:
    """Whether a range shorter than an hour shows all of the scope's usage in the last hour:
    its own rollup (kept at least as long as the range) has rows in the range and none in the
    hour before it."""
    if trange.rollup is UsageTenSecond and (
            timedelta(hours=settings.USAGE_TEN_SECOND_RETENTION_HOURS) < trange.span):
        return False
    start = trange.bounds(now)[0]
    rows = trange.rollup.objects.in_scope(tenants).filter(bucket__gte=now - HOUR)
    return rows.filter(bucket__gte=start).exists() and not rows.filter(bucket__lt=start).exists()


# ----------------------------------------------------------------------------- reading rollups


FLOAT_COUNTERS = {"latency_ms_total", "ttft_ms_total"}


class DateBin(Func):
    """PostgreSQL's date_bin(stride, source, origin): the start of the bin holding source."""

    function = "date_bin"

    def __init__(self, seconds: int, expression: Any, origin: datetime) -> None:
        from django.db.models import DateTimeField, DurationField

        super().__init__(
            Value(timedelta(seconds=seconds), output_field=DurationField()), expression,
            Value(origin, output_field=DateTimeField()), output_field=DateTimeField(),
        )


def _rollup_rows(
    rollup: type[UsageRollup],
    start: datetime,
    group_by: Sequence[str],
    counters: Sequence[str],
    tenants: QuerySet[Tenant],
    model: str | None = None,
    with_max: bool = False,
    bin_seconds: int | None = None,
) -> list[dict[str, Any]]:
    """Summed counters grouped by `group_by`. With `bin_seconds` on PostgreSQL, `bucket` is
    folded into bins of that width in SQL (date_bin), so fewer rows come back."""
    qs = rollup.objects.in_scope(tenants).filter(bucket__gte=start)
    if model:
        qs = qs.filter(model=model)
    # Sums of bigint columns are numeric in PostgreSQL; cast them back so no Decimal is built.
    aggregates: dict[str, Any] = {
        name: Cast(Sum(name), FloatField() if name in FLOAT_COUNTERS else BigIntegerField())
        for name in counters
    }
    if with_max:
        aggregates["latency_ms_max"] = Max("latency_ms_max")
    # order_by() drops the Meta ordering, which would otherwise join the GROUP BY.
    qs = qs.order_by()
    if bin_seconds and "bucket" in group_by and connection.vendor == "postgresql":
        qs = qs.annotate(bin=DateBin(bin_seconds, F("bucket"), start))
        group_by = ["bin" if g == "bucket" else g for g in group_by]
        rows = list(qs.values(*group_by).annotate(**aggregates))
        for row in rows:
            row["bucket"] = row.pop("bin")
        return rows
    return list(qs.values(*group_by).annotate(**aggregates))


def _zero(counters: Sequence[str]) -> dict[str, float]:
    return dict.fromkeys(counters, 0)


def _add(into: dict[str, float], row: dict[str, Any], counters: Sequence[str]) -> None:
    for name in counters:
        into[name] += row[name] or 0
    if "latency_ms_max" in row:
        into["latency_ms_max"] = max(into.get("latency_ms_max", 0.0), row["latency_ms_max"] or 0)


def percentile(
    hist: dict[str, float],
    q: float,
    fields: Sequence[str] = HIST_FIELDS,
    total: str = "requests",
    maximum: str = "latency_ms_max",
) -> float | None:
    """The q-quantile (0..1) of a rollup histogram (latency by default; `fields`, `total` and
    `maximum` name another's, e.g. time to first token's), interpolated inside its buckets."""
    return histogram_quantile(
        [hist.get(name, 0) for name in fields], hist.get(total, 0), hist.get(maximum) or 0.0, q
    )


def tenant_names(tenants: QuerySet[Tenant]) -> dict[int, Tenant]:
    """The scope's tenants by id, in slug order."""
    return {t.pk: t for t in _tenants(tenants).order_by("slug")}


def _tenants(tenants: QuerySet[Tenant]) -> QuerySet[Tenant]:
    """The scope itself, checked like the usage rows are (a Tenant queryset, never ids)."""
    if not isinstance(tenants, QuerySet) or tenants.model is not Tenant:
        raise TypeError("dashboard queries are scoped by a Tenant queryset, not by ids or None")
    return tenants


# ----------------------------------------------------------------------------- usage


@dataclass
class Series:
    """Per-tenant counters folded into the range's bins."""

    bins: list[datetime]
    by_tenant: dict[int, list[dict[str, float]]] = field(default_factory=dict)


def _fold(
    trange: TimeRange,
    rows: list[dict[str, Any]],
    counters: Sequence[str],
    now: datetime | None = None,
) -> Series:
    bins = trange.bins(now)
    start = bins[0]
    series = Series(bins=bins)
    width = trange.bin_seconds
    last = len(bins) - 1
    for row in rows:
        index = int((row["bucket"] - start).total_seconds() // width)
        index = min(max(index, 0), last)
        per_bin = series.by_tenant.get(row["tenant_id"])
        if per_bin is None:
            per_bin = [_zero(counters) for _ in bins]
            series.by_tenant[row["tenant_id"]] = per_bin
        _add(per_bin[index], row, counters)
    return series


def usage_series(
    trange: TimeRange, tenants: QuerySet[Tenant], now: datetime | None = None
) -> Series:
    """Requests and tokens per bin, per tenant."""
    start, _ = trange.bounds(now)
    rows = _rollup_rows(
        trange.rollup, start, ("bucket", "tenant_id"), USAGE_COUNTERS, tenants,
        bin_seconds=trange.bin_seconds,
    )
    return _fold(trange, rows, USAGE_COUNTERS, now)


def usage_totals(
    trange: TimeRange, tenants: QuerySet[Tenant], now: datetime | None = None
) -> list[dict[str, Any]]:
    """Per tenant: the range's totals, and the month's tokens against the monthly budget."""
    start, _ = trange.bounds(now)
    rows = {
        r["tenant_id"]: r
        for r in _rollup_rows(trange.rollup, start, ("tenant_id",), USAGE_COUNTERS, tenants)
    }
    month = month_used_tokens(tenants, now)
    out = []
    for tenant in tenant_names(tenants).values():
        row = rows.get(tenant.pk) or _zero(USAGE_COUNTERS)
        used = month.get(tenant.pk, 0)
        budget = tenant.monthly_token_budget
        out.append(
            {
                "tenant": tenant,
                "requests": int(row["requests"] or 0),
                "errors": int(row["errors"] or 0),
                "rate_limited": int(row["rate_limited"] or 0),
                "prompt_tokens": int(row["prompt_tokens"] or 0),
                "completion_tokens": int(row["completion_tokens"] or 0),
                "total_tokens": int((row["prompt_tokens"] or 0) + (row["completion_tokens"] or 0)),
                "month_tokens": used,
                "budget": budget,
                "budget_fraction": (used / budget) if budget else None,
            }
        )
    return out


GUARDRAIL_ACTIONS = ("block", "redact", "detect")


def guardrail_counts(
    trange: TimeRange, tenants: QuerySet[Tenant], now: datetime | None = None
) -> list[dict[str, Any]]:
    """Per tenant and category: the findings guardrails blocked, redacted and only detected
    over the range, input and output together (the guardrail rollups: minutes up to a day,
    hours beyond), and the requests they were found in (`requests`, and per action
    `<action>_requests`; a request with findings on input and output, or blocked and redacted,
    counts under each). Only tenants and categories with findings; never a value."""
    start, _ = trange.bounds(now)
    rollup = GuardrailHour if trange.rollup is UsageHour else GuardrailMinute
    names = tenant_names(tenants)
    found: dict[tuple[int, str], dict[str, Any]] = {}
    rows = (rollup.objects.in_scope(tenants).filter(bucket__gte=start).order_by()
            .values_list("tenant_id", "category", "action")
            .annotate(n=Sum("count"), r=Sum("requests")))
    for tenant_id, category, action, n, r in rows:
        tenant = names.get(tenant_id)
        if tenant is None or action not in GUARDRAIL_ACTIONS:
            continue
        entry = found.setdefault((tenant_id, category), {
            "tenant": tenant, "category": category, "total": 0, "requests": 0,
            **dict.fromkeys(GUARDRAIL_ACTIONS, 0),
            **dict.fromkeys((f"{a}_requests" for a in GUARDRAIL_ACTIONS), 0)})
        entry[action] += int(n or 0)
        entry["total"] += int(n or 0)
        entry[f"{action}_requests"] += int(r or 0)
        entry["requests"] += int(r or 0)
    return sorted(found.values(), key=lambda e: (e["tenant"].slug, e["category"]))


def month_used_tokens(tenants: QuerySet[Tenant], now: datetime | None = None) -> dict[int, int]:
    """Prompt plus completion tokens since the month started, per tenant (the budgets' rule)."""
    return UsageHour.objects.month_tokens(tenants, now)


def current_load(
    tenants: QuerySet[Tenant], minutes: int = 5, now: datetime | None = None
) -> dict[int, dict[str, float]]:
    """Per tenant: requests and tokens per minute over the last few minutes."""
    now = now or timezone.now()
    start = (now - timedelta(minutes=minutes)).replace(second=0, microsecond=0)
    rows = _rollup_rows(UsageMinute, start, ("tenant_id",), USAGE_COUNTERS, tenants)
    return {
        r["tenant_id"]: {
            "rpm": (r["requests"] or 0) / minutes,
            "tpm": ((r["prompt_tokens"] or 0) + (r["completion_tokens"] or 0)) / minutes,
            "errors": int(r["errors"] or 0),
            "rate_limited": int(r["rate_limited"] or 0),
        }
        for r in rows
    }


# ----------------------------------------------------------------------------- latency


@dataclass
class LatencyPoint:
    requests: int
    p50: float | None
    p95: float | None
    p99: float | None
    ttft_mean: float | None
    error_rate: float | None
    rate_limited_rate: float | None


def latency_point(counters: dict[str, float]) -> LatencyPoint:
    requests = int(counters.get("requests", 0))
    ttft_count = counters.get("ttft_count", 0)
    return LatencyPoint(
        requests=requests,
        p50=percentile(counters, 0.50),
        p95=percentile(counters, 0.95),
        p99=percentile(counters, 0.99),
        ttft_mean=(counters["ttft_ms_total"] / ttft_count) if ttft_count else None,
        error_rate=(counters["errors"] / requests) if requests else None,
        rate_limited_rate=(counters["rate_limited"] / requests) if requests else None,
    )


@dataclass
class LatencySeries:
    bins: list[datetime]
    by_tenant: dict[int, list[LatencyPoint]]
    overall: list[LatencyPoint]


def latency_series(
    trange: TimeRange,
    tenants: QuerySet[Tenant],
    model: str | None = None,
    now: datetime | None = None,
) -> LatencySeries:
    """Percentiles, mean time to first token and error rates per bin: per tenant and overall."""
    start, _ = trange.bounds(now)
    rows = _rollup_rows(
        trange.rollup, start, ("bucket", "tenant_id"), COUNTERS, tenants, model, with_max=True,
        bin_seconds=trange.bin_seconds,
    )
    folded = _fold(trange, rows, COUNTERS, now)
    overall = [_zero(COUNTERS) for _ in folded.bins]
    for per_bin in folded.by_tenant.values():
        for total, counters in zip(overall, per_bin, strict=True):
            _add(total, counters, COUNTERS)
    return LatencySeries(
        bins=folded.bins,
        by_tenant={
            tid: [latency_point(c) for c in per_bin] for tid, per_bin in folded.by_tenant.items()
        },
        overall=[latency_point(c) for c in overall],
    )


def latency_table(
    trange: TimeRange, tenants: QuerySet[Tenant], now: datetime | None = None
) -> list[dict[str, Any]]:
    """Per tenant and model over the whole range: percentiles, TTFT, error rates, objective."""
    start, _ = trange.bounds(now)
    rows = _rollup_rows(
        trange.rollup, start, ("tenant_id", "model"), COUNTERS, tenants, with_max=True
    )
    names = tenant_names(_tenants(tenants).filter(pk__in={r["tenant_id"] for r in rows}))
    out = []
    for row in rows:
        tenant = names.get(row["tenant_id"])
        if tenant is None or not row["model"]:
            # Requests that named no model (`/v1/models`, a malformed body) have no latency
            # objective and form no row; the error chart counts them (`unnamed_requests`).
            continue
        counters = _zero(COUNTERS)
        _add(counters, row, COUNTERS)
        point = latency_point(counters)
        objective = tenant.latency_objective_ms
        succeeded = point.requests - int(counters["errors"])
        out.append(
            {
                "tenant": tenant,
                "model": row["model"],
                "point": point,
                "objective": objective,
                "succeeded": succeeded,
                "too_many_errors": too_many_errors(counters),
                "meets_objective": meets_objective(counters, objective),
            }
        )
    out.sort(key=lambda r: (r["tenant"].slug, r["model"]))
    return out


def too_many_errors(counters: dict[str, float]) -> bool:
    """More of the requests failed than `OBJECTIVE_MAX_ERROR_RATE` allows: no objective is met."""
    requests = counters.get("requests", 0)
    limit = float(settings.OBJECTIVE_MAX_ERROR_RATE)
    return bool(requests) and counters.get("errors", 0) / requests > limit


def meets_objective(counters: dict[str, float], objective: int | None) -> bool | None:
    """Whether the successful requests' p95 latency is within `objective` ms; None without an
    objective or without a successful request (a row of failures met nothing); False when more
    requests failed than `OBJECTIVE_MAX_ERROR_RATE` allows, however fast the rest were.

    The histogram counts failed requests too, and a refusal is fast: taken as the fastest of
    all (the worst case for the successes), the successes' p95 is at most the whole's quantile
    at (errors + 0.95 * successes) / requests, so "met" is only said of latencies that met it.
    """
    requests = counters.get("requests", 0)
    errors = counters.get("errors", 0)
    succeeded = requests - errors
    if objective is None or succeeded <= 0:
        return None
    if too_many_errors(counters):
        return False
    bound = percentile(counters, (errors + 0.95 * succeeded) / requests)
    return None if bound is None else bound <= objective


def model_names(tenants: QuerySet[Tenant]) -> list[str]:
    """The latency page's model filter: the public names the scope's tenants have, the base
    models of the deployments that serve them (running or not, so past traffic stays
    reachable) and their adapters; never a name a client merely asked for (refused, 404),
    though its usage rows exist."""
    scope = _tenants(tenants)
    bases = Deployment.objects.filter(tenants__in=scope).values_list("base_model__name",
                                                                     flat=True)
    adapters = LoraAdapter.objects.filter(tenant__in=scope).values_list("name", flat=True)
    return sorted({*bases.order_by(), *adapters.order_by()})


def models_in_range(trange: TimeRange, tenants: QuerySet[Tenant]) -> list[str]:
    start, _ = trange.bounds()
    qs = trange.rollup.objects.in_scope(tenants).filter(bucket__gte=start)
    return sorted(set(qs.order_by().values_list("model", flat=True).distinct()))


# ----------------------------------------------------------------------------- GPUs


@dataclass
class GpuSeries:
    gpu: Gpu
    bins: list[datetime]
    utilization: list[float | None]
    memory_used_gib: list[float | None]


def gpu_series(trange: TimeRange, now: datetime | None = None) -> list[GpuSeries]:
    """Each GPU's utilization and memory used, averaged per bin (samples are kept for a day
    by default, `GPU_SAMPLE_RETENTION_HOURS`, so longer ranges show what is kept)."""
    bins = trange.bins(now)
    start = bins[0]
    width = trange.bin_seconds
    gpus = list(Gpu.objects.select_related("node").filter(parent__isnull=True))
    rows = (
        GpuSample.objects.filter(at__gte=start, gpu__in=gpus)
        .order_by()
        .values_list("gpu_id", "at", "utilization_percent", "memory_used_bytes")
    )
    sums: dict[int, list[list[float]]] = defaultdict(lambda: [[0.0, 0, 0.0, 0] for _ in bins])
    last = len(bins) - 1
    for gpu_id, at, util, used in rows.iterator(chunk_size=5000):
        index = min(max(int((at - start).total_seconds() // width), 0), last)
        cell = sums[gpu_id][index]
        if util is not None:
            cell[0] += util
            cell[1] += 1
        if used is not None:
            cell[2] += used
            cell[3] += 1
    out = []
    for gpu in gpus:
        cells = sums.get(gpu.pk)
        if cells is None:
            continue
        out.append(
            GpuSeries(
                gpu=gpu,
                bins=bins,
                utilization=[c[0] / c[1] if c[1] else None for c in cells],
                memory_used_gib=[c[2] / c[3] / GIB if c[3] else None for c in cells],
            )
        )
    return out
