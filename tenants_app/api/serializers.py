"""Serializers for tenants, memberships, API keys, prefix-cache sharing groups and users."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.contrib.auth.password_validation import validate_password
from rest_framework import serializers

from tenants_app.api.base import (
    LookupSlugField,
    ScopedPrimaryKeyField,
    TenantSlugField,
    ValidatedModelSerializer,
)
from tenants_app.models import (
    ApiKey,
    Invitation,
    Membership,
    MoneyBudget,
    PrefixCacheGroup,
    Tenant,
)

# The user model as settings name it (Django's own User: the type hints name that class).
UserModel = get_user_model()


class TenantSerializer(ValidatedModelSerializer[Tenant]):
    prefix_cache_group = LookupSlugField(
        slug_field="name", queryset=PrefixCacheGroup.objects.all(), allow_null=True,
        required=False, help_text="Sharing group (platform admins only). Null: shares with nobody.",
    )

    class Meta:
        model = Tenant
        fields = ["id", *Tenant.EDITABLE_FIELDS, "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]

    def to_representation(self, tenant: Tenant) -> dict[str, Any]:
        data = super().to_representation(tenant)
        request = self.context.get("request")
        if request is None or not request.user.is_staff:
            data.pop("prefix_cache_group", None)  # who shares with whom is the platform's
        return data


class PrefixCacheGroupSerializer(ValidatedModelSerializer[PrefixCacheGroup]):
    tenants: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        slug_field="slug", many=True, read_only=True)

    class Meta:
        model = PrefixCacheGroup
        fields = ["id", "name", "description", "tenants", "created_at"]
        read_only_fields = ["id", "created_at"]


class MembershipSerializer(ValidatedModelSerializer[Membership]):
    tenant = TenantSlugField()
    user = LookupSlugField(slug_field="username", queryset=UserModel.objects.all())

    class Meta:
        model = Membership
        fields = ["id", "tenant", "user", "role", "created_at"]
        read_only_fields = ["id", "created_at"]

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        request = self.context.get("request")
        if request is not None and not request.user.is_staff:
            # Tenant users add members by invitation and never name a user here: a username
            # lookup would tell them which usernames exist.
            fields["user"] = serializers.CharField(source="user.username", read_only=True)
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if self.instance is not None:
            fixed: tuple[str, ...] = ("tenant", "user")
            for field in fixed:
                if field in attrs and attrs[field] != getattr(self.instance, field):
                    raise serializers.ValidationError({field: "Cannot be changed; add a new one."})
        return super().validate(attrs)


class InvitationSerializer(serializers.ModelSerializer[Invitation]):
    """An invitation as its tenant's managers see it: what they typed, never whom it found."""

    tenant = TenantSlugField()
    invited_as = serializers.CharField(
        max_length=254, help_text="The username or email address of the person to invite."
    )
    state = serializers.CharField(read_only=True)
    invited_by = serializers.CharField(source="invited_by.username", read_only=True, default=None)

    class Meta:
        model = Invitation
        fields = ["id", "tenant", "invited_as", "role", "state", "invited_by", "expires_at",
                  "answered_at", "created_at"]
        read_only_fields = ["id", "state", "invited_by", "expires_at", "answered_at",
                            "created_at"]

    def create(self, validated_data: dict[str, Any]) -> Invitation:
        return Invitation.objects.invite(**validated_data)


class ReceivedInvitationSerializer(serializers.ModelSerializer[Invitation]):
    """An invitation as the invited user sees it."""

    tenant = serializers.CharField(source="tenant.slug", read_only=True)
    tenant_name = serializers.CharField(source="tenant.name", read_only=True)
    invited_by = serializers.CharField(source="invited_by.username", read_only=True, default=None)
    state = serializers.CharField(read_only=True)

    class Meta:
        model = Invitation
        fields = ["id", "tenant", "tenant_name", "role", "state", "invited_by", "expires_at",
                  "created_at"]
        read_only_fields = fields


class ApiKeySerializer(ValidatedModelSerializer[ApiKey]):
    tenant = TenantSlugField()
    is_usable = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "tenant",
            "name",
            "prefix",
            "allowed_models",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "is_usable",
            "created_at",
        ]
        read_only_fields = ["id", "prefix", "revoked_at", "last_used_at", "created_at"]

    def get_is_usable(self, key: ApiKey) -> bool:
        return key.is_usable()

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if (
            self.instance is not None
            and "tenant" in attrs
            and attrs["tenant"] != self.instance.tenant
        ):
            raise serializers.ValidationError({"tenant": "A key cannot move to another tenant."})
        return super().validate(attrs)

    def create(self, validated_data: dict[str, Any]) -> ApiKey:
        key, secret = ApiKey.objects.create_key(**validated_data)
        key.new_secret = secret
        return key

    def to_representation(self, key: ApiKey) -> dict[str, Any]:
        data = super().to_representation(key)
        if key.new_secret:
            data["secret"] = key.new_secret
        return data


class UserSerializer(serializers.ModelSerializer[User]):
    password = serializers.CharField(
        write_only=True, required=False, style={"input_type": "password"}
    )
    memberships = serializers.SerializerMethodField()

    class Meta:
        model = UserModel
        fields = [
            "id",
            "username",
            "email",
            "first_name",
            "last_name",
            "is_staff",
            "is_active",
            "password",
            "memberships",
            "date_joined",
        ]
        read_only_fields = ["id", "date_joined"]

    def get_memberships(self, user: User) -> list[dict[str, str]]:
        return [
            {"tenant": m.tenant.slug, "role": m.role}
            for m in user.memberships.select_related("tenant")
        ]

    def validate_password(self, value: str) -> str:
        # Checked against the user as it will be saved: the similarity validator compares the
        # password with the username, names and email.
        current = self.instance or UserModel()
        candidate = UserModel(**{
            name: self.initial_data.get(name, getattr(current, name))
            for name in ("username", "email", "first_name", "last_name")
        })
        validate_password(value, user=candidate)
        return value

    def create(self, validated_data: dict[str, Any]) -> User:
        password = validated_data.pop("password", None)
        user = UserModel(**validated_data)
        user.set_password(password) if password else user.set_unusable_password()
        user.save()
        return user

    def update(self, user: User, validated_data: dict[str, Any]) -> User:
        password = validated_data.pop("password", None)
        for name, value in validated_data.items():
            setattr(user, name, value)
        if password:
            user.set_password(password)
        user.save()
        return user


class MoneyBudgetSerializer(ValidatedModelSerializer[MoneyBudget]):
    tenant = TenantSlugField()
    api_key = ScopedPrimaryKeyField(
        queryset=ApiKey.objects.none(), required=False, allow_null=True,
        help_text="A key's id: its own budget, inside its tenant's. Empty: the tenant's.")

    class Meta:
        model = MoneyBudget
        fields = ["id", "tenant", "api_key", "amount", "period", "rolling", "time_zone",
                  "soft_threshold_percent", "hard_limit", "created_at"]
        read_only_fields = ["id", "created_at"]
        validators: list[Any] = []  # the model's constraints, checked by full_clean()
