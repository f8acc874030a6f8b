"""The audit log in the Django admin (read only, for everyone), and `SecretsAdmin`, which every
admin of a model with secrets builds on (`audit_app.E002` says where one does not)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db import models
from django.http import HttpRequest

from audit_app import encryption
from audit_app.models import AuditLog


class SecretsAdmin(admin.ModelAdmin):
    """A model's secrets (its encrypted fields) read "set" or "not set", never their value;
    an editable one is a replace field: left empty, the stored secret is kept."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [*super().get_readonly_fields(request, obj), "secrets_state"]

    def get_exclude(self, request: HttpRequest, obj: Any = None) -> list[str]:
        names = encryption.secret_fields(self.model)
        if self.has_change_permission(request, obj):  # editable ones stay, as replace fields
            names = frozenset(n for n in names if not self.model._meta.get_field(n).editable)
        return [*(super().get_exclude(request, obj) or ()), *sorted(names)]

    def formfield_for_dbfield(self, db_field: models.Field[Any, Any], request: HttpRequest,
                              **kwargs: Any) -> forms.Field | None:
        if isinstance(db_field, encryption.EncryptedTextField):
            return forms.CharField(
                required=False, label=f"Replace {db_field.verbose_name}",
                widget=forms.PasswordInput(render_value=False),
                help_text="Never shown. Leave empty to keep the stored one.")
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False,
                 **kwargs: Any) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        names = [n for n in encryption.secret_fields(self.model) if n in form.base_fields]
        model = self.model

        class KeepingSecrets(form):  # type: ignore[misc,valid-type]
            """A replace field left empty keeps the stored secret, before the model's own
            checks run (a webhook's URL is required, and kept)."""

            def _post_clean(self) -> None:
                if self.instance.pk is not None:
                    stored = model._base_manager.get(pk=self.instance.pk)
                    for name in names:
                        if name in self.cleaned_data and not self.cleaned_data[name]:
                            self.cleaned_data[name] = getattr(stored, name)
                super()._post_clean()

        return KeepingSecrets

    @admin.display(description="Secrets")
    def secrets_state(self, obj: Any) -> str:
        names = sorted(encryption.secret_fields(self.model))
        return "; ".join(f"{self.model._meta.get_field(name).verbose_name}: "
                         f"{'set' if obj is not None and getattr(obj, name) else 'not set'}"
                         for name in names) or "none"


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
