"""Base classes every management API endpoint builds on.

`ScopedModelViewSet` reads through the model's `for_user()` (so another tenant's object is a
404 that no endpoint can forget), asks `check_write()` before every write (403 for too low a
role), and runs the models' `full_clean()` through `ValidatedModelSerializer`. The audit log
records every write on its own (audit_app: model signals, with the request's user and the
source "api").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import models
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import permissions, serializers, viewsets
from rest_framework.exceptions import NotAuthenticated, PermissionDenied
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.views import APIView

from audit_app import encryption
from tenants_app.models import Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

_M = TypeVar("_M", bound=models.Model)


def scoped_rows(model: type[_M], user: User | AnonymousUser) -> models.QuerySet[_M]:
    """The rows of `model` the user may see: its default manager's `for_user()`. Every scoped
    model has one (tenants_app.models' querysets and their like); the stubs know only a plain
    Manager."""
    for_user: Callable[[User | AnonymousUser], models.QuerySet[_M]] | None = getattr(
        model._default_manager, "for_user", None)
    if for_user is None:
        raise ImproperlyConfigured(f"{model.__qualname__}'s manager has no for_user()")
    return for_user(user)


@extend_schema_field(OpenApiTypes.BOOL)
class SecretSetField(serializers.ReadOnlyField):
    """Whether a secret is stored ("set" / "not set"), never the secret."""

    def to_representation(self, value: Any) -> bool:
        return bool(value)


class ValidatedModelSerializer(serializers.ModelSerializer[_M]):
    """Validate through the model's `full_clean()`, like the admin and forms do.

    Many-to-many values are left out of `full_clean()` (they need a saved row) and are checked by
    the serializer's own `validate_relations()`. Fields the model derives in `clean()` (listed in
    `Meta.derived_fields`) are copied back into the validated data.
    """

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        """The model's secrets (its encrypted fields, `audit_app.encryption`) are write-only:
        accepted, never returned; `<name>_set` says whether one is stored. One the console
        generates (not editable) is never returned either, except by a creation's answer that
        lists it in `Meta.shown_once` (shown that once)."""
        fields = super().get_fields()
        model: type[_M] = self.Meta.model
        shown = getattr(self.Meta, "shown_once", ())
        for name in sorted(encryption.secret_fields(model) - set(shown)):
            field = fields.pop(name, None)
            if not model._meta.get_field(name).editable:
                continue
            if field is not None and not field.read_only:
                fields[name] = serializers.CharField(
                    write_only=True, required=False, allow_blank=True, max_length=2000,
                    style={"input_type": "password"},
                    help_text="Write-only: never returned. Left out or empty on an update: "
                              "the stored one is kept.")
            fields[f"{name}_set"] = SecretSetField(source=name)
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        model: type[_M] = self.Meta.model
        if self.instance is not None:  # an update without a secret keeps the stored one
            for name in encryption.secret_fields(model):
                if not attrs.get(name):
                    attrs.pop(name, None)
        m2m = {f.name for f in model._meta.many_to_many}
        plain = {k: v for k, v in attrs.items() if k not in m2m}
        if self.instance is None:
            candidate = model(**plain)
        else:
            candidate = model._default_manager.get(pk=self.instance.pk)
            for name, value in plain.items():
                setattr(candidate, name, value)
        exclude = [f.name for f in model._meta.get_fields() if f.name in m2m]
        try:
            candidate.full_clean(exclude=exclude, validate_unique=True)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(as_serializer_error(exc)) from exc
        for name in getattr(self.Meta, "derived_fields", ()):
            attrs[name] = getattr(candidate, name)
        self.validate_relations(candidate, attrs)
        return attrs

    def validate_relations(self, candidate: _M, attrs: dict[str, Any]) -> None:
        """Hook for checks that need the many-to-many values."""


class LookupSlugField(serializers.SlugRelatedField[_M]):
    """A related row chosen by a text field. A value the database cannot even compare (a NUL
    character: PostgreSQL text cannot hold one) is the same field error as an unknown one,
    instead of a database error and a 500."""

    def to_internal_value(self, data: Any) -> _M:
        if isinstance(data, str) and "\x00" in data:
            self.fail("does_not_exist", slug_name=self.slug_field, value=data.replace("\x00", ""))
        return super().to_internal_value(data)


@extend_schema_field(OpenApiTypes.STR)
class TenantSlugField(LookupSlugField[Tenant]):
    """A tenant chosen by slug, among the tenants the caller may see (others do not exist)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("slug_field", "slug")
        super().__init__(**kwargs)

    def get_queryset(self) -> models.QuerySet[Tenant]:
        request = self.context.get("request")
        if request is None:
            return Tenant.objects.none()
        return Tenant.objects.for_user(request.user)


class ScopedPrimaryKeyField(serializers.PrimaryKeyRelatedField[_M]):
    """A related row chosen by id, among those the caller may see (`for_user()`: others do not
    exist). Declare it with the model's rows (`Model.objects.none()`): they name the model, and
    are all it offers when there is no request to name a caller."""

    queryset: models.QuerySet[_M] | None

    def get_queryset(self) -> models.QuerySet[_M]:
        if self.queryset is None:
            raise ImproperlyConfigured(f"{type(self).__qualname__} needs the model's rows")
        user: User | AnonymousUser | None = getattr(self.context.get("request"), "user", None)
        if user is None:
            return self.queryset.all()
        return scoped_rows(self.queryset.model, user)


