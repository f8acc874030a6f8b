"""Engine metric endpoints: what a deployment's (or one instance's) engines reported.

- ``GET /api/v1/deployments/{id}/metrics/?minutes=N``: the samples of every instance of the
  deployment over the last N minutes (default 60), oldest first. Tenant users read the
  deployments they may see (another's is a 404, as everywhere in the API), and of the adapters
  an engine names only their own tenants'.
- ``GET /api/v1/instances/{id}/metrics/?minutes=N``: one instance's samples (platform admins
  only, like the instances endpoint).

A window up to the sample retention (``ENGINE_SAMPLE_RETENTION_HOURS``) answers the samples
themselves under ``samples``; a longer one (up to ``ENGINE_ROLLUP_RETENTION_DAYS``) answers the
hourly rollups under ``hours``, and ``resolution`` says which. ``urlpatterns`` at the bottom lists
both; console/urls.py includes them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.urls import path
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import permissions, serializers
from rest_framework.request import Request
from rest_framework.response import Response

from serving_app.models import Deployment, Instance, LoraAdapter
from serving_app.models.engine_metrics import (
    EngineHour,
    EngineSample,
    quantile_ms,
    rollup_retention,
    sample_retention,
)
from serving_app.redaction import is_platform_admin
from tenants_app.api.base import IsStaff, ScopedQuerysetMixin

MINUTES_PER_DAY = 24 * 60


class MetricsQuery(serializers.Serializer[Any]):
    minutes = serializers.IntegerField(
        required=False, default=60, min_value=1,
        help_text="How far back, in minutes (default 60; at most the rollup retention).",
    )

    def validate_minutes(self, value: int) -> int:
        limit = int(rollup_retention().total_seconds() // 60)
        if value > limit:
            raise serializers.ValidationError(
                f"At most {limit} minutes ({limit // MINUTES_PER_DAY} days): older engine "
                f"metrics are not kept."
            )
        return value


class AdapterFilterMixin:
    """Tenant users see only their own tenants' adapters among those an engine names."""

    context: dict[str, Any]

    def visible(self, names: list[str]) -> list[str]:
        allowed = self.context.get("adapters")
        return list(names) if allowed is None else [n for n in names if n in allowed]


class EngineSampleSerializer(AdapterFilterMixin, serializers.ModelSerializer[EngineSample]):
    prompt_tokens_per_second = serializers.FloatField(read_only=True, allow_null=True)
    generation_tokens_per_second = serializers.FloatField(read_only=True, allow_null=True)
    prefix_cache_hit_rate = serializers.FloatField(read_only=True, allow_null=True)
    active_adapters = serializers.SerializerMethodField()

    class Meta:
        model = EngineSample
        fields = [
            "instance", "at", "interval_seconds", "requests_running", "requests_waiting",
            "kv_cache_usage", "prefix_cache_hit_rate", "prompt_tokens_per_second",
            "generation_tokens_per_second", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms",
            "itl_p95_ms", "prompt_tokens", "generation_tokens", "preemptions",
            "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_total",
            "generation_tokens_total", "preemptions_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total", "active_adapters",
        ]
        read_only_fields = fields

    def get_active_adapters(self, sample: EngineSample) -> list[str]:
        return self.visible(sample.active_adapters or [])


class EngineHourSerializer(AdapterFilterMixin, serializers.ModelSerializer[EngineHour]):
    at = serializers.DateTimeField(source="bucket", read_only=True)
    prompt_tokens_per_second = serializers.SerializerMethodField()
    generation_tokens_per_second = serializers.SerializerMethodField()
    prefix_cache_hit_rate = serializers.SerializerMethodField()
    ttft_p50_ms = serializers.SerializerMethodField()
    ttft_p95_ms = serializers.SerializerMethodField()
    itl_p50_ms = serializers.SerializerMethodField()
    itl_p95_ms = serializers.SerializerMethodField()
    adapter_samples = serializers.SerializerMethodField()

    class Meta:
        model = EngineHour
        fields = [
            "instance", "at", "samples", "seconds", "requests_running_mean",
            "requests_running_max", "requests_waiting_mean", "requests_waiting_max",
            "kv_cache_usage_mean", "kv_cache_usage_max", "prefix_cache_hit_rate",
            "prompt_tokens_per_second", "generation_tokens_per_second", "ttft_p50_ms",
            "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "prompt_tokens", "generation_tokens",
            "preemptions", "prefix_cache_queries", "prefix_cache_hits", "adapter_samples",
        ]
        read_only_fields = fields

    def _rate(self, hour: EngineHour, count: int) -> float | None:
        return count / hour.seconds if hour.seconds else None

    def get_prompt_tokens_per_second(self, hour: EngineHour) -> float | None:
        return self._rate(hour, hour.prompt_tokens)

    def get_generation_tokens_per_second(self, hour: EngineHour) -> float | None:
        return self._rate(hour, hour.generation_tokens)

    def get_prefix_cache_hit_rate(self, hour: EngineHour) -> float | None:
        queries = hour.prefix_cache_queries
        return hour.prefix_cache_hits / queries if queries else None

    def get_ttft_p50_ms(self, hour: EngineHour) -> float | None:
        return quantile_ms(hour.ttft_buckets, 0.50)

    def get_ttft_p95_ms(self, hour: EngineHour) -> float | None:
        return quantile_ms(hour.ttft_buckets, 0.95)

    def get_itl_p50_ms(self, hour: EngineHour) -> float | None:
        return quantile_ms(hour.itl_buckets, 0.50)

    def get_itl_p95_ms(self, hour: EngineHour) -> float | None:
        return quantile_ms(hour.itl_buckets, 0.95)

    def get_adapter_samples(self, hour: EngineHour) -> dict[str, int]:
        counts = hour.adapter_samples or {}
        return {name: counts[name] for name in self.visible(sorted(counts))}


