"""The console's page forms, except those it shares: with the Django admin (a deployment, a
what-if plan: `serving_app.forms`) and with the portal (guardrail policies:
`guardrails_app.forms`). Validation is the models' own: a ModelForm runs `full_clean()`, so a
page rejects exactly what the API and the Django admin reject, with the same message."""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.validators import MaxValueValidator

from serving_app import frontier
from serving_app.api.joins import MAX_TTL_MINUTES, name_problem
from serving_app.enginespec import MAX_REPLICAS
from serving_app.models import BaseModel, GpuPriceCard, LoraAdapter, Node, PriceCard
from serving_app.models.autoscalers import Autoscaler
from serving_app.models.capacity import MAX_LEVELS
from serving_app.models.revisions import Rollout
from tenants_app.models import ApiKey, MoneyBudget, Tenant


class TenantForm(forms.ModelForm[Tenant]):
    class Meta:
        model = Tenant
        fields = list(Tenant.EDITABLE_FIELDS)


class BaseModelForm(forms.ModelForm[BaseModel]):
    class Meta:
        model = BaseModel
        fields = ["name", "path", "dtype", "quantization", "load_format", "test_model"]
        help_texts = {"path": "Absolute path of the model folder under one of the model roots "
                              "(MODEL_ROOTS), the same on every node host."}


class FromVersionErrors:
    """The model's own errors about its artifact version (not a field of these forms: the page
    sets it) read as the form's, not as a field it lacks."""

    fields: dict[str, Any]

    def _update_errors(self, errors: ValidationError) -> None:
        if hasattr(errors, "error_dict"):
            moved: dict[str, list[Any]] = {}
            for field, messages in errors.error_dict.items():
                moved.setdefault(field if field in self.fields else NON_FIELD_ERRORS,
                                 []).extend(messages)
            errors = ValidationError(moved)
        super()._update_errors(errors)  # type: ignore[misc]


class ModelFromVersionForm(FromVersionErrors, forms.ModelForm[BaseModel]):
    """A base model served from an artifact version (set by the page): its architecture is read
    from the version's files by `BaseModel.clean()`."""

    class Meta:
        model = BaseModel
        fields = ["name", "dtype", "quantization", "load_format", "test_model"]


