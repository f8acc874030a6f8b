"""Artifacts and the models and adapters made from them (each test has its own blob store and
node caches: tests/conftest.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from serving_app.artifacts import sources
from serving_app.models import Artifact, ArtifactVersion, BaseModel, LoraAdapter
from tests.factories import make_adapter_dir, make_model_dir


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def announce(folder: Path) -> list[dict]:
    return [{"path": p.relative_to(folder).as_posix(), "size": p.stat().st_size,
             "sha256": sha256(p.read_bytes())} for p in sorted(folder.rglob("*")) if p.is_file()]


def model_artifact(root: Path, name: str = "llama-mini") -> tuple[Artifact, ArtifactVersion]:
    artifact = Artifact.objects.create(name=name, kind=Artifact.Kind.MODEL)
    folder = make_model_dir(root / "src", name)
    return artifact, sources.import_console_folder(artifact, folder)


@pytest.fixture
def artifact_model(db, tmp_path) -> BaseModel:
    """A base model served from an artifact version (no host path)."""
    _, version = model_artifact(tmp_path)
    model = BaseModel(name="llama-mini", artifact_version=version)
    model.full_clean()
    model.save()
    return model


def adapter_from_artifact(tenant, base: BaseModel, root: Path, name: str = "lora"
                          ) -> LoraAdapter:
    artifact = Artifact.objects.create(name=name, kind=Artifact.Kind.ADAPTER, tenant=tenant)
    version = sources.import_console_folder(artifact, make_adapter_dir(root / tenant.slug, name))
    adapter = LoraAdapter(tenant=tenant, base_model=base, name=name, artifact_version=version)
    adapter.full_clean()
    adapter.save()
    return adapter
