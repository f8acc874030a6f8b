"""Tenant portal forms: API keys (scoped to model names the page passes in) and invitations.
The adapter forms, which read serving data, are in `ui_app.portal.forms`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.utils import timezone

from tenants_app.models import Role

EXPIRY_CHOICES = [("", "Never"), ("1", "1 day"), ("7", "7 days"), ("30", "30 days"),
                  ("90", "90 days")]


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    allowed_models = forms.MultipleChoiceField(
        required=False, widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every model the tenant may use.",
    )
    expires_in = forms.ChoiceField(choices=EXPIRY_CHOICES, required=False, label="Expires")

    def __init__(self, *args: Any, model_names: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        allowed_models = self.fields["allowed_models"]
        if not isinstance(allowed_models, forms.ChoiceField):
            raise TypeError("allowed_models is declared a MultipleChoiceField")
        allowed_models.choices = [(n, n) for n in model_names or []]

    def key_fields(self) -> dict[str, Any]:
        days = self.cleaned_data.get("expires_in")
        return {
            "name": self.cleaned_data["name"],
            "allowed_models": list(self.cleaned_data.get("allowed_models") or []),
            "expires_at": timezone.now() + timedelta(days=int(days)) if days else None,
        }


class InviteForm(forms.Form):
    """Invite someone by username or email. Whether such a user exists is never said."""

    invited_as = forms.CharField(max_length=254, label="Username or email")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class MemberRoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)
