"""How a change becomes an entry: snapshots and diffs of an object's fields, with secrets never
copied, and one entry per object changed in a request, task or `acting_as()` block.

The receivers in `audit_app.registry` call `created()`, `updated()`, `related_changed()` and
`deleted()`; a model method whose write sends no signal (a conditional `QuerySet.update()`) or
that is an action rather than a field change calls `record()` itself, with the action's name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models

from audit_app import context

if TYPE_CHECKING:
    from audit_app.models import AuditLog

EVENTS = frozenset({"create", "update", "delete"})
# Never copied into an entry, whichever model has them. `invitee`: the user an invitation's
# text resolved to, which tenant admins reading their audit log must not learn (it would tell
# them the username exists).
SECRET_FIELDS = frozenset({"password", "secret", "secret_hash", "cache_secret", "invitee"})
# What a changed secret reads as, before and after.
SECRET_MARK = "(secret)"
# Changed by every save; never a change of its own.
IGNORED_FIELDS = frozenset({"updated_at"})
# What a change or an operator action changed, {field: [before, after]}: an entry's changes.
Changes = dict[str, list[Any]]


def _label(obj: models.Model) -> str:
    return str(obj)


def _pk(obj: models.Model) -> object:
    return obj.pk


@dataclass(frozen=True)
class Policy:
    """How one model is audited.

    `events`: which of create, update and delete leave entries. `ignored`: fields the control
    plane writes (heartbeats, readings, last errors), neither copied nor a change on their own.
    `secret`: fields never copied, beyond `SECRET_FIELDS`. `describe` and `identify` give the
    entry's `object_repr` and `object_id` (for a model whose `str()` or key is a secret).
    """

    events: frozenset[str] = EVENTS
    ignored: frozenset[str] = frozenset()
    secret: frozenset[str] = frozenset()
    describe: Callable[[models.Model], str] = _label
    identify: Callable[[models.Model], object] = _pk
    reason: str = ""

    def is_secret(self, name: str) -> bool:
        return name in SECRET_FIELDS or name in self.secret

    def is_ignored(self, name: str) -> bool:
        return name in IGNORED_FIELDS or name in self.ignored


# Filled by `audit_app.registry.track()`: how each audited model is recorded.
POLICIES: dict[type[models.Model], Policy] = {}


@dataclass(frozen=True)
class Hidden:
    """A secret's value inside a snapshot: comparable (a digest), never written out."""

    digest: str


def _plain(value: Any) -> Any:
    """JSON-ready data."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, models.Model):
        return value.pk
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    return DjangoJSONEncoder().default(value)


def _hidden(value: Any) -> Hidden:
    return Hidden(hashlib.sha256(repr(value).encode()).hexdigest())


def snapshot(obj: models.Model, policy: Policy, fields: Collection[str] | None = None,
             many_to_many: bool = False) -> dict[str, Any]:
    """The object's audited field values (only `fields` when given); secrets as `Hidden`."""
    data: dict[str, Any] = {}
    for f in obj._meta.concrete_fields:
        if fields is not None and f.name not in fields and f.attname not in fields:
            continue
        if policy.is_ignored(f.name):
            continue
        value = getattr(obj, f.attname)
        data[f.name] = _hidden(value) if policy.is_secret(f.name) else _plain(value)
    if many_to_many and obj.pk is not None:
        for m2m in obj._meta.many_to_many:
            if not policy.is_ignored(m2m.name):
                data[m2m.name] = related_ids(obj.pk, m2m)
    return data


def related_ids(owner_pk: Any, m2m: models.ManyToManyField[Any, Any]) -> list[Any]:
    """The ids the owner's many-to-many field holds, read from its through table."""
    through = cast("type[models.Model]", m2m.remote_field.through)
    source, target = m2m.m2m_field_name(), m2m.m2m_reverse_field_name()
    ids = through._base_manager.filter(**{source: owner_pk}).values_list(f"{target}_id", flat=True)
    return sorted(_plain(list(ids)), key=str)


def public(data: dict[str, Any]) -> dict[str, Any]:
    """A snapshot as stored: secrets left out."""
    return {name: value for name, value in data.items() if not isinstance(value, Hidden)}


def diff(before: dict[str, Any], after: dict[str, Any]) -> Changes:
    """{field: [before, after]} for the fields that changed; a secret reads `SECRET_MARK`."""
    return {
        name: [_shown(before.get(name)), _shown(value)]
        for name, value in after.items()
        if name in before and before[name] != value
    }


def _shown(value: Any) -> Any:
    return SECRET_MARK if isinstance(value, Hidden) else value


# -- entries ----------------------------------------------------------------------------------
def _log() -> type[AuditLog]:
    # By name: this module is imported by the apps' AppConfig modules, before models exist.
    return apps.get_model("audit_app", "AuditLog")


