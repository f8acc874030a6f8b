"""Django admin for guardrail policies and tenants' patterns. The models' `clean()` refuses a
policy that weakens the level above and a pattern RE2 refuses, here as everywhere; every change
is audited by audit_app's receivers."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from guardrails_app.models import FloorPolicy, GuardModel, KeyPolicy, TenantPattern, TenantPolicy


@admin.register(FloorPolicy)
class FloorPolicyAdmin(admin.ModelAdmin[FloorPolicy]):
    list_display = ["__str__", "input", "output", "restore", "classifier", "updated_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return not FloorPolicy.objects.exists()  # one row: change it


@admin.register(TenantPolicy)
class TenantPolicyAdmin(admin.ModelAdmin[TenantPolicy]):
    list_display = ["tenant", "input", "output", "restore", "classifier", "updated_at"]
    search_fields = ["tenant__slug"]
    autocomplete_fields = ["tenant"]


@admin.register(KeyPolicy)
class KeyPolicyAdmin(admin.ModelAdmin[KeyPolicy]):
    list_display = ["api_key", "tenant", "input", "output", "restore", "updated_at"]
    list_filter = ["tenant"]
    raw_id_fields = ["api_key"]


@admin.register(TenantPattern)
class TenantPatternAdmin(admin.ModelAdmin[TenantPattern]):
    list_display = ["name", "tenant", "kind", "category", "ignore_case", "updated_at"]
    list_filter = ["kind", "tenant"]
    search_fields = ["name", "tenant__slug"]


@admin.register(GuardModel)
class GuardModelAdmin(admin.ModelAdmin[GuardModel]):
    """Marking a deployment as a guard model: its template, verdicts and blocking verdicts
    are checked by the model's `clean()`."""

    list_display = ["deployment", "verdicts", "blocking", "max_tokens", "updated_at"]
    raw_id_fields = ["deployment"]
