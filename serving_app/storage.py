"""Where model and adapter files may live on the hosts, and each tenant's share of the disk.

Tenants never name a host path. An adapter a tenant uploads is unpacked into that tenant's own
area, `TENANT_STORAGE_ROOT/tenant-<id>/<random>/` (by id, not slug: a slug can be renamed, the
folder cannot). Platform admins register base models, and adapters they provide, from folders
under `MODEL_ROOTS`. The rules, checked by the models' `clean()` (so the admin, the console, the
portal and the API refuse the same paths) after resolving symlinks:

- an adapter's folder lies in its own tenant's area, or under a model root;
- a base model's folder lies under a model root, never in the tenant storage area;
- a folder (or one inside it, or around it) that is another tenant's adapter, or a base model,
  is refused: nobody serves someone else's weights under their own name.

The resolved path is what gets stored, so what was checked is what the engines load.

A problem with the path itself (outside the roots, missing, taken) is a `host_path` error. Its
detail would tell a tenant user which folders exist on the host, so anyone but a platform admin
sees `GENERIC_PATH_ERROR` instead (`public_errors()`).

Files of a deleted adapter are removed once no engine still has the adapter, and only when
they lie in a tenant's area (`removable()`; the workflow is `AdapterFileRemoval` in models.py).
Nothing here reads the database.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError

GENERIC_PATH_ERROR = "This adapter's files cannot be used."
HOST_PATH = "host_path"  # the ValidationError code of a host-path problem


def storage_root() -> Path:
    return Path(settings.TENANT_STORAGE_ROOT).resolve()


def model_roots() -> list[Path]:
    return [Path(root).resolve() for root in settings.MODEL_ROOTS]


def tenant_area(tenant_id: int) -> Path:
    """The folder holding one tenant's uploaded files."""
    return storage_root() / f"tenant-{tenant_id}"


def staging_area() -> Path:
    """Where archives are unpacked before they are checked (same filesystem: moves are renames)."""
    return storage_root() / ".staging"


def _inside(path: Path, root: Path) -> bool:
    """True if `path` is strictly inside `root` (a root itself is not a model folder)."""
    return root in path.parents


def host_path_error(message: str) -> ValidationError:
    return ValidationError({"path": ValidationError(message, code=HOST_PATH)})


def resolve_folder(path_text: str) -> Path:
    """The folder a path names, symlinks resolved; `~` is never expanded."""
    path = Path(path_text)
    if not path.is_absolute():
        raise host_path_error("Must be an absolute path on the node hosts.")
    try:
        resolved = path.resolve()
    except (OSError, ValueError) as exc:  # a symlink loop, a NUL byte
        raise host_path_error(f"{path} cannot be resolved: {exc}.") from exc
    if not resolved.is_dir():
        raise host_path_error(f"{path} is not a folder.")
    return resolved


def check_model_path(path_text: str) -> Path:
    """A base model's folder: under a model root, not in tenant storage. Returns it resolved."""
    resolved = resolve_folder(path_text)
    if _inside(resolved, storage_root()) or resolved == storage_root():
        raise host_path_error(f"{resolved} lies in the tenant storage area; base models are "
                              "registered from the model roots.")
    roots = model_roots()
    if not any(_inside(resolved, root) for root in roots):
        raise host_path_error(
            f"{resolved} lies outside the model roots ({', '.join(map(str, roots))}; "
            "the MODEL_ROOTS setting)."
        )
    return resolved


def check_adapter_path(path_text: str, tenant_id: int | None) -> Path:
    """An adapter's folder: in its own tenant's area or under a model root. Returns it
    resolved. (Whose files it holds is the model's check: `LoraAdapter.clean()`.)"""
    resolved = resolve_folder(path_text)
    root = storage_root()
    if resolved == root or _inside(resolved, root):
        if tenant_id is None or not _inside(resolved, tenant_area(tenant_id)):
            raise host_path_error(f"{resolved} lies in another tenant's storage area.")
    elif not any(_inside(resolved, model_root) for model_root in model_roots()):
        raise host_path_error(
            f"{resolved} lies outside the tenant's storage area and the model roots "
            f"({', '.join(map(str, model_roots()))}; the MODEL_ROOTS setting)."
        )
    return resolved


def is_in_tenant_area(path: Path) -> bool:
    """Whether a resolved folder lies in the tenant storage area (an upload)."""
    return _inside(path, storage_root())


def overlaps(a: str | Path, b: str | Path) -> bool:
    """Whether two folders are the same, or one holds the other."""
    a, b = Path(a), Path(b)
    return a == b or a in b.parents or b in a.parents


def public_errors(exc: ValidationError, user: object) -> ValidationError:
    """The errors as `user` may see them: host-path details only for platform admins."""
    if getattr(user, "is_staff", False) or not hasattr(exc, "error_dict"):
        return exc
    errors: dict[str, list[ValidationError]] = {}
    for field, items in exc.error_dict.items():
        for item in items:
            if item.code == HOST_PATH:
                item = ValidationError(GENERIC_PATH_ERROR, code=HOST_PATH)
            if item.message not in (e.message for e in errors.get(field, [])):
                errors.setdefault(field, []).append(item)
    return ValidationError(errors)


# -- quota -------------------------------------------------------------------------------------
def quota_bytes(tenant: object) -> int:
    """The tenant's storage quota: its own setting, else TENANT_STORAGE_QUOTA_MB."""
    mib = getattr(tenant, "storage_quota_mb", None)
    if mib is None:
        mib = settings.TENANT_STORAGE_QUOTA_MB
    return int(mib) * 1024 * 1024


def quota_error(new_bytes: int, used: int, quota: int) -> str:
    return (
        f"These files take {new_bytes:,} bytes; the tenant's adapters' files already take "
        f"{used:,} of its {quota:,}-byte storage quota. Delete adapters or versions of its "
        "files it no longer needs, or ask a platform admin for a larger quota."
    )


# -- removal of a deleted adapter's files ------------------------------------------------------
def removable(path_text: str) -> Path | None:
    """The folder to delete for a deleted adapter: only a tenant's uploaded folder, resolved;
    None for anything else (files under MODEL_ROOTS belong to the platform, never removed)."""
    if not path_text:
        return None
    path = Path(path_text).resolve()
    root = storage_root()
    if not _inside(path, root) or path.parent == root:  # never a tenant's whole area
        return None
    return path