class IsStaff(permissions.BasePermission):
    message = "Only platform admins may use this endpoint."

    def has_permission(self, request: Request, view: APIView) -> bool:
        return bool(request.user and request.user.is_authenticated and request.user.is_staff)


class ScopedQuerysetMixin(GenericAPIView[_M]):
    """Rows are always read through the model's `for_user(request.user)`; no subclass can skip it.

    A subclass narrows or prefetches in `safely_get_queryset(queryset)`, which receives the rows
    already scoped. Overriding `get_queryset()` is refused when the class is defined. A view whose
    rows are deliberately not read through `for_user()` says so by defining
    `dangerously_get_queryset()` (as PostHog's API routing does), and a reviewer sees the word.
    """

    #: The model's rows (`Model.objects.all()`), which only name the model: what is read is
    #: `Model.objects.for_user(user)`.
    queryset: models.QuerySet[_M] | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for klass in cls.__mro__:
            if klass is ScopedQuerysetMixin:
                break
            if "get_queryset" in klass.__dict__:
                raise TypeError(
                    f"{cls.__qualname__}: {klass.__qualname__} overrides get_queryset(), which "
                    f"would skip for_user(); narrow the scoped rows in safely_get_queryset(), "
                    f"or name a deliberate bypass dangerously_get_queryset()"
                )

    def get_queryset(self) -> models.QuerySet[_M]:
        bypass: Callable[[], models.QuerySet[_M]] | None = getattr(
            self, "dangerously_get_queryset", None)
        if bypass is not None:
            return bypass()
        if self.queryset is None:
            raise ImproperlyConfigured(f"{type(self).__qualname__} names no queryset")
        model = self.queryset.model
        scoped = scoped_rows(model, self.request.user)
        return self.safely_get_queryset(scoped.order_by(*model._meta.ordering or ["pk"]))

    def safely_get_queryset(self, queryset: models.QuerySet[_M]) -> models.QuerySet[_M]:
        """Narrow, annotate or prefetch the rows the user may see (already scoped)."""
        return queryset

    @property
    def user(self) -> User:
        """The signed-in user: the permission checks (`IsAuthenticated` by default, `IsStaff`)
        turned anyone else away before a handler runs."""
        user = self.request.user
        if not user.is_authenticated:
            raise NotAuthenticated
        return user


class ScopedReadOnlyModelViewSet(ScopedQuerysetMixin[_M], viewsets.ReadOnlyModelViewSet[_M]):
    """A read-only viewset whose rows are always read through `for_user(request.user)`."""


class ScopedModelViewSet(ScopedQuerysetMixin[_M], viewsets.ModelViewSet[_M]):
    """A model viewset whose rows are always read through `for_user(request.user)`.

    `write_role`: "staff" (platform admins only) or "manager" (tenant owners and admins, and
    staff). Subclasses with tenant-owned rows name how to find the tenant in `tenant_of()`.
    """

    write_role = "staff"

    def get_object(self) -> _M:
        # A text lookup (a tenant's slug) holding a NUL character matches nothing; PostgreSQL
        # would refuse the query itself.
        value = self.kwargs.get(self.lookup_url_kwarg or self.lookup_field)
        if isinstance(value, str) and "\x00" in value:
            raise Http404
        return super().get_object()

    # -- permissions -----------------------------------------------------------------------
    def tenant_of(self, obj_or_data: Any) -> Tenant | None:
        if isinstance(obj_or_data, dict):
            return obj_or_data.get("tenant")
        return getattr(obj_or_data, "tenant", None)

    def check_write(self, target: Any) -> None:
        user = self.request.user
        if user.is_staff:
            return
        if self.write_role == "staff":
            raise PermissionDenied("Only platform admins may change this.")
        tenant = self.tenant_of(target)
        if tenant is None or not tenant.user_can_manage(user):
            raise PermissionDenied("Your role in this tenant does not allow this change.")

    def check_object_permissions(self, request: Request, obj: _M) -> None:
        super().check_object_permissions(request, obj)
        if request.method not in permissions.SAFE_METHODS:
            self.check_write(obj)

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # Refuse a too-low role before looking at the body, so it gets 403 rather than 400.
        user = request.user
        if not user.is_staff:
            if self.write_role == "staff":
                raise PermissionDenied("Only platform admins may change this.")
            slug = request.data.get("tenant") if hasattr(request.data, "get") else None
            # Anything but a plain slug is left to the serializer's field error (a NUL character
            # would be a database error here).
            usable = isinstance(slug, str) and slug and "\x00" not in slug
            tenant = Tenant.objects.for_user(user).filter(slug=slug).first() if usable else None
            if tenant is not None and not tenant.user_can_manage(user):
                raise PermissionDenied("Your role in this tenant does not allow this change.")
        return super().create(request, *args, **kwargs)

    # -- writes --------------------------------------------------------------------------------
    def perform_create(self, serializer: serializers.BaseSerializer[_M]) -> None:
        self.check_write(serializer.validated_data)
        serializer.save(**self.extra_create_fields())

    def extra_create_fields(self) -> dict[str, Any]:
        return {}

    def perform_update(self, serializer: serializers.BaseSerializer[_M]) -> None:
        if "tenant" in serializer.validated_data:
            self.check_write(serializer.validated_data)
        serializer.save()

    def perform_destroy(self, instance: _M) -> None:
        self.before_destroy(instance)
        instance.delete()

    def before_destroy(self, instance: _M) -> None:
        """Raise a ValidationError to refuse a delete."""
