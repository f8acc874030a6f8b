"""Receivers that publish gateway cache invalidations when keys, tenants or the catalog change.

Connected when `serving_app.usage` is imported (with serving_app's models). Changes made with
`QuerySet.update()` send no `post_save`: a revoke (`ApiKey.revoke()` and its queryset form) sends
`tenants_app.signals.api_keys_revoked` instead, and instance state changes are picked up by the
periodic catalog refresh (or an explicit `invalidation.catalog_changed()`).
"""

from __future__ import annotations

from typing import Any

from django.db.models.signals import m2m_changed, post_delete, post_save

from serving_app.gateway import invalidation
from tenants_app.signals import api_keys_revoked

_CATALOG_M2M = {"serving_app.Deployment_tenants", "serving_app.Deployment_adapters"}


def _key_saved(sender: Any, instance: Any, **kwargs: Any) -> None:
    invalidation.key_changed(instance)


def _key_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    invalidation.key_changed(instance, deleted=True)


def _keys_revoked(sender: Any, keys: list[Any], **kwargs: Any) -> None:
    for key in keys:
        invalidation.key_changed(key)


def _tenant_saved(sender: Any, instance: Any, **kwargs: Any) -> None:
    invalidation.tenant_changed(instance)


def _tenant_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    invalidation.tenant_changed(instance, deleted=True)


def _catalog_changed(sender: Any, **kwargs: Any) -> None:
    invalidation.catalog_changed()


def _m2m_changed(sender: Any, action: str, **kwargs: Any) -> None:
    if action.startswith("post_") and sender._meta.label in _CATALOG_M2M:
        invalidation.catalog_changed()


post_save.connect(_key_saved, sender="tenants_app.ApiKey", dispatch_uid="gw-key-saved")
post_delete.connect(_key_deleted, sender="tenants_app.ApiKey", dispatch_uid="gw-key-deleted")
api_keys_revoked.connect(_keys_revoked, dispatch_uid="gw-keys-revoked")
post_save.connect(_tenant_saved, sender="tenants_app.Tenant", dispatch_uid="gw-tenant-saved")
post_delete.connect(
    _tenant_deleted, sender="tenants_app.Tenant", dispatch_uid="gw-tenant-deleted"
)
# Deleting a group moves its tenants out of it with an UPDATE (no tenant signal): re-read all.
post_save.connect(
    _catalog_changed, sender="tenants_app.PrefixCacheGroup", dispatch_uid="gw-cache-group-saved"
)
post_delete.connect(
    _catalog_changed, sender="tenants_app.PrefixCacheGroup", dispatch_uid="gw-cache-group-deleted"
)
for _model in ("Deployment", "LoraAdapter", "Instance", "Node", "BaseModel"):
    post_save.connect(
        _catalog_changed, sender=f"serving_app.{_model}", dispatch_uid=f"gw-{_model}-saved"
    )
    post_delete.connect(
        _catalog_changed, sender=f"serving_app.{_model}", dispatch_uid=f"gw-{_model}-deleted"
    )
m2m_changed.connect(_m2m_changed, dispatch_uid="gw-catalog-m2m")
