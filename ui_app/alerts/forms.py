"""Forms of the portal's and the console's alert pages. Validation is the models' `clean()`
(run by ModelForm), so a page refuses a bad rule, channel or silence with the same field
errors as the API and the admin."""

from __future__ import annotations

from typing import Any

from django import forms

from alerts_app.metrics import TENANT_SCOPES, Scope, tenant_metrics
from alerts_app.models import URL_MAX_LENGTH, Alert, AlertRule, Channel, Silence
from tenants_app.models import Tenant

RULE_FIELDS = ["name", "metric", "scope", "target", "comparison", "threshold",
               "use_tenant_objective", "percentile", "window_seconds", "for_seconds",
               "recovery_threshold", "min_requests", "severity", "enabled"]


class RuleForm(forms.ModelForm):
    """A rule of `tenant` (its metrics and scopes only), or of the platform (tenant None)."""

    class Meta:
        model = AlertRule
        fields = RULE_FIELDS

    def __init__(self, *args: Any, tenant: Tenant | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is None:
            self.instance.tenant = tenant
        metric: Any = self.fields["metric"]
        scope: Any = self.fields["scope"]
        if tenant is not None:
            metric.choices = [(s.metric.value, s.label) for s in tenant_metrics()]
            scope.choices = [(s.value, s.label) for s in TENANT_SCOPES]
            self.fields["target"].help_text = "A model's public name. Empty: each model."


class ChannelForm(forms.ModelForm):
    """A new channel (pages create and delete channels; the API and the admin edit them). Its
    webhook URL is a URL field here, though stored encrypted (often its credential)."""

    url = forms.URLField(required=False, max_length=URL_MAX_LENGTH, assume_scheme="https",
                         help_text="Webhooks: where to POST.")
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices, required=False, widget=forms.CheckboxSelectMultiple,
        help_text="Only alerts of rules with these scopes. None ticked: all.",
    )

    class Meta:
        model = Channel
        fields = ["name", "kind", "url", "email_to", "min_severity", "scopes", "send_resolved",
                  "enabled", "allow_private_targets"]

    def __init__(self, *args: Any, tenant: Tenant | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is None:
            self.instance.tenant = tenant
        if tenant is not None or self.instance.tenant_id is not None:
            del self.fields["allow_private_targets"]  # platform channels only


class SilenceForm(forms.ModelForm):
    ends_at = forms.DateTimeField(widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
                                  help_text="UTC.")

    class Meta:
        model = Silence
        fields = ["alert", "rule", "ends_at", "reason"]

    def __init__(self, *args: Any, tenant: Tenant | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instance.tenant = tenant
        alert: Any = self.fields["alert"]
        rule: Any = self.fields["rule"]
        if tenant is not None:
            alert.queryset = Alert.objects.for_tenant(tenant).select_related("rule")
            rule.queryset = AlertRule.objects.for_tenant(tenant)
        else:
            alert.queryset = Alert.objects.select_related("rule")
            rule.queryset = AlertRule.objects.all()
        alert.help_text = "One alert; or leave empty and pick a rule, or neither for all."
