"""Usage metering: one event per gateway request, and time-bucketed rollups for the dashboards.

The gateway never writes these rows itself: it appends events to a Redis stream and the batch
writer (`gateway_app.writer`) persists them, together with the per-minute and per-hour
rollups, in one transaction per batch. Ids of keys, deployments and instances are stored as plain
numbers (not foreign keys) so that usage history outlives the rows it refers to and a deleted
instance can never make a batch fail; the tenant is a foreign key without a database constraint
for the same reason, so the dashboards can still join on it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db import models
from django.db.models import F, Sum
from django.utils import timezone

from tenants_app.models import Tenant, TenantOwnedQuerySet

__all__ = ["UsageEvent", "UsageMinute", "UsageHour", "LATENCY_BUCKETS_MS"]

# Upper bounds (ms) of the latency histogram kept in the rollups; a p95 can be read off them.
LATENCY_BUCKETS_MS = (100, 250, 500, 1000, 2500, 5000, 10000)


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
    stream = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    reserved_tokens = models.PositiveIntegerField(
        default=0, help_text="Tokens reserved at admission (settled to the real count)."
    )
    ttft_ms = models.FloatField(null=True, blank=True, help_text="Time to first token (streams).")
    latency_ms = models.FloatField(default=0.0)

    objects = UsageQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="usageevent_tenant_at")]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.status_code}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageRollup(models.Model):
    """Counters for one tenant and public model over one time bucket (abstract)."""

    bucket = models.DateTimeField(help_text="Start of the bucket (UTC).")
    tenant = models.ForeignKey(
        "tenants_app.Tenant", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    model = models.CharField(max_length=200)
    requests = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveBigIntegerField(default=0, help_text="Responses with status >= 400.")
    rate_limited = models.PositiveBigIntegerField(default=0, help_text="429 responses.")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    latency_ms_total = models.FloatField(default=0.0)
    latency_ms_max = models.FloatField(default=0.0)
    ttft_ms_total = models.FloatField(default=0.0)
    ttft_count = models.PositiveBigIntegerField(default=0)
    latency_le_100 = models.PositiveBigIntegerField(default=0)
    latency_le_250 = models.PositiveBigIntegerField(default=0)
    latency_le_500 = models.PositiveBigIntegerField(default=0)
    latency_le_1000 = models.PositiveBigIntegerField(default=0)
    latency_le_2500 = models.PositiveBigIntegerField(default=0)
    latency_le_5000 = models.PositiveBigIntegerField(default=0)
    latency_le_10000 = models.PositiveBigIntegerField(default=0)

    objects = UsageQuerySet.as_manager()

    class Meta:
        abstract = True
        ordering = ["-bucket"]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.model}@{self.bucket:%Y-%m-%d %H:%M}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageMinute(UsageRollup):
    """Per-minute rollup per tenant and model (kept for recent, fine-grained charts)."""

    class Meta(UsageRollup.Meta):
        constraints = [
            models.UniqueConstraint(
                fields=["bucket", "tenant", "model"], name="unique_usage_minute"
            ),
        ]
        indexes = [models.Index(fields=["tenant", "-bucket"], name="usageminute_tenant_bucket")]


class UsageHour(UsageRollup):
    """Per-hour rollup per tenant and model (long-range charts and monthly budgets)."""

    class Meta(UsageRollup.Meta):
        constraints = [
            models.UniqueConstraint(fields=["bucket", "tenant", "model"], name="unique_usage_hour"),
        ]
        indexes = [models.Index(fields=["tenant", "-bucket"], name="usagehour_tenant_bucket")]
