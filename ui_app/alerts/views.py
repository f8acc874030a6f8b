"""The alert pages: in the tenant portal (`/portal/<slug>/alerts/...`: the tenant's alerts,
its rules, channels and silences) and in the console (`/alerts/`: every alert, the rules,
channels and silences of the platform, the evaluator's last round).

Portal pages find the tenant through `Tenant.objects.for_user()` (tenants_app's TenantPage),
so another tenant's pages and rows answer 404; changes need the owner or admin role (403
otherwise). Views parse the form, call one model method, and redirect or render; validation is
the models' `clean()` through the forms.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.db.models import Case, IntegerField, QuerySet, Value, When
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views import View

from alerts_app import delivery
from alerts_app.models import (
    Alert,
    AlertRule,
    AlertTransition,
    Channel,
    EvaluationState,
    Silence,
)
from tenants_app.models import Tenant
from ui_app.alerts.forms import ChannelForm, RuleForm, SilenceForm
from ui_app.scoping import StaffPage, TenantPage

STATE_ORDER = Case(
    When(state=Alert.State.FIRING, then=Value(0)), When(state=Alert.State.PENDING, then=Value(1)),
    When(state=Alert.State.NO_DATA, then=Value(2)), default=Value(3), output_field=IntegerField(),
)


def open_alerts(alerts: QuerySet[Alert]) -> QuerySet[Alert]:
    """Alerts not ok, firing first."""
    return (alerts.exclude(state=Alert.State.OK).select_related("rule", "tenant",
                                                                "acknowledged_by")
            .annotate(order=STATE_ORDER).order_by("order", "-state_changed_at"))


class Owner:
    """Whose rules, channels and silences a page shows: one tenant's, or the platform's."""

    def __init__(self, tenant: Tenant | None) -> None:
        self.tenant = tenant

    def rules(self) -> QuerySet[AlertRule]:
        base = AlertRule.objects.select_related("tenant")
        return base.for_tenant(self.tenant) if self.tenant else base.platform()

    def channels(self) -> QuerySet[Channel]:
        base = Channel.objects.all()
        return base.for_tenant(self.tenant) if self.tenant else base.platform()

    def silences(self) -> QuerySet[Silence]:
        base = Silence.objects.select_related("rule", "alert", "created_by")
        return base.for_tenant(self.tenant) if self.tenant else base.platform()

    def alerts(self) -> QuerySet[Alert]:
        return Alert.objects.for_tenant(self.tenant) if self.tenant else Alert.objects.all()


# ----------------------------------------------------------------------------- portal


class PortalAlertsMixin(TenantPage):
    section = "alerts"

    @property
    def owner(self) -> Owner:
        return Owner(self.tenant)

    def page(self, template: str, status: int = 200, **extra: Any) -> HttpResponse:
        home = reverse("portal-alerts:alerts", kwargs={"slug": self.tenant.slug})
        return self.render(template, status=status, now=timezone.now(),
                           requests_url=reverse("portal:requests", args=[self.tenant.slug]),
                           ack_url_base=home, ack_url_tail="/acknowledge/",
                           end_url_base=f"{home}silences/", end_url_tail="/end/", **extra)

    def back(self, name: str) -> HttpResponse:
        return redirect(f"portal-alerts:{name}", slug=self.tenant.slug)


class PortalAlertsView(PortalAlertsMixin, View):
    """The tenant's alerts (open ones first), their recent history, and its silences."""

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.alerts_page(SilenceForm(tenant=self.tenant))

    def alerts_page(self, silence_form: SilenceForm, status: int = 200) -> HttpResponse:
        alerts = self.owner.alerts()
        history = (AlertTransition.objects.for_tenant(self.tenant)
                   .select_related("alert__rule").order_by("-at")[:50])
        return self.page("alerts/alerts.html", status=status, alerts=open_alerts(alerts),
                         history=history, silences=self.owner.silences()[:50],
                         silence_form=silence_form)

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        """Create a silence."""
        self.require_manager()
        form = SilenceForm(request.POST, tenant=self.tenant)
        if not form.is_valid():
            return self.alerts_page(form, status=400)
        form.instance.created_by = request.user
        form.save()
        messages.success(request, "Silence created.")
        return self.back("alerts")


class PortalAcknowledgeView(PortalAlertsMixin, View):
    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        alert = get_object_or_404(self.owner.alerts(), pk=pk)
        if alert.acknowledge(request.user):
            messages.success(request, f"{alert} acknowledged.")
        return self.back("alerts")


class PortalSilenceEndView(PortalAlertsMixin, View):
    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        get_object_or_404(self.owner.silences(), pk=pk).end()
        return self.back("alerts")


class PortalRulesView(PortalAlertsMixin, View):
    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.rules_page(RuleForm(tenant=self.tenant))

    def rules_page(self, form: RuleForm, status: int = 200) -> HttpResponse:
        return self.page("alerts/rules.html", status=status, rules=self.owner.rules(),
                         form=form)

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        form = RuleForm(request.POST, tenant=self.tenant)
        if not form.is_valid():
            return self.rules_page(form, status=400)
        form.instance.created_by = request.user
        rule = form.save()
        messages.success(request, f"Rule {rule.name} created.")
        return self.back("rules")


