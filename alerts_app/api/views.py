"""The alerts API under /api/v1/: rules, alerts (acknowledge), channels (test, rotate the
secret, delivery log), silences (end) and the delivery log.

Scoping as everywhere in the API (`ScopedModelViewSet`): rows are read through the model's
`for_user()`, so another tenant's rule, alert, channel or silence is a 404; writes need the
owner or admin role in the row's tenant (403 for members and viewers), and only platform admins
touch the platform's rows. Members and viewers see a channel and its delivery log without the
webhook URL, the addresses and the errors (which may quote them).
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from alerts_app import delivery
from alerts_app.api.serializers import (
    AlertRuleSerializer,
    AlertSerializer,
    ChannelSerializer,
    ChannelWithSecretSerializer,
    NotificationSerializer,
    SilenceSerializer,
)
from alerts_app.models import Alert, AlertRule, Channel, Notification, Silence
from tenants_app.api.base import ScopedModelViewSet, ScopedReadOnlyModelViewSet


class AlertRuleViewSet(ScopedModelViewSet[AlertRule]):
    """Alert rules: platform rules (no tenant; platform admins) and tenants' own rules on their
    latency, time to first token, failures, 429s and budget."""

    queryset = AlertRule.objects.all()
    serializer_class = AlertRuleSerializer
    filterset_fields = {"tenant__slug": ["exact"], "metric": ["exact"], "scope": ["exact"],
                        "enabled": ["exact"]}
    ordering_fields = ["name", "created_at"]
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[AlertRule]) -> QuerySet[AlertRule]:
        return queryset.select_related("tenant")

    def extra_create_fields(self) -> dict[str, Any]:
        return {"created_by": self.request.user}


class AlertViewSet(ScopedReadOnlyModelViewSet[Alert]):
    """Alerts, one per rule and scope key, with their history. A tenant's users see the alerts
    that concern their tenant, whichever rule raised them."""

    queryset = Alert.objects.all()
    serializer_class = AlertSerializer
    filterset_fields = {"state": ["exact", "in"], "tenant__slug": ["exact"], "rule": ["exact"]}
    ordering_fields = ["state_changed_at", "fired_at"]

    def safely_get_queryset(self, queryset: QuerySet[Alert]) -> QuerySet[Alert]:
        return queryset.select_related("rule", "tenant", "acknowledged_by").prefetch_related(
            "transitions")

    @extend_schema(summary="Acknowledge a firing alert", request=None, responses=AlertSerializer)
    @action(detail=True, methods=["post"])
    def acknowledge(self, request: Request, pk: str | None = None) -> Response:
        """Mark a firing alert as seen (owners and admins of its tenant; platform admins)."""
        alert = self.get_object()
        user = request.user
        if not user.is_staff and (alert.tenant is None or not alert.tenant.user_can_manage(user)):
            raise PermissionDenied("Your role in this tenant does not allow this change.")
        if not alert.acknowledge(request.user):
            return Response({"detail": "Only a firing alert not yet acknowledged can be."},
                            status=status.HTTP_409_CONFLICT)
        return Response(self.get_serializer(alert).data)


class ChannelViewSet(ScopedModelViewSet[Channel]):
    """Notification channels: webhook, Slack-compatible webhook, email. The signing secret is in
    the creation response and `rotate-secret`'s only."""

    queryset = Channel.objects.all()
    resource_names = ("notification channel", "notification channels")
    serializer_class = ChannelSerializer
    filterset_fields = {"tenant__slug": ["exact"], "kind": ["exact"]}
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[Channel]) -> QuerySet[Channel]:
        return queryset.select_related("tenant")

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        response = super().create(request, *args, **kwargs)
        channel = Channel.objects.get(pk=response.data["id"])
        response.data = ChannelWithSecretSerializer(channel, context={"request": request}).data
        return response

    @extend_schema(summary="Give a channel a new signing secret", request=None,
                   responses=ChannelWithSecretSerializer)
    @action(detail=True, methods=["post"], url_path="rotate-secret")
    def rotate_secret(self, request: Request, pk: str | None = None) -> Response:
        channel = self.get_object()
        self.check_write(channel)
        channel.rotate_secret()
        return Response(ChannelWithSecretSerializer(channel, context={"request": request}).data)

    @extend_schema(summary="Send a test notification to a channel", request=None,
                   responses={202: NotificationSerializer})
    @action(detail=True, methods=["post"])
    def test(self, request: Request, pk: str | None = None) -> Response:
        """Send a test notification; its entry in the delivery log shows how it went."""
        channel = self.get_object()
        self.check_write(channel)
        notification = delivery.send_test(channel)
        return Response(NotificationSerializer(notification, context={"request": request}).data,
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(summary="List a channel's notifications, newest first",
                   responses=NotificationSerializer(many=True))
    @action(detail=True, methods=["get"])
    def deliveries(self, request: Request, pk: str | None = None) -> Response:
        channel = self.get_object()
        rows = channel.notifications.order_by("-created_at", "-pk")
        # The paginator itself: the view's paginate_queryset() is typed for channels.
        paginator = self.paginator
        page = (paginator.paginate_queryset(rows, request, view=self)
                if paginator is not None else None)
        data = NotificationSerializer(page, many=True, context={"request": request}).data
        return self.get_paginated_response(data)


class SilenceViewSet(ScopedModelViewSet[Silence]):
    """Silences: notifications of one alert, one rule's alerts, or everything of their owner are
    held back (logged as silenced) until `ends_at`."""

    queryset = Silence.objects.all()
    serializer_class = SilenceSerializer
    filterset_fields = {"tenant__slug": ["exact"], "rule": ["exact"]}
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[Silence]) -> QuerySet[Silence]:
        return queryset.select_related("tenant", "created_by")

    def extra_create_fields(self) -> dict[str, Any]:
        return {"created_by": self.request.user}

    @extend_schema(summary="End a silence now", request=None, responses=SilenceSerializer)
    @action(detail=True, methods=["post"])
    def end(self, request: Request, pk: str | None = None) -> Response:
        silence = self.get_object()
        self.check_write(silence)
        silence.end()
        return Response(self.get_serializer(silence).data)


class NotificationViewSet(ScopedReadOnlyModelViewSet[Notification]):
    """Every channel's delivery log, as the channel's tenant sees it."""

    queryset = Notification.objects.all()
    serializer_class = NotificationSerializer
    filterset_fields = {"channel": ["exact"], "state": ["exact"], "kind": ["exact"]}

    def safely_get_queryset(self, queryset: QuerySet[Notification]) -> QuerySet[Notification]:
        return queryset.select_related("channel")
