"""The request log: every request the gateway metered (`UsageEvent`), filtered by time, key,
model, status and error code, and one request's story (its route, instance, stages with their
milliseconds, queue wait, time to first token, tokens, guardrail findings (per category, and
per field: which detector fired where and what it did) and its error).

One filter set serves the console's and the portal's pages and the API (`/api/v1/requests/`);
the rows it filters are always already scoped (`UsageEvent.objects.for_user()` or the portal's
one tenant). What a tenant's user may not read (a node, a host path in an engine's message) is
left out by `story(..., for_tenant=True)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import django_filters
from django import forms
from django.db.models import QuerySet

from serving_app.models import Deployment, Instance, UsageEvent
from serving_app.redaction import redact_paths
from tenants_app.models import ApiKey

# `?status=`: a class of statuses or one status code the gateway answers.
STATUS_CHOICES = [
    ("ok", "succeeded (below 400)"),
    ("error", "failed (400 and above)"),
    ("4xx", "refused (4xx)"),
    ("5xx", "failed serving (5xx)"),
    *((str(code), str(code)) for code in (400, 401, 403, 404, 405, 413, 429, 499, 500, 502,
                                          503, 504)),
]
_STATUS_RANGES = {"ok": (0, 399), "error": (400, 999), "4xx": (400, 499), "5xx": (500, 599)}

# The stage whose milliseconds are the request's wait for an engine slot (flow control).
QUEUE_STAGE = "dispatched"


class UtcIsoDateTimeField(django_filters.fields.IsoDateTimeField):
    """An ISO 8601 time, handed to the query in UTC: Python accepts offsets up to a day, which
    PostgreSQL refuses ("time zone displacement out of range", a 500 the API fuzz found), and
    a time near year 1 or 9999 may leave the calendar once moved to UTC (a field error)."""

    def to_python(self, value: Any) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return parsed.astimezone(UTC)
        except OverflowError:
            raise forms.ValidationError("This time is out of range once moved to UTC.",
                                        code="invalid") from None


class UtcIsoDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcIsoDateTimeField


class RequestFilter(django_filters.FilterSet):
    """The request log's filters; a bad value is a field error (the API answers 400)."""

    since = UtcIsoDateTimeFilter(
        field_name="created_at", lookup_expr="gte", label="From",
        widget=forms.TextInput(attrs={"placeholder": "2026-01-31 14:00", "size": 16}),
        help_text="Requests that arrived at or after this time (ISO 8601; UTC without a zone).")
    until = UtcIsoDateTimeFilter(
        field_name="created_at", lookup_expr="lt", label="Until",
        widget=forms.TextInput(attrs={"placeholder": "2026-01-31 15:00", "size": 16}),
        help_text="Requests that arrived before this time.")
    tenant = django_filters.CharFilter(field_name="tenant__slug", label="Tenant",
                                       max_length=50, help_text="A tenant's slug.")
    key = django_filters.NumberFilter(field_name="api_key_id", label="API key",
                                      min_value=1, help_text="An API key's id.")
    model = django_filters.CharFilter(field_name="model", label="Model", max_length=200,
                                      help_text="The public model name asked for.")
    status = django_filters.ChoiceFilter(choices=STATUS_CHOICES, method="filter_status",
                                         label="Status", empty_label="any status")
    error_code = django_filters.CharFilter(
        field_name="error_code", label="Error code", max_length=64,
        widget=forms.TextInput(attrs={"list": "error-codes", "size": 18}),
        help_text="As the gateway answered it: model_not_found, rate_limit_exceeded, ...")
    deployment = django_filters.NumberFilter(field_name="deployment_id", label="Deployment",
                                             min_value=1)
    request_id = django_filters.CharFilter(field_name="request_id", label="Request id",
                                           max_length=64)

    class Meta:
        model = UsageEvent
        fields: list[str] = []

    def filter_status(self, queryset: QuerySet[UsageEvent], name: str,
                      value: str) -> QuerySet[UsageEvent]:
        if value in _STATUS_RANGES:
            low, high = _STATUS_RANGES[value]
            return queryset.filter(status_code__gte=low, status_code__lte=high)
        return queryset.filter(status_code=int(value))


