"""The serving domain: base models, LoRA adapters, nodes and GPUs, deployments, instances.

A Deployment is desired state; Instances record what actually runs. Node agents and the
reconciler change Instance state only through conditional updates (`Instance.transition`).
"""

from __future__ import annotations

import secrets
import shlex
import shutil
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.urls import reverse
from django.utils import timezone

from audit_app import context as audit_context
from audit_app import recording
from serving_app import blobstore, lifecycle, signals, storage
from serving_app.enginespec import ENGINE_FIELDS, FIELD, FIELDS, EngineSpec, with_defaults
from serving_app.modelfiles import (
    AdapterInfo,
    ModelFilesError,
    expected_module_shapes,
    read_adapter,
    read_model,
)
from serving_app.models import canaries, events
from serving_app.models.artifacts import Artifact as Artifact
from serving_app.models.artifacts import ArtifactFile as ArtifactFile
from serving_app.models.artifacts import ArtifactImport as ArtifactImport
from serving_app.models.artifacts import ArtifactVersion as ArtifactVersion
from serving_app.models.artifacts import Blob as Blob
from serving_app.models.artifacts import NodeCacheEntry as NodeCacheEntry
from serving_app.models.revisions import (
    DeploymentRevision,
    Rollout,
    describe,
    diff,
    spec_of,
)
from serving_app.placement import fleetspec
from serving_app.placement.inventory import cpulist_text, parse_cpulist
from tenants_app.models import SignedInQuerySet, StaffOnlyQuerySet, Tenant, TenantOwnedQuerySet

if TYPE_CHECKING:
    from collections.abc import Iterable

    # request.user's types (AUTH_USER_MODEL is Django's own User).
    from django.contrib.auth.models import AnonymousUser, User


# What an operator action changed, {field: [before, after]}: the audit entry's changes.
Changes = dict[str, list[Any]]


def _path_error(exc: ModelFilesError) -> ValidationError:
    """A model-files problem as a field error on "path"; a problem with the path itself keeps
    the `host_path` code, so a tenant user is shown the generic message instead."""
    code = storage.HOST_PATH if exc.host_path else "files"
    return ValidationError({"path": ValidationError(str(exc), code=code)})


def engine_field(name: str) -> dict[str, Any]:
    """A model field's options from the declaration of the engine setting `name`
    (serving_app.enginespec): its label, help text, default, range and choices; it may be left
    empty where its default is None or ""."""
    declared = FIELD[name]
    out: dict[str, Any] = {"verbose_name": declared.verbose_name, "help_text": declared.help_text}
    validators = [*([MinValueValidator(declared.minimum)] if declared.minimum is not None else []),
                  *([MaxValueValidator(declared.maximum)] if declared.maximum is not None else [])]
    if validators:
        out["validators"] = validators
    if declared.choices:
        out["choices"] = list(declared.choices)
    if declared.default is None:
        out.update(null=True, blank=True)
    else:
        out["default"] = declared.default
        if declared.default == "":
            out["blank"] = True
    return out


def version_files(version: ArtifactVersion) -> list[blobstore.FileEntry]:
    """A version's manifest as the blob store and node caches take it."""
    return [blobstore.FileEntry(f.path, f.size, f.blob_id) for f in version.files.all()]



def artifact_folder(version: ArtifactVersion) -> Path:
    """A folder on the console with the version's files, for reading its config and headers."""
    return blobstore.version_folder(version.digest, version_files(version))


LEGACY_PATH_LABEL = "Path on every node (legacy)"


