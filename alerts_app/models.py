"""Alert rules, the alerts they raise, where notifications go, silences and the delivery log.

A rule is data: a metric (alerts_app.metrics), a scope, a comparison with a threshold, how long
the condition must hold (`for_seconds`) and a severity. The evaluator (alerts_app.evaluate),
run by beat on the control worker, keeps one `Alert` per rule and scope key (`deployment:3`,
`tenant:7/model:llama`) with its state, and records each notifiable change as an
`AlertTransition`; each transition gets one `Notification` per channel it is routed to, created
in the same transaction, so a redelivered task can never send a second one.

Ownership: a rule, channel or silence with a tenant belongs to that tenant (its owners and
admins manage it); without one it is the platform's (platform admins only). An alert concerns
a tenant when its scope key names one; a tenant's users see only the alerts that concern their
tenant, whoever's rule raised them.
"""

from __future__ import annotations

import secrets
import uuid
from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, validate_email
from django.db import models
from django.utils import timezone

from alerts_app.metrics import (
    QUANTILES,
    REGISTRY,
    TENANT_SCOPES,
    Metric,
    MetricSpec,
    Scope,
    Source,
    spec,
)
from alerts_app.targets import literal_target_error
from audit_app import recording
from audit_app.encryption import EncryptedTextField
from serving_app.models import Deployment, Node
from tenants_app.models import Tenant, TenantOwnedQuerySet

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, AnonymousUser


class Severity(models.TextChoices):
    INFO = "info", "Info"
    WARNING = "warning", "Warning"
    CRITICAL = "critical", "Critical"


SEVERITY_RANK = {Severity.INFO: 1, Severity.WARNING: 2, Severity.CRITICAL: 3}


class Comparison(models.TextChoices):
    GT = ">", "above"
    GE = ">=", "at or above"
    LT = "<", "below"
    LE = "<=", "at or below"


def compare(comparison: str, value: float, threshold: float) -> bool:
    if comparison == Comparison.GT:
        return value > threshold
    if comparison == Comparison.GE:
        return value >= threshold
    if comparison == Comparison.LT:
        return value < threshold
    return value <= threshold


# Without a recovery threshold an alert resolves once the value is this far (as a share of the
# threshold) on the clear side of it: a value hovering at the threshold does not flap.
DEFAULT_HYSTERESIS = 0.05


class OwnedQuerySet(TenantOwnedQuerySet):
    """Rows of a tenant (its members read them) or of the platform (tenant empty: staff only)."""

    def platform(self) -> OwnedQuerySet:
        return self.filter(tenant__isnull=True)


