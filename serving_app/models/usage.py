"""Usage metering: one event per gateway request, and time-bucketed rollups for the dashboards,
the alert rules and the Prometheus endpoint.

The gateway never writes these rows itself: it appends events to a Redis stream and the batch
writer (`gateway_app.writer`) persists them, together with the rollups (per ten seconds, minute
and hour, and one all-time total), in one transaction per batch. Ids of keys, deployments and
instances are stored as plain numbers (not foreign keys) so that usage history outlives the rows
it refers to and a deleted instance can never make a batch fail; the tenant is a foreign key
without a database constraint for the same reason, so the dashboards can still join on it.

The rollups carry latency and time-to-first-token histograms with log-spaced buckets, ten per
decade from 10 ms to 100 s (the R10 preferred numbers, rounded to whole milliseconds): a
bucket's upper edge is at most 1.3 times its lower one, so a percentile read off it, or the share
of requests above a threshold, is close wherever the threshold lies, and the old edges (100,
250, 500, 1000 ms...) are among the new ones. Histograms of several rows merge by adding their
counts, in SQL (`SUM`) or in Python. The ten-second rollup is kept for
`USAGE_TEN_SECOND_RETENTION_HOURS` only: alert windows are short and read it; charts read the
minute and hour rollups.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db import models
from django.db.models import F, Sum
from django.utils import timezone

from tenants_app.models import Tenant, TenantOwnedQuerySet

__all__ = [
    "KeyUsage", "UsageEvent", "UsageTenSecond", "UsageMinute", "UsageHour", "UsageTotal",
    "GuardrailMinute", "GuardrailHour", "GuardrailTotal",
    "LATENCY_BUCKETS_MS", "LATENCY_FIELDS", "TTFT_FIELDS", "ROLLUP_COUNTERS", "bucket_index",
    "histogram_quantile",
]

# Upper bounds (ms) of the histogram buckets kept in the rollups, for latency and time to first
# token alike; above the last bound the row's maximum is the upper end.
_R10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)
LATENCY_BUCKETS_MS: tuple[int, ...] = (
    *(int(step * 10**decade + 0.5) for decade in range(1, 5) for step in _R10), 100_000,
)
LATENCY_FIELDS = tuple(f"latency_le_{bound}" for bound in LATENCY_BUCKETS_MS)
TTFT_FIELDS = tuple(f"ttft_le_{bound}" for bound in LATENCY_BUCKETS_MS)
# Every counter a rollup row adds up (the maxima are kept apart: they merge by GREATEST).
ROLLUP_COUNTERS = (
    "requests", "errors", "server_errors", "rate_limited", "prompt_tokens", "completion_tokens",
    "cached_tokens", "cost", "latency_ms_total", "ttft_ms_total", "ttft_count", *LATENCY_FIELDS,
    *TTFT_FIELDS,
)
# A cost: exact to 1e-12 (six decimals per million tokens), up to a trillion per row.
COST_DIGITS, COST_PLACES = 28, 12
# The all-time total's one bucket.
TOTAL_BUCKET = datetime(2000, 1, 1, tzinfo=UTC)


def bucket_index(value: float) -> int:
    """The histogram bucket holding `value` (ms): the first bound at or above it;
    len(LATENCY_BUCKETS_MS) for a value above the last bound."""
    return bisect_left(LATENCY_BUCKETS_MS, value)


def histogram_quantile(
    counts: Sequence[float], total: float, maximum: float, q: float
) -> float | None:
    """The q-quantile (0..1) of a rollup histogram: `counts` per LATENCY_BUCKETS_MS bucket,
    `total` observations (those above the last bound are the difference), `maximum` the largest
    one. Linear inside a bucket; None without observations."""
    if not total:
        return None
    rank = q * total
    seen = 0.0
    lower = 0.0
    for bound, count in zip(LATENCY_BUCKETS_MS, counts, strict=True):
        if count and seen + count >= rank:
            return lower + (bound - lower) * (rank - seen) / count
        seen += count
        lower = float(bound)
    overflow = max(total - seen, 0)
    upper = max(float(maximum or 0.0), lower)
    if not overflow:
        return lower
    return lower + (upper - lower) * min(max(rank - seen, 0) / overflow, 1.0)


def month_start(now: datetime | None = None) -> datetime:
    """The start of the calendar month (UTC): the period monthly token budgets count over."""
    now = (now or timezone.now()).astimezone(UTC)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


class UsageQuerySet(TenantOwnedQuerySet[Any]):
    """Usage is tenant data: read it `for_user()`, `for_tenant()` or `in_scope()`."""

    def in_scope(self, tenants: models.QuerySet[Tenant]) -> UsageQuerySet:
        """The rows of an already-scoped tenant queryset (`Tenant.objects.for_user(user)`,
        `.for_tenant(t)`, or `.all()` for platform admins). Ids or None are refused: a
        forgotten argument must never read as "every tenant"."""
        if not isinstance(tenants, models.QuerySet) or tenants.model is not Tenant:
            raise TypeError("usage is scoped by a Tenant queryset, not by ids or None")
        if not tenants.query.where and not tenants.query.is_sliced:
            # Every tenant (a platform admin's view): rows of deleted tenants included, as the
            # rollups keep them, and no subquery.
            return self.all()
        return self.filter(tenant__in=tenants)

    def month_tokens(self, tenants: models.QuerySet[Tenant],
                     now: datetime | None = None) -> dict[int, int]:
        """Prompt plus completion tokens since the month started, per tenant of `tenants`: what
        monthly budgets count (read from the hourly rollups, `UsageHour.objects`)."""
        rows = (
            self.in_scope(tenants).filter(bucket__gte=month_start(now))
            .values("tenant_id").order_by()
            .annotate(used=Sum(F("prompt_tokens") + F("completion_tokens")))
        )
        return {row["tenant_id"]: int(row["used"] or 0) for row in rows}


# The most entries an event's `guardrail_fields` keeps (a prompt of ten thousand messages each
# with a number would otherwise make an event of that many); its `guardrails` counts stay whole.
GUARDRAIL_FIELDS_KEPT = 50


class UsageEvent(models.Model):
    """One request through the gateway, successful or not, with the engine's token counts."""

    request_id = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(db_index=True, help_text="When the request arrived.")
    tenant = models.ForeignKey(
        "tenants_app.Tenant",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="+",
    )
    api_key_id = models.PositiveBigIntegerField(null=True, blank=True)
    endpoint = models.CharField(max_length=32, help_text="chat.completions, completions, models.")
    model = models.CharField(max_length=200, blank=True, help_text="Public model name asked for.")
    adapter = models.CharField(max_length=200, blank=True, help_text="Engine adapter name.")
    deployment_id = models.PositiveBigIntegerField(null=True, blank=True)
    instance_id = models.PositiveBigIntegerField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.CharField(
        max_length=500, blank=True, help_text="The error's message, as the client was answered."
    )
    stream = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    reserved_tokens = models.PositiveIntegerField(
        default=0, help_text="Tokens reserved at admission (settled to the real count)."
    )
    cached_tokens = models.PositiveIntegerField(
        default=0, help_text="Prompt tokens the engine served from its prefix cache.")
    cost = models.DecimalField(
        max_digits=COST_DIGITS, decimal_places=COST_PLACES, null=True, blank=True,
        help_text="At the price card in force when the request arrived; empty: none was.")
    price_card_id = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="The price card that priced it.")
    ttft_ms = models.FloatField(null=True, blank=True, help_text="Time to first token (streams).")
    latency_ms = models.FloatField(default=0.0)
    guardrails = models.JSONField(
        default=dict, blank=True,
        help_text='What guardrails did: counts per "direction:action:CATEGORY" '
                  '(e.g. "input:redact:PHONE": 2); never the matched text.',
    )
    guardrail_fields = models.JSONField(
        default=list, blank=True,
        help_text="Where guardrails found something: one entry per field, detector and action "
                  '({"direction": "input", "field": "messages[2].tool_calls[0].function.'
                  'arguments.to", "detector": "phone", "category": "PHONE", "action": "redact", '
                  '"count": 1}); never the matched text.',
    )
    stages = models.JSONField(
        default=list, blank=True,
        help_text="The gateway's stages the request went through, in order, each with its "
                  'milliseconds ([["authenticated", 0.4], ...]); the last is where it stopped.',
    )

    objects = UsageQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="usageevent_tenant_at")]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.status_code}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageRollupQuerySet(UsageQuerySet):
    def prune(self, older_than: datetime) -> int:
        """Delete the buckets that start before `older_than`; how many went."""
        deleted, _ = self.filter(bucket__lt=older_than).delete()
        return deleted


