"""Management API views for the serving domain."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import django_filters
import redis
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import permissions, status
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error

from audit_app.models import AuditLog
from serving_app import storage
from serving_app.api.capacity import ObjectiveCostActions
from serving_app.api.fleet import DeploymentOperations
from serving_app.api.serializers import (
    AdapterUploadSerializer,
    AuditLogSerializer,
    BaseModelSerializer,
    DeploymentSerializer,
    FlowReportSerializer,
    GpuSerializer,
    InstanceSerializer,
    LoraAdapterSerializer,
    NodeSerializer,
    ScaleSerializer,
)
from serving_app.deployments import sharing
from serving_app.models import BaseModel, Deployment, Gpu, Instance, LoraAdapter, Node
from serving_app.uploads import register_upload
from tenants_app.api.base import IsStaff, ScopedModelViewSet, ScopedReadOnlyModelViewSet
from tenants_app.models import Tenant


class BaseModelViewSet(ScopedModelViewSet[BaseModel]):
    """Base models. Everyone signed in reads them; platform admins register them."""

    queryset = BaseModel.objects.all()
    serializer_class = BaseModelSerializer
    filterset_fields = ["name", "dtype", "quantization", "architecture"]
    write_role = "staff"


class LoraAdapterViewSet(ScopedModelViewSet[LoraAdapter]):
    """A tenant's LoRA adapters. Owners and admins register and remove them."""

    queryset = LoraAdapter.objects.all()
    serializer_class = LoraAdapterSerializer
    filterset_fields = {"tenant__slug": ["exact"], "base_model__name": ["exact"], "name": ["exact"]}
    write_role = "manager"

    def safely_get_queryset(self, queryset: QuerySet[LoraAdapter]) -> QuerySet[LoraAdapter]:
        return queryset.select_related("tenant", "base_model")

    @extend_schema(summary="Upload a zipped LoRA adapter",
                   request={"multipart/form-data": AdapterUploadSerializer},
                   responses={201: LoraAdapterSerializer})
    @action(detail=False, methods=["post"], parser_classes=[MultiPartParser, FormParser],
            serializer_class=AdapterUploadSerializer)
    def upload(self, request: Request) -> Response:
        """Register an adapter from a zipped adapter folder (multipart: tenant, base_model,
        name, archive). Its files go to the tenant's own storage area. The zip holds
        adapter_config.json, adapter_model.safetensors and optionally README.md, at its top or
        in one top folder, nothing else; unpacked, it must fit what is left of the tenant's
        storage quota, and the adapter must match the base model's shapes."""
        # What is accepted, and why: serving_app/uploads.py.
        user = request.user
        slug = request.data.get("tenant") if hasattr(request.data, "get") else None
        tenant = Tenant.objects.for_user(user).filter(slug=slug).first() if slug else None
        if tenant is not None and not tenant.user_can_manage(user):
            raise PermissionDenied("Your role in this tenant does not allow this change.")
        serializer = AdapterUploadSerializer(data=request.data,
                                             context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        self.check_write(data)
        try:
            adapter = register_upload(data["tenant"], data["base_model"], data["name"],
                                      data["archive"])
        except DjangoValidationError as exc:
            raise ValidationError(as_serializer_error(storage.public_errors(exc, user))) from exc
        return Response(LoraAdapterSerializer(adapter, context=self.get_serializer_context()).data,
                        status=status.HTTP_201_CREATED)


class NodeViewSet(ScopedModelViewSet[Node]):
    """Hosts running node agents (platform admins only). Agents register themselves.

    `cordon` stops new instances going to a node, `uncordon` lets them again (and ends a drain
    after the move under way), `drain` cordons it and moves its instances to other nodes one at
    a time (`drain_status` says where that stands). Each answers the node."""

    queryset = Node.objects.all()
    serializer_class = NodeSerializer
    permission_classes = [IsStaff]
    filterset_fields = ["name", "cordoned", "draining", "inventory_source"]

    def safely_get_queryset(self, queryset: QuerySet[Node]) -> QuerySet[Node]:
        return queryset.prefetch_related("gpus").order_by("name")

    def _action(self, name: str, method: Callable[[Node], object]) -> Response:
        node = self.get_object()
        method(node)  # records its own audit entry
        return Response(self.get_serializer(node).data)

    @extend_schema(summary="Cordon a node: no new instances go to it", request=None,
                   responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk: str | None = None) -> Response:
        return self._action("cordon", Node.cordon)

    @extend_schema(summary="Uncordon a node: instances may go to it again", request=None,
                   responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk: str | None = None) -> Response:
        return self._action("uncordon", Node.uncordon)

    @extend_schema(summary="Drain a node: move its instances elsewhere, one at a time",
                   request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        return self._action("drain", Node.drain)


class GpuViewSet(ScopedReadOnlyModelViewSet[Gpu]):
    """GPUs as their node agents reported them (platform admins only)."""

    queryset = Gpu.objects.all()
    serializer_class = GpuSerializer
    permission_classes = [IsStaff]

    def safely_get_queryset(self, queryset: QuerySet[Gpu]) -> QuerySet[Gpu]:
        return queryset.select_related("node").order_by("node__name", "index")
    filterset_fields = {"node__name": ["exact"], "mig_mode": ["exact"]}


class DeploymentFilter(django_filters.FilterSet):
    """`tenants__slug` filters by a tenant the caller belongs to; any other tenant's slug finds
    nothing, so a tenant user cannot learn which deployments another tenant shares."""

    tenants__slug = django_filters.CharFilter(method="filter_tenant")

    class Meta:
        model = Deployment
        fields = {"name": ["exact"], "desired_state": ["exact"], "base_model__name": ["exact"]}

    def filter_tenant(
        self, queryset: QuerySet[Deployment], name: str, value: str
    ) -> QuerySet[Deployment]:
        if self.request is None:  # the viewset always passes its request
            raise TypeError("DeploymentFilter needs the request")
        user = self.request.user
        tenants = Tenant.objects.for_user(user).filter(slug=value)
        return queryset.filter(tenants__in=tenants).distinct()


class DeploymentViewSet(ObjectiveCostActions, DeploymentOperations):
    """Deployments: what should run. Tenants read the ones they may use. Each has its events,
    revisions and rollouts; start, stop, restart and scale act on it; `objective-cost/` says
    what latency objectives cost on its capacity curve."""

    # Events, revisions and rollouts: serving_app/api/fleet.py (DeploymentOperations); what an
    # objective costs: serving_app/api/capacity.py.

    queryset = Deployment.objects.all()
    serializer_class = DeploymentSerializer
    filterset_class = DeploymentFilter
    write_role = "staff"

    def safely_get_queryset(self, queryset: QuerySet[Deployment]) -> QuerySet[Deployment]:
        return queryset.select_related("base_model", "applied_revision").prefetch_related(
            "tenants", "adapters__tenant", "instances__node"
        )

    def extra_create_fields(self) -> dict[str, Any]:
        return {"created_by": self.request.user}

    def _action(self, method: Callable[[Deployment], object]) -> Response:
        """Run one of the deployment's workflows (which records its own audit entry)."""
        deployment = self.get_object()
        method(deployment)
        return Response(self.get_serializer(deployment).data)

    @extend_schema(summary="Start a deployment (its replicas run)", request=None,
                   responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def start(self, request: Request, pk: str | None = None) -> Response:
        return self._action(Deployment.start)

    @extend_schema(summary="Stop a deployment (its instances stop)", request=None,
                   responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, pk: str | None = None) -> Response:
        return self._action(Deployment.stop)

    @extend_schema(summary="Restart a deployment's instances", request=None,
                   responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, pk: str | None = None) -> Response:
        return self._action(Deployment.restart)

    @extend_schema(summary="Flow control: each tenant's queue, waits and share",
                   request=None, responses=FlowReportSerializer)
    @action(detail=True, methods=["get"])
    def flow(self, request: Request, pk: str | None = None) -> Response:
        """Flow control on this deployment over the last minutes: per tenant queue length,
        waits, served against entitled share, and Jain's index over the backlogged tenants.
        A tenant's member sees only the rows of its own tenants, without the index."""
        deployment = self.get_object()
        mine = None
        if not request.user.is_staff:
            mine = Tenant.objects.for_user(request.user).values_list("pk", flat=True)
        try:
            flow_report = sharing.report(deployment, tenant_ids=mine)
        except redis.RedisError:
            return Response({"detail": "Flow-control state cannot be read right now."},
                            status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return Response(FlowReportSerializer(dataclasses.asdict(flow_report)).data)

    @extend_schema(summary="Scale a deployment to a number of replicas",
                   request=ScaleSerializer, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, pk: str | None = None) -> Response:
        serializer = ScaleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        replicas = serializer.validated_data["replicas"]
        return self._action(lambda deployment: deployment.scale_to(replicas))


class InstanceViewSet(ScopedReadOnlyModelViewSet[Instance]):
    """Engine processes as they run (platform admins only), with their command and log tail."""

    queryset = Instance.objects.all()
    serializer_class = InstanceSerializer
    permission_classes = [IsStaff]

    def safely_get_queryset(self, queryset: QuerySet[Instance]) -> QuerySet[Instance]:
        return queryset.select_related("deployment__base_model", "node").prefetch_related(
            "gpus", "workers__node", "workers__gpus")
    filterset_fields = {"deployment__name": ["exact"], "state": ["exact"], "node__name": ["exact"]}


class CanReadAuditLog(permissions.BasePermission):
    message = "Only tenant owners and admins may read the audit log."

    def has_permission(self, request: Request, view: object) -> bool:
        user = request.user
        return bool(user.is_staff or Tenant.objects.managed_by(user).exists())


class AuditLogViewSet(ScopedReadOnlyModelViewSet[AuditLog]):
    """The audit trail: platform admins see all of it, tenant owners and admins their tenant's."""

    queryset = AuditLog.objects.all()
    resource_names = ("audit log entry", "audit log entries")
    serializer_class = AuditLogSerializer
    permission_classes = [permissions.IsAuthenticated, CanReadAuditLog]
    filterset_fields = {
        "action": ["exact"],
        "object_type": ["exact"],
        "object_id": ["exact"],
        "tenant__slug": ["exact"],
        "actor_label": ["exact"],
        "via": ["exact"],
    }

    def safely_get_queryset(self, queryset: QuerySet[AuditLog]) -> QuerySet[AuditLog]:
        return queryset.select_related("tenant")