class AlertRule(models.Model):
    """A condition on a metric that raises an alert per scope key while it holds."""

    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="alert_rules",
        help_text="The tenant whose rule this is. Empty: a platform rule.",
    )
    key = models.SlugField(
        max_length=60, unique=True, null=True, blank=True, editable=False,
        help_text="Set on the rules the console ships with.",
    )
    name = models.CharField(max_length=100)
    metric = models.CharField(max_length=32, choices=Metric.choices)
    scope = models.CharField(max_length=16, choices=Scope.choices)
    target = models.CharField(
        max_length=200, blank=True,
        help_text="One node, deployment or model by name, or a tenant by slug. Empty: each.",
    )
    comparison = models.CharField(max_length=2, choices=Comparison.choices, default=Comparison.GT)
    threshold = models.FloatField(null=True, blank=True)
    use_tenant_objective = models.BooleanField(
        default=False, help_text="Latency only: the threshold is the tenant's latency objective.",
    )
    percentile = models.PositiveSmallIntegerField(
        default=95, help_text="Latency and time to first token: which percentile.",
    )
    window_seconds = models.PositiveIntegerField(
        default=60, validators=[MinValueValidator(10), MaxValueValidator(7 * 86400)],
        help_text="The value is read over this much of the recent past.",
    )
    for_seconds = models.PositiveIntegerField(
        default=0, validators=[MaxValueValidator(86400)],
        help_text="The condition must hold this long before the alert fires.",
    )
    recovery_threshold = models.FloatField(
        null=True, blank=True,
        help_text="A firing alert resolves once the value is past this on the clear side. "
                  "Empty: 5% of the threshold from it.",
    )
    min_requests = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1)],
        help_text="Traffic metrics: fewer requests in the window count as no data.",
    )
    severity = models.CharField(max_length=16, choices=Severity.choices, default=Severity.WARNING)
    enabled = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+", editable=False,
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__slug", "name", "pk"]

    def __str__(self) -> str:
        return self.name

    @property
    def spec(self) -> MetricSpec:
        return spec(self.metric)

    def clean(self) -> None:
        errors: dict[str, str] = {}
        metric = REGISTRY.get(self.metric)
        if metric is None:
            raise ValidationError({"metric": "Unknown metric."})
        if (metric.max_window_seconds and metric.windowed
                and self.window_seconds > metric.max_window_seconds):
            errors["window_seconds"] = (f"{metric.label} is kept for "
                                        f"{metric.max_window_seconds} s: choose a window of "
                                        "at most that.")
        if self.scope not in metric.scopes:
            allowed = ", ".join(str(s) for s in metric.scopes)
            errors["scope"] = f"{metric.label} has values per {allowed}, not per {self.scope}."
        if self.tenant_id is not None:
            if not metric.tenant_allowed:
                errors["metric"] = (f"{metric.label} is about the platform: tenants set rules on "
                                    "latency, time to first token, failures, 429s and budget.")
            elif self.scope not in TENANT_SCOPES:
                errors["scope"] = "A tenant's rule watches the tenant as a whole or its models."
            elif self.scope == Scope.TENANT and self.target:
                errors["target"] = "A tenant's rule watches its own tenant: leave this empty."
        elif self.target and "scope" not in errors:
            error = self._target_error()
            if error:
                errors["target"] = error
        if self.scope == Scope.CLUSTER and self.target:
            errors["target"] = "The cluster has no target: leave this empty."
        if self.use_tenant_objective:
            if self.metric != Metric.LATENCY or self.scope not in TENANT_SCOPES:
                errors["use_tenant_objective"] = (
                    "Only a latency rule per tenant or model can use the tenant's objective.")
        elif self.threshold is None:
            errors["threshold"] = "Give a threshold."
        if metric.quantile and self.percentile not in QUANTILES:
            errors["percentile"] = f"One of {', '.join(map(str, QUANTILES))}."
        if (self.recovery_threshold is not None and self.threshold is not None
                and compare(self.comparison, self.recovery_threshold, self.threshold)):
            errors["recovery_threshold"] = (
                "The recovery threshold must be on the clear side of the threshold.")
        if errors:
            raise ValidationError(errors)

    def _target_error(self) -> str:
        if self.scope == Scope.NODE and not Node.objects.filter(name=self.target).exists():
            return f"No node is named {self.target}."
        if (self.scope == Scope.DEPLOYMENT
                and not Deployment.objects.filter(name=self.target).exists()):
            return f"No deployment is named {self.target}."
        if self.scope == Scope.TENANT and not Tenant.objects.filter(slug=self.target).exists():
            return f"No tenant has the slug {self.target}."
        return ""

    def threshold_for(self, tenant: Tenant | None) -> float | None:
        """The threshold for one scope key: the rule's own, or the key's tenant's objective."""
        if self.use_tenant_objective:
            objective = tenant.latency_objective_ms if tenant is not None else None
            return float(objective) if objective else None
        return self.threshold

    def recovery_for(self, threshold: float) -> float:
        if self.recovery_threshold is not None and not self.use_tenant_objective:
            return self.recovery_threshold
        margin = abs(threshold) * DEFAULT_HYSTERESIS
        if self.comparison in (Comparison.GT, Comparison.GE):
            return threshold - margin
        return threshold + margin

    def describe(self) -> str:
        """`p95 latency above 500 ms for 60 s`, as the UI and notifications show a rule."""
        metric = self.spec
        label = metric.label.split(" percentile")[0]
        if not label[1:2].isupper():  # "GPU ..." keeps its capitals
            label = label[0].lower() + label[1:]
        name = f"p{self.percentile} {label}" if metric.quantile else label
        threshold = "the tenant's objective" if self.use_tenant_objective else \
            f"{self.threshold:g} {metric.unit}"
        text = f"{name} {Comparison(self.comparison).label} {threshold}"
        if metric.windowed:
            text += f" over {self.window_seconds} s"
        if self.for_seconds:
            text += f" for {self.for_seconds} s"
        return text


