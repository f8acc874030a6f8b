"""Django admin for the alerts: platform admins edit every rule (the defaults included),
channel and silence, acknowledge alerts, send test notifications, and read the history and
every channel's delivery log. Saving runs the models' `clean()`, as the API and pages do."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from alerts_app import delivery
from alerts_app.models import (
    Alert,
    AlertRule,
    AlertTransition,
    Channel,
    EvaluationState,
    Notification,
    Silence,
)
from audit_app.admin import SecretsAdmin


class ReadOnly(admin.ModelAdmin):
    """Written by the evaluator and the delivery task, never by hand (nor deleted: deleting a
    rule or a channel takes its alerts, history and deliveries with it)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(AlertRule)
class AlertRuleAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "metric", "scope", "target", "comparison", "threshold",
                    "for_seconds", "severity", "enabled", "key"]
    list_filter = ["enabled", "severity", "metric", "scope", "tenant"]
    search_fields = ["name", "target", "tenant__slug"]
    readonly_fields = ["key", "created_by", "created_at", "updated_at"]

    def save_model(self, request: HttpRequest, obj: AlertRule, form: object,
                   change: bool) -> None:
        if not change:
            obj.created_by = request.user  # type: ignore[assignment]
        super().save_model(request, obj, form, change)


class TransitionInline(admin.TabularInline):
    model = AlertTransition
    fields = ["kind", "at", "value", "threshold", "values", "severity"]
    readonly_fields = ("kind", "at", "value", "threshold", "values", "severity")
    extra = 0
    can_delete = False
    ordering = ["-at"]

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Alert)
class AlertAdmin(ReadOnly):
    list_display = ["rule", "scope_label", "tenant", "state", "value", "threshold", "fired_at",
                    "resolved_at", "acknowledged_at"]
    list_filter = ["state", "rule__severity", "tenant"]
    search_fields = ["scope_label", "rule__name"]
    inlines = [TransitionInline]
    actions = ["acknowledge"]

    @admin.action(description="Acknowledge the selected firing alerts")
    def acknowledge(self, request: HttpRequest, queryset: QuerySet[Alert]) -> None:
        done = sum(alert.acknowledge(request.user) for alert in queryset)
        self.message_user(request, f"{done} alert(s) acknowledged.")


@admin.register(AlertTransition)
class AlertTransitionAdmin(ReadOnly):
    list_display = ["at", "kind", "alert", "tenant", "value", "threshold", "severity"]
    list_filter = ["kind", "severity", "tenant"]


@admin.register(Channel)
class ChannelAdmin(SecretsAdmin):
    list_display = ["name", "tenant", "kind", "url_shown", "email_to", "min_severity", "enabled"]
    list_filter = ["kind", "enabled", "tenant"]
    search_fields = ["name", "email_to"]  # the URL is encrypted: not searchable
    actions = ["send_test"]

    @admin.action(description="Send a test notification")
    def send_test(self, request: HttpRequest, queryset: QuerySet[Channel]) -> None:
        for channel in queryset:
            delivery.send_test(channel)
        self.message_user(request, f"Test notifications queued to {queryset.count()} "
                                   "channel(s): see their delivery logs.", messages.SUCCESS)


@admin.register(Silence)
class SilenceAdmin(admin.ModelAdmin):
    list_display = ["reason", "tenant", "rule", "alert", "starts_at", "ends_at", "created_by"]
    list_filter = ["tenant"]
    readonly_fields = ["created_by", "created_at"]
    raw_id_fields = ["alert"]

    def save_model(self, request: HttpRequest, obj: Silence, form: object, change: bool) -> None:
        if not change:
            obj.created_by = request.user  # type: ignore[assignment]
        super().save_model(request, obj, form, change)


@admin.register(Notification)
class NotificationAdmin(ReadOnly):
    """Every channel's delivery log."""

    list_display = ["created_at", "channel", "kind", "state", "attempts", "response_status",
                    "sent_at", "last_error"]
    list_filter = ["state", "kind", "channel"]
    search_fields = ["uuid", "last_error"]


@admin.register(EvaluationState)
class EvaluationStateAdmin(ReadOnly):
    list_display = ["rounds", "rules", "last_started_at", "last_finished_at",
                    "last_duration_ms", "last_error"]