class BaseModel(models.Model):
    """A model served from an artifact version (fetched into each node's cache), or, the legacy
    way, from a folder that sits at the same local path on every node host.

    The architecture fields are read from the files' config.json and safetensors headers
    when the model is registered or its files change; they are never typed in. A capacity-test
    model (`load_format` "dummy") is a folder with a `config.json` and a tokenizer alone: its
    engines run with random weights of the real shape (vLLM's `--load-format dummy`), so a
    platform team can test placement, memory and throughput before the weights arrive; its
    weight size is the parameter count its configuration gives (`modelfiles.config_parameters`).
    """

    class LoadFormat(models.TextChoices):
        AUTO = "auto", "Weights from the folder"
        DUMMY = "dummy", "Capacity test: random weights"

    name = models.SlugField(max_length=100, unique=True, help_text="Public model name.")
    path = models.CharField(
        max_length=500, blank=True,
        help_text="Legacy: a folder at this same path on every node host. Empty when the model "
                  "comes from an artifact version.")
    artifact_version = models.ForeignKey(
        ArtifactVersion, null=True, blank=True, on_delete=models.RESTRICT,
        related_name="base_models",
        help_text="The files' version: each node fetches it into its cache before a start.")
    # The model's own settings, which a deployment's "auto" or empty one falls back on.
    dtype = models.CharField(max_length=16, choices=FIELD["dtype"].choices, default="auto")
    quantization = models.CharField(
        max_length=16, choices=FIELD["quantization"].choices, default="", blank=True
    )
    load_format = models.CharField(
        max_length=8, choices=LoadFormat.choices, default=LoadFormat.AUTO,
        help_text="Capacity test: the folder needs only config.json and a tokenizer; engines "
                  "start with random weights of the model's shape (vLLM --load-format dummy). "
                  "Its answers are noise: for placement, memory and throughput tests only.",
    )
    architecture = models.CharField(max_length=100, editable=False, default="")
    num_layers = models.PositiveIntegerField(editable=False, default=0)
    hidden_size = models.PositiveIntegerField(editable=False, default=0)
    intermediate_size = models.PositiveIntegerField(editable=False, default=0)
    num_attention_heads = models.PositiveIntegerField(editable=False, default=0)
    num_kv_heads = models.PositiveIntegerField(editable=False, default=0)
    head_dim = models.PositiveIntegerField(editable=False, default=0)
    max_position_embeddings = models.PositiveIntegerField(editable=False, default=0)
    vocab_size = models.PositiveIntegerField(editable=False, default=0)
    torch_dtype = models.CharField(max_length=16, editable=False, default="")
    weight_bytes = models.PositiveBigIntegerField(editable=False, default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    # Read from the model's files, never typed in.
    ARCHITECTURE_FIELDS = (
        "architecture", "num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_kv_heads", "head_dim", "max_position_embeddings", "vocab_size", "torch_dtype",
        "weight_bytes",
    )

    objects = SignedInQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        verbose_name = "base model"

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Saved with another version of its files, each deployment of the model records a
        revision that pins it: pending where engines run (apply it to roll it out; a
        rollback returns to the files before), applied at once where nothing runs."""
        adding = self._state.adding
        before = None if adding else BaseModel.objects.filter(pk=self.pk).values_list(
            "artifact_version_id", flat=True).first()
        with transaction.atomic():
            super().save(*args, **kwargs)
            if not adding and before != self.artifact_version_id:
                for deployment in self.deployments.all():
                    deployment.base_model = self
                    deployment.record_revision(audit_context.current().actor)

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:basemodel-detail", args=[self.pk])

    @property
    def source_label(self) -> str:
        """Where the engines get the files: the artifact version, or the legacy host path."""
        return str(self.artifact_version) if self.artifact_version_id else LEGACY_PATH_LABEL

    def clean(self) -> None:
        if self.artifact_version_id:
            self._clean_from_artifact()
            return
        if not self.path:
            raise ValidationError({"path": "Give an artifact version, or (legacy) a folder "
                                           "at the same path on every node host."})
        resolved = storage.check_model_path(self.path)
        for adapter in LoraAdapter.objects.select_related("tenant").only(
            "path", "name", "tenant__slug"
        ):
            if adapter.path and storage.overlaps(resolved, adapter.path):
                raise storage.host_path_error(f"{resolved} holds the files of the adapter "
                                              f"{adapter}.")
        try:
            arch = read_model(str(resolved), dummy=self.load_format == self.LoadFormat.DUMMY)
        except ModelFilesError as exc:
            raise _path_error(exc) from exc
        self.path = str(resolved)  # what was checked is what the engines load
        for name, value in vars(arch).items():
            setattr(self, name, value)

    def _clean_from_artifact(self) -> None:
        version = self.artifact_version
        assert version is not None
        if version.artifact.kind != Artifact.Kind.MODEL:
            raise ValidationError({"artifact_version": f"{version} holds an adapter's files, "
                                                       "not a base model's."})
        try:
            arch = read_model(str(artifact_folder(version)),
                              dummy=self.load_format == self.LoadFormat.DUMMY)
        except ModelFilesError as exc:
            raise ValidationError({"artifact_version": str(exc)}) from exc
        self.path = ""
        for name, value in vars(arch).items():
            setattr(self, name, value)

    @property
    def capacity_test(self) -> bool:
        """Random weights of the model's shape: answers are noise (shown wherever it is)."""
        return self.load_format == self.LoadFormat.DUMMY

    @property
    def kv_bytes_per_token(self) -> int:
        element = 4 if self.effective_dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def effective_dtype(self) -> str:
        return self.torch_dtype if self.dtype == "auto" else self.dtype


class LoraAdapterQuerySet(TenantOwnedQuerySet["LoraAdapter"]):
    def storage_used(self, tenant: Tenant) -> int:
        """Bytes the tenant's adapters take (size_bytes, read from their files when
        registered): what the portal shows against the tenant's storage quota."""
        return self.filter(tenant=tenant).aggregate(total=models.Sum("size_bytes"))["total"] or 0


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
            self._check_info(info, counts_against_quota=self._state.adding)
            return
        if not self.path:
            raise ValidationError({"path": "Give an artifact version, or (legacy) a folder "
                                           "at the same path on every node host."})
        resolved = self.check_path()
        try:
            info = read_adapter(str(resolved))
        except ModelFilesError as exc:
            raise _path_error(exc) from exc
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
                field = "artifact_version" if self.artifact_version_id else "path"
                raise ValidationError(
                    {field: storage.quota_error(info.size_bytes, used, quota)}
                )
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


class Node(models.Model):
    """A host running a node agent (a Celery worker consuming `queue`)."""

    class InventorySource(models.TextChoices):
        NVML = "nvml", "NVML"
        DECLARED = "declared", "Declared in configuration"

    name = models.SlugField(max_length=100, unique=True)
    queue = models.CharField(max_length=150, unique=True)
    address = models.CharField(
        max_length=100, default="127.0.0.1", help_text="Where the gateway reaches its engines."
    )
    engine_env = models.CharField(max_length=500, blank=True, help_text="Engine virtualenv path.")
    engine_python = models.CharField(
        max_length=500, blank=True, default="",
        help_text="The engines' Python interpreter (NODE_ENGINE_PYTHON; blank: the engine "
                  "virtualenv's bin/python), e.g. the host's own python3 with torch.",
    )
    engine_pythonpath = models.CharField(
        max_length=2000, blank=True, default="",
        help_text="Folders put first on the engines' PYTHONPATH (NODE_ENGINE_PYTHONPATH), e.g. "
                  "a pip --target folder holding vLLM.",
    )
    engine_versions = models.JSONField(
        default=dict, blank=True, editable=False,
        help_text="What the engine interpreter reported when the agent registered: Python, "
                  "vLLM, torch, CUDA and driver versions, or the error.",
    )
    cpu_binding = models.CharField(
        max_length=200, blank=True, default="",
        help_text="How engines are pinned to CPU cores: blank pins each engine to the cores "
                  "nearest its GPUs (NVML's CPU affinity), 'off' pins nothing, a CPU list such "
                  "as 0-7,16-23 pins every engine of the node there.",
    )
    mps = models.JSONField(
        default=dict, blank=True, editable=False,
        help_text="The node's MPS control daemon, as its agent last saw it.",
    )
    inventory_source = models.CharField(
        max_length=16, choices=InventorySource.choices, default=InventorySource.DECLARED
    )
    cordoned = models.BooleanField(default=False, help_text="Gets no new instances.")
    draining = models.BooleanField(
        default=False, editable=False,
        help_text="Its instances are being moved to other nodes, one at a time (it is cordoned).",
    )
    drain_status = models.CharField(
        max_length=500, blank=True, default="", editable=False,
        help_text="Where the drain stands: the move in progress, or why it waits.",
    )
    lost_at = models.DateTimeField(
        null=True, blank=True, editable=False,
        help_text="When the reconciler declared the node lost (its heartbeat had stopped) and "
                  "replaced its instances; cleared when its agent is back.",
    )
    max_instances = models.PositiveIntegerField(
        default=4, help_text="Engines this host may run when it has no GPUs (CPU engines)."
    )
    # The node's artifact cache, as its agent reports it (serving_app/artifacts/staging.py).
    cache_path = models.CharField(max_length=500, blank=True, default="", editable=False)
    cache_quota_bytes = models.PositiveBigIntegerField(default=0, editable=False)
    cache_used_bytes = models.PositiveBigIntegerField(default=0, editable=False)
    cache_url = models.CharField(
        max_length=200, blank=True, default="", editable=False,
        help_text="Where other nodes fetch the files of its cache (its agent's peer server).")
    fetch_token_hash = models.CharField(
        max_length=64, blank=True, default="", editable=False,
        help_text="SHA-256 of the node's token: what its agent fetches artifacts with (made "
                  "by the join exchange, or by the agent of a node that did not join).")
    # The node's own database role and Redis user, made by the join exchange and dropped when
    # the node is deleted (serving_app/fleet/credentials.py); blank for a node that did not join
    # (its agent runs with the installation's shared URLs).
    db_role = models.CharField(max_length=63, blank=True, default="", editable=False)
    redis_user = models.CharField(max_length=100, blank=True, default="", editable=False)
    agent_pid = models.PositiveIntegerField(null=True, blank=True, editable=False)
    last_heartbeat = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:node-detail", args=[self.pk])

    def clean(self) -> None:
        if self.queue and not self.queue.startswith("node."):
            raise ValidationError({"queue": "A node agent's queue is named node.<host>."})
        if self.cpu_binding not in ("", "off"):
            try:
                self.cpu_binding = cpulist_text(parse_cpulist(self.cpu_binding))
            except ValueError as exc:
                raise ValidationError({"cpu_binding": str(exc)}) from exc

    def effective_cpu_binding(self) -> list[tuple[str, str]]:
        """Where this node's engines are pinned, as (what, CPU list) rows for its page: the
        node's CPU list for every engine, nothing ("off"), or by default each GPU's nearest
        cores (the agent's `cpu_cores()` applies the same rule at each launch)."""
        if self.cpu_binding == "off":
            return [("every engine", "off: not pinned")]
        if self.cpu_binding:
            return [("every engine", self.cpu_binding)]
        rows = [(f"nearest cores of GPU {gpu.index}",
                 gpu.cpu_affinity or "unknown (NVML gave none)")
                for gpu in self.gpus.all() if gpu.parent_id is None]
        return rows or [("every engine", "not pinned (no GPU to be near)")]

    @property
    def is_lost(self) -> bool:
        if self.last_heartbeat is None:
            return True
        age = timezone.now() - self.last_heartbeat
        return age > timedelta(seconds=settings.NODE_LOST_SECONDS)

    @property
    def state(self) -> str:
        if self.is_lost or self.lost_at:
            return "lost"
        if self.draining:
            return "draining"
        return "cordoned" if self.cordoned else "ready"

    # -- operator actions. Each records its audit entry (a conditional update sends no signal)
    # and returns the change made ({field: [before, after]}, empty when nothing changed).
    def cordon(self) -> Changes:
        """No new instances on this node; what runs here goes on running."""
        return self._change("cordon", cordoned=True)

    def uncordon(self) -> Changes:
        """Take new instances again; a drain in progress stops after the move under way."""
        changes = self._change("uncordon", cordoned=False, draining=False, drain_status="")
        lifecycle.nodes_changed()  # placements that waited for room may fit now
        return changes

    def drain(self) -> Changes:
        """Cordon the node and move every instance off it, one at a time: the reconciler starts
        a replacement elsewhere, waits until it is ready, then stops the old one. Refused when
        no other node could take anything."""
        serving = self.instances.filter(
            state__in=(Instance.State.READY, Instance.State.UNHEALTHY, Instance.State.STARTING,
                       Instance.State.STAGING)
        ).count()
        others = [n for n in Node.objects.exclude(pk=self.pk).filter(cordoned=False)
                  if not n.is_lost]
        if serving and not others:
            raise ValidationError(
                f"Nothing to move the {serving} instance(s) of {self.name} to: no other node is "
                "online and uncordoned. Start another node agent, or cordon this node instead."
            )
        changes = self._change("drain", cordoned=True, draining=True,
                               drain_status="Drain requested." if not self.draining
                               else self.drain_status)
        lifecycle.nodes_changed()
        return changes

    def _change(self, action: str, **values: object) -> Changes:
        with transaction.atomic():
            current = Node.objects.select_for_update().get(pk=self.pk)
            changes = {name: [getattr(current, name), value] for name, value in values.items()
                       if getattr(current, name) != value}
            if changes:
                Node.objects.filter(pk=self.pk).update(**{n: v[1] for n, v in changes.items()})
            for name, value in values.items():
                setattr(self, name, value)
        changes.pop("drain_status", None)  # a message, not a setting
        # Recorded even when nothing changed, as a deployment's start is: someone asked for it.
        recording.record(action, self, changes)
        if changes:
            kind, message = NODE_ACTION_EVENTS[action]
            events.record(kind, message.format(node=self.name), node=self)
        return changes


# The event on the cluster's timeline of each operator action on a node that changed it.
NODE_ACTION_EVENTS: dict[str, tuple[str, str]] = {
    "cordon": (events.Kind.NODE_CORDONED, "Node {node} cordoned: it gets no new instances."),
    "uncordon": (events.Kind.NODE_UNCORDONED, "Node {node} uncordoned: it takes new instances "
                                              "again."),
    "drain": (events.Kind.NODE_DRAIN, "Node {node} cordoned and drained: its instances move "
                                      "to other nodes, one at a time."),
}


class Gpu(models.Model):
    """A GPU (or a MIG device, with `parent` set) on a node."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=100)
    name = models.CharField(max_length=100)
    memory_total_bytes = models.PositiveBigIntegerField()
    mig_mode = models.BooleanField(default=False)
    mig_profile = models.CharField(max_length=50, blank=True)
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="mig_devices"
    )
    memory_used_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    utilization_percent = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    processes = models.JSONField(default=list, blank=True)
    cpu_affinity = models.CharField(
        max_length=500, blank=True, default="",
        help_text="The CPU cores nearest the GPU (NVML), as a CPU list.",
    )
    declared = models.BooleanField(default=False, help_text="From configuration, not NVML.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["node__name", "index", "uuid"]
        verbose_name = "GPU"
        constraints = [
            models.UniqueConstraint(fields=["node", "uuid"], name="unique_gpu_per_node"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id and self.node.name} GPU {self.index} ({self.name})"

    def clean(self) -> None:
        if self.parent is not None and self.parent.node_id != self.node_id:
            raise ValidationError({"parent": "A MIG device belongs to a GPU on the same node."})


class GpuSample(models.Model):
    """A point-in-time reading of one GPU, kept for the dashboards."""

    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(default=timezone.now, db_index=True)
    memory_used_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    utilization_percent = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["gpu", "-at"], name="gpusample_gpu_at")]

    def __str__(self) -> str:
        return f"{self.gpu_id}@{self.at:%H:%M:%S}"


class FleetPlan(models.Model):
    """A what-if: a fleet that is not running (declared nodes, GPUs and MIG devices) and the
    deployments to place on it. Placing it (``placement.fleetplans``) starts nothing and
    reserves nothing; the GPU allocation page shows it beside the live allocation, labelled as
    a plan. Platform admins only: a plan may name any tenant, so tenants see none."""

    class Policy(models.TextChoices):
        BINPACK = "binpack", "Bin-pack (tightest fit)"
        SPREAD = "spread", "Spread (most free memory)"

    name = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    fleet = models.TextField(
        help_text=(
            "One node per line, NAME: GPUS in the declared-inventory format, MIG devices in "
            "brackets: 'gpu-a: 2xNVIDIA A100-SXM4-80GB:80GiB, "
            "2:NVIDIA A100-SXM4-80GB:80GiB[3g.40gb,3g.40gb]'."
        )
    )
    deployments = models.JSONField(
        default=list, blank=True,
        help_text=(
            'A list of deployments, placed in this order: {"name": ..., "model": a registered '
            'base model or an object with its architecture, "tenants": [slugs], "replicas", '
            '"isolation", "max_num_seqs", "max_model_len", ...} (docs/placement.md).'
        ),
    )
    policy = models.CharField(max_length=16, choices=Policy.choices, default=Policy.BINPACK)
    headroom = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0), MaxValueValidator(0.5)],
        help_text="Share of every GPU left unreserved. Empty: PLACEMENT_HEADROOM.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["-updated_at", "name"]
        verbose_name = "what-if plan"

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:fleetplan-detail", args=[self.pk])

    def clean(self) -> None:
        errors: dict[str, list[str]] = {}
        try:
            fleetspec.parse_fleet(self.fleet)
        except fleetspec.FleetSpecError as exc:
            errors["fleet"] = exc.messages
        try:
            planned = fleetspec.parse_plan_deployments(self.deployments)
        except fleetspec.FleetSpecError as exc:
            errors["deployments"] = exc.messages
        else:
            missing = self._missing_references(planned)
            if missing:
                errors["deployments"] = missing
        if errors:
            raise ValidationError(errors)

    @staticmethod
    def _missing_references(planned: list[fleetspec.PlanDeployment]) -> list[str]:
        slugs = {slug for d in planned for slug in d.tenants}
        known = set(Tenant.objects.filter(slug__in=slugs).values_list("slug", flat=True))
        names = {d.model for d in planned if d.model}
        models_known = set(BaseModel.objects.filter(name__in=names).values_list("name", flat=True))
        problems = []
        for number, d in enumerate(planned, start=1):
            where = f"deployment {number} ({d.name})"
            for slug in d.tenants:
                if slug not in known:
                    problems.append(f"{where}: there is no tenant {slug!r}")
            if d.model and d.model not in models_known:
                problems.append(
                    f"{where}: there is no base model {d.model!r}; register it, or give the "
                    "model's architecture as an object"
                )
        return problems


class DeploymentQuerySet(models.QuerySet["Deployment"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        """Deployments the user may see: all for staff, else those open to their tenants."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(tenants__memberships__user=user).distinct()

    def for_tenant(self, tenant: Tenant) -> Self:
        return self.filter(tenants=tenant)


class Deployment(models.Model):
    """What should run: a base model with adapters, engine settings, replicas and isolation."""

    # Names for the declared choices of isolation_mode and scheduling_policy
    # (serving_app.enginespec; tests/unit/test_engine_spec.py checks they agree).
    class Isolation(models.TextChoices):
        DEDICATED = "dedicated", "Dedicated GPUs"
        SHARED = "shared", "Shared GPU"
        MIG = "mig", "MIG slice"
        MPS = "mps", "MPS"

    class DesiredState(models.TextChoices):
        RUNNING = "running", "Running"
        STOPPED = "stopped", "Stopped"

    class SchedulingPolicy(models.TextChoices):
        FCFS = "fcfs", "First come, first served"
        PRIORITY = "priority", "Priority (from the tenant's tier)"

    name = models.SlugField(max_length=100, unique=True)
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="deployments")
    tenants = models.ManyToManyField(Tenant, related_name="deployments")
    adapters = models.ManyToManyField(LoraAdapter, blank=True, related_name="deployments")
    replicas = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(64)])
    # The engine settings (a revision holds them): each declared once, with its label, help
    # text, default, range and choices, in serving_app.enginespec.
    isolation_mode = models.CharField(max_length=16, **engine_field("isolation_mode"))
    mps_thread_percentage = models.PositiveIntegerField(**engine_field("mps_thread_percentage"))
    gpu_memory_utilization = models.FloatField(**engine_field("gpu_memory_utilization"))
    tensor_parallel_size = models.PositiveIntegerField(**engine_field("tensor_parallel_size"))
    pipeline_parallel_size = models.PositiveIntegerField(
        **engine_field("pipeline_parallel_size"))
    allow_multi_node = models.BooleanField(**engine_field("allow_multi_node"))
    max_num_seqs = models.PositiveIntegerField(**engine_field("max_num_seqs"))
    max_model_len = models.PositiveIntegerField(**engine_field("max_model_len"))
    max_num_batched_tokens = models.PositiveIntegerField(**engine_field("max_num_batched_tokens"))
    enable_prefix_caching = models.BooleanField(**engine_field("enable_prefix_caching"))
    enforce_eager = models.BooleanField(**engine_field("enforce_eager"))
    dtype = models.CharField(max_length=16, **engine_field("dtype"))
    quantization = models.CharField(max_length=16, **engine_field("quantization"))
    kv_cache_dtype = models.CharField(max_length=16, **engine_field("kv_cache_dtype"))
    max_loras = models.PositiveIntegerField(**engine_field("max_loras"))
    max_lora_rank = models.PositiveIntegerField(**engine_field("max_lora_rank"))
    scheduling_policy = models.CharField(max_length=16, **engine_field("scheduling_policy"))
    base_port = models.PositiveIntegerField(**engine_field("base_port"))
    flow_control = models.BooleanField(
        default=True,
        help_text="The gateway queues requests beyond each instance's dispatch budget, by "
        "priority band then fair share. Off: first come, first served.",
    )
    dispatch_budget = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(65536)],
        help_text="Requests the gateway sends one instance at a time. Empty: max_num_seqs plus "
        "GATEWAY_FLOW_QUEUE_ALLOWANCE.",
    )
    desired_state = models.CharField(
        max_length=16, choices=DesiredState.choices, default=DesiredState.STOPPED
    )
    generation = models.PositiveIntegerField(
        default=0, editable=False, help_text="Raised by a restart; older instances are replaced."
    )
    applied_revision = models.ForeignKey(
        DeploymentRevision, null=True, blank=True, editable=False, on_delete=models.SET_NULL,
        related_name="+",
        help_text="The revision of the engine settings that instances run (restarts, scale-ups "
                  "and replacements too); an edit makes a pending revision until it is applied.",
    )
    placement_error = models.TextField(
        blank=True, default="", editable=False,
        help_text="Why the last placement was refused (nothing is half-placed).",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = DeploymentQuerySet.as_manager()

    # What the console's form and the API edit (the engine settings as enginespec declares them).
    EDITABLE_FIELDS = ("name", "base_model", "tenants", "adapters", "replicas", *ENGINE_FIELDS,
                       "flow_control", "dispatch_budget")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        """A new deployment starts with revision 1 of its engine settings, applied."""
        adding = self._state.adding
        with transaction.atomic():
            super().save(*args, **kwargs)
            if adding and self.applied_revision_id is None:
                first = DeploymentRevision.objects.create(
                    deployment=self, number=1, spec=spec_of(self), created_by=self.created_by,
                    model_version_id=self.base_model.artifact_version_id)
                Deployment.objects.filter(pk=self.pk).update(applied_revision=first)
                self.applied_revision = first

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:deployment-detail", args=[self.pk])

    def clean(self) -> None:
        errors: dict[str, str] = {}
        base = self.base_model if self.base_model_id else None
        if base is not None:
            if (
                self.max_model_len
                and base.max_position_embeddings
                and (self.max_model_len > base.max_position_embeddings)
            ):
                errors["max_model_len"] = (
                    f"{base.name} supports at most {base.max_position_embeddings} tokens."
                )
            if base.num_attention_heads and base.num_attention_heads % self.tensor_parallel_size:
                errors["tensor_parallel_size"] = (
                    f"{base.name} has {base.num_attention_heads} attention heads, "
                    f"not divisible by {self.tensor_parallel_size}."
                )
            if base.num_layers and self.pipeline_parallel_size > base.num_layers:
                errors["pipeline_parallel_size"] = (
                    f"{base.name} has {base.num_layers} layers: at most {base.num_layers} "
                    "pipeline stages."
                )
        for declared in FIELDS:
            value = getattr(self, declared.name)
            if declared.allowed and value is not None and value not in declared.allowed:
                errors[declared.name] = f"vLLM accepts {', '.join(map(str, declared.allowed))}."
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.max_num_seqs:
            errors["max_num_batched_tokens"] = "Must be at least max_num_seqs."
        if self.isolation_mode == self.Isolation.MPS and not self.mps_thread_percentage:
            errors["mps_thread_percentage"] = "MPS isolation needs a thread percentage."
        if self.isolation_mode != self.Isolation.MPS and self.mps_thread_percentage:
            errors["mps_thread_percentage"] = "Only used with MPS isolation."
        if self.isolation_mode == self.Isolation.MIG and self.tensor_parallel_size > 1:
            errors["tensor_parallel_size"] = "A MIG slice runs one GPU's worth: use 1."
        if self.isolation_mode == self.Isolation.MIG and self.pipeline_parallel_size > 1:
            errors["pipeline_parallel_size"] = "A MIG slice runs one GPU's worth: use 1."
        if self.allow_multi_node and self.tensor_parallel_size * self.pipeline_parallel_size < 2:
            errors["allow_multi_node"] = ("Only an instance of several GPUs (tensor x pipeline "
                                          "parallel size above 1) can span nodes.")
        if self.pk and self.base_model_id and Deployment.objects.filter(pk=self.pk).exclude(
            base_model_id=self.base_model_id
        ).exists():
            # The gateway routes the deployment's public name to every instance at once, and
            # adapters are trained for one base model: a new model is a new deployment.
            errors["base_model"] = ("A deployment's base model cannot change; create a new "
                                    "deployment for another model.")
        if errors:
            raise ValidationError(errors)

    def check_relations(self, tenants: Iterable[Tenant], adapters: Iterable[LoraAdapter]) -> None:
        """Validate the many-to-many choices, which `clean()` cannot see before saving."""
        tenants = list(tenants)
        errors: dict[str, list[str]] = {}
        if not tenants:
            errors["tenants"] = ["A deployment serves at least one tenant."]
        tenant_ids = {t.pk for t in tenants}
        for adapter in adapters:
            if adapter.base_model_id != self.base_model_id:
                errors.setdefault("adapters", []).append(
                    f"{adapter} is an adapter for {adapter.base_model}, not {self.base_model}."
                )
            elif adapter.tenant_id not in tenant_ids:
                errors.setdefault("adapters", []).append(
                    f"{adapter} belongs to a tenant this deployment does not serve."
                )
            elif adapter.rank and adapter.rank > self.max_lora_rank:
                errors.setdefault("adapters", []).append(
                    f"{adapter} has rank {adapter.rank}, above max_lora_rank {self.max_lora_rank}."
                )
        if errors:
            raise ValidationError(errors)

    def engine_spec(self, revision: DeploymentRevision | None = None) -> EngineSpec:
        """The engine settings of `revision`, resolved against the base model: what an instance
        of that revision is started with and placed by. None: the settings as they are now
        (saved or not)."""
        return EngineSpec.resolve(revision.spec if revision is not None else spec_of(self),
                                  self.base_model)

    @property
    def effective_max_model_len(self) -> int:
        """The context length of the settings as they are now (0: the model's is unknown)."""
        return self.engine_spec().max_model_len or 0

    def dispatch_budget_for(self, engine: EngineSpec) -> int:
        """Requests the gateway's flow control sends each instance running `engine` at a
        time."""
        return self.dispatch_budget or (engine.max_num_seqs
                                        + settings.GATEWAY["FLOW_QUEUE_ALLOWANCE"])

    @property
    def effective_dispatch_budget(self) -> int:
        """`dispatch_budget_for()` the settings as they are now."""
        return self.dispatch_budget_for(self.engine_spec())

    @property
    def flow_controlled(self) -> bool:
        return self.flow_control and settings.GATEWAY["FLOW_CONTROL"]

    @property
    def lora_enabled(self) -> bool:
        return self.adapters.exists()

    # -- revisions ----------------------------------------------------------------------------
    @property
    def latest_revision(self) -> DeploymentRevision | None:
        return self.revisions.order_by("-number").first()

    @property
    def pending_revision(self) -> DeploymentRevision | None:
        """The newest revision if it is not the applied one (an edit waiting to be applied)."""
        latest = self.latest_revision
        if latest is None or latest.pk == self.applied_revision_id:
            return None
        return latest

    @property
    def active_rollout(self) -> Rollout | None:
        return self.rollouts.active().select_related("from_revision", "to_revision").first()

    def out_of_date(self) -> list[Instance]:
        """Instances (not stopped) that do not run the newest revision."""
        latest = self.latest_revision
        return [i for i in self.instances.exclude(state=Instance.State.STOPPED)
                if latest is not None and i.revision_id != latest.pk]

    def record_revision(
        self, by: User | AnonymousUser | None = None
    ) -> DeploymentRevision | None:
        """Record the engine settings as a new revision if they differ from the newest one.
        Nothing runs (no instance, no rollout): it is applied at once, since there is nothing to
        roll out. Otherwise it is pending until applied. Returns the new revision, if any."""
        latest = self.latest_revision
        spec = spec_of(self)
        model_version = self.base_model.artifact_version if self.base_model_id else None
        same_files = latest is not None and latest.model_version_id == (
            model_version.pk if model_version else None)
        if latest is not None and with_defaults(latest.spec) == spec and same_files:
            return None
        number = (latest.number if latest else 0) + 1
        revision = DeploymentRevision.objects.create(
            deployment=self, number=number, spec=spec, model_version=model_version,
            created_by=by if by is not None and by.is_authenticated else None)
        changes = describe(diff(latest.spec if latest else None, spec))
        if latest is not None and not same_files:
            files = f"model files {latest.model_version or 'legacy path'} → " \
                    f"{model_version or 'legacy path'}"
            changes = files if changes == describe([]) else f"{files}; {changes}"
        running = self.instances.exclude(state=Instance.State.STOPPED).exists()
        stopped = Deployment.objects.filter(pk=self.pk,
                                            desired_state=self.DesiredState.STOPPED).exists()
        idle = (not running or stopped) and self.active_rollout is None
        if idle:
            Deployment.objects.filter(pk=self.pk).update(applied_revision=revision)
            self.applied_revision = revision
            events.record(events.Kind.APPLIED,
                          f"Revision {number} applied at once (nothing was running): {changes}.",
                          deployment=self, data={"revision": number})
        else:
            events.record(events.Kind.REVISION,
                          f"Revision {number} recorded, pending until applied: {changes}.",
                          deployment=self, data={"revision": number})
        return revision

    def apply(self, revision: DeploymentRevision | None = None,
              strategy: str = Rollout.Strategy.ROLLING, *, max_surge: int = 1,
              max_unavailable: int = 0,
              keep_old_seconds: int = Rollout.DEFAULT_KEEP_OLD_SECONDS,
              by: User | AnonymousUser | None = None) -> Rollout:
        """Set `revision` (default: the newest) as the target and roll it out with `strategy`;
        the reconciler carries the rollout out. With nothing running it is applied at once (a
        rollout that succeeded immediately). Raises ValidationError when it cannot start.
        Leaves the "apply" audit entry."""
        with transaction.atomic():
            started = self._start_rollout(revision, strategy, max_surge=max_surge,
                                          max_unavailable=max_unavailable,
                                          keep_old_seconds=keep_old_seconds, by=by)
            recording.record("apply", self, {
                "applied_revision": [started.from_revision.number if started.from_revision
                                     else None, started.to_revision.number],
                "strategy": [None, started.strategy]})
        return started

    def _start_rollout(self, revision: DeploymentRevision | None, strategy: str, *,
                       max_surge: int = 1, max_unavailable: int = 0,
                       keep_old_seconds: int = Rollout.DEFAULT_KEEP_OLD_SECONDS,
                       by: User | AnonymousUser | None = None) -> Rollout:
        with transaction.atomic():
            locked = Deployment.objects.select_for_update(no_key=True).get(pk=self.pk)
            revision = revision or locked.latest_revision
            if revision is None or revision.deployment_id != self.pk:
                raise ValidationError({"revision": "No such revision of this deployment."})
            if locked.active_rollout is not None:
                raise ValidationError("A rollout of this deployment is in progress: wait for it, "
                                      "or abort it first.")
            if revision.pk == locked.applied_revision_id:
                raise ValidationError({"revision": f"Revision {revision.number} is already "
                                                   "applied."})
            rollout = Rollout(
                deployment=locked, from_revision_id=locked.applied_revision_id,
                to_revision=revision, strategy=strategy, max_surge=max_surge,
                max_unavailable=max_unavailable, keep_old_seconds=keep_old_seconds,
                instances_total=locked.replicas,
                created_by=by if by is not None and by.is_authenticated else None,
            )
            rollout.full_clean(exclude=["deployment", "from_revision", "to_revision",
                                        "created_by"])
            previous = locked.applied_revision
            changes = describe(revision.changes_from(previous))
            running = locked.instances.exclude(state=Instance.State.STOPPED).exists()
            if not running or locked.desired_state == self.DesiredState.STOPPED:
                rollout.state = Rollout.State.SUCCEEDED
                rollout.finished_at = timezone.now()
                rollout.step = "Applied at once: nothing was running."
                rollout.save()
                Deployment.objects.filter(pk=self.pk).update(applied_revision=revision)
                events.record(events.Kind.APPLIED,
                              f"Revision {revision.number} applied at once (nothing was "
                              f"running): {changes}.", deployment=self,
                              data={"revision": revision.number, "rollout": rollout.pk})
            else:
                if strategy == Rollout.Strategy.BLUE_GREEN:
                    rollout.phase = Rollout.Phase.STARTING
                rollout.step = "Waiting for the reconciler."
                rollout.save()
                source = previous.number if previous else "none"
                events.record(events.Kind.ROLLOUT_STARTED,
                              f"Rollout from revision {source} to revision {revision.number} "
                              f"({rollout.get_strategy_display().lower()}): {changes}.",
                              deployment=self, data={"rollout": rollout.pk,
                                                     "strategy": strategy,
                                                     "revision": revision.number})
            lifecycle.deployment_changed(self.pk)
        self.refresh_from_db(fields=["applied_revision"])
        return rollout

    def rollback(self, by: User | AnonymousUser | None = None) -> Rollout:
        """Return to the revision applied before: an active rollout is aborted (a blue-green one
        that switched switches back at once); otherwise the revision the last finished rollout
        started from is applied again, rolling. Leaves the "rollback" audit entry."""
        self.refresh_from_db(fields=["applied_revision"])
        before = self.applied_revision.number if self.applied_revision else None
        with transaction.atomic():
            active = self.active_rollout
            if active is not None:
                active.abort(reason="Rolled back by an operator.")
                active.refresh_from_db()
                result, target = active, active.from_revision
            else:
                last = (self.rollouts.filter(state=Rollout.State.SUCCEEDED,
                                             from_revision__isnull=False,
                                             to_revision_id=self.applied_revision_id)
                        .select_related("from_revision").first())
                if last is None or last.from_revision is None:
                    raise ValidationError("There is no earlier applied revision to return to.")
                result = self._start_rollout(last.from_revision, Rollout.Strategy.ROLLING, by=by)
                target = result.to_revision
            recording.record("rollback", self, {
                "target_revision": [before, target.number if target else None]})
        return result

    # -- workflows: each one transaction that asks the reconciler once it commits and leaves its
    # audit entry (their conditional updates send no signal). They return the change made
    # ({field: [before, after]}, empty when nothing changed). A request that changes nothing (a
    # start of a running deployment) is still recorded: someone asked for it.
    def start(self) -> Changes:
        """Ask for the deployment to run."""
        return self._change_desired_state("start", self.DesiredState.RUNNING)

    def stop(self, *, reconcile: bool = True) -> Changes:
        """Ask for every instance of the deployment to stop, each draining first
        (`reconcile=False`: the caller stops the engines itself, as `manage.py stop_engines`
        does)."""
        return self._change_desired_state("stop", self.DesiredState.STOPPED, reconcile)

    def restart(self) -> Changes:
        """Replace every instance (a new generation, of the applied revision) and ask for the
        deployment to run. The reconciler replaces them one by one, each new instance ready
        before an old one drains, as in a rolling rollout."""
        with transaction.atomic():
            locked = self._locked()
            Deployment.objects.filter(pk=self.pk).update(
                generation=models.F("generation") + 1,
                desired_state=self.DesiredState.RUNNING, updated_at=timezone.now(),
            )
            self.refresh_from_db(fields=["generation", "desired_state", "updated_at"])
            changes: Changes = {"generation": [locked.generation, self.generation]}
            if locked.desired_state != self.desired_state:
                changes["desired_state"] = [locked.desired_state, self.desired_state]
            recording.record("restart", self, changes)
            events.record(events.Kind.DESIRED_STATE,
                          f"Restart asked: generation {locked.generation} is replaced by "
                          f"generation {self.generation}.", deployment=self)
            lifecycle.deployment_changed(self.pk)
        return changes

    def scale_to(self, replicas: int) -> Changes:
        """Ask for `replicas` instances (0 to 64)."""
        if not 0 <= replicas <= 64:
            raise ValidationError({"replicas": "Must be between 0 and 64."})
        with transaction.atomic():
            before = self._locked().replicas
            changed = Deployment.objects.filter(pk=self.pk).exclude(replicas=replicas).update(
                replicas=replicas, updated_at=timezone.now()
            )
            self.replicas = replicas
            changes = {"replicas": [before, replicas]}
            recording.record("scale", self, changes)
            if changed:
                events.record(events.Kind.SCALED, f"Scaled from {before} to {replicas} "
                              f"replica{'s' if replicas != 1 else ''}.", deployment=self,
                              data={"before": before, "after": replicas})
            lifecycle.deployment_changed(self.pk)
        return changes

    def save_settings(self, tenants: Iterable[Tenant] | None = None,
                      adapters: Iterable[LoraAdapter] | None = None,
                      by: User | AnonymousUser | None = None) -> None:
        """Save edited settings (and the tenants and adapters when given; None leaves them to a
        caller that sets them in the same transaction, as the Django admin does), then ask the
        reconciler to converge. Changed engine settings become a pending revision
        (`record_revision()`); adapters and tenants apply at once, without restarts. The save
        and the many-to-many changes are audited by the signals (one entry). A changed number
        of replicas of a saved deployment is a scale: `scale_to()` makes it, with its event and
        its "scale" entry, as the scale action does."""
        with transaction.atomic():
            replicas = self.replicas
            if not self._state.adding:
                self.replicas = self._locked().replicas  # as committed: scale_to() changes it
            self.save()
            if tenants is not None:
                self.tenants.set(tenants)
            if adapters is not None:
                self.adapters.set(adapters)
            self.record_revision(by)
            if replicas != self.replicas:
                self.scale_to(replicas)  # which asks the reconciler
            else:
                lifecycle.deployment_changed(self.pk)

    def _change_desired_state(self, action: str, state: str,
                              reconcile: bool = True) -> Changes:
        with transaction.atomic():
            before = self._locked().desired_state
            changed = self._set_desired_state(state)
            changes = {"desired_state": [before, state]} if changed else {}
            recording.record(action, self, changes)
            if changed:
                events.record(events.Kind.DESIRED_STATE,
                              f"Desired state {before} → {state}.", deployment=self)
            if reconcile:
                lifecycle.deployment_changed(self.pk)
        return changes

    def _locked(self) -> Deployment:
        """The row as committed, locked until the surrounding transaction ends."""
        return Deployment.objects.select_for_update(no_key=True).only(
            "desired_state", "generation", "replicas").get(pk=self.pk)

    def _set_desired_state(self, state: str) -> bool:
        """Record what should run, without asking the reconciler; True if it changed."""
        changed = (
            Deployment.objects.filter(pk=self.pk)
            .exclude(desired_state=state)
            .update(desired_state=state, updated_at=timezone.now())
        )
        self.desired_state = state
        return bool(changed)


def new_instance_secret() -> str:
    """The engine's API key. Hex, because the engine's argument parser reads a value that begins
    with "-" as an option (`--api-key -x...`: "expected at least one argument"), which URL-safe
    base64 produced for one instance in 64: that instance could never start."""
    return secrets.token_hex(24)


class InstanceQuerySet(models.QuerySet["Instance"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(deployment__tenants__memberships__user=user).distinct()

    def for_tenant(self, tenant: Tenant) -> Self:
        """Instances of the deployments that serve the tenant."""
        return self.filter(deployment__tenants=tenant).distinct()

    def active(self) -> Self:
        return self.exclude(state__in=Instance.TERMINAL_STATES)


class Instance(models.Model):
    """One engine process of a deployment: where it runs and what state it is in."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        # Placed, its node agent fetching and verifying its files into the node's cache: no
        # port, no GPU memory, no engine yet (docs/artifacts.md, "Staging").
        STAGING = "staging", "Staging files"
        STARTING = "starting", "Starting"
        READY = "ready", "Ready"
        UNHEALTHY = "unhealthy", "Unhealthy"
        FAILED = "failed", "Failed"
        CRASH_LOOP = "crash_loop", "Crash loop"
        # Out of routing in every gateway worker, still running: its requests in flight finish
        # before it stops (serving_app/deployments/draining.py).
        DRAINING = "draining", "Draining"
        STOPPING = "stopping", "Stopping"
        STOPPED = "stopped", "Stopped"

    TERMINAL_STATES = (State.STOPPED,)

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="instances")
    ordinal = models.PositiveIntegerField(default=0)
    generation = models.PositiveIntegerField(default=0)
    revision = models.ForeignKey(
        DeploymentRevision, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="instances", help_text="The engine settings this instance runs.",
    )
    standby_until = models.DateTimeField(
        null=True, blank=True,
        help_text="Blue-green: the previous generation, out of routing but kept running until "
                  "then so that a rollback switches back at once.",
    )
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="instances"
    )
    gpus = models.ManyToManyField(Gpu, blank=True, related_name="instances")
    replaces = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="replacements",
        help_text="The instance this one takes over from (moved off a draining node): that one "
                  "is stopped once this one is ready.",
    )
    gpu_memory_fraction = models.FloatField(null=True, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    restarts = models.PositiveIntegerField(default=0)
    restart_history = models.JSONField(
        default=list, blank=True, help_text="When recent restarts happened (ISO times)."
    )
    exit_code = models.IntegerField(null=True, blank=True)
    health_failures = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    log_tail = models.TextField(blank=True, default="")
    log_path = models.CharField(max_length=500, blank=True, default="")
    command = models.JSONField(default=list, blank=True)
    environment = models.JSONField(default=dict, blank=True)
    secret = models.CharField(max_length=64, default=new_instance_secret, editable=False)
    model_version = models.ForeignKey(
        ArtifactVersion, null=True, blank=True, on_delete=models.RESTRICT, related_name="instances",
        help_text="The base model's files this instance runs (pinned when it is created); empty "
                  "for a model at a legacy host path.")
    staging = models.JSONField(
        default=dict, blank=True, editable=False,
        help_text="Fetching its files into the node's cache before the start: artifact, bytes, "
                  "rate, error.")
    loaded_adapters = models.JSONField(default=list, blank=True)
    adapter_errors = models.JSONField(
        default=dict, blank=True, help_text="Adapters that failed to load here: name -> error."
    )
    canary = models.JSONField(
        default=dict, blank=True, editable=False,
        help_text="Canary generations on this engine (serving_app/engine/canary.py): model "
                  "name -> whether its last one passed, its error, attempts and next try. An "
                  "adapter is routed to here only once its canary has passed.",
    )
    next_restart_at = models.DateTimeField(null=True, blank=True)
    startup = models.JSONField(
        default=dict, blank=True,
        help_text="How far the engine's start has got, read from its log: the phase (loading "
                  "weights, compiling, capturing CUDA graphs...) and the figures it logged.",
    )
    cpu_cores = models.CharField(
        max_length=500, blank=True, default="", help_text="The CPU cores its engine is pinned to."
    )
    master_addr = models.CharField(
        max_length=100, blank=True, default="",
        help_text="Multi-node only: where the headless workers meet the leader (vLLM's "
                  "--master-addr, the leader node's address), chosen at placement.")
    master_port = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Multi-node only: the rendezvous port on the leader's node (--master-port).")
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = InstanceQuerySet.as_manager()

    class Meta:
        ordering = ["deployment__name", "ordinal"]

    def __str__(self) -> str:
        return f"{self.deployment_id and self.deployment.name}#{self.ordinal}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        # An instance created without a revision runs its deployment's applied one.
        if self._state.adding and self.revision_id is None and self.deployment_id:
            self.revision_id = self.deployment.applied_revision_id
        # ...and pins the version of its base model's files it will run: its revision's.
        if self._state.adding and self.model_version_id is None and self.deployment_id:
            revision = self.revision if self.revision_id else None
            self.model_version_id = (revision.model_version_id if revision is not None
                                     and revision.model_version_id else
                                     self.deployment.base_model.artifact_version_id)
        super().save(*args, **kwargs)

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:instance-detail", args=[self.pk])

    def engine_spec(self) -> EngineSpec:
        """The engine settings of this instance's revision: what its engine is started with,
        whatever was edited since."""
        return self.deployment.engine_spec(self.revision)

    def transition(self, expected: Iterable[str], new: str, **fields: Any) -> bool:
        """Move to `new` only if the row is still in one of `expected` (Celery may redeliver)."""
        now = timezone.now()
        expected = list(expected)
        updated = Instance.objects.filter(pk=self.pk, state__in=expected).update(
            state=new, state_changed_at=now, **fields
        )
        if updated:
            self.state = new
            self.state_changed_at = now
            for name, value in fields.items():
                setattr(self, name, value)
            if new == self.State.READY or self.State.READY in expected:
                # The gateway routes to ready instances: its workers hear of it now, not at
                # their next periodic refresh.
                signals.instance_routing_changed.send(sender=Instance, instance=self)
        return bool(updated)

    def leave_routing(self, reason: str, standby_until: datetime | None = None) -> bool:
        """A ready instance leaves routing and drains (its event says why); `standby_until`
        keeps it running, drained, until then for a rollback. False if it was not ready."""
        if not self.transition([self.State.READY], self.State.DRAINING,
                               standby_until=standby_until):
            return False
        kept = (f"; kept running until {standby_until:%H:%M:%S} for a rollback"
                if standby_until else "")
        events.record(events.Kind.DRAINING,
                      f"Instance #{self.ordinal} left routing and drains: {reason}{kept}.",
                      instance=self, data={"reason": reason})
        return True

    @property
    def routable_adapters(self) -> list[str]:
        """The loaded adapters whose canary generation has passed here: what the gateway
        routes to (a loaded adapter whose generation fails is never routed here)."""
        entries = self.canary or {}
        return [name for name in self.loaded_adapters or [] if canaries.passed(entries, name)]

    @property
    def canary_failures(self) -> list[str]:
        """The models (base model or adapters) whose last canary on this engine failed."""
        return sorted(name for name, entry in (self.canary or {}).items()
                      if not (entry or {}).get("ok"))

    @property
    def canary_problems(self) -> list[str]:
        """One line per model of this engine whose canary has not passed, with why."""
        return canaries.problems(self.canary or {}, self.deployment.base_model.name)

    @property
    def command_line(self) -> str:
        """The engine's command as a shell would take it (it holds no secret: the engine's key
        is in its environment only)."""
        return shlex.join(self.command or [])

    @property
    def base_url(self) -> str:
        address = self.node.address if self.node is not None else "127.0.0.1"
        return f"http://{address}:{self.port}"

    @property
    def multi_node(self) -> bool:
        """Whether its engine spans several nodes: this row's node runs the leader (node rank
        0, the API server the gateway routes to), each `workers` row a headless worker."""
        return self.master_port is not None

    @property
    def nnodes(self) -> int:
        """Nodes its engine spans (vLLM's --nnodes)."""
        return 1 + self.workers.count() if self.multi_node else 1


class InstanceWorker(models.Model):
    """A headless worker of a multi-node instance: node rank 1 and up of its engine, on a node
    of its own, started, supervised and stopped by that node's agent. It serves no API: the
    leader (its instance's own node) does, and the gateway routes to the leader only. A worker
    lost is the group's failure: the leader's agent stops the whole group and the reconciler
    restarts it as one."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        STARTING = "starting", "Starting"
        RUNNING = "running", "Running"
        FAILED = "failed", "Failed"
        STOPPING = "stopping", "Stopping"
        STOPPED = "stopped", "Stopped"

    # A worker in these states may have a process; the others have none.
    LIVE_STATES = (State.STARTING, State.RUNNING, State.STOPPING)

    instance = models.ForeignKey(Instance, on_delete=models.CASCADE, related_name="workers")
    node_rank = models.PositiveIntegerField()
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="instance_workers"
    )
    gpus = models.ManyToManyField(Gpu, blank=True, related_name="instance_workers")
    state = models.CharField(max_length=16, choices=State.choices, default=State.STOPPED)
    pid = models.PositiveIntegerField(null=True, blank=True)
    command = models.JSONField(default=list, blank=True)
    environment = models.JSONField(
        default=dict, blank=True, help_text="The placer's environment for this node's part "
                                            "(its devices); the rest is the launch spec's.")
    log_path = models.CharField(max_length=500, blank=True, default="")
    log_tail = models.TextField(blank=True, default="")
    last_error = models.TextField(blank=True, default="")
    exit_code = models.IntegerField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["instance", "node_rank"]
        constraints = [models.UniqueConstraint(fields=["instance", "node_rank"],
                                               name="one_worker_per_node_rank")]

    def __str__(self) -> str:
        return f"{self.instance} rank {self.node_rank}"

    def transition(self, expected: Iterable[str], new: str, **fields: Any) -> bool:
        """Move to `new` only if the row is still in one of `expected` (Celery may redeliver)."""
        now = timezone.now()
        updated = InstanceWorker.objects.filter(pk=self.pk, state__in=list(expected)).update(
            state=new, state_changed_at=now, **fields)
        if updated:
            self.state = new
            self.state_changed_at = now
            for name, value in fields.items():
                setattr(self, name, value)
        return bool(updated)


# Usage metering models and engine metric samples live in their own modules (written by the
# gateway, and by node agents and the control worker); importing them here registers them.
from serving_app.models.autoscalers import Autoscaler as Autoscaler  # noqa: E402
from serving_app.models.engine_metrics import EngineHour as EngineHour  # noqa: E402
from serving_app.models.engine_metrics import EngineSample as EngineSample  # noqa: E402
from serving_app.models.joins import NodeJoinToken as NodeJoinToken  # noqa: E402
from serving_app.models.usage import *  # noqa: E402,F401,F403
