"""Management API views for tenants, memberships, API keys, prefix-cache groups and users."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers as drf_serializers
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from serving_app import audit
from serving_app.gateway import invalidation as gateway_invalidation
from tenants_app.api.base import IsStaff, ScopedModelViewSet
from tenants_app.api.serializers import (
    ApiKeySerializer,
    MembershipSerializer,
    PrefixCacheGroupSerializer,
    TenantSerializer,
    UserSerializer,
)
from tenants_app.models import ApiKey, Membership, PrefixCacheGroup, Role, Tenant


class TenantViewSet(ScopedModelViewSet):
    """Tenants and their limits. Members read their own tenants; platform admins manage all."""

    queryset = Tenant.objects.all()
    serializer_class = TenantSerializer
    lookup_field = "slug"
    filterset_fields = ["status", "priority_tier"]
    ordering_fields = ["slug", "name", "created_at"]
    write_role = "staff"

    def tenant_of(self, obj):
        return obj if isinstance(obj, Tenant) else None


class MembershipViewSet(ScopedModelViewSet):
    """Who belongs to a tenant, with which role. Owners and admins manage their tenant's."""

    queryset = Membership.objects.all()
    serializer_class = MembershipSerializer
    filterset_fields = {"tenant__slug": ["exact"], "role": ["exact"], "user__username": ["exact"]}
    write_role = "manager"

    def get_queryset(self) -> QuerySet:
        return super().get_queryset().select_related("tenant", "user")

    def _check_owner_grant(self, tenant: Tenant, role: str | None) -> None:
        if role == Role.OWNER and tenant.role_of(self.request.user) not in ("platform", Role.OWNER):
            raise PermissionDenied("Only an owner can make someone an owner.")

    def perform_create(self, serializer: drf_serializers.BaseSerializer) -> None:
        data = serializer.validated_data
        self._check_owner_grant(data["tenant"], data.get("role"))
        super().perform_create(serializer)

    def perform_update(self, serializer: drf_serializers.BaseSerializer) -> None:
        membership = serializer.instance
        self._check_owner_grant(membership.tenant, serializer.validated_data.get("role"))
        if membership.role == Role.OWNER:
            self._check_owner_grant(membership.tenant, Role.OWNER)
        super().perform_update(serializer)

    def before_destroy(self, membership: Membership) -> None:
        if membership.role == Role.OWNER:
            self._check_owner_grant(membership.tenant, Role.OWNER)
        membership.check_deletable()


class ApiKeyViewSet(ScopedModelViewSet):
    """Gateway keys. The secret is in the creation response only; revoke to disable a key."""

    queryset = ApiKey.objects.all()
    serializer_class = ApiKeySerializer
    filterset_fields = {"tenant__slug": ["exact"], "revoked_at": ["isnull"]}
    ordering_fields = ["created_at", "name", "last_used_at"]
    write_role = "manager"

    def get_queryset(self) -> QuerySet:
        return super().get_queryset().select_related("tenant")

    def extra_create_fields(self) -> dict:
        return {"created_by": self.request.user}

    @extend_schema(request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        key = self.get_object()
        if key.revoke():
            audit.record(
                request, "revoke", key, changes={"revoked_at": [None, str(key.revoked_at)]}
            )
        gateway_invalidation.key_changed(key)
        return Response(self.get_serializer(key).data)


class PrefixCacheGroupViewSet(ScopedModelViewSet):
    """Prefix-cache sharing groups (platform admins only). A tenant joins one through its
    `prefix_cache_group` field; members share cached prompt prefixes on shared engines."""

    queryset = PrefixCacheGroup.objects.all()
    serializer_class = PrefixCacheGroupSerializer
    permission_classes = [IsStaff]
    lookup_field = "name"

    def get_queryset(self) -> QuerySet:
        return PrefixCacheGroup.objects.prefetch_related("tenants").order_by("name")


class UserViewSet(ScopedModelViewSet):
    """Console users (platform admins only). Tenant roles are set through memberships."""

    queryset = get_user_model().objects.all()
    serializer_class = UserSerializer
    permission_classes = [IsStaff]
    filterset_fields = ["is_staff", "is_active", "username"]

    def get_queryset(self) -> QuerySet:
        return get_user_model().objects.order_by("username").prefetch_related("memberships__tenant")
