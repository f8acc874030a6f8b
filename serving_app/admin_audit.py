"""A ModelAdmin mixin that writes the audit trail for every change made in the Django admin."""

from __future__ import annotations

from django.contrib import admin

from serving_app import audit


class AuditedAdmin(admin.ModelAdmin):
    """Records create/update/delete (with the changed fields, many-to-many included)."""

    def save_model(self, request, obj, form, change) -> None:
        self.remember_before(request, obj, change)
        super().save_model(request, obj, form, change)

    def remember_before(self, request, obj, change) -> None:
        """Keep the stored row for the diff (a subclass that saves through a model method calls
        this before it)."""
        request._audit_before = (
            audit.snapshot(type(obj).objects.get(pk=obj.pk)) if change and obj.pk else None
        )

    def save_related(self, request, form, formsets, change) -> None:
        super().save_related(request, form, formsets, change)
        obj = form.instance
        after = audit.snapshot(obj)
        before = getattr(request, "_audit_before", None)
        if before is None:
            audit.record(request, "create", obj, changes=after, via="admin")
        else:
            audit.record(request, "update", obj, changes=audit.diff(before, after), via="admin")

    def delete_model(self, request, obj) -> None:
        audit.record(request, "delete", obj, changes=audit.snapshot(obj), via="admin")
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset) -> None:
        for obj in queryset:
            audit.record(request, "delete", obj, changes=audit.snapshot(obj), via="admin")
        super().delete_queryset(request, queryset)