class AlertQuerySet(TenantOwnedQuerySet):
    def firing(self) -> AlertQuerySet:
        return self.filter(state=Alert.State.FIRING)


class Alert(models.Model):
    """One rule's condition for one scope key, and where it stands."""

    class State(models.TextChoices):
        OK = "ok", "OK"
        PENDING = "pending", "Pending"
        FIRING = "firing", "Firing"
        NO_DATA = "no_data", "No data"

    rule = models.ForeignKey(AlertRule, on_delete=models.CASCADE, related_name="alerts")
    scope_key = models.CharField(max_length=250)
    scope_label = models.CharField(max_length=250)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="alerts",
        help_text="The tenant the scope key names, if any: its users see this alert.",
    )
    state = models.CharField(max_length=16, choices=State.choices, default=State.OK)
    value = models.FloatField(null=True, blank=True)
    threshold = models.FloatField(null=True, blank=True)
    values = models.JSONField(
        default=list, blank=True, help_text="Recent [time, value] pairs (the ones that fired it).",
    )
    state_changed_at = models.DateTimeField(default=timezone.now)
    pending_since = models.DateTimeField(null=True, blank=True)
    fired_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    last_evaluated_at = models.DateTimeField(null=True, blank=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )

    objects = AlertQuerySet.as_manager()

    class Meta:
        ordering = ["-state_changed_at", "pk"]
        constraints = [
            models.UniqueConstraint(fields=["rule", "scope_key"], name="unique_alert_per_scope"),
        ]
        indexes = [models.Index(fields=["tenant", "state"], name="alert_tenant_state")]

    def __str__(self) -> str:
        return f"{self.rule} · {self.scope_label}"

    @property
    def severity(self) -> str:
        return self.rule.severity

    @property
    def no_data_reason(self) -> str:
        """Why an alert without data has none, in the words of its metric's source."""
        rule = self.rule
        spec = rule.spec
        if spec.source in (Source.USAGE, Source.FLOW):
            return (f"fewer than {rule.min_requests} request{'s' if rule.min_requests != 1 else ''}"
                    f" in the last {rule.window_seconds // 60 or 1} min: nothing to judge")
        return f"no readings from {spec.source.label.lower()} in the window"

    def request_filter(self) -> str:
        """The request log's query string for the requests behind this alert (its tenant,
        model or deployment, the failures its metric counts, from its window before it
        changed state); "" for a metric that is not about requests."""
        rule = self.rule
        if rule.spec.source not in (Source.USAGE, Source.GUARDRAILS, Source.FLOW):
            return ""
        since = self.state_changed_at - timedelta(seconds=rule.window_seconds or 300)
        query = {"since": since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        kind, _, value = self.scope_key.partition(":")
        if self.tenant is not None:
            query["tenant"] = self.tenant.slug
        if kind == "model":
            query["model"] = value
        elif kind == "deployment" and value.isdigit():
            query["deployment"] = value
        status = {Metric.ERROR_RATE: "error", Metric.RATE_LIMITED: "429"}.get(
            Metric(rule.metric))
        if status:
            query["status"] = status
        if rule.metric == Metric.GUARDRAIL_BLOCKED:
            query["error_code"] = "guardrail_blocked"
        return urlencode(query)

    def acknowledge(self, user: AbstractBaseUser | AnonymousUser) -> bool:
        """Mark a firing alert as seen; False when it is not firing (or already acknowledged).
        The acknowledgement ends with the episode: a new firing needs a new one."""
        now = timezone.now()
        by = user if user.is_authenticated else None
        changed = Alert.objects.filter(
            pk=self.pk, state=Alert.State.FIRING, acknowledged_at__isnull=True
        ).update(acknowledged_at=now, acknowledged_by=by)
        if changed:
            self.acknowledged_at, self.acknowledged_by = now, by  # type: ignore[assignment]
            # A conditional update sends no signal: the audit entry is written here.
            recording.record("acknowledge", self, {"acknowledged_at": [None, now]})
        return bool(changed)


class AlertTransition(models.Model):
    """A change of an alert that people are told about: it fired, resolved, or lost its data."""

    class Kind(models.TextChoices):
        FIRING = "firing", "Firing"
        RESOLVED = "resolved", "Resolved"
        NO_DATA = "no_data", "No data"

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="transitions")
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    at = models.DateTimeField(default=timezone.now)
    value = models.FloatField(null=True, blank=True)
    threshold = models.FloatField(null=True, blank=True)
    values = models.JSONField(default=list, blank=True)
    severity = models.CharField(max_length=16, choices=Severity.choices)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "-pk"]

    def __str__(self) -> str:
        return f"{self.alert} {self.kind} at {self.at:%Y-%m-%d %H:%M:%S}"