class AdapterFromVersionForm(FromVersionErrors, forms.ModelForm[LoraAdapter]):
    """A tenant's adapter served from an artifact version (set by the page): the artifact's
    tenant, for one of the base models; rank and targets are read from its files."""

    class Meta:
        model = LoraAdapter
        fields = ["name", "tenant", "base_model"]

    def __init__(self, *args: Any, tenant: Tenant | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if tenant is not None:  # an adapter artifact of a tenant serves that tenant only
            tenants = self.fields["tenant"]
            assert isinstance(tenants, forms.ModelChoiceField)
            tenants.queryset = Tenant.objects.filter(pk=tenant.pk)
            tenants.initial = tenant.pk


class AdapterChoiceField(forms.ModelChoiceField[LoraAdapter]):
    def label_from_instance(self, obj: LoraAdapter) -> str:
        return f"{obj} (requested by its tenant)" if obj.serving_requested_at else str(obj)


class AttachAdapterForm(forms.Form):
    """An adapter of a tenant the deployment serves, for its base model, not attached yet;
    those their tenant asked for first, named so."""

    adapter = AdapterChoiceField(queryset=LoraAdapter.objects.none(),
                                     help_text="Adapters of this deployment's tenants for its "
                                               "base model.")

    def __init__(self, *args: Any, choices: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["adapter"]
        assert isinstance(field, forms.ModelChoiceField)
        field.queryset = choices


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


class ScaleForm(forms.Form):
    """A deployment's number of replicas, 0 to `maximum` (`MAX_REPLICAS`, or the top of the
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
    max_surge = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS, initial=1,
                                   help_text="Rolling: new instances beside the old at once.")
    max_unavailable = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS, initial=0,
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


class AutoscalerForm(forms.ModelForm[Autoscaler]):
    """A deployment's autoscaling policy; the model's `clean()` checks it."""

    class Meta:
        model = Autoscaler
        fields = ["enabled", "min_replicas", "max_replicas", "metric", "target",
                  "up_window_seconds", "down_window_seconds", "up_cooldown_seconds",
                  "down_cooldown_seconds"]


class AddNodeForm(forms.Form):
    """A join token's node name (checked as the join checks it) and how long it is open."""

    node_name = forms.SlugField(
        max_length=100, label="Node name",
        help_text="The name the new host joins as (letters, digits, - and _); its queue is "
                  "node.<name>.")
    ttl_minutes = forms.IntegerField(
        min_value=1, max_value=MAX_TTL_MINUTES, required=False, label="Open for (minutes)",
        help_text="How long the token may be used (default NODE_JOIN_TOKEN_TTL_MINUTES).")

    def clean_node_name(self) -> str:
        name: str = self.cleaned_data["node_name"]
        problem = name_problem(name)
        if problem:
            raise forms.ValidationError(problem)
        return name


class PriceCardForm(forms.ModelForm[PriceCard]):
    """A token price card; its date and prices are checked by `PriceCard.clean()`."""

    class Meta:
        model = PriceCard
        fields = ["base_model", "adapter", "currency", "effective_from", "input_per_million",
                  "cached_input_per_million", "output_per_million", "note"]
        help_texts = {"effective_from": "UTC, e.g. 2026-12-01 00:00. In force from then until a "
                                        "later card for the same model or adapter."}


class GpuPriceCardForm(forms.ModelForm[GpuPriceCard]):
    class Meta:
        model = GpuPriceCard
        fields = ["gpu_model", "mig_profile", "currency", "effective_from", "per_gpu_second",
                  "note"]
        help_texts = {"effective_from": "UTC, e.g. 2026-12-01 00:00."}


class MoneyBudgetForm(forms.ModelForm[MoneyBudget]):
    """A tenant's or key's money budget; `MoneyBudget.clean()` checks the time zone and that
    the key is the tenant's, the constraints one budget per tenant and per key."""

    class Meta:
        model = MoneyBudget
        fields = ["tenant", "api_key", "amount", "period", "rolling", "time_zone",
                  "soft_threshold_percent", "hard_limit"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        keys = self.fields["api_key"]
        assert isinstance(keys, forms.ModelChoiceField)
        keys.queryset = ApiKey.objects.filter(revoked_at__isnull=True).select_related("tenant")


class CapacityTestForm(forms.Form):
    """A capacity test's settings, as `CapacityTest.objects.start()` takes them (it validates
    them as the API does); the concurrency levels typed as a list of numbers."""

    input_tokens = forms.IntegerField(min_value=1, label="Input tokens")
    output_tokens = forms.IntegerField(min_value=2, label="Output tokens")
    concurrency = forms.CharField(
        label="Concurrency levels", max_length=200,
        help_text=f"Requests in flight at each level, in order: at most {MAX_LEVELS} numbers, "
                  "separated by commas.")
    requests_per_level = forms.IntegerField(
        min_value=1, label="Requests per level",
        help_text="At least the highest level; more give steadier p95s and take longer.")

    def clean_concurrency(self) -> list[int]:
        text = self.cleaned_data["concurrency"]
        try:
            return [int(part) for part in text.replace(",", " ").split()]
        except ValueError:
            raise ValidationError("Numbers separated by commas, such as 1, 2, 4, 8.") from None


class ObjectivesForm(forms.Form):
    """Objectives to price on the deployments' curves before they are set: named as the
    tenant's own fields, so that the tenant form's typed values read as they are."""

    latency_objective_ms = forms.IntegerField(min_value=1, required=False,
                                              label="End-to-end p95 (ms)")
    ttft_objective_ms = forms.IntegerField(min_value=1, required=False,
                                           label="Time to first token p95 (ms)")
    tpot_objective_ms = forms.IntegerField(min_value=1, required=False,
                                           label="Time per output token p95 (ms)")

    def objectives(self) -> frontier.Objectives:
        """The valid values of a bound form (an invalid one is no bound: its field says
        why)."""
        self.is_valid()
        data = self.cleaned_data
        return frontier.Objectives(ttft_ms=data.get("ttft_objective_ms"),
                                   tpot_ms=data.get("tpot_objective_ms"),
                                   e2e_ms=data.get("latency_objective_ms"))