def _tenant_id(obj: models.Model, deleting: bool = False) -> Any:
    """The tenant the object belongs to (itself for a tenant), so its managers see the entry.

    A row deleted in its tenant's cascade after the tenant itself (the collector's order where
    RESTRICT links join the cascade) names no tenant: its entry would point at a row gone when
    the transaction commits. Only a deletion can come after its tenant's, so only a deletion
    asks whether the tenant is still there."""
    tenant_model = _log()._meta.get_field("tenant").related_model
    if isinstance(obj, cast(type, tenant_model)):
        return obj.pk
    for f in obj._meta.concrete_fields:
        if f.is_relation and f.related_model is tenant_model:
            tenant_id = getattr(obj, f.attname)
            if deleting and tenant_id is not None and not cast(
                    Any, tenant_model)._base_manager.filter(pk=tenant_id).exists():
                return None
            return tenant_id
    return None


def _write(action: str, obj: models.Model, policy: Policy, changes: dict[str, Any],
           object_id: object = None) -> AuditLog:
    ctx = context.current()
    actor = ctx.actor
    return _log().objects.create(
        actor=actor,
        actor_label=actor.get_username() if actor is not None else "system",
        action=action,
        object_type=obj._meta.label,
        object_id=str(policy.identify(obj) if object_id is None else object_id)[:64],
        object_repr=policy.describe(obj)[:200],
        tenant_id=_tenant_id(obj, deleting=action == "delete"),
        changes=changes,
        via=ctx.source,
        remote_addr=ctx.remote_addr,
    )


@dataclass
class _Pending:
    """An entry written in this context that later changes of its object fold into."""

    entry_id: int
    action: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)

    def changes(self) -> dict[str, Any]:
        if self.action == "create":
            return public(self.after)
        return diff(self.before, self.after)


def _key(obj: models.Model, policy: Policy) -> tuple[str, str]:
    return obj._meta.label, str(policy.identify(obj))


def _store(obj: models.Model, policy: Policy, pending: _Pending) -> None:
    """Write the folded entry again (or anew, if a rolled-back savepoint took it away)."""
    changes = pending.changes()
    log = _log()
    if not changes:
        log.objects.filter(pk=pending.entry_id).delete()
        context.current().pending.pop(_key(obj, policy), None)
        return
    updated = log.objects.filter(pk=pending.entry_id).update(
        changes=changes, object_repr=policy.describe(obj)[:200])
    if not updated:
        pending.entry_id = _write(pending.action, obj, policy, changes).pk


def created(obj: models.Model, policy: Policy) -> None:
    after = snapshot(obj, policy)
    entry = _write("create", obj, policy, public(after))
    ctx = context.current()
    if ctx.fold:
        ctx.pending[_key(obj, policy)] = _Pending(entry.pk, "create", after=after)


def updated(obj: models.Model, policy: Policy, before: dict[str, Any],
            fields: Collection[str] | None = None) -> None:
    """Record what a save changed (nothing when it changed nothing audited)."""
    after = snapshot(obj, policy, fields)
    changed = {name: value for name, value in after.items()
               if name in before and before[name] != value}
    if changed:
        _fold(obj, policy, {name: before[name] for name in changed}, changed)


def related_changed(obj: models.Model, policy: Policy, name: str, before: list[Any],
                    after: list[Any]) -> None:
    """A many-to-many change, folded into the owner's entry."""
    if before != after:
        _fold(obj, policy, {name: before}, {name: after})


def _fold(obj: models.Model, policy: Policy, before: dict[str, Any],
          after: dict[str, Any]) -> None:
    ctx = context.current()
    pending = ctx.pending.get(_key(obj, policy)) if ctx.fold else None
    if pending is None:
        pending = _Pending(0, "update", dict(before), dict(after))
        pending.entry_id = _write("update", obj, policy, pending.changes()).pk
        if ctx.fold:
            ctx.pending[_key(obj, policy)] = pending
        return
    for name, value in before.items():
        pending.before.setdefault(name, value)
    pending.after.update(after)
    _store(obj, policy, pending)


def deleted(obj: models.Model, policy: Policy, data: dict[str, Any], object_id: object) -> None:
    context.current().pending.pop(_key(obj, policy), None)
    _write("delete", obj, policy, public(data), object_id=object_id)


def forget_references(model: type[models.Model], pk: Any) -> None:
    """Entries naming a row deleted in this transaction (a tenant, the actor) stop naming it, as
    older entries did through SET_NULL: entries written during its cascade would otherwise
    point at a row that no longer exists when the transaction commits."""
    log = _log()
    for f in log._meta.concrete_fields:
        if f.is_relation and f.related_model is model._meta.concrete_model:
            log.objects.filter(**{f.attname: pk}).update(**{f.attname: None})


def record(action: str, obj: models.Model, changes: dict[str, Any] | None = None) -> AuditLog:
    """An entry for an action (`start`, `revoke`, `accept`...) made by a model method through
    a conditional `QuerySet.update()`, which sends no signal: the method calls this itself."""
    policy = POLICIES.get(cast("type[models.Model]", obj._meta.concrete_model), Policy())
    return _write(action, obj, policy, {k: _plain(v) for k, v in (changes or {}).items()})

