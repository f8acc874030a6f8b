"""Serializers for guardrail policies and patterns. Validation is the models' `full_clean()`
(`ValidatedModelSerializer`): a policy that weakens the level above, an unknown detector or
rule, and a pattern RE2 refuses are field errors, as in the admin."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from guardrails_app.models import FloorPolicy, GuardModel, KeyPolicy, TenantPattern, TenantPolicy
from serving_app.models import Deployment
from tenants_app.api.base import ScopedPrimaryKeyField, TenantSlugField, ValidatedModelSerializer
from tenants_app.models import ApiKey, Tenant

POLICY_FIELDS = ["input", "output", "restore", "classifier", "classifier_timeout_ms",
                 "classifier_fail_open", "refuse_non_text", "updated_at"]


class GuardDeploymentField(serializers.PrimaryKeyRelatedField[Deployment]):
    """A policy's guard deployment: the id of a deployment marked as a guard model (any
    other id, a tenant's private deployment's included, reads as not one)."""

    default_error_messages = {
        "does_not_exist": "Deployment {pk_value} is not marked as a guard model "
                          "(see /api/v1/guard-models/).",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(queryset=Deployment.objects.filter(guard_model__isnull=False),
                         allow_null=True, required=False, **kwargs)


class GuardModelSerializer(ValidatedModelSerializer[GuardModel]):
    """A deployment marked as a guard model; its template, verdicts and blocking verdicts are
    checked by the model's `clean()` (the core's `GuardModel`)."""

    name = serializers.CharField(source="deployment.name", read_only=True)

    class Meta:
        model = GuardModel
        fields = ["id", "deployment", "name", "template", "verdicts", "blocking", "max_tokens",
                  "updated_at"]
        read_only_fields = ["id", "updated_at"]


def stays(instance: Any, attrs: dict[str, Any], field: str) -> None:
    """A row does not move to another tenant (or key) on update."""
    if instance is not None and field in attrs and attrs[field] != getattr(instance, field):
        raise serializers.ValidationError({field: "This cannot be changed; create a new one."})


class FloorPolicySerializer(ValidatedModelSerializer[FloorPolicy]):
    classifier = GuardDeploymentField()
    class Meta:
        model = FloorPolicy
        fields = ["id", *POLICY_FIELDS]
        read_only_fields = ["id", "updated_at"]


class TenantPolicySerializer(ValidatedModelSerializer[TenantPolicy]):
    classifier = GuardDeploymentField()
    tenant = TenantSlugField()

    class Meta:
        model = TenantPolicy
        fields = ["id", "tenant", *POLICY_FIELDS]
        read_only_fields = ["id", "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        stays(self.instance, attrs, "tenant")
        return super().validate(attrs)


class KeyPolicySerializer(ValidatedModelSerializer[KeyPolicy]):
    classifier = GuardDeploymentField()
    api_key = ScopedPrimaryKeyField(queryset=ApiKey.objects.none())
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True)

    class Meta:
        model = KeyPolicy
        fields = ["id", "api_key", "tenant", *POLICY_FIELDS]
        read_only_fields = ["id", "tenant", "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        stays(self.instance, attrs, "api_key")
        return super().validate(attrs)


class TenantPatternSerializer(ValidatedModelSerializer[TenantPattern]):
    tenant = TenantSlugField()

    class Meta:
        model = TenantPattern
        fields = ["id", "tenant", "name", "kind", "pattern", "terms", "category", "ignore_case",
                  "updated_at"]
        read_only_fields = ["id", "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        stays(self.instance, attrs, "tenant")
        return super().validate(attrs)


class BenchSerializer(serializers.Serializer[Any]):
    """Text to try a policy on, and which side of a request it stands for."""

    text = serializers.CharField(max_length=65536, trim_whitespace=False)
    direction = serializers.ChoiceField(choices=["input", "output"], default="input")


class FindingSerializer(serializers.Serializer[Any]):
    detector = serializers.CharField()
    category = serializers.CharField()
    action = serializers.CharField()
    start = serializers.IntegerField()
    end = serializers.IntegerField()


class BenchResultSerializer(serializers.Serializer[Any]):
    """What the policy does to the text: the redacted text (empty when blocked), the category
    that blocked it, and the findings as offsets (never the values)."""

    blocked = serializers.CharField(allow_null=True)
    text = serializers.CharField(allow_blank=True)
    findings = FindingSerializer(many=True)
    counts = serializers.DictField(child=serializers.IntegerField())
    error = serializers.DictField(allow_null=True)
