"""Base models: the models deployments serve, their architecture read from their files."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.urls import reverse

from audit_app import context as audit_context
from serving_app import storage
from serving_app.enginespec import FIELD
from serving_app.layouts import ArchitectureError, Layout
from serving_app.modelfiles import ModelFilesError, read_model
from serving_app.models.artifacts import Artifact, ArtifactVersion, artifact_folder
from serving_app.units import format_bytes
from tenants_app.models import SignedInQuerySet

LEGACY_PATH_LABEL = "Path on every node (legacy)"


def path_error(exc: ModelFilesError) -> ValidationError:
    """A model-files problem as a field error on "path"; a problem with the path itself keeps
    the `host_path` code, so a tenant user is shown the generic message instead."""
    code = storage.HOST_PATH if exc.host_path else "files"
    return ValidationError({"path": ValidationError(str(exc), code=code)})


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
    test_model = models.BooleanField(
        default=False, verbose_name="Test model",
        help_text="Its answers are noise by design: a model for exercising the serving path "
                  "(tokenizer, streaming, adapters), not language, such as the demo's "
                  "tiny-llama. The playground and the portal say so.")
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
    config = models.JSONField(
        editable=False, default=dict, blank=True,
        help_text="The language model's config.json as read from its files: the planner reads "
                  "the layers' layout from it (experts, latent attention, sliding windows).")
    measured_profile = models.JSONField(
        editable=False, default=dict, blank=True,
        help_text="What one start of the engine logged (weights, peak activation, non-torch, "
                  "CUDA graphs, KV cache GiB and tokens; placement.calibration.EngineMemory): "
                  "the planner uses it, marked \"measured\", where it cannot model the layout.")
    created_at = models.DateTimeField(auto_now_add=True)

    # Read from the model's files, never typed in.
    ARCHITECTURE_FIELDS = (
        "architecture", "num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_kv_heads", "head_dim", "max_position_embeddings", "vocab_size", "torch_dtype",
        "weight_bytes", "config",
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
        # An adapter names its base model, so its module sits above this one: read by label.
        adapters = apps.get_model("serving_app", "LoraAdapter").objects
        for path, name, tenant in adapters.values_list("path", "name", "tenant__slug"):
            if path and storage.overlaps(resolved, path):
                raise storage.host_path_error(f"{resolved} holds the files of the adapter "
                                              f"{tenant}/{name}.")
        try:
            arch = read_model(str(resolved), dummy=self.load_format == self.LoadFormat.DUMMY)
        except ModelFilesError as exc:
            raise path_error(exc) from exc
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
    def answers_are_noise(self) -> str:
        """Why this model's answers are noise by design, or "": random weights of the model's
        shape (a capacity test), or a model registered as a test model (`test_model`), such
        as the demo's tiny-llama (2 MiB of random weights), which exercises the serving path
        (tokenizer, streaming, adapters), not language. The playground shows it. An operator
        says which models are test models: no size tells a test model from a small real one
        (migration 0042 marked those registered before under 16 MiB, the rule it replaces)."""
        if self.capacity_test:
            return ("a capacity test: random weights of the model's shape, for throughput and "
                    "memory, so its answers are noise by design")
        if self.test_model:
            size = f" of {format_bytes(self.weight_bytes)} of weights" if self.weight_bytes else ""
            return (f"a test model{size}: it exercises the serving path, not language, so its "
                    "answers are noise by design")
        return ""

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token on one GPU, as vLLM allocates them (the layout's rule:
        latent attention caches one latent per layer)."""
        element = 4 if self.effective_dtype == "float32" else 2
        if self.config:
            try:
                return self.num_layers * Layout.from_config(self.config).kv_values_per_layer(1) \
                    * element
            except ArchitectureError:
                pass
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def effective_dtype(self) -> str:
        return self.torch_dtype if self.dtype == "auto" else self.dtype
