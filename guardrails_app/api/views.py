"""Guardrail endpoints: the platform floor (platform admins), a tenant's policy, its patterns
and its keys' narrowings (the tenant's owners and admins write; members read), and the policy
test bench (`POST .../tenant-guardrails/{id}/test/`)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from guardrails_app.api.serializers import (
    BenchResultSerializer,
    BenchSerializer,
    FloorPolicySerializer,
    GuardModelSerializer,
    KeyPolicySerializer,
    TenantPatternSerializer,
    TenantPolicySerializer,
)
from guardrails_app.models import (
    FloorPolicy,
    GuardModel,
    KeyPolicy,
    TenantPattern,
    TenantPolicy,
    bench,
)
from guardrails_app.policy import Direction
from tenants_app.api.base import IsStaff, ScopedModelViewSet
from tenants_app.models import Tenant


class FloorPolicyViewSet(ScopedModelViewSet[FloorPolicy]):
    """The platform's guardrail floor (one row; platform admins only). Every tenant's policy
    may only tighten it."""

    queryset = FloorPolicy.objects.all()
    resource_names = ("guardrail floor", "guardrail floors")
    serializer_class = FloorPolicySerializer
    permission_classes = [IsStaff]


class GuardModelViewSet(ScopedModelViewSet[GuardModel]):
    """Deployments marked as guard models (the classifier stage): every signed-in user may list
    them (a tenant's policy may name one); platform admins mark and change them."""

    queryset = GuardModel.objects.all()
    resource_names = ("guard model", "guard models")
    serializer_class = GuardModelSerializer

    def safely_get_queryset(self, queryset: QuerySet[GuardModel]) -> QuerySet[GuardModel]:
        return queryset.select_related("deployment")

    def perform_destroy(self, instance: GuardModel) -> None:
        named = instance.named_by()
        if named:
            raise ValidationError({"deployment": f"Named by {', '.join(named)}: change those "
                                                 "policies first."})
        instance.delete()


class TenantPolicyViewSet(ScopedModelViewSet[TenantPolicy]):
    """A tenant's guardrail policy: stricter than the floor only (a weakening is a 400 naming
    the detector)."""

    queryset = TenantPolicy.objects.all()
    resource_names = ("tenant guardrail policy", "tenant guardrail policies")
    serializer_class = TenantPolicySerializer
    filterset_fields = {"tenant__slug": ["exact"]}
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[TenantPolicy]) -> QuerySet[TenantPolicy]:
        return queryset.select_related("tenant")

    def check_write(self, target: Any) -> None:
        if self.action == "test":  # the bench changes nothing: every member may use it
            return
        super().check_write(target)

    @extend_schema(summary="Try a tenant's guardrail policy on a text",
                   request=BenchSerializer, responses=BenchResultSerializer)
    @action(detail=True, methods=["post"])
    def test(self, request: Request, pk: str | None = None) -> Response:
        """Run the tenant's effective policy (floor and tenant) on pasted text with the real
        detectors: what it would block or redact. Findings are offsets, never values."""
        policy_row = self.get_object()
        query = BenchSerializer(data=request.data)
        query.is_valid(raise_exception=True)
        return Response(bench(policy_row.tenant, query.validated_data["text"],
                              Direction(query.validated_data["direction"])))


class KeyPolicyViewSet(ScopedModelViewSet[KeyPolicy]):
    """An API key's narrowing of its tenant's guardrail policy (stricter still)."""

    queryset = KeyPolicy.objects.all()
    resource_names = ("API key guardrail policy", "API key guardrail policies")
    serializer_class = KeyPolicySerializer
    filterset_fields = {"tenant__slug": ["exact"], "api_key": ["exact"]}
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[KeyPolicy]) -> QuerySet[KeyPolicy]:
        return queryset.select_related("tenant", "api_key")

    def tenant_of(self, obj_or_data: Any) -> Tenant | None:
        if isinstance(obj_or_data, dict):
            key = obj_or_data.get("api_key")
            return key.tenant if key is not None else None
        return getattr(obj_or_data, "tenant", None)


class TenantPatternViewSet(ScopedModelViewSet[TenantPattern]):
    """A tenant's own detectors: RE2 patterns and deny-lists its policy can name."""

    queryset = TenantPattern.objects.all()
    resource_names = ("guardrail pattern", "guardrail patterns")
    serializer_class = TenantPatternSerializer
    filterset_fields = {"tenant__slug": ["exact"]}
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[TenantPattern]) -> QuerySet[TenantPattern]:
        return queryset.select_related("tenant")

    def perform_destroy(self, instance: TenantPattern) -> None:
        """A pattern that a policy's rules name is not deleted (the portal refuses the same)."""
        named = instance.named_by()
        if named:
            raise ValidationError({"name": f"Pattern {instance.name} is named by the policy "
                                           f"of {', '.join(named)}: take it out there first."})
        instance.delete()
