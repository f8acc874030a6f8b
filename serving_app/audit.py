"""The audit trail: one row for every create, update, delete and action, from API or admin."""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.db import models

from serving_app.models import AuditLog
from tenants_app.models import Tenant

if TYPE_CHECKING:
    from django.http import HttpRequest

# Never copied into an entry. `invitee`: the user an invitation's text resolved to, which tenant
# admins reading their audit log must not learn (it would tell them the username exists).
SECRET_FIELDS = {"secret_hash", "password", "secret", "invitee", "cache_secret"}


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, models.Model):
        return value.pk
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    return value


def snapshot(obj: models.Model) -> dict[str, Any]:
    """The object's field values, many-to-many included, as JSON-ready data."""
    data: dict[str, Any] = {}
    for field in obj._meta.concrete_fields:
        if field.name in SECRET_FIELDS:
            continue
        data[field.name] = _plain(getattr(obj, field.attname))
    if obj.pk:
        for field in obj._meta.many_to_many:
            data[field.name] = sorted(_plain(list(getattr(obj, field.name).all())))
    return data


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """{field: [old, new]} for the fields that changed."""
    ignored = {"updated_at"}
    return {
        name: [before.get(name), value]
        for name, value in after.items()
        if name not in ignored and before.get(name) != value
    }


def tenant_of(obj: models.Model) -> Tenant | None:
    if isinstance(obj, Tenant):
        return obj
    tenant = getattr(obj, "tenant", None)
    return tenant if isinstance(tenant, Tenant) else None


def client_address(request: HttpRequest | None) -> str | None:
    if request is None:
        return None
    return request.META.get("REMOTE_ADDR") or None


def record(
    request: HttpRequest | None,
    action: str,
    obj: models.Model,
    *,
    changes: dict[str, Any] | None = None,
    via: str = "api",
    object_id: Any = None,
) -> AuditLog:
    user = getattr(request, "user", None)
    authenticated = user is not None and user.is_authenticated
    tenant = tenant_of(obj)
    return AuditLog.objects.create(
        actor=user if authenticated else None,
        actor_label=user.get_username() if authenticated else "system",
        action=action,
        object_type=obj._meta.label,
        object_id=str(object_id if object_id is not None else obj.pk),
        object_repr=str(obj)[:200],
        tenant=tenant if tenant is not None and tenant.pk else None,
        changes=changes or {},
        via=via,
        remote_addr=client_address(request),
    )
