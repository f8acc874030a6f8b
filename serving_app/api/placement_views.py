"""Placement endpoints for platform admins: dry-run plans, the GPU allocation, GPU samples.

- ``GET  /api/v1/deployments/{id}/plan/``: where a saved deployment's replicas would go.
- ``POST /api/v1/plan/``: the same for a deployment body that is not saved. The body is
  validated by ``DeploymentSerializer``, exactly as a create would be, so a form can show the
  plan, or the same validation errors, before saving.
- ``GET  /api/v1/gpu-allocation/?range=24h``: per GPU, what is reserved for which deployment
  and tenant, shared deployments split among their tenants by use over the range.
- ``GET  /api/v1/gpu-accounting/?range=24h``: the same split per deployment and per tenant
  (GPU memory now, GPU-seconds over the range, MIG slices).
- ``GET  /api/v1/gpus/{id}/samples/?hours=N``: the GPU's recent samples, oldest first.

All of them answer 403 to anyone but staff. ``urlpatterns`` at the bottom lists them, and
console/urls.py includes them.
"""

from __future__ import annotations

from datetime import timedelta

from django.shortcuts import get_object_or_404
from django.urls import path
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from serving_app.api.serializers import DeploymentSerializer
from serving_app.fleet.accounting import Period
from serving_app.fleet.report import accounting, allocation, dry_run
from serving_app.fleet.sync import sample_retention
from serving_app.metering import panels, queries
from serving_app.models import Deployment, Gpu, GpuSample
from tenants_app.api.base import IsStaff


class StaffView(APIView):
    """An endpoint only platform admins may use (403 for tenant users)."""

    permission_classes = [IsStaff]


class DeploymentPlanView(StaffView):
    """The dry-run plan of a saved deployment: memory figures and where each replica would go."""

    @extend_schema(summary="Plan a saved deployment (dry run)", responses=OpenApiTypes.OBJECT)
    def get(self, request: Request, pk: int) -> Response:
        deployment = get_object_or_404(Deployment.objects.select_related("base_model"), pk=pk)
        return Response(dry_run(deployment))


class PlanView(StaffView):
    """The dry-run plan of an unsaved deployment body; nothing is written."""

    @extend_schema(summary="Plan a deployment before saving it (dry run)",
                   request=DeploymentSerializer, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request) -> Response:
        serializer = DeploymentSerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        tenants = list(data.pop("tenants", []))
        adapters = list(data.pop("adapters", []))
        candidate = Deployment(**data)
        return Response(dry_run(candidate, tenants=tenants, adapters=adapters))


RANGE_PARAMETER = OpenApiParameter(
    "range", str, enum=list(queries.RANGES),
    description="The period shared deployments are charged over (default 24h).",
)


class RangeQuery(serializers.Serializer):
    range = serializers.ChoiceField(choices=list(queries.RANGES), default=queries.DEFAULT_RANGE)


def _period(request: Request) -> Period:
    query = RangeQuery(data=request.query_params)
    query.is_valid(raise_exception=True)
    return panels.accounting_period(queries.get_range(query.validated_data["range"]))


class GpuAllocationView(StaffView):
    """What every GPU holds: its total, the reservations per deployment and tenant, what is free.
    A shared deployment's reservation is split among its tenants by use over ``range``."""

    @extend_schema(summary="What every GPU holds, per deployment and tenant",
                   parameters=[RANGE_PARAMETER], responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(allocation(_period(request)))


class GpuAccountingView(StaffView):
    """The GPU reservation charged to each tenant over ``range``: per deployment (the split, by
    use or by weight, and each tenant's part) and per tenant (GPU memory now, GPU-seconds over
    the range, MIG slices)."""

    @extend_schema(summary="GPU memory and time charged to each tenant",
                   parameters=[RANGE_PARAMETER], responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        report = accounting(_period(request))
        return Response({key: report[key] for key in ("period", "deployments", "tenants")})


class SamplesQuery(serializers.Serializer):
    hours = serializers.FloatField(required=False, default=1.0, min_value=0.01)


class GpuSampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = GpuSample
        fields = ["at", "memory_used_bytes", "utilization_percent", "temperature_c", "power_w"]
        read_only_fields = fields


class GpuSamplesView(StaffView):
    """A GPU's samples over the last ``hours`` (default 1, at most the retention), oldest first."""

    @extend_schema(
        summary="A GPU's recent samples (memory, utilization, temperature, power)",
        parameters=[OpenApiParameter("hours", float, description="How far back (default 1).")],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request: Request, pk: int) -> Response:
        gpu = get_object_or_404(Gpu.objects.select_related("node"), pk=pk)
        query = SamplesQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        retention = sample_retention()
        # Capped before it becomes a timedelta: a huge `hours` would overflow one (a 500).
        hours = min(query.validated_data["hours"], retention.total_seconds() / 3600)
        span = timedelta(hours=hours)
        samples = GpuSample.objects.filter(gpu=gpu, at__gte=timezone.now() - span).order_by("at")
        return Response(
            {
                "gpu": gpu.pk,
                "node": gpu.node.name,
                "index": gpu.index,
                "name": gpu.name,
                "memory_total_bytes": gpu.memory_total_bytes,
                "hours": span.total_seconds() / 3600,
                "samples": GpuSampleSerializer(samples, many=True).data,
            }
        )


urlpatterns = [
    path(
        "deployments/<int:pk>/plan/", DeploymentPlanView.as_view(), name="deployment-plan"
    ),
    path("plan/", PlanView.as_view(), name="plan"),
    path("gpu-allocation/", GpuAllocationView.as_view(), name="gpu-allocation"),
    path("gpu-accounting/", GpuAccountingView.as_view(), name="gpu-accounting"),
    path("gpus/<int:pk>/samples/", GpuSamplesView.as_view(), name="gpu-samples"),
]
