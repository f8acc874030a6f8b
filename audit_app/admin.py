"""The audit log in the Django admin: read only, for everyone."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from audit_app.models import AuditLog


@admin.register(AuditLog)
class AuditLogAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "actor_label",
        "action",
        "object_type",
        "object_repr",
        "via",
        "remote_addr",
    ]
    list_filter = ["action", "object_type", "via"]
    search_fields = ["actor_label", "object_repr", "object_id"]
    readonly_fields = [f.name for f in AuditLog._meta.concrete_fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
