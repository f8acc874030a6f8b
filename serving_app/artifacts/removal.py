"""Deleting artifact versions and whole artifacts: only what nothing needs, their blobs with them.

A version is needed while
- a base model or an adapter points at it (it serves under that name);
- an instance that is not stopped pins it (its node runs, stages or stops those files);
- a deployment's applied revision pins it, or a revision it would return to: the one its active
  rollout started from, or the one its last finished rollout started from (`Deployment.
  rollback`).
What needs it is named (`needed_by`) and nothing is deleted. Whatever else names the version
keeps its history without it: a stopped instance's and an older revision's `model_version`
becomes empty (`on_delete=SET_NULL`).

Deleting frees the console's copy: each blob that no other version's file holds goes, its row in
the transaction and its file in the blob store once that commits. A node's cache keeps its copy
until its quota evicts it, least recently used first (`artifacts.cache`): no engine can be
started on it again, because placement reads the files from the console.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Q, QuerySet, RestrictedError

from audit_app import recording
from serving_app import blobstore
from serving_app.models import (
    Artifact,
    ArtifactVersion,
    BaseModel,
    Blob,
    Deployment,
    Instance,
    LoraAdapter,
    Rollout,
)

if TYPE_CHECKING:
    from django.db.models import Model


@dataclass
class Needs:
    """What needs some versions, by kind; empty when they can go."""

    base_models: list[BaseModel] = field(default_factory=list)
    adapters: list[LoraAdapter] = field(default_factory=list)
    deployments: list[Deployment] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.base_models or self.adapters or self.deployments)

    def describe(self) -> list[str]:
        """One line per kind, for an API error or a page."""
        lines = []
        for label, objects in (("base models", self.base_models),
                               ("adapters", self.adapters),
                               ("deployments", self.deployments)):
            if objects:
                lines.append(f"{label}: " + ", ".join(str(o) for o in objects))
        return lines

    def as_data(self) -> dict[str, list[dict[str, Any]]]:
        def rows(objects: Iterable[Model]) -> list[dict[str, Any]]:
            return [{"id": o.pk, "name": str(o)} for o in objects]

        return {"base_models": rows(self.base_models), "adapters": rows(self.adapters),
                "deployments": rows(self.deployments)}


class InUse(Exception):
    """The versions are needed: `needs` says by what."""

    def __init__(self, what: str, needs: Needs) -> None:
        self.needs = needs
        super().__init__(f"{what} cannot be deleted while these need it: "
                         + "; ".join(needs.describe()) + ".")


def needed_by(versions: QuerySet[ArtifactVersion]) -> Needs:
    """What needs any of `versions` (the module docstring's rules)."""
    ids = set(versions.values_list("pk", flat=True))
    if not ids:
        return Needs()
    revision_pins = Q(applied_revision__model_version__in=ids) | Q(
        rollouts__state__in=Rollout.ACTIVE_STATES,
        rollouts__from_revision__model_version__in=ids) | Q(
        rollouts__state__in=Rollout.ACTIVE_STATES, rollouts__to_revision__model_version__in=ids)
    deployments = set(Deployment.objects.filter(revision_pins).values_list("pk", flat=True))
    deployments |= set(Instance.objects.filter(model_version__in=ids).exclude(
        state__in=Instance.TERMINAL_STATES).values_list("deployment_id", flat=True))
    for deployment in Deployment.objects.exclude(pk__in=deployments).filter(
            rollouts__from_revision__model_version__in=ids).distinct():
        if _rollback_target_version(deployment) in ids:
            deployments.add(deployment.pk)
    return Needs(
        base_models=list(BaseModel.objects.filter(artifact_version__in=ids).order_by("name")),
        adapters=list(LoraAdapter.objects.filter(artifact_version__in=ids)
                      .select_related("tenant").order_by("tenant__slug", "name")),
        deployments=list(Deployment.objects.filter(pk__in=deployments).order_by("name")),
    )


def bytes_only_in(versions: QuerySet[ArtifactVersion]) -> int:
    """What deleting `versions` would free in the console's blob store: the blobs no other
    version holds."""
    held = Blob.objects.filter(files__version__in=versions).distinct()
    shared = Blob.objects.filter(files__version__in=ArtifactVersion.objects.exclude(
        pk__in=versions.values("pk"))).values("sha256")
    return sum(held.exclude(sha256__in=shared).values_list("size", flat=True))


def _rollback_target_version(deployment: Deployment) -> int | None:
    """The artifact version of the revision a rollback of the deployment returns to."""
    last = (Rollout.objects.filter(deployment=deployment, state=Rollout.State.SUCCEEDED,
                                   to_revision_id=deployment.applied_revision_id,
                                   from_revision__isnull=False)
            .select_related("from_revision").first())
    if last is None or last.from_revision is None:
        return None
    return last.from_revision.model_version_id


def delete_version(version: ArtifactVersion, *, drop_empty_artifact: bool = False) -> int:
    """Delete one version of an artifact (InUse when something needs it); the bytes freed in
    the console's blob store. `drop_empty_artifact`: the artifact goes too, in the same
    transaction, when this was its last version (the portal's tenant files: a name with no
    files left is nothing to keep)."""
    with transaction.atomic():
        Artifact.objects.select_for_update().get(pk=version.artifact_id)
        versions = ArtifactVersion.objects.filter(pk=version.pk)
        needs = needed_by(versions)
        if needs:
            raise InUse(f"Version {version.number} of {version.artifact}", needs)
        freed = _delete(f"Version {version.number} of {version.artifact}", versions,
                        versions.delete)
        recording.record("delete_version", version.artifact,
                         {"version": [version.number, None], "bytes_freed": [None, freed]})
        if drop_empty_artifact and not ArtifactVersion.objects.filter(
                artifact_id=version.artifact_id).exists():
            version.artifact.delete()
    return freed


def delete_artifact(artifact: Artifact) -> int:
    """Delete an artifact with every version (InUse when something needs one of them); the
    bytes freed in the console's blob store. The delete is audited like any other."""
    with transaction.atomic():
        Artifact.objects.select_for_update().get(pk=artifact.pk)
        versions = ArtifactVersion.objects.filter(artifact=artifact)
        needs = needed_by(versions)
        if needs:
            raise InUse(f"{artifact}", needs)
        return _delete(f"{artifact}", versions, artifact.delete)


def _delete(what: str, versions: QuerySet[ArtifactVersion], delete: Callable[[], Any]) -> int:
    """Run `delete` (inside the caller's transaction), then drop the blobs no other version
    holds any more; their files leave the store once the transaction commits."""
    digests = set(Blob.objects.filter(files__version__in=versions).values_list("sha256",
                                                                                flat=True))
    try:
        with transaction.atomic():
            delete()
    except RestrictedError as exc:  # a model or adapter pointed at it since `needed_by`
        raise InUse(what, needed_by(versions)) from exc
    orphans = Blob.objects.filter(sha256__in=digests, files__isnull=True)
    gone = dict(orphans.values_list("sha256", "size"))
    Blob.objects.filter(sha256__in=gone).delete()
    store = blobstore.console_store()
    transaction.on_commit(lambda: _unlink(store, gone))
    return sum(gone.values())


def _unlink(store: blobstore.BlobStore, digests: Iterable[str]) -> None:
    for digest in digests:
        store.path(digest).unlink(missing_ok=True)
