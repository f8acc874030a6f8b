"""Who is making changes, and from where: a context variable set for each request (by
`AuditContextMiddleware`), for each Celery task, or by `acting_as()` in a shell session.

The audit receivers read it when they write an entry, so no view, viewset, admin or task passes
the request along. Outside any of these (a management command, `manage.py shell`, start-up code)
the source is "shell" and there is no actor.

As in NetBox's change logging, the request itself is kept and its user read when an entry is
written: the management API authenticates its token inside the view, after every middleware
has run, and DRF then sets the user on the underlying request too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import models

if TYPE_CHECKING:
    from django.http import HttpRequest


class Source(models.TextChoices):
    """Where a change came from (the entry's `via`)."""

    CONSOLE = "console", "web console"
    PORTAL = "portal", "tenant portal"
    API = "api", "management API"
    ADMIN = "admin", "Django admin"
    TASK = "task", "background task"
    SHELL = "shell", "shell or management command"
    # Entries recorded before the console and the portal were told apart.
    UI = "ui", "console or portal"


@dataclass
class ChangeContext:
    """One unit of changes: a request, a task, or an `acting_as()` block.

    Within a context that folds (`fold`), every change to one object becomes one entry: a
    second save, and the many-to-many changes that follow a save, update the entry the first
    one wrote (`pending`, keyed by object). Without one, each change is its own entry.
    """

    source: str
    request: HttpRequest | None = None
    user: Any = None
    fold: bool = True
    pending: dict[tuple[str, str], Any] = field(default_factory=dict)

    @property
    def actor(self) -> Any:
        """The signed-in user making the change, or None (the system)."""
        user = getattr(self.request, "user", None) if self.request is not None else self.user
        return user if user is not None and user.is_authenticated else None

    @property
    def remote_addr(self) -> str | None:
        if self.request is None:
            return None
        return self.request.META.get("REMOTE_ADDR") or None


# Outside any request, task or `acting_as()`: nothing to fold into, nobody to name.
_NO_CONTEXT = ChangeContext(source=Source.SHELL, fold=False)
_current: ContextVar[ChangeContext | None] = ContextVar("audit_change_context", default=None)


def current() -> ChangeContext:
    return _current.get() or _NO_CONTEXT


def enter(context: ChangeContext) -> Token[ChangeContext | None]:
    return _current.set(context)


def leave(token: Token[ChangeContext | None]) -> None:
    _current.reset(token)


@contextmanager
def changes_in(context: ChangeContext) -> Iterator[ChangeContext]:
    token = enter(context)
    try:
        yield context
    finally:
        leave(token)


def acting_as(user: Any, source: str = Source.SHELL) -> Any:
    """Record the changes made inside the block as `user`'s (in a shell session or a script):
    `with acting_as(admin): tenant.save()`."""
    return changes_in(ChangeContext(source=source, user=user))


# Celery tasks: one context per task run, so the changes a task makes are folded and attributed
# to "task" (connected to Celery's task_prerun/task_postrun in `AuditAppConfig.ready()`).
_task_tokens: dict[str, Token[ChangeContext | None]] = {}


def task_started(task_id: str | None = None, **kwargs: Any) -> None:
    if task_id is not None:
        _task_tokens[task_id] = enter(ChangeContext(source=Source.TASK))


def task_finished(task_id: str | None = None, **kwargs: Any) -> None:
    token = _task_tokens.pop(task_id, None) if task_id is not None else None
    if token is not None:
        try:
            leave(token)
        except ValueError:  # finished in another context than it started: nothing to restore
            _current.set(None)
