"""Capacity tests and what an objective costs, in the management API.

- ``/api/v1/capacity-tests/`` (platform admins only; tenants get 403): list (``?deployment=``
  an id, ``?state=``), read, and start one (``POST`` with ``deployment``, its name, and any of
  ``input_tokens``, ``output_tokens``, ``concurrency``, ``requests_per_level``: the rest are
  derived from the deployment). A start is refused with 409 while a test of the deployment is
  queued or running, or when none of its instances is ready; bad settings are 400s under their
  field. ``POST /api/v1/capacity-tests/{id}/cancel/`` stops one (409 once it has finished).
- ``GET /api/v1/deployments/{id}/objective-cost/?ttft_ms=&tpot_ms=&e2e_ms=``: what those p95
  bounds cost on the deployment's curve (its newest test that succeeded), and what each of its
  tenants' saved objectives cost there; a tenant user reads the deployments of its tenants and
  its own tenants' rows only (`DeploymentViewSet.objective_cost`).
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error

from serving_app import frontier
from serving_app.models import CapacityPoint, CapacityTest, Deployment
from serving_app.models.capacity import (
    MAX_CONCURRENCY,
    MAX_LEVELS,
    MAX_REQUESTS_PER_LEVEL,
    MAX_TOKENS,
    Refused,
    costs_on,
    objectives_of,
)
from tenants_app.api.base import IsStaff, LookupSlugField, ScopedModelViewSet
from tenants_app.models import Tenant

# The largest objective the cost endpoint reads (ten minutes): anything above is no bound.
MAX_OBJECTIVE_MS = 600_000


class CapacityPointSerializer(serializers.ModelSerializer[CapacityPoint]):
    class Meta:
        model = CapacityPoint
        fields = ["concurrency", "completed", "failed", "output_tokens", "duration_s",
                  "tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms",
                  "e2e_p95_ms", "errors", "measured_at"]
        read_only_fields = fields


class CapacityTestSerializer(serializers.ModelSerializer[CapacityTest]):
    deployment = serializers.SlugRelatedField[Deployment](slug_field="name", read_only=True)
    created_by = serializers.SlugRelatedField[Any](slug_field="username", read_only=True)
    levels_total = serializers.IntegerField(read_only=True)
    points = CapacityPointSerializer(many=True, read_only=True)

    class Meta:
        model = CapacityTest
        fields = ["id", "deployment", "instance", "node_name", "created_by", "created_at",
                  "started_at", "finished_at", "state", "error", "input_tokens",
                  "output_tokens", "concurrency", "requests_per_level", "levels_done",
                  "levels_total", "points"]
        read_only_fields = fields


class CapacityTestStartSerializer(serializers.Serializer[Any]):
    """What a start names: the deployment, and any setting to differ from its defaults."""

    deployment = LookupSlugField[Deployment](slug_field="name",
                                             queryset=Deployment.objects.all())
    input_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS, required=False)
    output_tokens = serializers.IntegerField(min_value=2, max_value=MAX_TOKENS, required=False)
    concurrency = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=MAX_CONCURRENCY),
        min_length=1, max_length=MAX_LEVELS, required=False)
    requests_per_level = serializers.IntegerField(min_value=1, max_value=MAX_REQUESTS_PER_LEVEL,
                                                  required=False)


class CapacityTestViewSet(ScopedModelViewSet[CapacityTest]):
    """Capacity tests of deployments' engines: vLLM's own benchmark client against one ready
    instance at rising concurrency, on that instance's node (it sends real load to the engine,
    beside its tenants' traffic). The newest that succeeded is the deployment's curve."""

    queryset = CapacityTest.objects.all()
    serializer_class = CapacityTestSerializer
    permission_classes = [IsStaff]
    http_method_names = ["get", "post", "head", "options"]
    filterset_fields = {"deployment": ["exact"], "deployment__name": ["exact"],
                        "state": ["exact"]}

    def safely_get_queryset(self, queryset: Any) -> Any:
        return queryset.select_related("deployment", "created_by").prefetch_related("points")

    @extend_schema(request=CapacityTestStartSerializer, responses={201: CapacityTestSerializer},
                   summary="Start a capacity test of a deployment")
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        start = CapacityTestStartSerializer(data=request.data,
                                            context=self.get_serializer_context())
        start.is_valid(raise_exception=True)
        fields = dict(start.validated_data)
        deployment = fields.pop("deployment")
        try:
            test = CapacityTest.objects.start(deployment, request.user, **fields)
        except DjangoValidationError as exc:
            raise ValidationError(as_serializer_error(exc)) from exc
        except Refused as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(self.get_serializer(test).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: CapacityTestSerializer},
                   summary="Cancel a queued or running capacity test")
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        test = self.get_object()
        try:
            test.cancel()  # records its own audit entry
        except Refused as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(self.get_serializer(test).data)


# -- what an objective costs ---------------------------------------------------------------
class ObjectiveQuerySerializer(serializers.Serializer[Any]):
    """p95 bounds in milliseconds; each may be left out (no bound)."""

    ttft_ms = serializers.FloatField(min_value=1, max_value=MAX_OBJECTIVE_MS, required=False,
                                     help_text="Time to first token, p95 (ms).")
    tpot_ms = serializers.FloatField(min_value=0.01, max_value=MAX_OBJECTIVE_MS, required=False,
                                     help_text="Time per output token, p95 (ms).")
    e2e_ms = serializers.FloatField(min_value=1, max_value=MAX_OBJECTIVE_MS, required=False,
                                    help_text="End-to-end latency, p95 (ms).")


class CostSerializer(serializers.Serializer[Any]):
    tokens_per_s = serializers.FloatField()
    fraction = serializers.FloatField(help_text="Of the curve's peak output tokens/s.")
    concurrency = serializers.FloatField(allow_null=True)
    peak_tokens_per_s = serializers.FloatField()
    reach = serializers.ChoiceField(choices=[frontier.WHOLE, frontier.PART, frontier.NONE])
    limited_by = serializers.CharField(allow_null=True)


class TenantCostSerializer(serializers.Serializer[Any]):
    tenant = serializers.CharField()
    objectives = ObjectiveQuerySerializer()
    cost = CostSerializer(allow_null=True)


class ObjectiveCostSerializer(serializers.Serializer[Any]):
    deployment = serializers.CharField()
    capacity_test = serializers.IntegerField(allow_null=True,
                                             help_text="The curve's test; null before one "
                                                       "succeeded.")
    measured_at = serializers.DateTimeField(allow_null=True)
    objectives = ObjectiveQuerySerializer()
    cost = CostSerializer(allow_null=True)
    tenants = TenantCostSerializer(many=True)
    detail = serializers.CharField(required=False)


def _objectives_dict(objectives: frontier.Objectives) -> dict[str, float | None]:
    return {"ttft_ms": objectives.ttft_ms, "tpot_ms": objectives.tpot_ms,
            "e2e_ms": objectives.e2e_ms}


def read_objectives(params: Any) -> frontier.Objectives:
    """The query's bounds (an empty parameter is none); field errors otherwise."""
    given = {name: params.get(name) for name in ("ttft_ms", "tpot_ms", "e2e_ms")
             if params.get(name) not in (None, "")}
    query = ObjectiveQuerySerializer(data=given)
    query.is_valid(raise_exception=True)
    return frontier.Objectives(**query.validated_data)


