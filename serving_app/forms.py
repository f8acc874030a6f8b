"""Console forms. Validation is the models' own: a ModelForm runs `full_clean()`, and the
deployment form adds `Deployment.check_relations()`, so a page rejects exactly what the API and
the Django admin reject, with the same message."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator

from serving_app.enginespec import FIELD, GROUPS, EngineField
from serving_app.models import BaseModel, Deployment, FleetPlan, LoraAdapter, Node
from serving_app.models.autoscalers import MAX_REPLICAS
from serving_app.models.revisions import Rollout
from tenants_app.models import Tenant


class TenantForm(forms.ModelForm[Tenant]):
    class Meta:
        model = Tenant
        fields = list(Tenant.EDITABLE_FIELDS)


class BaseModelForm(forms.ModelForm[BaseModel]):
    class Meta:
        model = BaseModel
        fields = ["name", "path", "dtype", "quantization", "load_format"]
        help_texts = {"path": "Absolute path of the model folder under one of the model roots "
                              "(MODEL_ROOTS), the same on every node host."}


class NodeCpuBindingForm(forms.ModelForm[Node]):
    """A node's CPU binding; `Node.clean()` checks and normalises the CPU list."""

    class Meta:
        model = Node
        fields = ["cpu_binding"]
        labels = {"cpu_binding": "CPU binding"}
        help_texts = {"cpu_binding": "Blank: each engine on the cores nearest its GPUs; "
                                     "\"off\": not pinned; or a CPU list such as 0-7,16-23 "
                                     "for every engine. Applies to engines started from now on."}


class LoraAdapterForm(forms.ModelForm[LoraAdapter]):
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


class AdapterChoiceField(forms.ModelMultipleChoiceField[LoraAdapter]):
    """Adapters named with their tenant, base model and rank."""

    def label_from_instance(self, obj: LoraAdapter) -> str:
        return f"{obj.tenant.slug}/{obj.name} (for {obj.base_model.name}, rank {obj.rank})"


@dataclass(frozen=True)
class Row:
    """One field of a sectioned form, with its engine-setting declaration (None: not one)."""

    field: forms.BoundField
    spec: EngineField | None = None
    hidden: bool = False

    @property
    def shown_when(self) -> str:
        """`setting=value` where the field applies only then (console.js hides it otherwise)."""
        return "=".join(self.spec.shown_when) if self.spec and self.spec.shown_when else ""


@dataclass(frozen=True)
class Section:
    title: str
    rows: list[Row]


# The deployment form's fields that are not engine settings, by section ("" first, untitled).
DEPLOYMENT_SECTIONS = {"name": "", "base_model": "model", "tenants": "", "replicas": "",
                       "adapters": "lora"}


class DeploymentForm(forms.ModelForm[Deployment]):
    """A deployment and its engine settings, each labelled, bounded and explained by its
    declaration in `serving_app.enginespec` (`sections()` groups them as it says)."""

    class Meta:
        model = Deployment
        fields = list(Deployment.EDITABLE_FIELDS)
        field_classes = {"adapters": AdapterChoiceField}
        widgets = {
            "tenants": forms.CheckboxSelectMultiple,
            "adapters": forms.CheckboxSelectMultiple,
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        adapters = self.fields["adapters"]
        assert isinstance(adapters, AdapterChoiceField)
        adapters.queryset = LoraAdapter.objects.select_related("tenant", "base_model")
        for name, field in self.fields.items():
            if name in FIELD:
                _declare(field, FIELD[name])

    def sections(self) -> list[Section]:
        """The fields in the declaration's sections (`enginespec.GROUPS`), after the untitled
        one of the deployment itself (name, base model, tenants, replicas)."""
        rows: dict[str, list[Row]] = {"": [], **{group: [] for group, _ in GROUPS}}
        for bound in self:
            spec = FIELD.get(bound.name)
            group = spec.group if spec else DEPLOYMENT_SECTIONS.get(bound.name, "")
            hidden = bool(spec and spec.shown_when
                          and str(self[spec.shown_when[0]].value()) != spec.shown_when[1])
            rows[group].append(Row(bound, spec, hidden))
        titles: dict[str, str] = {"": "", **dict(GROUPS)}
        return [Section(titles[group], found) for group, found in rows.items() if found]

    def full_clean(self) -> None:
        """The model's own validation, then the many-to-many choices against it
        (`Deployment.check_relations()`, which needs the cleaned instance)."""
        super().full_clean()
        if not self.is_bound or self.errors.get("tenants") or self.errors.get("adapters"):
            return
        if not self.instance.base_model_id:
            return
        try:
            self.instance.check_relations(
                self.cleaned_data.get("tenants", []), self.cleaned_data.get("adapters", [])
            )
        except ValidationError as exc:
            self.add_error(None, exc)

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


def _declare(field: forms.Field, spec: EngineField) -> None:
    """The form field of an engine setting as declared: its short label (the flag is shown
    beside it), its bounds on the input itself so a browser steps and checks them."""
    field.label = spec.label
    if spec.minimum is not None:
        field.widget.attrs["min"] = f"{spec.minimum:g}"
    if spec.maximum is not None:
        field.widget.attrs["max"] = f"{spec.maximum:g}"
    if spec.kind == "float":
        field.widget.attrs["step"] = "0.01"


class IndentedJSONField(forms.JSONField):
    """JSON shown indented, so a plan's deployments can be read and edited in a text area."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, forms.fields.InvalidJSONInput):
            return value
        return json.dumps(value, ensure_ascii=False, indent=2, cls=self.encoder)


class FleetPlanForm(forms.ModelForm[FleetPlan]):
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
    """A deployment's number of replicas, 0 to `maximum` (the model's 64, or the top of the
    autoscaling range while the autoscaler is on)."""

    replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS, label="Replicas")

    def __init__(self, *args: Any, maximum: int = MAX_REPLICAS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["replicas"]
        assert isinstance(field, forms.IntegerField)
        field.max_value = maximum
        field.validators = [v for v in field.validators if not isinstance(v, MaxValueValidator)]
        field.validators.append(MaxValueValidator(maximum))
        field.widget.attrs.update(max=str(maximum), min="0")


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