def error_codes(events: QuerySet[UsageEvent]) -> list[str]:
    """The error codes among `events` (already scoped), for the filter's suggestions."""
    return sorted(events.exclude(error_code="").order_by().values_list("error_code", flat=True)
                  .distinct()[:100])


def key_names(events: list[UsageEvent]) -> dict[int, str]:
    """The names of the keys of `events` (a page of rows), by id: "name (prefix…)"."""
    ids = {e.api_key_id for e in events if e.api_key_id}
    return {k.pk: f"{k.name} ({k.prefix}…)"
            for k in ApiKey.objects.filter(pk__in=ids).only("pk", "name", "prefix")}


@dataclass(frozen=True)
class Finding:
    direction: str
    action: str
    category: str
    count: int


@dataclass(frozen=True)
class FieldFinding:
    """What a detector found in one field of the request (input) or its answer (output)."""

    direction: str
    field: str  # `messages[2].tool_calls[0].function.arguments.to`; "" for the whole request
    detector: str
    category: str
    action: str
    count: int


@dataclass
class RequestStory:
    """One request as the log's detail shows it. The instance and deployment are None when
    the request reached none or they were deleted since (the event keeps their ids)."""

    event: UsageEvent
    key: str
    deployment: Deployment | None
    instance: Instance | None
    stages: list[tuple[str, float]]
    queue_wait_ms: float | None
    findings: list[Finding] = field(default_factory=list)
    field_findings: list[FieldFinding] = field(default_factory=list)
    error_message: str = ""

    @property
    def stopped_at(self) -> str:
        """The last stage the request entered: where a refused one was refused."""
        return self.stages[-1][0] if self.stages else ""

    @property
    def failed(self) -> bool:
        return self.event.status_code >= 400


def story(event: UsageEvent, *, for_tenant: bool) -> RequestStory:
    """The request's story. `for_tenant`: for a tenant's user, so without the instance (its
    node and port are the platform's) and with host paths taken out of the error message."""
    stages = stage_times(event)
    deployment = (Deployment.objects.filter(pk=event.deployment_id).first()
                  if event.deployment_id else None)
    instance = None
    if event.instance_id and not for_tenant:
        instance = Instance.objects.select_related("node").filter(pk=event.instance_id).first()
    message = event.error_message
    return RequestStory(
        event=event,
        key=key_names([event]).get(event.api_key_id or 0, ""),
        deployment=deployment,
        instance=instance,
        stages=stages,
        queue_wait_ms=queue_wait_ms(stages),
        findings=findings(event.guardrails),
        field_findings=field_findings(event.guardrail_fields),
        error_message=redact_paths(message) if for_tenant else message,
    )


def findings(counts: dict[str, Any]) -> list[Finding]:
    """Guardrail counts (`"direction:action:CATEGORY": n`) as findings, most first."""
    out = []
    for name, count in (counts or {}).items():
        parts = str(name).split(":", 2)
        if len(parts) == 3 and isinstance(count, int):
            direction, action, category = parts
            out.append(Finding(direction, action, category, count))
    return sorted(out, key=lambda f: (-f.count, f.direction, f.category))


def field_findings(entries: Any) -> list[FieldFinding]:
    """The event's per-field findings (`UsageEvent.guardrail_fields`), input first, in the
    order they were found; malformed entries left out."""
    out = []
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("count"), int):
            text = {k: str(entry.get(k) or "") for k in (
                "direction", "field", "detector", "category", "action")}
            out.append(FieldFinding(count=entry["count"], **text))
    return sorted(out, key=lambda f: f.direction != "input")


def stage_times(event: UsageEvent) -> list[tuple[str, float]]:
    """The event's stages with their milliseconds, in order (malformed entries left out)."""
    value = event.stages
    if not isinstance(value, list):
        return []
    return [(str(p[0]), float(p[1])) for p in value
            if isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[1], int | float)]


def queue_wait_ms(stages: list[tuple[str, float]]) -> float | None:
    """The milliseconds of the flow-control wait (the `dispatched` stage), None if the request
    never got there."""
    return next((ms for name, ms in stages if name == QUEUE_STAGE), None)
