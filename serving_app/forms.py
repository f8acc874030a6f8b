"""Console forms. Validation is the models' own: a ModelForm runs `full_clean()`, and the
deployment form adds `Deployment.check_relations()`, so a page rejects exactly what the API and
the Django admin reject, with the same message."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from serving_app.models import BaseModel, Deployment, FleetPlan, LoraAdapter
from serving_app.models.revisions import Rollout
from tenants_app.models import Tenant


class TenantForm(forms.ModelForm):
    class Meta:
        model = Tenant
        fields = list(Tenant.EDITABLE_FIELDS)


class BaseModelForm(forms.ModelForm):
    class Meta:
        model = BaseModel
        fields = ["name", "path", "dtype", "quantization"]
        help_texts = {"path": "Absolute path of the model folder under one of the model roots "
                              "(MODEL_ROOTS), the same on every node host."}


class LoraAdapterForm(forms.ModelForm):
    """Tenant and base model are fixed once registered (as in the API): register a new one."""

    class Meta:
        model = LoraAdapter
        fields = ["tenant", "base_model", "name", "path", "rank"]
        help_texts = {"path": "Absolute path of the adapter folder under one of the model roots "
                              "(MODEL_ROOTS) or in the tenant's own storage area."}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            for name in ("tenant", "base_model"):
                self.fields[name].disabled = True
                self.fields[name].help_text = "Cannot be changed; register a new adapter."


class DeploymentForm(forms.ModelForm):
    class Meta:
        model = Deployment
        fields = list(Deployment.EDITABLE_FIELDS)
        widgets = {
            "tenants": forms.CheckboxSelectMultiple,
            "adapters": forms.CheckboxSelectMultiple,
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["adapters"].queryset = LoraAdapter.objects.select_related(
            "tenant", "base_model"
        )
        self.fields["adapters"].label_from_instance = (
            lambda a: f"{a.tenant.slug}/{a.name} (for {a.base_model.name}, rank {a.rank})"
        )

    def _post_clean(self) -> None:
        super()._post_clean()
        if self.errors.get("tenants") or self.errors.get("adapters"):
            return
        if not self.instance.base_model_id:
            return
        try:
            self.instance.check_relations(
                self.cleaned_data.get("tenants", []), self.cleaned_data.get("adapters", [])
            )
        except ValidationError as exc:
            self._update_errors(exc)

    # Who saves (the view sets it): recorded on a new revision of the engine settings.
    editor: Any = None

    def save(self, commit: bool = True) -> Deployment:
        """Save through `Deployment.save_settings()`, which also asks the reconciler."""
        if not commit or self.errors:  # ModelForm's own save() refuses an invalid form
            return super().save(commit=False)
        tenants, adapters = self.relations()
        self.instance.save_settings(tenants=tenants, adapters=adapters, by=self.editor)
        return self.instance

    def relations(self) -> tuple[list[Tenant], list[LoraAdapter]]:
        """The many-to-many choices of a valid form (an unsaved row cannot hold them)."""
        return list(self.cleaned_data.get("tenants", [])), list(
            self.cleaned_data.get("adapters", [])
        )


class IndentedJSONField(forms.JSONField):
    """JSON shown indented, so a plan's deployments can be read and edited in a text area."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, forms.fields.InvalidJSONInput):
            return value
        return json.dumps(value, ensure_ascii=False, indent=2, cls=self.encoder)


class FleetPlanForm(forms.ModelForm):
    """A what-if plan; the model's `clean()` checks the fleet and the deployments."""

    class Meta:
        model = FleetPlan
        fields = ["name", "description", "fleet", "deployments", "policy", "headroom"]
        field_classes = {"deployments": IndentedJSONField}
        widgets = {
            "description": forms.Textarea(attrs={"rows": 2}),
            "fleet": forms.Textarea(attrs={"rows": 5, "class": "mono"}),
            "deployments": forms.Textarea(attrs={"rows": 18, "class": "mono"}),
        }


class ScaleForm(forms.Form):
    replicas = forms.IntegerField(min_value=0, max_value=64)


class ApplyForm(forms.Form):
    """Applying a revision: which one (default the newest), the strategy and its options; the
    same bounds as the API's (`Rollout` validates the pair)."""

    revision = forms.IntegerField(min_value=1, max_value=2**31 - 1, required=False,
                                  widget=forms.HiddenInput)
    strategy = forms.ChoiceField(choices=Rollout.Strategy.choices,
                                 initial=Rollout.Strategy.ROLLING)
    max_surge = forms.IntegerField(min_value=0, max_value=64, initial=1,
                                   help_text="Rolling: new instances beside the old at once.")
    max_unavailable = forms.IntegerField(min_value=0, max_value=64, initial=0,
                                         help_text="Rolling: ready instances that may be missing.")
    keep_old_seconds = forms.IntegerField(
        min_value=0, max_value=7 * 86400, initial=Rollout.DEFAULT_KEEP_OLD_SECONDS,
        help_text="Blue-green: how long the old generation stays for a rollback.")


class AuditFilterForm(forms.Form):
    action = forms.CharField(required=False)
    object_type = forms.CharField(required=False)
    actor = forms.CharField(required=False)
    tenant = forms.ModelChoiceField(
        queryset=Tenant.objects.all(), required=False, to_field_name="slug", empty_label="all"
    )