def new_channel_secret() -> str:
    return secrets.token_hex(32)


URL_MAX_LENGTH = 500  # a channel's URL, before encryption


def masked_url(url: str) -> str:
    """A webhook URL as it may be shown: its scheme and host (the path and query often hold
    the credential)."""
    if not url:
        return ""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}/…"


class Channel(models.Model):
    """Where notifications go: a webhook (signed JSON), a Slack-compatible webhook, or email.

    Routing: a tenant's channel gets the alerts that concern its tenant; a platform channel gets
    the alerts of platform rules. Either only from `min_severity` up and, when `scopes` is not
    empty, only of rules with one of those scopes.
    """

    class Kind(models.TextChoices):
        WEBHOOK = "webhook", "Webhook (JSON)"
        SLACK = "slack", "Slack-compatible webhook"
        EMAIL = "email", "Email"

    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="alert_channels",
        help_text="The tenant whose channel this is. Empty: a platform channel.",
    )
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    url = EncryptedTextField(
        blank=True,
        help_text="Webhooks: where to POST. Encrypted at rest and never shown whole (a "
                  "Slack-compatible webhook's URL is its credential): its scheme and host only.",
    )
    email_to = models.CharField(
        max_length=500, blank=True, help_text="Email: addresses, separated by commas.",
    )
    secret = EncryptedTextField(
        default=new_channel_secret, editable=False,
        help_text="Signs each webhook body (HMAC-SHA256); encrypted, shown once.",
    )
    min_severity = models.CharField(
        max_length=16, choices=Severity.choices, default=Severity.WARNING,
    )
    scopes = models.JSONField(
        default=list, blank=True, help_text="Only alerts of rules with these scopes. Empty: all.",
    )
    send_resolved = models.BooleanField(default=True)
    allow_private_targets = models.BooleanField(
        default=False,
        help_text="Platform channels only: may reach loopback, private and link-local "
                  "addresses (where engines, Redis and PostgreSQL listen).",
    )
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__slug", "name", "pk"]

    def __str__(self) -> str:
        return self.name

    @property
    def url_shown(self) -> str:
        """What pages, the API and the admin show of the URL: its scheme and host."""
        return masked_url(self.url)

    @property
    def recipients(self) -> list[str]:
        return [a.strip() for a in self.email_to.split(",") if a.strip()]

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.kind in (self.Kind.WEBHOOK, self.Kind.SLACK):
            if not self.url:
                errors["url"] = "A webhook needs a URL."
            elif len(self.url) > URL_MAX_LENGTH:
                errors["url"] = f"At most {URL_MAX_LENGTH} characters."
            elif not self.url.lower().startswith(("http://", "https://")):
                errors["url"] = "Only http:// and https:// URLs."
            elif self.tenant_id is not None or not self.allow_private_targets:
                error = literal_target_error(self.url)
                if error:
                    errors["url"] = error
        elif self.kind == self.Kind.EMAIL:
            if not self.recipients:
                errors["email_to"] = "Give at least one address."
            for address in self.recipients:
                try:
                    validate_email(address)
                except ValidationError:
                    errors["email_to"] = f"{address} is not an email address."
        if self.tenant_id is not None and self.allow_private_targets:
            errors["allow_private_targets"] = "Only platform channels may reach private addresses."
        unknown = [s for s in self.scopes or [] if s not in Scope.values]
        if not isinstance(self.scopes, list) or unknown:
            errors["scopes"] = f"A list of {', '.join(Scope.values)}."
        if errors:
            raise ValidationError(errors)

    def rotate_secret(self) -> str:
        """A new signing secret (receivers must be given it); the old one stops verifying."""
        self.secret = new_channel_secret()
        self.save(update_fields=["secret"])
        return self.secret

    def wants(self, rule: AlertRule, severity: str, kind: str) -> bool:
        """Routing by severity, scope and kind (the owner check is the caller's)."""
        if not self.enabled:
            return False
        if SEVERITY_RANK[Severity(severity)] < SEVERITY_RANK[Severity(self.min_severity)]:
            return False
        if self.scopes and rule.scope not in self.scopes:
            return False
        return kind != AlertTransition.Kind.RESOLVED or self.send_resolved


