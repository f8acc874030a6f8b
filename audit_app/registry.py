"""Which models are audited, and the receivers that record their changes.

Every model of every installed app is classified once, in its app's `AppConfig.ready()`:
`track(Model, ...)`, naming the fields the control plane writes (which are no change of their
own) and any secret beyond the usual names and the model's encrypted fields (secrets by their
type, `audit_app.encryption`), or `exclude(Model, reason)`. A model that is neither fails the
`audit_app.E001` system check, so a new model cannot slip past the log.

Why signals and not django-pghistory: pghistory records through PostgreSQL triggers into one
event table per model, while this console also runs on SQLite (the embedded default) and keeps
one log, the table tenant managers already read through the API. Signals see every ORM write
that sends them: saves, deletes (a queryset's too: with a receiver connected Django deletes row
by row) and many-to-many changes, from the admin, the API, the pages, tasks and a shell alike.
What they cannot see is `QuerySet.update()`; the model methods that use it (a conditional
update such as `Deployment.start()` or `ApiKey.revoke()`) call `recording.record()` themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from django.apps import apps
from django.db import models
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_delete, pre_save

from audit_app import encryption, recording
from audit_app.recording import EVENTS, POLICIES, Policy

EXCLUDED: dict[type[models.Model], str] = {}

# Where a receiver keeps what it read before the write, on the instance being written.
_BEFORE = "_audit_before"
_DELETED = "_audit_deleted"
_RELATED = "_audit_related"


def track(
    model: type[models.Model],
    *,
    events: Iterable[str] = EVENTS,
    ignore: Iterable[str] = (),
    secret: Iterable[str] = (),
    describe: Callable[[Any], str] | None = None,
    identify: Callable[[Any], object] | None = None,
    reason: str = "",
) -> None:
    """Audit `model`'s changes. `events` narrows which of create, update and delete are
    recorded, and then `reason` says why (docs/architecture.md lists these models)."""
    events = frozenset(events)
    if not events <= EVENTS or not events:
        raise ValueError(f"{model._meta.label}: events are some of {sorted(EVENTS)}")
    if events != EVENTS and not reason:
        raise ValueError(f"{model._meta.label}: say why only {sorted(events)} are audited")
    # A model's encrypted fields are its secrets (audit_app.encryption): never copied.
    policy = Policy(events=events, ignored=frozenset(ignore),
                    secret=frozenset(secret) | encryption.secret_fields(model), reason=reason)
    if describe is not None:
        policy = replace(policy, describe=describe)
    if identify is not None:
        policy = replace(policy, identify=identify)
    POLICIES[model] = policy
    uid = f"audit:{model._meta.label}"
    post_save.connect(partial(_saved, policy), sender=model, weak=False, dispatch_uid=uid)
    if "update" in events:
        pre_save.connect(partial(_saving, policy), sender=model, weak=False, dispatch_uid=uid)
        for m2m in model._meta.local_many_to_many:
            m2m_changed.connect(
                partial(_related, policy, model, m2m), sender=m2m.remote_field.through,
                weak=False, dispatch_uid=f"{uid}.{m2m.name}",
            )
    if "delete" in events:
        pre_delete.connect(partial(_deleting, policy), sender=model, weak=False, dispatch_uid=uid)
        post_delete.connect(partial(_deleted, policy), sender=model, weak=False, dispatch_uid=uid)


def exclude(model: type[models.Model], reason: str) -> None:
    """Leave `model` out of the audit log, for `reason` (docs/architecture.md lists them)."""
    if not reason:
        raise ValueError(f"{model._meta.label}: say why it is not audited")
    EXCLUDED[model] = reason


def unclassified() -> list[type[models.Model]]:
    """Installed models neither tracked nor excluded."""
    return [
        model for model in apps.get_models()
        if model not in POLICIES and model not in EXCLUDED
    ]


# -- receivers ----------------------------------------------------------------------------------
def _saving(policy: Policy, sender: type[models.Model], instance: models.Model,
            using: str | None = None, update_fields: Iterable[str] | None = None,
            **kwargs: Any) -> None:
    """Read the row as it is before an update (a save of a row that has a key)."""
    if instance.pk is None:
        return
    fields = set(update_fields) if update_fields is not None else None
    if fields is not None and all(policy.is_ignored(name) for name in fields):
        return  # the control plane's own fields only: nothing to record
    row = sender._base_manager.using(using).filter(pk=instance.pk).first()
    if row is not None:
        instance.__dict__[_BEFORE] = recording.snapshot(row, policy, fields)


def _saved(policy: Policy, sender: type[models.Model], instance: models.Model,
           created: bool = False, update_fields: Iterable[str] | None = None,
           **kwargs: Any) -> None:
    before = instance.__dict__.pop(_BEFORE, None)
    if created:
        if "create" in policy.events:
            recording.created(instance, policy)
    elif before is not None:
        fields = set(update_fields) if update_fields is not None else None
        recording.updated(instance, policy, before, fields)


def _deleting(policy: Policy, sender: type[models.Model], instance: models.Model,
              **kwargs: Any) -> None:
    instance.__dict__[_DELETED] = (
        recording.snapshot(instance, policy, many_to_many=True), policy.identify(instance)
    )


def _deleted(policy: Policy, sender: type[models.Model], instance: models.Model,
             **kwargs: Any) -> None:
    data, object_id = instance.__dict__.pop(_DELETED, ({}, instance.pk))
    recording.deleted(instance, policy, data, object_id)
    recording.forget_references(sender, instance.pk)


def _related(policy: Policy, owner: type[models.Model], m2m: models.ManyToManyField[Any, Any],
             sender: type[models.Model], instance: models.Model, action: str, reverse: bool,
             pk_set: set[Any] | None, **kwargs: Any) -> None:
    """A many-to-many change, from either side, recorded on the model that declares the field
    (a user's groups on the user, a deployment's tenants on the deployment)."""
    phase, _, _ = action.partition("_")
    scratch = instance.__dict__.setdefault(_RELATED, {})
    if phase == "pre":
        if not reverse:
            owner_ids = [instance.pk]
        elif pk_set is not None:
            owner_ids = list(pk_set)
        else:  # a related object's clear(): every owner that holds it
            owner_ids = list(sender._base_manager.filter(
                **{m2m.m2m_reverse_field_name(): instance.pk}
            ).values_list(f"{m2m.m2m_field_name()}_id", flat=True))
        scratch[(m2m.name, "owners")] = owner_ids
        for owner_id in owner_ids:
            scratch.setdefault((m2m.name, owner_id), recording.related_ids(owner_id, m2m))
        return
    owner_ids = scratch.pop((m2m.name, "owners"), [])
    owners = [instance] if not reverse else list(owner._base_manager.filter(pk__in=owner_ids))
    for obj in owners:
        before = scratch.pop((m2m.name, obj.pk), None)
        if before is not None:
            recording.related_changed(obj, policy, m2m.name, before,
                                      recording.related_ids(obj.pk, m2m))
