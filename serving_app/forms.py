"""The forms the console and the Django admin share: a deployment with its engine settings
(each field as `serving_app.enginespec` declares it) and a what-if plan. Validation is the
models' own: a ModelForm runs `full_clean()`, and the deployment form adds
`Deployment.check_relations()`, so a page rejects exactly what the API and the Django admin
reject, with the same message. The console's other forms are `ui_app.console.forms`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from serving_app.enginespec import FIELD, GROUPS, EngineField
from serving_app.models import Deployment, FleetPlan, LoraAdapter
from tenants_app.models import Tenant


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