class PortalRuleView(PortalAlertsMixin, View):
    """Edit or delete one of the tenant's rules."""

    def get(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        rule = get_object_or_404(self.owner.rules(), pk=pk)
        return self.page("alerts/rule_form.html", form=RuleForm(instance=rule,
                                                                    tenant=self.tenant),
                         rule=rule)

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        rule = get_object_or_404(self.owner.rules(), pk=pk)
        if request.POST.get("action") == "delete":
            rule.delete()
            messages.success(request, f"Rule {rule.name} deleted.")
            return self.back("rules")
        form = RuleForm(request.POST, instance=rule, tenant=self.tenant)
        if not form.is_valid():
            return self.page("alerts/rule_form.html", status=400, form=form, rule=rule)
        form.save()
        messages.success(request, f"Rule {rule.name} saved.")
        return self.back("rules")


class PortalChannelsView(PortalAlertsMixin, View):
    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.channels_page(ChannelForm(tenant=self.tenant))

    def channels_page(self, form: ChannelForm, status: int = 200, **extra: Any) -> HttpResponse:
        return self.page("alerts/channels.html", status=status,
                         channels=self.owner.channels(), form=form, **extra)

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        form = ChannelForm(request.POST, tenant=self.tenant)
        if not form.is_valid():
            return self.channels_page(form, status=400)
        channel = form.save()
        # The secret is shown in this response only (rendered, not redirected).
        response = self.channels_page(ChannelForm(tenant=self.tenant), new_channel=channel)
        response["Cache-Control"] = "no-store"
        return response


class PortalChannelView(PortalAlertsMixin, View):
    """A channel's delivery log; send a test notification, or delete it."""

    def get(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        channel = get_object_or_404(self.owner.channels(), pk=pk)
        return self.page("alerts/channel.html", channel=channel,
                         deliveries=channel.notifications.all()[:100])

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        channel = get_object_or_404(self.owner.channels(), pk=pk)
        if request.POST.get("action") == "delete":
            channel.delete()
            return self.back("channels")
        delivery.send_test(channel)
        messages.success(request, "Test notification queued: its delivery shows below.")
        return redirect("portal-alerts:channel", slug=self.tenant.slug, pk=channel.pk)


# ----------------------------------------------------------------------------- console


class ConsoleAlertsView(StaffPage, View):
    """Every open alert and the recent history; the platform's rules, channels and silences;
    the evaluator's last round."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return self.page(SilenceForm(), RuleForm(), ChannelForm())

    def page(self, silence_form: SilenceForm, rule_form: RuleForm, channel_form: ChannelForm,
             status: int = 200, **extra: Any) -> HttpResponse:
        owner = Owner(None)
        return render(self.request, "alerts/console.html", {
            "alerts": open_alerts(Alert.objects.all()),
            "history": AlertTransition.objects.select_related("alert__rule", "tenant")
            .order_by("-at")[:50],
            "rules": AlertRule.objects.select_related("tenant").order_by("tenant__slug", "name"),
            "channels": owner.channels(), "silences": owner.silences()[:50],
            "evaluation": EvaluationState.objects.filter(pk=1).first(),
            "silence_form": silence_form, "rule_form": rule_form, "channel_form": channel_form,
            "now": timezone.now(), "ack_url_base": "/alerts/acknowledge/", "ack_url_tail": "/",
            "requests_url": reverse("console:request-log"),
            "end_url_base": "/alerts/end-silence/", "end_url_tail": "/",
            **extra,
        }, status=status)

    def post(self, request: HttpRequest) -> HttpResponse:
        kind = request.POST.get("form")
        forms_: dict[str, Any] = {"silence_form": SilenceForm(), "rule_form": RuleForm(),
                                  "channel_form": ChannelForm()}
        form: Any
        if kind == "rule":
            form = forms_["rule_form"] = RuleForm(request.POST)
        elif kind == "channel":
            form = forms_["channel_form"] = ChannelForm(request.POST)
        else:
            form = forms_["silence_form"] = SilenceForm(request.POST)
        if not form.is_valid():
            return self.page(status=400, **forms_)
        if kind != "channel":
            form.instance.created_by = request.user
        saved = form.save()
        if kind == "channel":
            response = self.page(new_channel=saved, **{**forms_, "channel_form": ChannelForm()})
            response["Cache-Control"] = "no-store"
            return response
        messages.success(request, f"{saved} saved.")
        return redirect("alerts:console")


class ConsoleAlertActionView(StaffPage, View):
    """Acknowledge an alert, end a silence, or send a test notification to a channel."""

    def post(self, request: HttpRequest, kind: str, pk: int) -> HttpResponse:
        if kind == "acknowledge":
            get_object_or_404(Alert, pk=pk).acknowledge(request.user)
        elif kind == "end-silence":
            get_object_or_404(Silence, pk=pk).end()
        else:
            delivery.send_test(get_object_or_404(Channel, pk=pk))
            messages.success(request, "Test notification queued.")
        return redirect("alerts:console")