def objective_cost(deployment: Deployment, tenants: list[Tenant], params: Any) -> dict[str, Any]:
    """What the query's bounds cost on `deployment`'s curve, and each of `tenants`' saved
    objectives (the caller's to see)."""
    objectives = read_objectives(params)
    (asked,) = costs_on([deployment], objectives)
    out: dict[str, Any] = {
        "deployment": deployment.name,
        "capacity_test": asked.curve.pk if asked.curve else None,
        "measured_at": asked.curve.finished_at if asked.curve else None,
        "objectives": _objectives_dict(objectives),
        "cost": asked.cost.as_dict() if asked.cost else None, "tenants": []}
    if asked.curve is None:
        out["detail"] = (f"No capacity test of {deployment.name} has succeeded yet: run one "
                         "(POST /api/v1/capacity-tests/) to know what an objective costs.")
    for tenant in tenants:
        saved = objectives_of(tenant)
        (row,) = costs_on([deployment], saved) if asked.curve else [asked]
        out["tenants"].append({"tenant": tenant.slug, "objectives": _objectives_dict(saved),
                               "cost": row.cost.as_dict() if row.cost else None})
    return out


class ObjectiveCostActions:
    """The deployment viewset's `objective-cost/` action (see the module)."""

    @extend_schema(summary="What latency objectives cost on a deployment's capacity curve",
                   parameters=[ObjectiveQuerySerializer], responses=ObjectiveCostSerializer)
    @action(detail=True, methods=["get"], url_path="objective-cost")
    def objective_cost(self, request: Request, pk: str | None = None) -> Response:
        deployment = self.get_object()  # type: ignore[attr-defined]
        tenants = deployment.tenants.order_by("slug")
        if not request.user.is_staff:
            tenants = tenants.filter(pk__in=Tenant.objects.for_user(request.user).values("pk"))
        return Response(objective_cost(deployment, list(tenants), request.query_params))
