"""Sets the audit context for each request: the request (its user is read when an entry is
written) and the source, told by the request's path (`AUDIT_REQUEST_SOURCES`)."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponseBase

from audit_app.context import ChangeContext, Source, changes_in


def source_of(request: HttpRequest) -> str:
    """The source named for the longest matching path prefix; "console" for none."""
    sources: dict[str, str] = getattr(settings, "AUDIT_REQUEST_SOURCES", {})
    path = request.path_info
    matches = [prefix for prefix in sources if path.startswith(prefix)]
    return sources[max(matches, key=len)] if matches else Source.CONSOLE


class AuditContextMiddleware:
    """Every change a request makes is attributed to its user and source, and folded into one
    entry per object changed."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        with changes_in(ChangeContext(source=source_of(request), request=request)):
            return self.get_response(request)
