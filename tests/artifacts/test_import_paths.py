"""`manage.py import_path_artifacts`: legacy host-path models and adapters become artifact
versions; a folder that is gone is reported and left as it is."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

from django.core.management import call_command

from serving_app.models import BaseModel, LoraAdapter
from tests.factories import make_adapter, make_deployment


def test_legacy_paths_become_versions_and_running_deployments_get_a_pending_revision(
        base_model, acme, tmp_path):
    adapter = make_adapter(acme.tenant, base_model, tmp_path / "adapters")
    gone = make_adapter(acme.tenant, base_model, tmp_path / "gone", name="gone")
    shutil.rmtree(gone.path)
    deployment = make_deployment(base_model, [acme.tenant])
    folder = Path(base_model.path)

    out, err = io.StringIO(), io.StringIO()
    call_command("import_path_artifacts", "--dry-run", stdout=out, stderr=err)
    assert f"would import {folder}" in out.getvalue()
    assert BaseModel.objects.get(pk=base_model.pk).artifact_version is None

    call_command("import_path_artifacts", stdout=out, stderr=err)
    model = BaseModel.objects.get(pk=base_model.pk)
    assert model.artifact_version is not None and model.path == ""
    assert {f.path for f in model.artifact_version.files.all()} == {
        p.name for p in folder.iterdir()}
    assert model.source_label == "llama-mini v1"
    imported = LoraAdapter.objects.get(pk=adapter.pk)
    assert imported.artifact_version.artifact.tenant == acme.tenant
    assert LoraAdapter.objects.get(pk=gone.pk).artifact_version is None
    assert "is not a folder on this host" in err.getvalue()
    assert deployment.latest_revision.model_version == model.artifact_version
    assert "2 imported, 1 left" in out.getvalue().splitlines()[-1]
