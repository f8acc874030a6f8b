"""`/api/v1/requests/`: the request log (every request the gateway metered), filtered as the
console's and the portal's log pages are (`serving_app.metering.requests.RequestFilter`).
Platform admins read every tenant's requests, a tenant's members their tenant's; another
tenant's request answers 404. Tenants' users get no instance and no host path in a message."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from rest_framework import serializers

from serving_app.api.serializers import ViewerMixin
from serving_app.metering.requests import RequestFilter, queue_wait_ms, stage_times
from serving_app.models import UsageEvent
from serving_app.redaction import redact_paths
from tenants_app.api.base import ScopedReadOnlyModelViewSet


class RequestSerializer(ViewerMixin, serializers.ModelSerializer[UsageEvent]):
    tenant = serializers.SlugRelatedField[Any](slug_field="slug", read_only=True)
    queue_wait_ms = serializers.SerializerMethodField(
        help_text="Milliseconds waiting for an engine slot (the `dispatched` stage).")
    stopped_at = serializers.SerializerMethodField(
        help_text="The last stage the request entered: where a refused one was refused.")

    class Meta:
        model = UsageEvent
        fields = [
            "request_id", "created_at", "tenant", "api_key_id", "endpoint", "model", "adapter",
            "deployment_id", "instance_id", "status_code", "error_code", "error_message",
            "stream", "prompt_tokens", "completion_tokens", "reserved_tokens", "ttft_ms",
            "latency_ms", "queue_wait_ms", "stages", "stopped_at", "guardrails",
            "guardrail_fields",
        ]
        read_only_fields = fields

    def get_queue_wait_ms(self, event: UsageEvent) -> float | None:
        return queue_wait_ms(stage_times(event))

    def get_stopped_at(self, event: UsageEvent) -> str:
        stages = stage_times(event)
        return stages[-1][0] if stages else ""

    def to_representation(self, instance: UsageEvent) -> dict[str, Any]:
        data = super().to_representation(instance)
        if not self.viewer_is_staff:
            data["instance_id"] = None
            data["error_message"] = redact_paths(instance.error_message)
        return data


class RequestViewSet(ScopedReadOnlyModelViewSet[UsageEvent]):
    """The request log: admins every tenant's requests, members their tenant's."""

    queryset = UsageEvent.objects.all()
    resource_names = ("request", "requests")
    serializer_class = RequestSerializer
    filterset_class = RequestFilter
    lookup_field = "request_id"
    lookup_value_regex = r"[-\w.]+"
    ordering_fields = ["created_at", "latency_ms", "status_code"]

    def safely_get_queryset(self, queryset: QuerySet[UsageEvent]) -> QuerySet[UsageEvent]:
        return queryset.select_related("tenant")