class UsageRollup(models.Model):
    """Counters for one tenant, public model and deployment over one time bucket (abstract).

    `deployment_id` is 0 for requests that reached no deployment (refused before routing).
    The histogram fields (`latency_le_<ms>`, `ttft_le_<ms>`, one per LATENCY_BUCKETS_MS bound)
    count the requests in (previous bound, bound]; they are added below the class.
    """

    bucket = models.DateTimeField(help_text="Start of the bucket (UTC).")
    tenant = models.ForeignKey(
        "tenants_app.Tenant", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    model = models.CharField(max_length=200)
    deployment_id = models.PositiveBigIntegerField(default=0)
    requests = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveBigIntegerField(default=0, help_text="Responses with status >= 400.")
    server_errors = models.PositiveBigIntegerField(
        default=0, help_text="Failed on the serving side: status >= 500 (engine errors too)."
    )
    rate_limited = models.PositiveBigIntegerField(default=0, help_text="429 responses.")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(max_digits=COST_DIGITS, decimal_places=COST_PLACES, default=0)
    latency_ms_total = models.FloatField(default=0.0)
    latency_ms_max = models.FloatField(default=0.0)
    ttft_ms_total = models.FloatField(default=0.0)
    ttft_ms_max = models.FloatField(default=0.0)
    ttft_count = models.PositiveBigIntegerField(default=0)

    objects = UsageRollupQuerySet.as_manager()

    class Meta:
        abstract = True
        ordering = ["-bucket"]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.model}@{self.bucket:%Y-%m-%d %H:%M:%S}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# Four-byte counts: a bucket of one hour would need 600,000 requests a second to overflow, and