WINDOW = OpenApiParameter("minutes", int, description="How far back, in minutes (default 60).")


class EngineMetricsView(ScopedQuerysetMixin[Any]):
    """A window of engine samples of the instances `scope()` gives for the looked-up object."""

    def scope(self, obj: Any) -> QuerySet[Instance]:
        raise NotImplementedError

    def describe(self, obj: Any) -> dict[str, Any]:
        raise NotImplementedError

    @extend_schema(parameters=[WINDOW], responses=OpenApiTypes.OBJECT)
    def get(self, request: Request, pk: int) -> Response:
        obj = self.get_object()
        query = MetricsQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        minutes = query.validated_data["minutes"]
        since = timezone.now() - timedelta(minutes=minutes)
        hourly = timedelta(minutes=minutes) > sample_retention()
        context = {"request": request, "adapters": self.visible_adapters()}
        instances = self.scope(obj)
        samples: list[Any] = []
        hours: list[Any] = []
        if hourly:
            rollups = EngineHour.objects.filter(instance__in=instances,
                                                bucket__gte=since).order_by("bucket", "instance")
            hours = list(EngineHourSerializer(rollups, many=True, context=context).data)
        else:
            rows = EngineSample.objects.filter(instance__in=instances,
                                               at__gte=since).order_by("at", "instance")
            samples = list(EngineSampleSerializer(rows, many=True, context=context).data)
        return Response({
            **self.describe(obj),
            "minutes": minutes,
            "resolution": "hour" if hourly else "sample",
            "interval_seconds": settings.ENGINE_METRICS_INTERVAL_SECONDS,
            "samples": samples,
            "hours": hours,
        })

    def visible_adapters(self) -> frozenset[str] | None:
        """The engine names of the adapters the caller may see; None: all (platform admins)."""
        user = self.request.user
        if is_platform_admin(user):
            return None
        adapters = LoraAdapter.objects.for_user(user).select_related("tenant")
        return frozenset(a.engine_name for a in adapters)


@extend_schema_view(get=extend_schema(summary="A deployment's engine metrics"))
class DeploymentMetricsView(EngineMetricsView):
    """Engine samples of every instance of a deployment the caller may see."""

    queryset = Deployment.objects.all()
    permission_classes = [permissions.IsAuthenticated]

    def scope(self, obj: Any) -> QuerySet[Instance]:
        return Instance.objects.filter(deployment=obj)

    def describe(self, obj: Any) -> dict[str, Any]:
        return {"deployment": obj.pk, "instance": None}


@extend_schema_view(get=extend_schema(summary="An instance's engine metrics"))
class InstanceMetricsView(EngineMetricsView):
    """Engine samples of one instance (platform admins only)."""

    queryset = Instance.objects.all()
    permission_classes = [IsStaff]

    def scope(self, obj: Any) -> QuerySet[Instance]:
        return Instance.objects.filter(pk=obj.pk)

    def describe(self, obj: Any) -> dict[str, Any]:
        return {"deployment": obj.deployment_id, "instance": obj.pk}


urlpatterns = [
    path("deployments/<int:pk>/metrics/", DeploymentMetricsView.as_view(),
         name="deployment-metrics"),
    path("instances/<int:pk>/metrics/", InstanceMetricsView.as_view(), name="instance-metrics"),
]
