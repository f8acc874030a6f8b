"""The audit log: one entry for each object a person (or a task) changed, with the changed
fields, who, when and from where.

The table is the one `serving_app` created (`serving_app_auditlog`): the model moved here with
state-only migrations, so no row was copied and no table rebuilt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.conf import settings
from django.db import models

from audit_app.context import Source

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User


class AuditLogQuerySet(models.QuerySet["AuditLog"]):
    def for_user(self, user: User | AnonymousUser) -> AuditLogQuerySet:
        """Staff see everything; tenant owners and admins see their tenant's entries (the
        tenants' own rule, `Tenant.objects.managed_by()`, read through the foreign key)."""
        if not user.is_authenticated:
            return self.none()
        if getattr(user, "is_staff", False):
            return self.all()
        tenants: Any = AuditLog._meta.get_field("tenant").related_model
        return self.filter(tenant__in=tenants.objects.managed_by(user))

    def for_tenant(self, tenant: Any) -> AuditLogQuerySet:
        return self.filter(tenant=tenant)


class AuditLog(models.Model):
    """Who did what to which object, with the changed fields, when and from where.

    `changes` holds the object's fields for a create or a delete, and `{field: [before, after]}`
    for an update or an action; secrets are never copied (a changed password reads
    "(secret)"). `object_id` and `object_repr` are text, so an entry outlives its object.
    """

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_label = models.CharField(max_length=150, blank=True)
    action = models.CharField(max_length=50)
    object_type = models.CharField(max_length=100)
    object_id = models.CharField(max_length=64)
    object_repr = models.CharField(max_length=200)
    tenant = models.ForeignKey(
        "tenants_app.Tenant", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="audit_entries",
    )
    changes = models.JSONField(default=dict, blank=True)
    via = models.CharField(max_length=16, choices=Source.choices)
    remote_addr = models.GenericIPAddressField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = AuditLogQuerySet.as_manager()

    class Meta:
        db_table = "serving_app_auditlog"
        ordering = ["-created_at", "-id"]
        verbose_name = "audit log entry"
        verbose_name_plural = "audit log"

    def __str__(self) -> str:
        return f"{self.actor_label} {self.action} {self.object_type} {self.object_repr}"

    @property
    def object_label(self) -> str:
        """The object as a person names it: "API key 'lcsk-ab… (ci-bot)' of acme", from its
        model's verbose name and the `object_repr` written with the entry (the object's `str()`
        while it still exists where an entry has none), with its tenant."""
        try:
            model: type[models.Model] | None = apps.get_model(self.object_type)
        except (LookupError, ValueError):
            model = None
        noun = str(model._meta.verbose_name) if model is not None else self.object_type
        name = self.object_repr
        if not name and model is not None:
            found = model._default_manager.filter(pk=self.object_id).first()
            name = str(found) if found is not None else ""
        label = f"{noun[:1].upper()}{noun[1:]} '{name}'" if name else f"{noun} #{self.object_id}"
        tenant_model = AuditLog._meta.get_field("tenant").related_model
        if self.tenant_id is not None and model is not tenant_model:
            label += f" of {self.tenant}"
        return label
