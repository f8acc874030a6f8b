"""The portal's adapter forms: an uploaded archive, or (platform admins only) a folder already
on the node hosts.

Rows are validated by the models' `full_clean()`, as in the API. An uploaded adapter goes
through `serving_app.uploads.register_upload()`, the same workflow as the API's upload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError

from serving_app import storage
from serving_app.models import BaseModel, LoraAdapter
from serving_app.uploads import allowed_base_models, register_upload
from tenants_app.models import Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User


class AdapterPathForm(forms.ModelForm[LoraAdapter]):
    """Register an adapter folder that is already on the node hosts (platform admins only:
    tenants never name host paths; the portal offers it to staff alone)."""

    class Meta:
        model = LoraAdapter
        fields = ["base_model", "name", "path", "rank"]
        help_texts = {"path": "Absolute path of the adapter folder under one of the model roots "
                              "(MODEL_ROOTS), the same on every node host."}

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        kwargs.setdefault("instance", LoraAdapter(tenant=tenant))
        super().__init__(*args, **kwargs)
        base_model = self.fields["base_model"]
        if not isinstance(base_model, forms.ModelChoiceField):
            raise TypeError("base_model is a foreign key: a ModelChoiceField")
        base_model.queryset = allowed_base_models(tenant)

    def validate_unique(self) -> None:
        """With the unique checks, the model's constraints on all fields: a ModelForm skips
        those on fields it does not show (the tenant)."""
        super().validate_unique()
        try:
            self.instance.validate_constraints()
        except ValidationError as exc:
            self.add_error(None, exc)


NAME_PATTERN = r"[a-zA-Z0-9_\-]+"


class AdapterUploadForm(forms.Form):
    """Upload a zipped adapter folder (adapter_config.json and adapter_model.safetensors)."""

    # The one naming rule of adapters (a slug), checked in the browser too: `pattern` is
    # compiled with the `v` flag by Chromium, where a literal "-" in a class must be escaped.
    name = forms.SlugField(
        max_length=100, help_text="Letters, digits, - and _; unique within the tenant.",
        widget=forms.TextInput(attrs={"pattern": NAME_PATTERN, "maxlength": 100}))
    base_model = forms.ModelChoiceField(queryset=BaseModel.objects.none())
    archive = forms.FileField(help_text="A .zip of the adapter folder.")

    def __init__(self, *args: Any, tenant: Tenant, user: User | AnonymousUser | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tenant = tenant
        self.user = user
        base_model = self.fields["base_model"]
        if not isinstance(base_model, forms.ModelChoiceField):
            raise TypeError("base_model is declared a ModelChoiceField")
        base_model.queryset = allowed_base_models(tenant)

    def clean_name(self) -> str:
        name: str = self.cleaned_data["name"]
        if LoraAdapter.objects.for_tenant(self.tenant).filter(name=name).exists():
            raise ValidationError(f"This tenant already has an adapter named {name}.")
        return name

    def clean_archive(self) -> Any:
        archive = self.cleaned_data["archive"]
        limit = settings.ADAPTER_UPLOAD_MAX_BYTES
        if archive.size > limit:
            raise ValidationError(
                f"The archive is {archive.size:,} bytes; the limit is {limit:,} bytes."
            )
        return archive

    def save(self) -> LoraAdapter:
        """Unpack, validate and register the adapter (serving_app/uploads.py); on refusal raise
        ValidationError (already added to the form), having left nothing on disk."""
        data = self.cleaned_data
        try:
            return register_upload(self.tenant, data["base_model"], data["name"],
                                   data["archive"])
        except ValidationError as exc:
            exc = storage.public_errors(exc, self.user)
            if hasattr(exc, "error_dict"):
                for field, errors in exc.error_dict.items():
                    target = field if field in self.fields else "archive"
                    for error in errors:
                        self.add_error(target, error)
            else:
                self.add_error("archive", exc)
            raise exc from None
