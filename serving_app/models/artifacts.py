"""Content-addressed artifacts: a base model's or adapter's files as immutable versions.

An `Artifact` is a named series of `ArtifactVersion`s; a version is a manifest of files (path,
size, SHA-256), each file's content a `Blob` kept once by digest in the console's blob store
(ARTIFACT_STORE_ROOT). A version never changes once made (its `save()` refuses); a base model or
adapter points at one, and an instance pins the version it runs. `ArtifactImport` is the record
of bringing a version in (an upload in chunks, a node's folder, an S3 bucket, a Hugging Face
repository): its state, progress and error are what the pages show. `NodeCacheEntry` is what
one node's cache holds of a version, with the progress of its fetch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from django.core.exceptions import ValidationError
from django.db import models
from django.urls import reverse
from django.utils import timezone

from audit_app.encryption import EncryptedTextField
from serving_app import blobstore
from tenants_app.models import Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User


class Blob(models.Model):
    """A file's content, stored once in the blob store by its SHA-256 digest."""

    sha256 = models.CharField(max_length=64, primary_key=True)
    size = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.sha256


class ArtifactQuerySet(models.QuerySet["Artifact"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        """Platform admins read every artifact; a tenant's users read their tenants' adapter
        artifacts and the base models' (which everyone signed in reads)."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(
            models.Q(tenant__isnull=True) | models.Q(tenant__memberships__user=user)
        ).distinct()

    def for_tenant(self, tenant: Tenant) -> Self:
        return self.filter(tenant=tenant)


class Artifact(models.Model):
    """A named series of versions of a base model's or a tenant's adapter's files."""

    class Kind(models.TextChoices):
        MODEL = "model", "Base model"
        ADAPTER = "adapter", "LoRA adapter"

    name = models.SlugField(max_length=100)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="artifacts",
        help_text="The tenant an adapter's files belong to; empty for the platform's models.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ArtifactQuerySet.as_manager()

    class Meta:
        ordering = ["kind", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="unique_artifact_per_tenant"),
            models.UniqueConstraint(fields=["name"], condition=models.Q(tenant__isnull=True),
                                    name="unique_platform_artifact"),
            models.CheckConstraint(
                condition=models.Q(kind="model", tenant__isnull=True) | models.Q(kind="adapter"),
                name="model_artifacts_belong_to_the_platform"),
        ]

    def __str__(self) -> str:
        try:
            tenant = self.tenant if self.tenant_id else None
        except Tenant.DoesNotExist:  # deleted with its tenant, which went first in the cascade
            tenant = None
        return f"{tenant.slug}/{self.name}" if tenant is not None else self.name

    def get_absolute_url(self) -> str:
        return reverse("console:artifact-detail", args=[self.pk])

    def clean(self) -> None:
        if self.kind == self.Kind.MODEL and self.tenant_id:
            raise ValidationError({"tenant": "A base model's files belong to the platform: "
                                             "leave the tenant empty."})
        if self.kind == self.Kind.ADAPTER and not self.tenant_id:
            raise ValidationError({"tenant": "An adapter's files belong to a tenant: name it."})

    def latest(self) -> ArtifactVersion | None:
        return self.versions.order_by("-number").first()


class ArtifactVersionQuerySet(models.QuerySet["ArtifactVersion"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        """The versions of the artifacts the user may read."""
        return self.filter(artifact__in=Artifact.objects.for_user(user))


class ArtifactVersion(models.Model):
    """One immutable set of files of an artifact: never changed once saved."""

    class Source(models.TextChoices):
        UPLOAD = "upload", "Upload"
        NODE_FOLDER = "node_folder", "Folder on a node"
        S3 = "s3", "S3 bucket"
        HUGGINGFACE = "huggingface", "Hugging Face repository"
        CONSOLE_FOLDER = "console_folder", "Folder on the console host"

    artifact = models.ForeignKey(Artifact, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    digest = models.CharField(
        max_length=64, help_text="SHA-256 of the manifest: the same files give the same digest.")
    source = models.CharField(max_length=16, choices=Source.choices)
    source_detail = models.JSONField(default=dict, blank=True)
    total_bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ArtifactVersionQuerySet.as_manager()

    class Meta:
        ordering = ["artifact", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["artifact", "number"], name="unique_version_number"),
        ]

    def __str__(self) -> str:
        return f"{self.artifact} v{self.number}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise ValueError("An artifact version is immutable; make a new version instead.")
        super().save(*args, **kwargs)

    def get_absolute_url(self) -> str:
        return reverse("console:artifact-detail", args=[self.artifact_id]) + f"#v{self.number}"

    def manifest(self) -> list[dict[str, Any]]:
        return [{"path": f.path, "size": f.size, "sha256": f.blob_id}
                for f in self.files.order_by("path")]


class ArtifactFile(models.Model):
    """One file of a version: its path in the folder and its content."""

    version = models.ForeignKey(ArtifactVersion, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(max_length=500)
    size = models.PositiveBigIntegerField()
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="files")

    class Meta:
        ordering = ["version", "path"]
        constraints = [
            models.UniqueConstraint(fields=["version", "path"], name="unique_file_in_version"),
        ]

    def __str__(self) -> str:
        return f"{self.version}: {self.path}"


class ArtifactImportQuerySet(models.QuerySet["ArtifactImport"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        """As their artifacts: a tenant's users see their tenants' imports, staff every one
        (a base model's imports only staff: they may name buckets and host folders)."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(artifact__tenant__memberships__user=user).distinct()

    def for_tenant(self, tenant: Tenant) -> Self:
        return self.filter(artifact__tenant=tenant)


class ArtifactImport(models.Model):
    """Bringing one version in: its source, where it stands, and why it failed."""

    class State(models.TextChoices):
        WAITING = "waiting", "Waiting"  # an upload waits for its chunks; an import for a worker
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    artifact = models.ForeignKey(Artifact, on_delete=models.CASCADE, related_name="imports")
    source = models.CharField(max_length=16, choices=ArtifactVersion.Source.choices)
    detail = models.JSONField(default=dict, blank=True,
                              help_text="Where from: the bucket, repository, node folder.")
    credential = EncryptedTextField(
        blank=True, default="",
        help_text="The source's secret (an S3 secret access key, a Hugging Face token), "
                  "encrypted; never shown. Empty: the source's own credentials or none.")
    files = models.JSONField(default=list, blank=True,
                             help_text="An upload's announced files: path, size, sha256.")
    node = models.ForeignKey("serving_app.Node", null=True, blank=True,
                             on_delete=models.CASCADE, related_name="artifact_imports")
    state = models.CharField(max_length=8, choices=State.choices, default=State.WAITING)
    bytes_total = models.PositiveBigIntegerField(default=0)
    bytes_done = models.PositiveBigIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    version = models.ForeignKey(ArtifactVersion, null=True, blank=True,
                                on_delete=models.SET_NULL, related_name="imports")
    created_by = models.ForeignKey("auth.User", null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ArtifactImportQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.artifact} from {self.get_source_display()} ({self.state})"

    # Where a source's secret may be handed in `detail`; `save()` keeps it in the encrypted
    # `credential` instead (never in `detail`, which the pages, the API and the audit log show).
    CREDENTIAL_NAMES = ("secret_access_key", "token")

    def save(self, *args: Any, **kwargs: Any) -> None:
        if any(name in (self.detail or {}) for name in self.CREDENTIAL_NAMES):
            detail = dict(self.detail)
            given = [detail.pop(name) for name in self.CREDENTIAL_NAMES if name in detail]
            self.detail, self.credential = detail, next((c for c in given if c),
                                                        self.credential)
        super().save(*args, **kwargs)

    @property
    def tenant(self) -> Tenant | None:
        return self.artifact.tenant

    @property
    def percent(self) -> float:
        return 100.0 * self.bytes_done / self.bytes_total if self.bytes_total else 0.0

    def fail(self, error: str) -> None:
        ArtifactImport.objects.filter(pk=self.pk).exclude(state=self.State.DONE).update(
            state=self.State.FAILED, error=error, updated_at=timezone.now())
        self.state, self.error = self.State.FAILED, error


class NodeCacheEntry(models.Model):
    """What one node's cache holds of a version (written by that node's agent)."""

    class State(models.TextChoices):
        FETCHING = "fetching", "Fetching"
        READY = "ready", "Ready"
        FAILED = "failed", "Failed"

    node = models.ForeignKey("serving_app.Node", on_delete=models.CASCADE,
                             related_name="cache_entries")
    version = models.ForeignKey(ArtifactVersion, on_delete=models.CASCADE,
                                related_name="cache_entries")
    state = models.CharField(max_length=8, choices=State.choices, default=State.FETCHING)
    bytes_total = models.PositiveBigIntegerField(default=0)
    bytes_done = models.PositiveBigIntegerField(default=0)
    bytes_per_second = models.FloatField(default=0.0)
    error = models.TextField(blank=True, default="")
    last_used_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node", "version"]
        constraints = [
            models.UniqueConstraint(fields=["node", "version"], name="unique_cache_entry"),
        ]

    def __str__(self) -> str:
        return f"{self.version} on {self.node_id}"

    @property
    def percent(self) -> float:
        return 100.0 * self.bytes_done / self.bytes_total if self.bytes_total else 100.0

    @property
    def eta_seconds(self) -> float | None:
        if self.state != self.State.FETCHING or not self.bytes_per_second:
            return None
        return (self.bytes_total - self.bytes_done) / self.bytes_per_second


def version_files(version: ArtifactVersion) -> list[blobstore.FileEntry]:
    """A version's manifest as the blob store and node caches take it."""
    return [blobstore.FileEntry(f.path, f.size, f.blob_id) for f in version.files.all()]


def artifact_folder(version: ArtifactVersion) -> Path:
    """A folder on the console with the version's files, for reading its config and headers."""
    return blobstore.version_folder(version.digest, version_files(version))
