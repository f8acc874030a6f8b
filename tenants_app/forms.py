"""Tenant portal forms: API keys, adapters (from a path or an uploaded archive), invitations.

Rows are validated by the models' `full_clean()`, as in the API. An uploaded adapter archive is
checked before anything is written where the engines can see it: it must be a readable zip
within the size limits, with no entry escaping its folder (absolute paths, `..`, links); it is
unpacked into a staging folder under `VAR_DIR/uploads/`, moved into place only once the adapter
validates against its base model, and removed on every refusal.
"""

from __future__ import annotations

import shutil
import stat
import uuid
import zipfile
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import IO, Any

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.utils import timezone

from serving_app.models import BaseModel, Deployment, LoraAdapter
from tenants_app.models import Role, Tenant

MAX_ARCHIVE_BYTES = 256 * 1024 * 1024
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
MAX_ENTRIES = 2000
EXPIRY_CHOICES = [("", "Never"), ("1", "1 day"), ("7", "7 days"), ("30", "30 days"),
                  ("90", "90 days")]


def allowed_base_models(tenant: Tenant) -> QuerySet[BaseModel]:
    """Base models a tenant may register adapters for: those its deployments serve."""
    served = Deployment.objects.for_tenant(tenant)
    return BaseModel.objects.filter(deployments__in=served).distinct()


