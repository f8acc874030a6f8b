"""Receivers that publish gateway cache invalidations when keys, tenants or the catalog change.

Connected by `GatewayAppConfig.ready()`. Changes made with `QuerySet.update()` send no
`post_save`: a revoke (`ApiKey.revoke()` and its queryset form) sends
`tenants_app.signals.api_keys_revoked` instead, and an instance entering or leaving the ready
state sends `serving_app.signals.instance_routing_changed`.
"""

from __future__ import annotations

from typing import Any

from django.db.models.signals import m2m_changed, post_delete, post_save

from gateway_app import invalidation
from serving_app.signals import instance_routing_changed
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


def connect_receivers() -> None:
    """Connect the receivers (idempotent: each has a dispatch_uid)."""
    post_save.connect(_key_saved, sender="tenants_app.ApiKey", dispatch_uid="gw-key-saved")
    post_delete.connect(_key_deleted, sender="tenants_app.ApiKey", dispatch_uid="gw-key-deleted")
    api_keys_revoked.connect(_keys_revoked, dispatch_uid="gw-keys-revoked")
    post_save.connect(_tenant_saved, sender="tenants_app.Tenant", dispatch_uid="gw-tenant-saved")
    post_delete.connect(
        _tenant_deleted, sender="tenants_app.Tenant", dispatch_uid="gw-tenant-deleted"
    )
    # Deleting a group moves its tenants out of it with an UPDATE (no tenant signal): re-read all.
    group = "tenants_app.PrefixCacheGroup"
    post_save.connect(_catalog_changed, sender=group, dispatch_uid="gw-cache-group-saved")
    post_delete.connect(_catalog_changed, sender=group, dispatch_uid="gw-cache-group-deleted")
    # Money budgets and prices are read with the catalog.
    for label in ("tenants_app.MoneyBudget", "serving_app.PriceCard"):
        post_save.connect(_catalog_changed, sender=label, dispatch_uid=f"gw-{label}-saved")
        post_delete.connect(_catalog_changed, sender=label, dispatch_uid=f"gw-{label}-deleted")
    for model in ("Deployment", "LoraAdapter", "Instance", "Node", "BaseModel"):
        post_save.connect(
            _catalog_changed, sender=f"serving_app.{model}", dispatch_uid=f"gw-{model}-saved"
        )
        post_delete.connect(
            _catalog_changed, sender=f"serving_app.{model}", dispatch_uid=f"gw-{model}-deleted"
        )
    # Guardrail policies and patterns are compiled with the catalog.
    for model in ("FloorPolicy", "TenantPolicy", "KeyPolicy", "TenantPattern"):
        post_save.connect(_catalog_changed, sender=f"guardrails_app.{model}",
                          dispatch_uid=f"gw-guard-{model}-saved")
        post_delete.connect(_catalog_changed, sender=f"guardrails_app.{model}",
                            dispatch_uid=f"gw-guard-{model}-deleted")
    m2m_changed.connect(_m2m_changed, dispatch_uid="gw-catalog-m2m")
    instance_routing_changed.connect(_catalog_changed, dispatch_uid="gw-instance-routing")