# sums of `integer` are cheaper in PostgreSQL than sums of `bigint` (which add up as numeric).
for _name in (*LATENCY_FIELDS, *TTFT_FIELDS):
    UsageRollup.add_to_class(_name, models.PositiveIntegerField(default=0))


def _rollup_meta(name: str) -> dict[str, Any]:
    return {
        "constraints": [
            models.UniqueConstraint(
                fields=["bucket", "tenant", "model", "deployment_id"], name=f"unique_{name}"
            ),
        ],
        "indexes": [models.Index(fields=["tenant", "-bucket"], name=f"{name}_tenant_bucket")],
    }


class UsageTenSecond(UsageRollup):
    """Per-ten-second rollup, kept for USAGE_TEN_SECOND_RETENTION_HOURS: what alert rules with
    windows of seconds to minutes read (a minute bucket would blur them by up to a minute)."""

    class Meta(UsageRollup.Meta):
        # The unique constraint's index leads with `bucket`: it serves the windows across
        # tenants that alert rules read, and the pruning.
        constraints = _rollup_meta("usage10s")["constraints"]
        indexes = _rollup_meta("usage10s")["indexes"]


class UsageMinute(UsageRollup):
    """Per-minute rollup per tenant and model (kept for recent, fine-grained charts)."""

    class Meta(UsageRollup.Meta):
        constraints = _rollup_meta("usage_minute")["constraints"]
        indexes = [models.Index(fields=["tenant", "-bucket"], name="usageminute_tenant_bucket")]


class UsageHour(UsageRollup):
    """Per-hour rollup per tenant and model (long-range charts and monthly budgets)."""

    class Meta(UsageRollup.Meta):
        constraints = _rollup_meta("usage_hour")["constraints"]
        indexes = [models.Index(fields=["tenant", "-bucket"], name="usagehour_tenant_bucket")]


class UsageTotal(UsageRollup):
    """Everything ever counted, per tenant, model and deployment (one bucket, TOTAL_BUCKET):
    the monotonic counters `/metrics` exposes, read without summing the history."""

    class Meta(UsageRollup.Meta):
        constraints = _rollup_meta("usage_total")["constraints"]


