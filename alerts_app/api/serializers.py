"""Serializers of the alerts API. Every write runs the model's `full_clean()` (through
`ValidatedModelSerializer`), so the API, the portal, the console and the admin refuse the same
bad rule with the same field errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from django.db import models
from rest_framework import serializers

from alerts_app.metrics import REGISTRY
from alerts_app.models import (
    URL_MAX_LENGTH,
    Alert,
    AlertRule,
    AlertTransition,
    Channel,
    Notification,
    Silence,
)
from tenants_app.api.base import ScopedPrimaryKeyField, TenantSlugField, ValidatedModelSerializer
from tenants_app.models import Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

_M = TypeVar("_M", bound=models.Model)


def _request_user(serializer: serializers.BaseSerializer[Any]) -> User | AnonymousUser | None:
    request = serializer.context.get("request")
    user: User | AnonymousUser | None = getattr(request, "user", None)
    return user


class OwnedSerializer(ValidatedModelSerializer[_M]):
    """`tenant` by slug, among the caller's tenants. Platform admins may leave it empty: the row
    is then the platform's; anyone else must name a tenant they manage."""

    tenant = TenantSlugField(required=False, allow_null=True, default=None)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        user = _request_user(self)
        current = getattr(self.instance, "tenant", None)
        tenant = attrs.get("tenant", current)
        if self.instance is not None and "tenant" in attrs and attrs["tenant"] != current:
            raise serializers.ValidationError({"tenant": "Cannot be changed; add a new one."})
        if tenant is None and user is not None and not user.is_staff:
            raise serializers.ValidationError({"tenant": "Name your tenant."})
        return super().validate(attrs)


class AlertRuleSerializer(OwnedSerializer[AlertRule]):
    description = serializers.CharField(source="describe", read_only=True)
    unit = serializers.SerializerMethodField()

    class Meta:
        model = AlertRule
        fields = ["id", "tenant", "key", "name", "metric", "scope", "target", "comparison",
                  "threshold", "use_tenant_objective", "percentile", "window_seconds",
                  "for_seconds", "recovery_threshold", "min_requests", "severity", "enabled",
                  "description", "unit", "created_at", "updated_at"]
        read_only_fields = ["id", "key", "created_at", "updated_at"]

    def get_unit(self, rule: AlertRule) -> str:
        spec = REGISTRY.get(rule.metric)
        return spec.unit if spec else ""


class TransitionSerializer(serializers.ModelSerializer[AlertTransition]):
    class Meta:
        model = AlertTransition
        fields = ["kind", "at", "value", "threshold", "values", "severity"]


class AlertSerializer(serializers.ModelSerializer[Alert]):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True)
    rule_name = serializers.CharField(source="rule.name", read_only=True)
    severity = serializers.CharField(source="rule.severity", read_only=True)
    description = serializers.CharField(source="rule.describe", read_only=True)
    acknowledged_by = serializers.CharField(source="acknowledged_by.username", read_only=True,
                                            default=None)
    history = serializers.SerializerMethodField()

    class Meta:
        model = Alert
        fields = ["id", "rule", "rule_name", "description", "severity", "tenant", "scope_key",
                  "scope_label", "state", "value", "threshold", "values", "state_changed_at",
                  "pending_since", "fired_at", "resolved_at", "last_evaluated_at",
                  "acknowledged_at", "acknowledged_by", "history"]
        read_only_fields = fields

    def get_history(self, alert: Alert) -> list[dict[str, Any]]:
        """The last transitions: when it fired and resolved, and the values that fired it."""
        return list(TransitionSerializer(alert.transitions.all()[:20], many=True).data)


def may_manage(serializer: serializers.BaseSerializer[Any], tenant: Tenant | None) -> bool:
    user = _request_user(serializer)
    if user is None or not user.is_authenticated:
        return False
    return bool(user.is_staff or (tenant is not None and tenant.user_can_manage(user)))


class ChannelSerializer(OwnedSerializer[Channel]):
    """A channel; its signing secret is in the creation (and rotation) response only. A webhook
    URL often carries a token (Slack's do): it is write-only (an update without it keeps the
    stored one) and read back as its scheme and host, by everyone. Members and viewers of its
    tenant see that it exists, not where it sends: no addresses either."""

    url = serializers.CharField(
        required=False, allow_blank=True, max_length=URL_MAX_LENGTH,
        help_text="Webhooks: where to POST. Write-only: read back as its scheme and host.")

    class Meta:
        model = Channel
        fields = ["id", "tenant", "name", "kind", "url", "email_to", "min_severity", "scopes",
                  "send_resolved", "allow_private_targets", "enabled", "created_at"]
        read_only_fields = ["id", "created_at"]

    def to_representation(self, channel: Channel) -> dict[str, Any]:
        data = super().to_representation(channel)
        data["url"] = channel.url_shown
        if not may_manage(self, channel.tenant):
            data["email_to"] = f"{len(channel.recipients)} address(es)" if channel.email_to \
                else ""
        return data


class ChannelWithSecretSerializer(ChannelSerializer):
    class Meta(ChannelSerializer.Meta):
        fields = [*ChannelSerializer.Meta.fields, "secret"]
        read_only_fields = [*ChannelSerializer.Meta.read_only_fields, "secret"]
        shown_once = ("secret",)  # the creation's and a rotation's answer only


class SilenceSerializer(OwnedSerializer[Silence]):
    # Only rules and alerts the caller may see can be named (others do not exist).
    rule = ScopedPrimaryKeyField(queryset=AlertRule.objects.none(), required=False,
                                 allow_null=True)
    alert = ScopedPrimaryKeyField(queryset=Alert.objects.none(), required=False,
                                  allow_null=True)
    created_by = serializers.CharField(source="created_by.username", read_only=True,
                                       default=None)

    class Meta:
        model = Silence
        fields = ["id", "tenant", "rule", "alert", "starts_at", "ends_at", "reason",
                  "created_by", "created_at"]
        read_only_fields = ["id", "created_at"]


class NotificationSerializer(serializers.ModelSerializer[Notification]):
    """One entry of a channel's delivery log (the error, which may quote the target, for the
    channel's managers only)."""

    class Meta:
        model = Notification
        fields = ["id", "uuid", "channel", "kind", "state", "attempts", "next_attempt_at",
                  "sent_at", "response_status", "last_error", "created_at", "payload"]
        read_only_fields = fields

    def to_representation(self, notification: Notification) -> dict[str, Any]:
        data = super().to_representation(notification)
        if not may_manage(self, notification.tenant):
            data["last_error"] = "failed" if notification.last_error else ""
        return data
