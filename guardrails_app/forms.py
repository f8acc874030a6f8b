"""Forms of the guardrail pages (console floor editor, portal policy editor, key narrowing,
patterns and the test bench).

A policy row's `input` and `output` are JSON objects `{detector: rule}`; the editor shows them
as one choice per detector and direction instead, so nobody types JSON. Validation stays the
model's `full_clean()` (the same path as the admin and the API): its error on a direction names
the detector in backticks, and the form puts it on that detector's field.
"""

from __future__ import annotations

import re
from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from guardrails_app.detectors import Detector
from guardrails_app.models import CLASSIFIER_FIELDS, GuardModel, PolicyFields, TenantPattern
from guardrails_app.policy import Direction, Policy
from serving_app.models import Deployment

OFF = ""
RULE_CHOICES = [
    (OFF, "off"),
    ("detect", "detect (count only)"),
    ("redact", "redact: [PLACEHOLDER_1]"),
    ("redact:mask", "redact: mask ****"),
    ("redact:hash", "redact: salted hash"),
    ("block", "block the request"),
]
_NAMED = re.compile(r"`([^`]+)`")
# A policy's settings beside its rules, in the order the editor shows them.
SETTINGS = ("restore", *CLASSIFIER_FIELDS, "refuse_non_text")


def field_name(direction: Direction | str, detector: str) -> str:
    return f"{Direction(direction).value}__{detector}"


class PolicyForm(forms.Form):
    """One rule choice per detector and direction, and whether input placeholders are put
    back in the answer. `above` is the level above's policy (its rules are shown as what the
    detector must at least do); `detectors` are the ones the policy may name."""

    def __init__(self, *args: Any, row: PolicyFields, detectors: dict[str, Detector],
                 above: Policy | None = None, disabled: bool = False, **kwargs: Any) -> None:
        initial: dict[str, Any] = {name: getattr(row, name) for name in SETTINGS}
        for direction in Direction:
            for name, rule in (getattr(row, direction.value) or {}).items():
                initial[field_name(direction, name)] = str(rule)
        kwargs["initial"] = initial
        super().__init__(*args, **kwargs)
        # The settings below the detectors' table are the model's fields (their bounds, labels
        # and help); a blank timeout takes the model's default in save().
        self.fields.update(forms.fields_for_model(type(row), fields=SETTINGS))
        self.fields["classifier_timeout_ms"].required = False
        self.row = row
        self.detectors = detectors
        self.above = above
        for name in detectors:
            for direction in Direction:
                required = above.rules(direction).get(name) if above is not None else None
                self.fields[field_name(direction, name)] = forms.ChoiceField(
                    choices=RULE_CHOICES, required=False, label=f"{name} ({direction})",
                    help_text=f"at least {required} (level above)" if required else "",
                    disabled=disabled,
                )
        classifier = self.fields["classifier"]
        assert isinstance(classifier, forms.ModelChoiceField)
        classifier.queryset = Deployment.objects.filter(
            pk__in=GuardModel.objects.values("deployment_id")).order_by("name")
        classifier.empty_label = "none"
        for name in SETTINGS:
            self.fields[name].disabled = disabled
        if above is not None and above.classifier is not None:
            setting = above.classifier
            name = Deployment.objects.filter(pk=setting.deployment).values_list(
                "name", flat=True).first() or f"#{setting.deployment}"
            classifier.empty_label = f"the level above's ({name})"
            classifier.help_text = (
                f"The level above uses guard model {name}, waiting {setting.timeout_ms} ms, "
                f"failing {'open' if setting.fail_open else 'closed'}; name it here only to "
                "wait longer or fail closed.")
        if above is not None and above.refuse_non_text:
            self.fields["refuse_non_text"].help_text = "Required by the level above."

    def policy_fields(self) -> list[Any]:
        """The settings below the detectors' table, in order."""
        return [self[name] for name in SETTINGS]

    def rows(self) -> list[dict[str, Any]]:
        """The editor's table: each detector with its description and its two fields."""
        return [
            {"name": name, "category": d.category, "description": d.description,
             "fields": [self[field_name(direction, name)] for direction in Direction]}
            for name, d in self.detectors.items()
        ]

    def rules(self, direction: Direction) -> dict[str, str]:
        return {name: self.cleaned_data[field_name(direction, name)]
                for name in self.detectors
                if self.cleaned_data.get(field_name(direction, name))}

    def save(self) -> PolicyFields:
        """Validate through the model (`full_clean()`) and save; a refusal becomes the form's
        errors (on the detector it names) and raises ValidationError, changing nothing."""
        row = self.row
        names = ("input", "output", *SETTINGS)
        before = {name: getattr(row, name) for name in names}
        row.input = self.rules(Direction.INPUT)
        row.output = self.rules(Direction.OUTPUT)
        for name in SETTINGS:
            setattr(row, name, self.cleaned_data[name])
        if row.classifier_timeout_ms is None:
            row.classifier_timeout_ms = PolicyFields._meta.get_field(
                "classifier_timeout_ms").get_default()
        try:
            row.full_clean()
        except ValidationError as exc:
            for name, value in before.items():
                setattr(row, name, value)
            self.add_model_errors(exc)
            raise
        row.save()
        return row

    def add_model_errors(self, exc: ValidationError) -> None:
        for key, messages in exc.message_dict.items():
            for message in messages:
                named = _NAMED.search(message)
                target = field_name(key, named.group(1)) if (
                    key in (d.value for d in Direction) and named) else None
                if target in self.fields:
                    self.add_error(target, message)
                elif key in self.fields:
                    self.add_error(key, message)
                else:
                    self.add_error(None, f"{key}: {message}" if key != "__all__" else message)