class SilenceQuerySet(OwnedQuerySet):
    def active(self, now: Any = None) -> SilenceQuerySet:
        now = now or timezone.now()
        return self.filter(starts_at__lte=now, ends_at__gt=now)


class Silence(models.Model):
    """Holds back notifications until `ends_at`: of one alert, of one rule's alerts, or (with
    neither) of everything its owner would be told about."""

    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="alert_silences",
    )
    rule = models.ForeignKey(
        AlertRule, null=True, blank=True, on_delete=models.CASCADE, related_name="silences",
    )
    alert = models.ForeignKey(
        Alert, null=True, blank=True, on_delete=models.CASCADE, related_name="silences",
    )
    starts_at = models.DateTimeField(default=timezone.now)
    ends_at = models.DateTimeField()
    reason = models.CharField(max_length=300)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+", editable=False,
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = SilenceQuerySet.as_manager()

    class Meta:
        ordering = ["-ends_at", "-pk"]

    def __str__(self) -> str:
        return f"silence until {self.ends_at:%Y-%m-%d %H:%M}: {self.reason}"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if not (self.reason or "").strip():
            errors["reason"] = "Say why."
        if self.ends_at and self.ends_at <= (self.starts_at or timezone.now()):
            errors["ends_at"] = "The end must be after the start."
        if self.ends_at and self.starts_at and self.ends_at - self.starts_at > timedelta(days=90):
            errors["ends_at"] = "A silence lasts at most 90 days."
        if self.tenant_id is not None:
            if self.rule is not None and self.rule.tenant_id != self.tenant_id:
                errors["rule"] = "Not a rule of this tenant."
            if self.alert is not None and self.alert.tenant_id != self.tenant_id:
                errors["alert"] = "Not an alert of this tenant."
        if errors:
            raise ValidationError(errors)

    def matches(self, alert: Alert) -> bool:
        if self.tenant_id is not None and alert.tenant_id != self.tenant_id:
            return False
        if self.alert_id is not None:
            return self.alert_id == alert.pk
        if self.rule_id is not None:
            return self.rule_id == alert.rule_id
        return True

    def end(self) -> None:
        """End the silence now (kept in the list, with its reason)."""
        now = timezone.now()
        if self.ends_at > now:
            self.ends_at = now
            self.save(update_fields=["ends_at"])


class Notification(models.Model):
    """One message to one channel: about a transition, or a test. Its states are the channel's
    delivery log; `uuid` is sent along so a receiver can drop a duplicate."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        SENDING = "sending", "Sending"
        SENT = "sent", "Sent"
        FAILED = "failed", "Failed"
        SILENCED = "silenced", "Silenced"

    class Kind(models.TextChoices):
        FIRING = "firing", "Firing"
        RESOLVED = "resolved", "Resolved"
        NO_DATA = "no_data", "No data"
        TEST = "test", "Test"

    uuid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    channel = models.ForeignKey(Channel, on_delete=models.CASCADE, related_name="notifications")
    transition = models.ForeignKey(
        AlertTransition, null=True, blank=True, on_delete=models.CASCADE,
        related_name="notifications",
    )
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="+",
        help_text="The channel's tenant.",
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    payload = models.JSONField(default=dict)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    claimed_at = models.DateTimeField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["transition", "channel"], name="one_notification_per_transition",
                condition=models.Q(transition__isnull=False),
            ),
        ]
        indexes = [models.Index(fields=["state", "next_attempt_at"], name="notification_due")]

    def __str__(self) -> str:
        return f"{self.kind} to {self.channel} ({self.state})"


class EvaluationState(models.Model):
    """The evaluator's one row: locked while a round runs (two beats never evaluate at once),
    and what the last round did, for the console."""

    last_started_at = models.DateTimeField(null=True, blank=True)
    last_finished_at = models.DateTimeField(null=True, blank=True)
    last_duration_ms = models.FloatField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    rules = models.PositiveIntegerField(default=0)
    rounds = models.PositiveBigIntegerField(default=0)

    class Meta:
        verbose_name = "evaluation state"

    def __str__(self) -> str:
        return f"alert evaluation, {self.rounds} rounds"
