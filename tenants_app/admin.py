"""Django admin for tenants, memberships, invitations, API keys and prefix-cache sharing groups.
Every change made here is audited by audit_app's receivers (revocations by the models' own
methods)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

from audit_app.admin import SecretsAdmin
from tenants_app.models import (
    ApiKey,
    Invitation,
    Membership,
    MoneyBudget,
    PrefixCacheGroup,
    Tenant,
    new_cache_secret,
)


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(SecretsAdmin):
    list_display = [
        "slug",
        "name",
        "status",
        "priority_tier",
        "fair_share_weight",
        "requests_per_minute",
        "tokens_per_minute",
        "monthly_token_budget",
        "ttft_objective_ms",
        "tpot_objective_ms",
        "billing_basis",
    ]
    list_filter = ["status", "priority_tier", "prefix_cache_group", "billing_basis"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


class GroupTenantInline(admin.TabularInline):
    model = Tenant
    fk_name = "prefix_cache_group"
    fields = ["slug", "name", "status"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    verbose_name_plural = "tenants (add one from its tenant page)"

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.action(description="Rotate the prefix-cache secret (members stop sharing old blocks)")
def rotate_cache_secret(modeladmin, request, queryset) -> None:
    for group in queryset:
        group.cache_secret = new_cache_secret()
        # Saved (audited as a changed secret), so the gateway re-reads its catalog.
        group.save(update_fields=["cache_secret"])
    messages.success(request, "New secrets set; members share only blocks cached from now on.")


@admin.register(PrefixCacheGroup)
class PrefixCacheGroupAdmin(SecretsAdmin):
    """Tenants in one group share prefix-cache blocks on the engines they share (and so can
    learn from timing which prefixes the others sent); everyone else is isolated."""

    list_display = ["name", "description", "created_at"]
    search_fields = ["name", "description"]
    inlines = [GroupTenantInline]
    actions = [rotate_cache_secret]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["tenant", "user", "role", "created_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]
    autocomplete_fields = ["user", "tenant"]


@admin.action(description="Revoke selected invitations")
def revoke_invitations(modeladmin, request, queryset) -> None:
    for invitation in queryset:
        invitation.revoke()  # one audit entry for each one it revoked
    messages.success(request, "Selected pending invitations are revoked.")


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
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
    queryset.revoke()  # one audit entry for each key it revoked
    messages.success(request, "Selected keys are revoked.")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
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
        # Shown by response_add on a page of its own, never through messages (a cookie or the
        # session would carry it beyond this one response).
        request._new_api_key = (key, secret)

    def response_add(self, request, obj, post_url_continue=None):
        created = getattr(request, "_new_api_key", None)
        if created is None:
            return super().response_add(request, obj, post_url_continue)
        key, secret = created
        response = TemplateResponse(
            request,
            "admin/tenants_app/apikey/secret.html",
            {**self.admin_site.each_context(request), "opts": self.opts, "key": key,
             "secret": secret, "title": "API key created"},
        )
        # no-store (with no-cache, must-revalidate, private): no browser or proxy keeps the page.
        add_never_cache_headers(response)
        return response


@admin.register(MoneyBudget)
class MoneyBudgetAdmin(admin.ModelAdmin):
    list_display = ["tenant", "api_key", "amount", "period", "rolling", "time_zone",
                    "soft_threshold_percent", "hard_limit"]
    list_filter = ["period", "rolling", "hard_limit"]
    raw_id_fields = ["api_key"]
