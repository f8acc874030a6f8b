"""Registering an adapter from an uploaded archive: the one path for the portal and the API.

The archive is checked before anything is written where the engines can see it: a readable zip
within the size limits and what is left of the tenant's storage quota, with no entry escaping
its folder (absolute paths, `..`, links), holding only the files an adapter is made of
(`ADAPTER_FILES`, at its top or in its one top folder, no sub-folders). It is unpacked into a
staging folder under TENANT_STORAGE_ROOT, moved into the tenant's own area under a random name
(nothing the tenant typed becomes part of a path an engine is given) only once the adapter
validates (`LoraAdapter.full_clean()`: base model shapes, tensor data, quota), and removed on
every refusal.
"""

from __future__ import annotations

import shutil
import stat
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import IO

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db.models import QuerySet

from serving_app import storage
from serving_app.models import BaseModel, Deployment, LoraAdapter
from tenants_app.models import Tenant

MAX_ENTRIES = 100
# What a LoRA adapter folder is made of. Pickled weights (adapter_model.bin) are refused: loading
# a pickle runs code. vLLM reads adapter_config.json and adapter_model.safetensors.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")
# Left out of the unpacked folder without complaint (what macOS's archiver adds).
IGNORED_ENTRIES = ("__MACOSX/", ".DS_Store")


def allowed_base_models(tenant: Tenant) -> QuerySet[BaseModel]:
    """Base models a tenant may register adapters for: those its deployments serve."""
    served = Deployment.objects.for_tenant(tenant)
    return BaseModel.objects.filter(deployments__in=served).distinct()


def register_upload(tenant: Tenant, base_model: BaseModel, name: str,
                    archive: IO[bytes]) -> LoraAdapter:
    """Unpack, validate and save the adapter; raise ValidationError (fields: "archive" and the
    model's own) having left nothing on disk. Host-path details in the errors are for platform
    admins only: callers show others `storage.public_errors()`."""
    staging = storage.staging_area() / uuid.uuid4().hex
    final: Path | None = None
    try:
        quota = storage.quota_bytes(tenant)
        used = LoraAdapter.objects.storage_used(tenant)
        root = unpack_adapter_archive(
            archive, staging, quota_left=quota - used,
            quota_message=lambda size: storage.quota_error(size, used, quota),
        )
        final = storage.tenant_area(tenant.pk) / uuid.uuid4().hex
        final.parent.mkdir(parents=True, exist_ok=True)
        root.rename(final)
        adapter = LoraAdapter(tenant=tenant, base_model=base_model, name=name, path=str(final))
        adapter.full_clean()
        adapter.save()
        return adapter
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


def _archive_error(message: str) -> ValidationError:
    return ValidationError({"archive": message})


def _adapter_entries(infos: list[zipfile.ZipInfo]) -> list[tuple[zipfile.ZipInfo, PurePosixPath]]:
    """The entries to unpack, each as (entry, path), after refusing anything that is not part
    of an adapter folder: only `ADAPTER_FILES`, at the top or all in one top folder."""
    entries: list[tuple[zipfile.ZipInfo, PurePosixPath]] = []
    for info in infos:
        relative = _entry_path(info)
        if relative is None:
            raise _archive_error(
                f"The entry {info.filename!r} points outside the adapter folder; "
                "archives with absolute paths or '..' are refused."
            )
        if stat.S_ISLNK(info.external_attr >> 16):
            raise _archive_error(f"The entry {info.filename!r} is a link; links are refused.")
        if info.filename.startswith(IGNORED_ENTRIES[0]) or relative.name == IGNORED_ENTRIES[1]:
            continue
        entries.append((info, relative))
    tops = {relative.parts[0] for info, relative in entries
            if len(relative.parts) > 1 or info.is_dir()}
    if len(tops) > 1 or (tops and any(len(r.parts) == 1 and not i.is_dir()
                                      for i, r in entries)):
        raise _archive_error(
            "The archive holds several folders; an adapter is one folder (or its files at "
            "the top of the archive)."
        )
    seen: set[str] = set()
    files = []
    allowed = ", ".join(ADAPTER_FILES)
    for info, relative in entries:
        depth = len(relative.parts) - (1 if tops else 0)
        if info.is_dir():
            if depth > 0:
                raise _archive_error(f"The archive holds a sub-folder {info.filename!r}; an "
                                     f"adapter folder holds only {allowed}.")
            continue
        if depth != 1:
            raise _archive_error(f"The entry {info.filename!r} lies in a sub-folder; an "
                                 f"adapter folder holds only {allowed}.")
        if relative.name not in ADAPTER_FILES:
            raise _archive_error(
                f"The archive holds {relative.name!r}, which is not part of an adapter: "
                f"only {allowed} are accepted (pickled .bin weights are refused)."
            )
        if relative.name in seen:
            raise _archive_error(f"The archive holds {relative.name} twice.")
        seen.add(relative.name)
        files.append((info, relative))
    return files


def unpack_adapter_archive(upload: IO[bytes], staging: Path, *, quota_left: int | None = None,
                           quota_message: Callable[[int], str] | None = None) -> Path:
    """Check and unpack a zipped adapter folder into `staging`; return the folder holding its
    files. Raises ValidationError (on the archive) with the reason. What the files may unpack
    to is the smaller of ADAPTER_UPLOAD_MAX_UNPACKED_BYTES and what is left of the quota; the
    sizes the archive declares are checked first, then the bytes really written (a declared
    size can lie)."""
    unpacked_limit = settings.ADAPTER_UPLOAD_MAX_UNPACKED_BYTES
    try:
        archive = zipfile.ZipFile(upload)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise _archive_error(f"Not a readable zip archive ({exc}).") from exc
    with archive:
        infos = archive.infolist()
        if len(infos) > MAX_ENTRIES:
            raise _archive_error(f"The archive holds more than {MAX_ENTRIES} entries.")
        entries = _adapter_entries(infos)
        declared = sum(info.file_size for info, _ in entries)

        def check_size(size: int) -> None:
            if size > unpacked_limit:
                raise _archive_error(
                    f"The archive unpacks to {size:,} bytes or more; the limit is "
                    f"{unpacked_limit:,}."
                )
            if quota_left is not None and size > quota_left:
                raise _archive_error(quota_message(size) if quota_message else
                                     "The tenant's storage quota is used up.")

        check_size(declared)
        root = staging  # the files go to its top, whatever folder held them in the archive
        root.mkdir(parents=True)
        written = 0
        try:
            for info, relative in entries:
                target = root / relative.name
                with archive.open(info) as source, target.open("xb") as out:
                    while chunk := source.read(1024 * 1024):
                        written += len(chunk)
                        check_size(written)
                        out.write(chunk)
        except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError) as exc:
            raise _archive_error(f"The archive is broken: {exc}.") from exc
    if not (root / "adapter_config.json").is_file():
        raise _archive_error(
            "The archive holds no adapter_config.json at its top (or in its one top folder): "
            "it is not a LoRA adapter folder."
        )
    return root
