"""Price cards in the management API (platform admins only; tenants get 403).

- ``/api/v1/price-cards/``: token prices per base model (or adapter), per million tokens.
- ``/api/v1/price-cards/in-force/?base_model=<name>[&adapter=<id>][&at=<ISO time>]``: the card
  in force at that moment (now by default): the adapter's, else its base model's.
- ``/api/v1/gpu-price-cards/``: prices per GPU-second, by GPU model or MIG profile.

Prices are decimal strings (``"0.150000"``), never floats. A card in force is never changed
(400 naming the field): a price change is a new card from its date (docs/budgets.md).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from serving_app.models import BaseModel, GpuPriceCard, LoraAdapter, PriceCard, PriceTable
from tenants_app.api.base import (
    IsStaff,
    LookupSlugField,
    ScopedModelViewSet,
    ScopedPrimaryKeyField,
    ValidatedModelSerializer,
)

_CARD_FIELDS = ["currency", "effective_from", "version", "in_force_now", "note", "created_at"]


class PriceCardSerializer(ValidatedModelSerializer[PriceCard]):
    base_model = LookupSlugField(slug_field="name", queryset=BaseModel.objects.all())
    adapter = ScopedPrimaryKeyField(
        queryset=LoraAdapter.objects.none(), required=False, allow_null=True,
        help_text="An adapter's id: its own price, instead of its base model's.")
    in_force_now = serializers.BooleanField(read_only=True)

    class Meta:
        model = PriceCard
        fields = ["id", "base_model", "adapter", "input_per_million",
                  "cached_input_per_million", "output_per_million", *_CARD_FIELDS]
        read_only_fields = ["id", "version", "created_at"]
        validators: list[Any] = []  # the model's constraints, checked by full_clean()


class GpuPriceCardSerializer(ValidatedModelSerializer[GpuPriceCard]):
    in_force_now = serializers.BooleanField(read_only=True)

    class Meta:
        model = GpuPriceCard
        fields = ["id", "gpu_model", "mig_profile", "per_gpu_second", *_CARD_FIELDS]
        read_only_fields = ["id", "version", "created_at"]
        validators: list[Any] = []


class InForceQuery(serializers.Serializer[dict[str, Any]]):
    """The in-force lookup's query: field errors for a bad name (a NUL character included), id
    or time, never a 500."""

    base_model = serializers.CharField(max_length=200)
    adapter = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1)
    at = serializers.CharField(required=False, max_length=64)

    def validate_base_model(self, value: str) -> BaseModel:
        model = BaseModel.objects.filter(name=value).first()
        if model is None:
            raise serializers.ValidationError("No base model has this name.")
        return model

    def validate_at(self, value: str) -> datetime:
        try:
            at = parse_datetime(value)
        except ValueError:  # well formed, but no such date (2026-02-30)
            at = None
        if at is None or at.tzinfo is None:
            raise serializers.ValidationError(
                "An ISO 8601 time with its offset, e.g. 2026-12-01T00:00:00Z.")
        return at


class PriceCardViewSet(ScopedModelViewSet[PriceCard]):
    """Token price cards, effective-dated: the latest card whose date has come is in force."""

    queryset = PriceCard.objects.select_related("base_model", "adapter__tenant")
    serializer_class = PriceCardSerializer
    permission_classes = [IsStaff]
    filterset_fields = {"base_model__name": ["exact"], "currency": ["exact"]}
    ordering_fields = ["effective_from", "created_at"]

    @extend_schema(
        summary="The price card in force at a moment",
        parameters=[
            OpenApiParameter("base_model", str, required=True, description="Base model name."),
            OpenApiParameter("adapter", int, description="An adapter of it (its id)."),
            OpenApiParameter("at", str, description="ISO 8601 time; default now."),
        ],
        responses=PriceCardSerializer,
    )
    @action(detail=False, methods=["get"], url_path="in-force")
    def in_force(self, request: Request) -> Response:
        query = InForceQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        model: BaseModel = query.validated_data["base_model"]
        at = query.validated_data.get("at")
        adapter_id = query.validated_data.get("adapter")
        when = at.timestamp() if at is not None else None
        cards = list(self.get_queryset().filter(base_model=model))
        price = PriceTable(cards).price_at(
            model.pk, adapter_id,
            when if when is not None else time.time())
        if price is None:
            raise NotFound("No price card is in force for this model at that time.")
        card = next(c for c in cards if c.pk == price.card_id)
        return Response(self.get_serializer(card).data)


class GpuPriceCardViewSet(ScopedModelViewSet[GpuPriceCard]):
    """GPU-second price cards, by GPU model or MIG profile, effective-dated."""

    queryset = GpuPriceCard.objects.all()
    serializer_class = GpuPriceCardSerializer
    permission_classes = [IsStaff]
    filterset_fields = ["gpu_model", "mig_profile", "currency"]
    ordering_fields = ["effective_from", "created_at"]