def uploads_dir() -> Path:
    return Path(settings.VAR_DIR) / "uploads"


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    allowed_models = forms.MultipleChoiceField(
        required=False, widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every model the tenant may use.",
    )
    expires_in = forms.ChoiceField(choices=EXPIRY_CHOICES, required=False, label="Expires")

    def __init__(self, *args: Any, model_names: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["allowed_models"].choices = [(n, n) for n in model_names or []]

    def key_fields(self) -> dict[str, Any]:
        days = self.cleaned_data.get("expires_in")
        return {
            "name": self.cleaned_data["name"],
            "allowed_models": list(self.cleaned_data.get("allowed_models") or []),
            "expires_at": timezone.now() + timedelta(days=int(days)) if days else None,
        }


class _ConstraintsMixin:
    """ModelForms skip constraints on fields they do not show (the tenant); check them all."""

    def _post_clean(self) -> None:
        super()._post_clean()  # type: ignore[misc]
        try:
            self.instance.validate_constraints()  # type: ignore[attr-defined]
        except ValidationError as exc:
            self._update_errors(exc)  # type: ignore[attr-defined]


class AdapterPathForm(_ConstraintsMixin, forms.ModelForm):
    """Register an adapter folder that is already on the node hosts."""

    class Meta:
        model = LoraAdapter
        fields = ["base_model", "name", "path", "rank"]
        help_texts = {"path": "Absolute path of the adapter folder, the same on every node host."}

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        kwargs.setdefault("instance", LoraAdapter(tenant=tenant))
        super().__init__(*args, **kwargs)
        self.fields["base_model"].queryset = allowed_base_models(tenant)


class AdapterUploadForm(forms.Form):
    """Upload a zipped adapter folder (adapter_config.json and its safetensors)."""

    base_model = forms.ModelChoiceField(queryset=BaseModel.objects.none())
    name = forms.SlugField(max_length=100, help_text="Public name, unique within the tenant.")
    archive = forms.FileField(help_text="A .zip of the adapter folder.")

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tenant = tenant
        self.fields["base_model"].queryset = allowed_base_models(tenant)

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        if LoraAdapter.objects.for_tenant(self.tenant).filter(name=name).exists():
            raise ValidationError(f"This tenant already has an adapter named {name}.")
        return name

    def clean_archive(self) -> Any:
        archive = self.cleaned_data["archive"]
        limit = getattr(settings, "ADAPTER_UPLOAD_MAX_BYTES", MAX_ARCHIVE_BYTES)
        if archive.size > limit:
            raise ValidationError(
                f"The archive is {archive.size:,} bytes; the limit is {limit:,} bytes."
            )
        return archive

    def save(self) -> LoraAdapter:
        """Unpack, validate and register the adapter; on refusal raise ValidationError (already
        added to the form) and leave nothing on disk."""
        data = self.cleaned_data
        staging = uploads_dir() / ".staging" / uuid.uuid4().hex
        final: Path | None = None
        try:
            root = unpack_adapter_archive(data["archive"], staging)
            final = uploads_dir() / self.tenant.slug / f"{data['name']}-{uuid.uuid4().hex[:8]}"
            final.parent.mkdir(parents=True, exist_ok=True)
            root.rename(final)
            adapter = LoraAdapter(
                tenant=self.tenant, base_model=data["base_model"], name=data["name"],
                path=str(final),
            )
            adapter.full_clean()
            adapter.save()
            return adapter
        except ValidationError as exc:
            if final is not None:
                shutil.rmtree(final, ignore_errors=True)
            if hasattr(exc, "error_dict"):
                for field, errors in exc.error_dict.items():
                    target = field if field in self.fields else "archive"
                    for error in errors:
                        self.add_error(target, error)
            else:
                self.add_error("archive", exc)
            raise
        except BaseException:
            if final is not None:
                shutil.rmtree(final, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _entry_path(info: zipfile.ZipInfo) -> PurePosixPath | None:
    """The entry's relative path, or None when it would escape the folder."""
    name = info.filename
    if "\\" in name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return None
    path = PurePosixPath(name)
    if any(part in ("..", "") for part in path.parts) or path.is_absolute():
        return None
    return path


def unpack_adapter_archive(upload: IO[bytes], staging: Path) -> Path:
    """Check and unpack a zipped adapter folder into `staging`; return the folder holding
    adapter_config.json. Raises ValidationError (on the archive) with the reason."""
    unpacked_limit = getattr(settings, "ADAPTER_UPLOAD_MAX_UNPACKED_BYTES", MAX_UNPACKED_BYTES)
    try:
        archive = zipfile.ZipFile(upload)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ValidationError({"archive": f"Not a readable zip archive ({exc})."}) from exc
    with archive:
        infos = archive.infolist()
        if len(infos) > MAX_ENTRIES:
            raise ValidationError(
                {"archive": f"The archive holds more than {MAX_ENTRIES} entries."}
            )
        declared = 0
        for info in infos:
            if _entry_path(info) is None:
                raise ValidationError({"archive": (
                    f"The entry {info.filename!r} points outside the adapter folder; "
                    "archives with absolute paths or '..' are refused."
                )})
            if stat.S_ISLNK(info.external_attr >> 16):
                raise ValidationError({"archive": f"The entry {info.filename!r} is a link; "
                                                  "links are refused."})
            declared += info.file_size
        if declared > unpacked_limit:
            raise ValidationError({"archive": (
                f"The archive unpacks to {declared:,} bytes; the limit is {unpacked_limit:,}."
            )})
        staging.mkdir(parents=True)
        written = 0
        base = staging.resolve()
        try:
            for info in infos:
                relative = _entry_path(info)
                assert relative is not None
                target = (staging / relative).resolve()
                if base not in target.parents and target != base:
                    raise ValidationError({"archive": f"The entry {info.filename!r} escapes "
                                                      "the adapter folder."})
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as source, target.open("wb") as out:
                    while chunk := source.read(1024 * 1024):
                        written += len(chunk)
                        if written > unpacked_limit:
                            raise ValidationError({"archive": "The archive unpacks to more than "
                                                              f"{unpacked_limit:,} bytes."})
                        out.write(chunk)
        except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError) as exc:
            raise ValidationError({"archive": f"The archive is broken: {exc}."}) from exc
    if (staging / "adapter_config.json").is_file():
        return staging
    children = [p for p in staging.iterdir() if not p.name.startswith(("__MACOSX", "."))]
    if len(children) == 1 and (children[0] / "adapter_config.json").is_file():
        return children[0]
    raise ValidationError({"archive": (
        "The archive holds no adapter_config.json at its top (or in its one top folder): "
        "it is not a LoRA adapter folder."
    )})


class InviteForm(forms.Form):
    """Invite someone by username or email. Whether such a user exists is never said."""

    invited_as = forms.CharField(max_length=254, label="Username or email")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class MemberRoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)
