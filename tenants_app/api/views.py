"""Management API views for tenants, memberships, API keys, prefix-cache groups and users."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers as drf_serializers
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from tenants_app.api.base import IsStaff, ScopedModelViewSet, ScopedReadOnlyModelViewSet
from tenants_app.api.serializers import (
    ApiKeySerializer,
    InvitationSerializer,
    MembershipSerializer,
    MoneyBudgetSerializer,
    PrefixCacheGroupSerializer,
    ReceivedInvitationSerializer,
    TenantSerializer,
    UserSerializer,
)
from tenants_app.models import (
    ApiKey,
    Invitation,
    Membership,
    MoneyBudget,
    PrefixCacheGroup,
    Tenant,
)


class TenantViewSet(ScopedModelViewSet[Tenant]):
    """Tenants and their limits. Members read their own tenants; platform admins manage all."""

    queryset = Tenant.objects.all()
    serializer_class = TenantSerializer
    lookup_field = "slug"
    filterset_fields = ["status", "priority_tier"]
    ordering_fields = ["slug", "name", "created_at"]
    write_role = "staff"

    def tenant_of(self, obj_or_data: Any) -> Tenant | None:
        return obj_or_data if isinstance(obj_or_data, Tenant) else None


class MembershipViewSet(ScopedModelViewSet[Membership]):
    """Who belongs to a tenant, with which role. Owners and admins change roles and remove
    members of their tenant; they add members by invitation (`/api/v1/invitations/`), and only
    platform admins add a member directly."""

    queryset = Membership.objects.all()
    serializer_class = MembershipSerializer
    filterset_fields = {"tenant__slug": ["exact"], "role": ["exact"], "user__username": ["exact"]}
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[Membership]) -> QuerySet[Membership]:
        return queryset.select_related("tenant", "user")

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        if not request.user.is_staff:
            raise PermissionDenied(
                "Members join by invitation: POST /api/v1/invitations/ and they accept it."
            )
        return super().create(request, *args, **kwargs)

    def perform_create(self, serializer: drf_serializers.BaseSerializer[Membership]) -> None:
        data = serializer.validated_data
        Membership.objects.check_owner_grant(self.request.user, data["tenant"], data.get("role"))
        super().perform_create(serializer)

    def perform_update(self, serializer: drf_serializers.BaseSerializer[Membership]) -> None:
        membership = serializer.instance
        if membership is None:  # an update's serializer always holds the row (`get_object()`)
            raise TypeError("perform_update() without the membership")
        role = serializer.validated_data.get("role", membership.role)
        membership.change_role(role, by=self.request.user)

    def perform_destroy(self, membership: Membership) -> None:
        membership.remove(by=self.request.user)


class InvitationViewSet(ScopedModelViewSet[Invitation]):
    """Invitations to join a tenant. Owners and admins invite by username or email and revoke;
    the invited user accepts or declines through `/api/v1/my-invitations/`. The answer to an
    invitation is the same whether or not the username exists."""

    queryset = Invitation.objects.all()
    serializer_class = InvitationSerializer
    filterset_fields = {"tenant__slug": ["exact"], "status": ["exact"], "role": ["exact"]}
    write_role = "manager"
    http_method_names = ["get", "post", "head", "options"]

    def safely_get_queryset(self, queryset: QuerySet[Invitation]) -> QuerySet[Invitation]:
        return queryset.select_related("tenant", "invited_by")

    def perform_create(self, serializer: drf_serializers.BaseSerializer[Invitation]) -> None:
        data = serializer.validated_data
        Membership.objects.check_owner_grant(self.request.user, data["tenant"], data.get("role"))
        self.check_write(data)
        serializer.save(invited_by=self.request.user)

    @extend_schema(summary="Revoke an invitation", request=None,
                   responses=InvitationSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        invitation = self.get_object()
        self.check_write(invitation)
        Membership.objects.check_owner_grant(request.user, invitation.tenant, invitation.role)
        invitation.revoke()
        return Response(self.get_serializer(invitation).data)


class ReceivedInvitationViewSet(ScopedReadOnlyModelViewSet[Invitation]):
    """The signed-in user's open invitations, to accept or decline. Anyone else's is a 404."""

    serializer_class = ReceivedInvitationSerializer
    queryset = Invitation.objects.none()
    resource_names = ("invitation addressed to you", "invitations addressed to you")

    def dangerously_get_queryset(self) -> QuerySet[Invitation]:
        """Not the tenants' invitations (`for_user()`, what their managers see) but those
        addressed to the signed-in user, who belongs to none of those tenants yet."""
        return (
            Invitation.objects.addressed_to(self.request.user)
            .select_related("tenant", "invited_by")
            .order_by("-created_at")
        )

    @extend_schema(summary="Accept an invitation: join its tenant", request=None,
                   responses=MembershipSerializer)
    @action(detail=True, methods=["post"])
    def accept(self, request: Request, pk: str | None = None) -> Response:
        invitation = self.get_object()
        membership = invitation.accept(self.user)
        return Response(MembershipSerializer(membership, context={"request": request}).data)

    @extend_schema(summary="Decline an invitation", request=None,
                   responses=ReceivedInvitationSerializer)
    @action(detail=True, methods=["post"])
    def decline(self, request: Request, pk: str | None = None) -> Response:
        invitation = self.get_object()
        invitation.decline(self.user)
        return Response(self.get_serializer(invitation).data)


class ApiKeyViewSet(ScopedModelViewSet[ApiKey]):
    """Gateway keys. The secret is in the creation response only; revoke to disable a key."""

    queryset = ApiKey.objects.all()
    serializer_class = ApiKeySerializer
    filterset_fields = {"tenant__slug": ["exact"], "revoked_at": ["isnull"]}
    ordering_fields = ["created_at", "name", "last_used_at"]
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[ApiKey]) -> QuerySet[ApiKey]:
        return queryset.select_related("tenant")

    def extra_create_fields(self) -> dict[str, Any]:
        return {"created_by": self.request.user}

    @extend_schema(summary="Revoke an API key", request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        key = self.get_object()
        key.revoke()
        return Response(self.get_serializer(key).data)


class MoneyBudgetViewSet(ScopedModelViewSet[MoneyBudget]):
    """Money budgets of tenants and their keys. Members read their tenant's; platform admins
    set them (docs/gateway.md, "Money budgets")."""

    queryset = MoneyBudget.objects.all()
    serializer_class = MoneyBudgetSerializer
    filterset_fields = {"tenant__slug": ["exact"], "period": ["exact"]}
    write_role = "staff"

    def safely_get_queryset(self, queryset: QuerySet[MoneyBudget]) -> QuerySet[MoneyBudget]:
        return queryset.select_related("tenant")


class PrefixCacheGroupViewSet(ScopedModelViewSet[PrefixCacheGroup]):
    """Prefix-cache sharing groups (platform admins only). A tenant joins one through its
    `prefix_cache_group` field; members share cached prompt prefixes on shared engines."""

    queryset = PrefixCacheGroup.objects.all()
    serializer_class = PrefixCacheGroupSerializer
    permission_classes = [IsStaff]
    lookup_field = "name"

    def safely_get_queryset(
        self, queryset: QuerySet[PrefixCacheGroup]
    ) -> QuerySet[PrefixCacheGroup]:
        return queryset.prefetch_related("tenants").order_by("name")


class UserViewSet(ScopedModelViewSet[User]):
    """Console users (platform admins only). Tenant roles are set through memberships."""

    queryset = get_user_model().objects.all()
    serializer_class = UserSerializer
    permission_classes = [IsStaff]
    filterset_fields = ["is_staff", "is_active", "username"]

    def dangerously_get_queryset(self) -> QuerySet[User]:
        """Users are not tenant data and Django's user model has no `for_user()`: every user,
        for platform admins only (`IsStaff`)."""
        return get_user_model().objects.order_by("username").prefetch_related("memberships__tenant")
