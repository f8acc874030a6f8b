"""Operating a deployment through the API: its events, revisions and rollouts.

Actions of `/api/v1/deployments/{id}/` (`DeploymentOperations`, the base of
`DeploymentViewSet`), each reading the deployment through the scoped queryset (another tenant's
deployment is a 404, a tenant user's write a 403):

- ``GET  events/``: the deployment's timeline (tenant users: its deployment-level events).
- ``GET  revisions/``: every revision with what it changed; staff only.
- ``GET  apply/``: what applying would do now (``?revision=&strategy=``); staff only.
- ``POST apply/``: apply a revision (default the newest) with a strategy; staff only.
- ``GET  rollouts/``: the deployment's rollouts, newest first; staff only.
- ``POST rollout/pause/``, ``rollout/resume/``, ``rollout/abort/``: the active rollout.
- ``POST rollback/``: return to the revision applied before.

``EventViewSet`` is the cluster-wide timeline, ``/api/v1/events/`` (staff only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error

from serving_app.api.serializers import (
    ApplySerializer,
    EventSerializer,
    RevisionSerializer,
    RolloutSerializer,
)
from serving_app.deployments import rollout
from serving_app.models import Deployment
from serving_app.models.events import Event
from serving_app.models.revisions import DeploymentRevision, Rollout
from tenants_app.api.base import IsStaff, ScopedModelViewSet, ScopedReadOnlyModelViewSet

MAX_REVISION = 2**31 - 1


def _django_errors(exc: DjangoValidationError) -> ValidationError:
    return ValidationError(as_serializer_error(exc))


class DeploymentOperations(ScopedModelViewSet[Deployment]):
    """Events, revisions and rollouts of one deployment (see the module docstring)."""

    def _deployment(self) -> Deployment:
        deployment = self.get_object()
        assert isinstance(deployment, Deployment)
        return deployment

    def _staff_only(self) -> None:
        if not self.request.user.is_staff:
            raise PermissionDenied("Only platform admins may use this endpoint.")

    def _page(self, queryset: QuerySet, serializer_class: type) -> Response:
        context = self.get_serializer_context()
        page = self.paginate_queryset(queryset)
        return self.get_paginated_response(serializer_class(page, many=True,
                                                            context=context).data)

    @extend_schema(summary="List a deployment's events", responses=EventSerializer(many=True),
                   parameters=[OpenApiParameter("kind", str, required=False)])
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str | None = None) -> Response:
        deployment = self._deployment()
        queryset = (Event.objects.for_user(request.user).filter(deployment=deployment)
                    .select_related("deployment", "node").order_by("-created_at", "-id"))
        kind = request.query_params.get("kind")
        if kind:
            queryset = queryset.filter(kind=kind)
        return self._page(queryset, EventSerializer)

    @extend_schema(summary="List a deployment's revisions",
                   responses=RevisionSerializer(many=True))
    @action(detail=True, methods=["get"])
    def revisions(self, request: Request, pk: str | None = None) -> Response:
        deployment = self._deployment()  # another tenant's: 404 before the role's 403
        self._staff_only()
        queryset = (DeploymentRevision.objects.filter(deployment=deployment)
                    .select_related("deployment", "created_by").order_by("-number"))
        return self._page(queryset, RevisionSerializer)

    @extend_schema(summary="List a deployment's rollouts", responses=RolloutSerializer(many=True))
    @action(detail=True, methods=["get"])
    def rollouts(self, request: Request, pk: str | None = None) -> Response:
        deployment = self._deployment()  # another tenant's: 404 before the role's 403
        self._staff_only()
        queryset = (Rollout.objects.filter(deployment=deployment)
                    .select_related("from_revision", "to_revision", "created_by"))
        return self._page(queryset, RolloutSerializer)

    def _revision(self, deployment: Deployment, number: Any) -> DeploymentRevision | None:
        if number in (None, ""):
            return None
        try:
            value = int(number)
            if not 1 <= value <= MAX_REVISION:  # beyond what the column holds: none such
                raise DeploymentRevision.DoesNotExist
            return deployment.revisions.get(number=value)
        except (DeploymentRevision.DoesNotExist, ValueError, TypeError) as exc:
            raise ValidationError({"revision": f"No revision {number} of this deployment."}) \
                from exc

    @extend_schema(methods=["GET"], summary="Preview applying a revision",
                   responses=OpenApiTypes.OBJECT, parameters=[
        OpenApiParameter("revision", int, required=False),
        OpenApiParameter("strategy", str, required=False, enum=Rollout.Strategy.values)])
    @extend_schema(methods=["POST"], summary="Apply a revision (start a rollout)",
                   request=ApplySerializer, responses=RolloutSerializer)
    @action(detail=True, methods=["get", "post"])
    def apply(self, request: Request, pk: str | None = None) -> Response:
        """GET: what applying would do now (changes, instances out of date, and whether the new
        instances fit beside the old ones or stop-then-start is needed). POST: apply."""
        deployment = self._deployment()  # another tenant's: 404 before the role's 403
        self._staff_only()
        if request.method == "GET":
            strategy = request.query_params.get("strategy") or Rollout.Strategy.ROLLING
            if strategy not in Rollout.Strategy.values:
                raise ValidationError({"strategy": f"One of {', '.join(Rollout.Strategy.values)}."})
            revision = self._revision(deployment, request.query_params.get("revision"))
            return Response(rollout.preview(deployment, revision, strategy))
        serializer = ApplySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        revision = self._revision(deployment, data.pop("revision", None))
        try:  # audited by the method
            started = deployment.apply(revision, data.pop("strategy"), by=request.user, **data)
        except DjangoValidationError as exc:
            raise _django_errors(exc) from exc
        return Response(RolloutSerializer(started, context=self.get_serializer_context()).data)

    def _on_active(self, method: Callable[[Rollout], dict]) -> Response:
        deployment = self._deployment()  # another tenant's: 404 before the role's 403
        self._staff_only()
        active = deployment.active_rollout
        if active is None:
            raise ValidationError({"detail": "No rollout of this deployment is in progress."})
        try:
            method(active)  # audited by the method
        except DjangoValidationError as exc:
            raise _django_errors(exc) from exc
        active.refresh_from_db()
        return Response(RolloutSerializer(active, context=self.get_serializer_context()).data)

    @extend_schema(summary="Pause the rollout in progress", request=None,
                   responses=RolloutSerializer)
    @action(detail=True, methods=["post"], url_path="rollout/pause")
    def pause_rollout(self, request: Request, pk: str | None = None) -> Response:
        return self._on_active(Rollout.pause)

    @extend_schema(summary="Resume the paused rollout", request=None, responses=RolloutSerializer)
    @action(detail=True, methods=["post"], url_path="rollout/resume")
    def resume_rollout(self, request: Request, pk: str | None = None) -> Response:
        return self._on_active(Rollout.resume)

    @extend_schema(summary="Abort the rollout in progress", request=None,
                   responses=RolloutSerializer)
    @action(detail=True, methods=["post"], url_path="rollout/abort")
    def abort_rollout(self, request: Request, pk: str | None = None) -> Response:
        return self._on_active(Rollout.abort)

    @extend_schema(summary="Roll back to the revision applied before", request=None,
                   responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, pk: str | None = None) -> Response:
        """Return to the revision applied before (an active rollout is aborted)."""
        deployment = self._deployment()  # another tenant's: 404 before the role's 403
        self._staff_only()
        try:  # audited by the method
            result = deployment.rollback(by=request.user)
        except DjangoValidationError as exc:
            raise _django_errors(exc) from exc
        return Response(RolloutSerializer(result, context=self.get_serializer_context()).data)


class EventViewSet(ScopedReadOnlyModelViewSet):
    """What the control plane did, cluster-wide, newest first (platform admins only)."""

    queryset = Event.objects.all()
    serializer_class = EventSerializer
    permission_classes = [IsStaff]
    filterset_fields = {"kind": ["exact"], "level": ["exact"], "deployment__name": ["exact"],
                        "node__name": ["exact"], "instance": ["exact"]}

    def safely_get_queryset(self, queryset: QuerySet) -> QuerySet:
        return queryset.select_related("deployment", "node")
