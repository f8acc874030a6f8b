"""``GET /api/v1/health/``: PostgreSQL, Redis and the usage writer (events not yet stored, age of
the oldest: the metering lag), for platform admins (403 for tenant users). Always 200: the body
says what is unhealthy (`/readyz` is the probe that answers 503)."""

from __future__ import annotations

from django.urls import path
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from serving_app.metering import health
from tenants_app.api.base import IsStaff


class HealthView(APIView):
    """PostgreSQL, Redis and the usage writer as the console sees them: whether each answers,
    and how many usage events wait to be stored and for how long (the metering lag). Always
    200: the body says what is unhealthy. Platform admins only."""

    permission_classes = [IsStaff]

    @extend_schema(summary="The console's health", responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(health.report().as_dict())


urlpatterns = [path("health/", HealthView.as_view(), name="health")]
