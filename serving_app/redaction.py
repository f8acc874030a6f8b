"""What tenant users must not read: host filesystem paths and co-tenants' data.

Platform admins (staff) see every field. A tenant user reading a shared deployment sees only its
own tenants and adapters, and nothing about the host: no node, port, pid, log or error of an
instance, and no filesystem path (a base model's or adapter's `path`, or a path inside a stored
error message or audit entry). The API serializers and the portal call these helpers; the
rules live here so both apply the same ones.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from tenants_app.models import Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User
    from django.http import HttpRequest

PATH_PLACEHOLDER = "[path]"

# An absolute POSIX path (or a `~` one): a '/' or '~/' at the start of the text or after a
# space, quote, '=', '(', '[' or ','. A URL's path ("http://host:8000/v1/...") follows a letter,
# digit or ':' and is left alone.
_PATH = re.compile(r"""(?<![^\s'"=(\[,])~?/[^\s'"()\[\],;]+""")

# Audit-entry fields that hold host paths outright.
PATH_FIELDS = frozenset({"path", "log_path"})


def is_platform_admin(user: User | AnonymousUser | None) -> bool:
    return bool(user is not None and user.is_authenticated and user.is_staff)


def redact_paths(text: str) -> str:
    """`text` with every absolute filesystem path replaced by a placeholder."""
    if not text:
        return text
    return _PATH.sub(PATH_PLACEHOLDER, text)


def redact_value(value: Any) -> Any:
    """A JSON-ready value (an audit entry's changes) with paths redacted, path fields dropped."""
    if isinstance(value, str):
        return redact_paths(value)
    if isinstance(value, list):
        return [redact_value(item) for item in value]
    if isinstance(value, dict):
        return {
            key: redact_value(item) for key, item in value.items() if key not in PATH_FIELDS
        }
    return value


def visible_tenant_ids(request: HttpRequest) -> frozenset[int]:
    """Ids of the tenants the request's user belongs to, read once per request."""
    cached = getattr(request, "_visible_tenant_ids", None)
    if cached is None:
        cached = frozenset(
            Tenant.objects.for_user(request.user).values_list("pk", flat=True)
        )
        # Kept on the request itself, as Django keeps the request's user.
        vars(request)["_visible_tenant_ids"] = cached
    return cached
