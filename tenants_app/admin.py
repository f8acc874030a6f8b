"""Django admin for tenants, memberships, invitations and API keys (every change audited)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages

from serving_app import audit
from serving_app.admin_audit import AuditedAdmin
from tenants_app.models import ApiKey, Invitation, Membership, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin):
    list_display = [
        "slug",
        "name",
        "status",
        "priority_tier",
        "requests_per_minute",
        "tokens_per_minute",
        "monthly_token_budget",
    ]
    list_filter = ["status", "priority_tier"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(AuditedAdmin):
    list_display = ["tenant", "user", "role", "created_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]
    autocomplete_fields = ["user", "tenant"]


@admin.action(description="Revoke selected invitations")
def revoke_invitations(modeladmin, request, queryset) -> None:
    for invitation in queryset:
        if invitation.revoke():
            audit.record(request, "revoke", invitation,
                         changes={"status": ["pending", "revoked"]}, via="admin")
    messages.success(request, "Selected pending invitations are revoked.")


@admin.register(Invitation)
class InvitationAdmin(AuditedAdmin):
    """Platform admins see whom an invitation resolved to; they add members directly instead
    (Memberships), so invitations are created by tenant managers and only revoked here."""

    list_display = ["invited_as", "tenant", "role", "status", "invitee", "invited_by",
                    "expires_at", "created_at"]
    list_filter = ["status", "role", "tenant"]
    search_fields = ["invited_as", "tenant__slug", "invitee__username"]
    readonly_fields = ["tenant", "invited_as", "invitee", "role", "status", "invited_by",
                       "expires_at", "answered_at", "created_at"]
    actions = [revoke_invitations]

    def has_add_permission(self, request) -> bool:
        return False


class ApiKeyCreateForm(forms.ModelForm):
    class Meta:
        model = ApiKey
        fields = ["tenant", "name", "allowed_models", "expires_at"]


@admin.action(description="Revoke selected keys")
def revoke_keys(modeladmin, request, queryset) -> None:
    for key in queryset:
        if key.revoke():
            audit.record(request, "revoke", key, via="admin")
    messages.success(request, "Selected keys are revoked.")


@admin.register(ApiKey)
class ApiKeyAdmin(AuditedAdmin):
    list_display = ["prefix", "name", "tenant", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant", ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["prefix", "name", "tenant__slug"]
    readonly_fields = ["prefix", "revoked_at", "last_used_at", "created_by", "created_at"]
    actions = [revoke_keys]

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = ApiKeyCreateForm
        return super().get_form(request, obj, **kwargs)

    def get_readonly_fields(self, request, obj=None):
        return self.readonly_fields if obj else []

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["tenant", "name", "allowed_models", "expires_at"]
        return [
            "tenant",
            "name",
            "prefix",
            "allowed_models",
            "expires_at",
            *self.readonly_fields[1:],
        ]

    def save_model(self, request, obj, form, change) -> None:
        if change:
            return super().save_model(request, obj, form, change)
        key, secret = ApiKey.objects.create_key(
            tenant=obj.tenant,
            name=obj.name,
            allowed_models=obj.allowed_models,
            expires_at=obj.expires_at,
            created_by=request.user,
        )
        form.instance = key
        request._audit_before = None
        messages.warning(request, f"The key's secret, shown this once (copy it now): {secret}")
