"""What-if plans in the management API (platform admins only; tenants get 403).

- ``/api/v1/fleet-plans/``: list, create, read, change and delete plans. A body is validated by
  the model's ``clean()`` (through ``ValidatedModelSerializer``), so a bad fleet or deployment
  list is a 400 with the same messages the console and the admin show, under ``fleet`` or
  ``deployments``.
- ``/api/v1/fleet-plans/{id}/placement/``: where its deployments would go on its fleet, per GPU,
  per deployment and per tenant (``kind: "plan"``). Nothing is started or reserved.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from serving_app.fleet import plans as fleetplans
from serving_app.models import FleetPlan
from tenants_app.api.base import IsStaff, ScopedModelViewSet, ValidatedModelSerializer


class FleetPlanSerializer(ValidatedModelSerializer):
    created_by = serializers.CharField(source="created_by.username", read_only=True, default=None)
    deployments = serializers.JSONField(
        required=False,
        help_text="The deployments to place, in order (docs/placement.md, \"What-if plans\").",
    )

    class Meta:
        model = FleetPlan
        fields = ["id", "name", "description", "fleet", "deployments", "policy", "headroom",
                  "created_by", "created_at", "updated_at"]
        read_only_fields = ["id", "created_by", "created_at", "updated_at"]


class FleetPlanViewSet(ScopedModelViewSet):
    """What-if plans: a fleet that is not running and the deployments to place on it."""

    queryset = FleetPlan.objects.all()
    serializer_class = FleetPlanSerializer
    permission_classes = [IsStaff]
    filterset_fields = ["name", "policy"]

    def extra_create_fields(self) -> dict[str, Any]:
        return {"created_by": self.request.user}

    @extend_schema(summary="Place a what-if plan's deployments on its fleet",
                   responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get"])
    def placement(self, request: Request, pk: str | None = None) -> Response:
        """Where the plan's deployments would go, labelled as a plan; nothing is written."""
        plan = self.get_object()
        assert isinstance(plan, FleetPlan)
        return Response(fleetplans.plan_result(plan))