KEY_USAGE_MINUTES = 15


def key_usage_bucket(at: datetime) -> datetime:
    """The start of `at`'s KeyUsage bucket (15 minutes, UTC)."""
    return at.replace(minute=at.minute - at.minute % KEY_USAGE_MINUTES, second=0,
                      microsecond=0)


class KeyUsageQuerySet(UsageRollupQuerySet):
    def spend(self, tenant_id: int, since: datetime, until: datetime | None = None,
              key_id: int | None = None) -> Decimal:
        """What the tenant (or one of its keys) spent in [since, until): a sum over buckets,
        never a scan of events. `since` and `until` on bucket edges (any calendar period in
        any time zone is: offsets are whole quarter hours)."""
        rows = self.filter(tenant_id=tenant_id, bucket__gte=since)
        if until is not None:
            rows = rows.filter(bucket__lt=until)
        if key_id is not None:
            rows = rows.filter(api_key_id=key_id)
        total = rows.aggregate(total=Sum("cost"))["total"]
        return Decimal(total or 0)


class KeyUsage(models.Model):
    """Requests, tokens and cost per tenant and API key (0: none) over 15 minutes: what a key's
    or a tenant's spend in any period is summed from. Fifteen minutes because every time zone's
    offset is a whole number of quarter hours, so a calendar day, week, month or quarter in any
    zone starts on a bucket's edge."""

    bucket = models.DateTimeField(help_text="Start of the bucket (UTC).")
    tenant = models.ForeignKey(
        "tenants_app.Tenant", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    api_key_id = models.PositiveBigIntegerField(default=0)
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(max_digits=COST_DIGITS, decimal_places=COST_PLACES, default=0)

    objects = KeyUsageQuerySet.as_manager()

    COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")

    class Meta:
        ordering = ["-bucket"]
        constraints = [models.UniqueConstraint(fields=["bucket", "tenant", "api_key_id"],
                                               name="unique_key_usage")]
        indexes = [models.Index(fields=["tenant", "api_key_id", "-bucket"],
                                name="keyusage_tenant_key_bucket")]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.api_key_id}@{self.bucket:%Y-%m-%d %H:%M}"


class GuardrailRollup(models.Model):
    """What guardrails did for one tenant over one time bucket (abstract): how many findings
    per direction (input, output), action (block, redact, detect) and category (PHONE, ...),
    summed from the usage events' `guardrails` counts by the usage writer, and in how many
    requests (`requests`: one noisy request's thousands of matches count once). Never a
    value."""

    bucket = models.DateTimeField(help_text="Start of the bucket (UTC).")
    tenant = models.ForeignKey(
        "tenants_app.Tenant", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    direction = models.CharField(max_length=8)
    action = models.CharField(max_length=8)
    category = models.CharField(max_length=60)
    count = models.PositiveBigIntegerField(default=0)
    requests = models.PositiveBigIntegerField(
        default=0, help_text="Requests with at least one such finding.")

    objects = UsageRollupQuerySet.as_manager()

    class Meta:
        abstract = True
        ordering = ["bucket"]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} {self.direction}:{self.action}:{self.category}"


def _guardrail_meta(name: str) -> list[models.BaseConstraint]:
    return [models.UniqueConstraint(
        fields=["bucket", "tenant", "direction", "action", "category"],
        name=f"unique_{name}_bucket")]


class GuardrailMinute(GuardrailRollup):
    """Guardrail counts per minute: the dashboards up to a day and the alert metric."""

    class Meta(GuardrailRollup.Meta):
        constraints = _guardrail_meta("guardrail_minute")


class GuardrailHour(GuardrailRollup):
    """Guardrail counts per hour: the dashboards' longer ranges."""

    class Meta(GuardrailRollup.Meta):
        constraints = _guardrail_meta("guardrail_hour")


class GuardrailTotal(GuardrailRollup):
    """Guardrail counts ever (one bucket, TOTAL_BUCKET): the monotonic counter of `/metrics`."""

    class Meta(GuardrailRollup.Meta):
        constraints = _guardrail_meta("guardrail_total")
