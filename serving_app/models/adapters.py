"""Tenants' LoRA adapters, each for one base model, and the removal of a deleted adapter's files
once no engine can still read them.
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ValidationError
from django.db import models
from django.urls import reverse
from django.utils import timezone

from audit_app import encryption
from serving_app import lifecycle, storage
from serving_app.modelfiles import (
    AdapterInfo,
    ModelFilesError,
    expected_module_shapes,
    read_adapter,
)
from serving_app.models.artifacts import (
    Artifact,
    ArtifactImport,
    ArtifactVersion,
    artifact_folder,
)
from serving_app.models.basemodels import LEGACY_PATH_LABEL, BaseModel, path_error
from serving_app.models.instances import Instance
from serving_app.models.nodes import Node
from tenants_app.models import Tenant, TenantOwnedQuerySet

# How long an upload under way keeps its announced size reserved against its tenant's quota
# without a byte arriving; past it the upload is abandoned (`sources.expire_abandoned_uploads`).
UPLOAD_RESERVED_FOR = timedelta(days=1)


class LoraAdapterQuerySet(TenantOwnedQuerySet["LoraAdapter"]):
    def storage_used(self, tenant: Tenant) -> int:
        """Bytes the tenant's files take against its storage quota: the adapters uploaded as
        archives to a host folder (`size_bytes`, read from their files when registered), every
        version of the tenant's artifacts (`total_bytes`: a version's files count once they are
        announced, whether or not an adapter serves them), and the uploads under way (their
        announced size; one that moved in the last day: an older one counts as abandoned).
        What the portal shows; uploads beyond it are refused."""
        legacy = self.filter(tenant=tenant).exclude(path="").aggregate(
            total=models.Sum("size_bytes"))["total"] or 0
        versions = ArtifactVersion.objects.filter(artifact__tenant=tenant).aggregate(
            total=models.Sum("total_bytes"))["total"] or 0
        uploading = ArtifactImport.objects.filter(
            artifact__tenant=tenant, version__isnull=True,
            state__in=[ArtifactImport.State.WAITING, ArtifactImport.State.RUNNING],
            updated_at__gte=timezone.now() - UPLOAD_RESERVED_FOR,
        ).aggregate(total=models.Sum("bytes_total"))["total"] or 0
        return int(legacy) + int(versions) + int(uploading)

    def with_tenant(self, *related: str) -> LoraAdapterQuerySet:
        """With their tenant (and `related`) joined, less the tenant's secret columns, which a
        node's database role may not read: what a node agent's queries use."""
        return self.select_related("tenant", *related).defer(
            *(f"tenant__{name}" for name in sorted(encryption.secret_fields(Tenant))))


class LoraAdapter(models.Model):
    """A tenant's LoRA adapter for one base model; rank and targets come from its files."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="adapters")
    name = models.SlugField(max_length=100, help_text="Public name, unique within the tenant.")
    path = models.CharField(
        max_length=500, blank=True,
        help_text="Legacy: a folder at this same path on every node host. Empty when the "
                  "adapter comes from an artifact version.")
    artifact_version = models.ForeignKey(
        ArtifactVersion, null=True, blank=True, on_delete=models.RESTRICT, related_name="adapters",
        help_text="The files' version: each node serving the tenant fetches it into its cache.")
    rank = models.PositiveIntegerField(
        null=True, blank=True, help_text="Expected rank; read from adapter_config.json if empty."
    )
    target_modules = models.JSONField(default=list, editable=False)
    size_bytes = models.PositiveBigIntegerField(default=0, editable=False)
    last_error = models.TextField(blank=True, default="", editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    serving_requested_at = models.DateTimeField(
        null=True, blank=True, editable=False,
        help_text="When the tenant asked for it to be served (pending until a platform admin "
                  "attaches it to a deployment).")

    objects = LoraAdapterQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__slug", "name"]
        verbose_name = "LoRA adapter"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="unique_adapter_per_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id and self.tenant.slug}/{self.name}"

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:loraadapter-detail", args=[self.pk])

    def request_serving(self) -> bool:
        """The tenant asks a platform admin to attach it to a deployment: pending until one
        does (`Deployment.attach_adapter()` clears it). False when it is served already or
        was asked for before."""
        if self.serving_requested_at is not None or self.deployments.exists():
            return False
        self.serving_requested_at = timezone.now()
        self.save(update_fields=["serving_requested_at"])  # audited (the model's signals)
        return True

    @property
    def engine_name(self) -> str:
        """The name the engine knows it by; tenant-qualified so tenants never collide."""
        return f"{self.tenant.slug}--{self.name}"

    def check_path(self) -> Path:
        """The adapter's folder, resolved, if this tenant may use it (serving_app/storage.py):
        in its own storage area or under a model root, and neither a base model's folder nor
        another tenant's adapter's. Raises a `host_path` ValidationError on "path" otherwise."""
        resolved = storage.check_adapter_path(self.path, self.tenant_id)
        for model in BaseModel.objects.only("name", "path"):
            if model.path and storage.overlaps(resolved, model.path):
                raise storage.host_path_error(
                    f"{resolved} holds the files of the base model {model.name}."
                )
        others = LoraAdapter.objects.exclude(tenant_id=self.tenant_id).select_related("tenant")
        for other in others.only("path", "name", "tenant__slug"):
            if other.path and storage.overlaps(resolved, other.path):
                raise storage.host_path_error(
                    f"{resolved} holds the files of {other}, an adapter of another tenant."
                )
        return resolved

    @property
    def source_label(self) -> str:
        """Where the engines get the files: the artifact version, or the legacy host path."""
        return str(self.artifact_version) if self.artifact_version_id else LEGACY_PATH_LABEL

    def _artifact_info(self) -> AdapterInfo:
        version = self.artifact_version
        assert version is not None
        artifact = version.artifact
        if artifact.kind != Artifact.Kind.ADAPTER or artifact.tenant_id != self.tenant_id:
            raise ValidationError({"artifact_version": f"{version} is not an adapter artifact "
                                                       "of this tenant."})
        try:
            return read_adapter(str(artifact_folder(version)))
        except ModelFilesError as exc:
            raise ValidationError({"artifact_version": str(exc)}) from exc

    def clean(self) -> None:
        if self.artifact_version_id:
            info = self._artifact_info()
            self.path = ""
            # Its files count against the quota since their upload (`storage_used`).
            self._check_info(info, counts_against_quota=False)
            return
        if not self.path:
            raise ValidationError({"path": "Give an artifact version, or (legacy) a folder "
                                           "at the same path on every node host."})
        resolved = self.check_path()
        try:
            info = read_adapter(str(resolved))
        except ModelFilesError as exc:
            raise path_error(exc) from exc
        self.path = str(resolved)  # what was checked is what the engines load
        self._check_info(info, counts_against_quota=self._state.adding
                         and storage.is_in_tenant_area(resolved))

    def _check_info(self, info: AdapterInfo, *, counts_against_quota: bool) -> None:
        """The checks on what the files hold: quota, rank, shapes against the base model."""
        if counts_against_quota and self.tenant_id:
            # An upload takes the tenant's own disk: its quota applies.
            quota = storage.quota_bytes(self.tenant)
            used = LoraAdapter.objects.storage_used(self.tenant)
            if used + info.size_bytes > quota:
                raise ValidationError({"path": storage.quota_error(info.size_bytes, used, quota)})
        if self.rank is not None and self.rank != info.rank:
            raise ValidationError(
                {"rank": f"The adapter's files have rank {info.rank}, not {self.rank}."}
            )
        base = self.base_model if self.base_model_id else None
        if base is not None and base.hidden_size:
            expected = expected_module_shapes(base)
            mismatched = sorted(
                f"{module} {shape[0]}x{shape[1]} (base: {expected[module][0]}x"
                f"{expected[module][1]})"
                for module, shapes in info.module_shapes.items() if module in expected
                for shape in shapes if shape != expected[module] and shape[1]
            )
            if mismatched:
                raise ValidationError({
                    "base_model": (
                        f"This adapter was trained for another base model than {base.name}: "
                        f"its layer shapes do not match ({'; '.join(mismatched[:3])})."
                    )
                })
        self.rank = info.rank
        self.target_modules = info.target_modules
        self.size_bytes = info.size_bytes

    def release_files(self) -> None:
        """Queue the removal of a deleted adapter's uploaded files (nothing for files outside
        the tenants' storage areas), which `AdapterFileRemoval.objects.remove_released()` makes
        once no engine has them. Called by the app's post_delete receiver, so a deletion
        through the tenant's cascade is covered too.

        An adapter from an artifact version has no files on the console's host to remove: its
        version's copies in the node caches go instead, each node dropping it once none of its
        engines has the adapter (`remove_released()` asks them)."""
        if self.artifact_version_id:
            digest = ArtifactVersion.objects.filter(pk=self.artifact_version_id).values_list(
                "digest", flat=True).first()
            if digest:
                AdapterFileRemoval.objects.create(
                    tenant_id_at_deletion=self.tenant_id, engine_name=self.engine_name,
                    version_digest=digest)
                lifecycle.adapter_files_released()
            return
        if storage.removable(self.path) is None:
            return
        AdapterFileRemoval.objects.create(
            tenant_id_at_deletion=self.tenant_id, engine_name=self.engine_name, path=self.path,
        )
        lifecycle.adapter_files_released()


class AdapterFileRemovalQuerySet(models.QuerySet["AdapterFileRemoval"]):
    def remove_released(self) -> int:
        """Remove the files of deleted adapters that no engine has any more; how many went.

        Runs after the deleting transaction commits and again in every reconcile round, so
        files still loaded in an engine go as soon as its node agent has unloaded the adapter
        (the reconciler asks it to once the adapter left the deployment). Idempotent.
        """
        removed = 0
        for record in self.filter(removed_at__isnull=True):
            if record.still_in_use():
                continue
            if record.version_digest:
                removed += record.free_node_caches()
                continue
            folder = storage.removable(record.path)
            if folder is not None and LoraAdapter.objects.filter(path=record.path).exists():
                folder = None  # registered again since (by a platform admin): keep it
            if folder is not None and folder.exists():
                try:
                    shutil.rmtree(folder)
                except FileNotFoundError:
                    pass  # a concurrent round removed it first
                except OSError as exc:
                    AdapterFileRemoval.objects.filter(pk=record.pk).update(
                        last_error=f"Could not remove the files: {exc}")
                    continue
            removed += AdapterFileRemoval.objects.filter(
                pk=record.pk, removed_at__isnull=True
            ).update(removed_at=timezone.now(), last_error="")
        return removed


class AdapterFileRemoval(models.Model):
    """The files of a deleted adapter, waiting until no engine can still read them.

    Deleting an adapter (through the API, the portal, the admin, or with its tenant) records
    one of these; the files go once `still_in_use()` is false. Only folders in the tenant
    storage area are ever removed: an adapter registered from a model root leaves its files,
    which belong to the platform.
    """

    tenant_id_at_deletion = models.BigIntegerField(null=True, blank=True)
    engine_name = models.CharField(max_length=220)
    path = models.CharField(max_length=500, blank=True, default="")
    version_digest = models.CharField(
        max_length=64, blank=True, default="",
        help_text="An adapter from an artifact version: the version whose copies in the node "
                  "caches go (no host path to remove).")
    nodes_asked_at = models.DateTimeField(
        null=True, blank=True, help_text="When the nodes holding the version were last asked "
                                         "to drop it from their caches.")
    requested_at = models.DateTimeField(auto_now_add=True)
    removed_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")

    objects = AdapterFileRemovalQuerySet.as_manager()

    class Meta:
        ordering = ["-requested_at"]

    def __str__(self) -> str:
        return f"{self.engine_name} ({self.path})"

    def still_in_use(self) -> bool:
        """Whether an engine may still read the files.

        A ready, unhealthy or draining engine has the adapter while its instance lists it in
        `loaded_adapters` (set when the engine became ready, changed by each runtime load and
        unload). A starting or stopping engine was given its adapters on the command line,
        which holds their paths. vLLM reads an adapter's files again when it was evicted from
        its cache and is asked for again, so they stay until all of these are past. (A new
        adapter of the same tenant and name keeps the old files until it is unloaded too:
        later than needed, never too early.)
        """
        State = Instance.State
        live = Instance.objects.filter(
            state__in=(State.STARTING, State.READY, State.UNHEALTHY, State.DRAINING,
                       State.STOPPING)
        ).only("state", "loaded_adapters", "command")
        for instance in live:
            if self.engine_name in (instance.loaded_adapters or []):
                return True
            marker = self.path or self.version_digest  # its cache folder is named by digest
            if instance.state in (State.STARTING, State.STOPPING) and marker and any(
                marker in str(arg) for arg in instance.command or []
            ):
                return True
        return False

    def free_node_caches(self) -> int:
        """For a deleted adapter's artifact version: ask each live node whose cache holds it
        to drop it (at most once a minute; each agent keeps it while an instance of its own
        still uses it), and count the removal done (1) once no node holds it. A version another
        adapter still uses is kept."""
        done = AdapterFileRemoval.objects.filter(pk=self.pk, removed_at__isnull=True)
        if LoraAdapter.objects.filter(artifact_version__digest=self.version_digest).exists():
            return done.update(removed_at=timezone.now(), last_error="")
        if not ArtifactVersion.objects.filter(digest=self.version_digest).exists():
            # Deleted with its tenant, and with it the record of which nodes hold it: every
            # live node is asked once.
            for node in Node.objects.filter(lost_at__isnull=True):
                lifecycle.free_cached_version(self.pk, node.queue)
            return done.update(removed_at=timezone.now(), nodes_asked_at=timezone.now())
        holders = Node.objects.filter(cache_entries__version__digest=self.version_digest,
                                      lost_at__isnull=True).distinct()
        if not holders.exists():
            return done.update(removed_at=timezone.now(), last_error="")
        now = timezone.now()
        if self.nodes_asked_at is None or now - self.nodes_asked_at > timedelta(minutes=1):
            AdapterFileRemoval.objects.filter(pk=self.pk).update(nodes_asked_at=now)
            for node in holders:
                lifecycle.free_cached_version(self.pk, node.queue)
        return 0