class PatternForm(forms.ModelForm[TenantPattern]):
    """A tenant's pattern or deny-list; deny-list terms one per line."""

    # Not in Meta.fields: `clean()` turns the lines into the model's list, and the model's
    # errors on `terms` land on this field of the same name.
    terms = forms.CharField(
        required=False, label="Terms", widget=forms.Textarea(attrs={"rows": 4}),
        help_text="Deny-list: one word or phrase per line.")

    class Meta:
        model = TenantPattern
        fields = ["name", "kind", "pattern", "category", "ignore_case"]

    def __init__(self, *args: Any, tenant: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instance.tenant = tenant
        self.fields["terms"].initial = "\n".join(self.instance.terms or ())

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        terms = [line.strip() for line in (data.get("terms") or "").splitlines()]
        data["terms"] = self.instance.terms = [t for t in terms if t]
        name = data.get("name")
        if name and TenantPattern.objects.filter(tenant=self.instance.tenant, name=name) \
                .exclude(pk=self.instance.pk).exists():
            self.add_error("name", "The tenant has a pattern of this name already.")
        return data


REQUEST = "request"


class BenchForm(forms.Form):
    """Text to try the policy on, as a prompt or as an answer, or a whole chat-completions
    request body (`REQUEST`: the gateway's own checks on it, `gateway_app.bench`)."""

    direction = forms.ChoiceField(choices=[("input", "a prompt (input)"),
                                           ("output", "an answer (output)"),
                                           (REQUEST, "a whole request (chat-completions JSON)")],
                                  initial="input", label="Try it on")
    text = forms.CharField(widget=forms.Textarea(attrs={"rows": 6, "spellcheck": "false"}),
                           max_length=65536, strip=False, label="Text or request body",
                           help_text="Nothing is stored; findings are shown as offsets, or "
                                     "for a request, per field.")

    @property
    def whole_request(self) -> bool:
        return self.cleaned_data.get("direction") == REQUEST


class GuardModelForm(forms.ModelForm[GuardModel]):
    """Marking a deployment as a guard model (the console's guardrails page); verdicts one
    per line. Validation is the model's `clean()` (the core's `GuardModel`)."""

    verdicts = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), initial="safe\nunsafe",
                               help_text="The answers it may give, one per line.")
    blocking = forms.CharField(widget=forms.Textarea(attrs={"rows": 1}), initial="unsafe",
                               help_text="The verdicts that block a request, one per line.")

    class Meta:
        model = GuardModel
        fields = ["deployment", "template", "max_tokens"]
        widgets = {"template": forms.Textarea(attrs={"rows": 4})}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        deployment = self.fields["deployment"]
        assert isinstance(deployment, forms.ModelChoiceField)
        deployment.queryset = Deployment.objects.filter(guard_model__isnull=True).order_by(
            "name")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        for name in ("verdicts", "blocking"):
            lines = [line.strip() for line in (data.get(name) or "").splitlines()]
            setattr(self.instance, name, [line for line in lines if line])
        return data
