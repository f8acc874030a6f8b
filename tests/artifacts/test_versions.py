"""A new version of a base model's files is a revision of each deployment of it: pending while
engines run, rolled out by `apply()`, and a rollback returns to the revision pinning the files
before; each instance pins the version of its revision, and a node's cache keeps the files of
every version one of its live instances runs. (The rollout itself is the reconciler's, tested
with engines in tests/engine/test_rollout_e2e.py; no engine runs here.)"""

from __future__ import annotations

import pytest
from django.db.models import RestrictedError

from serving_app.artifacts import sources, staging
from serving_app.models import ArtifactVersion, Instance, LoraAdapter, Node
from serving_app.models.events import Event
from tests.artifacts.conftest import adapter_from_artifact
from tests.factories import make_deployment, make_model_dir


def test_a_new_model_version_rolls_out_as_a_revision_and_rolls_back(artifact_model, acme,
                                                                     tmp_path):
    deployment = make_deployment(artifact_model, [acme.tenant], desired_state="running")
    old = artifact_model.artifact_version
    first = deployment.latest_revision
    assert first is not None and first.model_version == old
    node = Node.objects.create(name="gpu-1", queue="node.gpu-1")
    running = Instance.objects.create(deployment=deployment, node=node, state="ready")
    assert running.model_version == old

    folder = make_model_dir(tmp_path / "v2", "llama-mini")
    (folder / "generation_config.json").write_text('{"temperature": 0.2}')
    new = sources.import_console_folder(old.artifact, folder)
    assert new.number == 2
    artifact_model.artifact_version = new
    artifact_model.full_clean()
    artifact_model.save()

    deployment.refresh_from_db()
    pending = deployment.latest_revision
    assert pending.number == 2 and pending.model_version == new
    assert deployment.applied_revision == first  # engines run: pending until applied
    assert deployment.out_of_date() == [running]
    assert Event.objects.filter(deployment=deployment,
                                message__contains="model files llama-mini v1 → llama-mini v2"
                                ).exists()
    # Keeps the old files on the node while the old instance lives.
    assert {old.digest, new.digest} >= staging.versions_in_use("gpu-1")
    assert old.digest in staging.versions_in_use("gpu-1")

    deployment.apply()
    replacement = Instance.objects.create(deployment=deployment, node=node, ordinal=1,
                                          revision=pending)
    assert replacement.model_version == new
    assert staging.versions_in_use("gpu-1") == {old.digest, new.digest}

    deployment.rollback()
    deployment.refresh_from_db()
    back = Instance.objects.create(deployment=deployment, node=node, ordinal=2,
                                   revision=first)
    assert back.model_version == old  # the files before, whatever the model points at now


def test_saving_a_model_without_changing_its_files_records_no_revision(artifact_model, acme):
    deployment = make_deployment(artifact_model, [acme.tenant])
    revisions = deployment.revisions.count()
    artifact_model.dtype = "float16"
    artifact_model.save()
    assert deployment.revisions.count() == revisions


def test_a_tenant_with_adapter_versions_is_deleted_with_them(artifact_model, acme, tmp_path,
                                                           client_for, platform_admin):
    """A version its adapter still uses cannot be deleted alone, but goes with its tenant (the
    tenant's artifacts, versions and adapters in one cascade: found by the API fuzz test as a 500
    when the adapter protected the version)."""
    adapter = adapter_from_artifact(acme.tenant, artifact_model, tmp_path)
    version = adapter.artifact_version
    with pytest.raises(RestrictedError):
        version.delete()
    response = client_for(platform_admin).delete(f"/api/v1/tenants/{acme.tenant.slug}/")
    assert response.status_code == 204, response.content
    assert not ArtifactVersion.objects.filter(pk=version.pk).exists()
    assert not LoraAdapter.objects.filter(pk=adapter.pk).exists()
    # The platform's model version stays, with its model.
    assert ArtifactVersion.objects.filter(pk=artifact_model.artifact_version_id).exists()
