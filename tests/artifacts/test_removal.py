"""Deleting artifact versions and artifacts (`serving_app/artifacts/removal.py`): refused while a
model, an adapter, a running instance or a deployment's revision needs them, naming what does;
otherwise gone with the files no other version holds, through the API and the console pages."""

from __future__ import annotations

import shutil

from django.test import Client

from audit_app.models import AuditLog
from serving_app.artifacts import sources
from serving_app.blobstore import console_store
from serving_app.models import (
    Artifact,
    ArtifactVersion,
    BaseModel,
    Blob,
    Deployment,
    DeploymentRevision,
    Instance,
    LoraAdapter,
    Rollout,
)
from tests.artifacts.conftest import adapter_from_artifact, model_artifact
from tests.factories import make_deployment


def two_versions(tmp_path):
    """A model artifact with two versions that share every file but one (v2 adds a file)."""
    artifact, v1 = model_artifact(tmp_path)
    folder = tmp_path / "v2"
    shutil.copytree(tmp_path / "src" / "llama-mini", folder)
    (folder / "README.md").write_text("version two\n")
    v2 = sources.import_console_folder(artifact, folder)
    return artifact, v1, v2


def register(version, name="llama-mini") -> BaseModel:
    model = BaseModel(name=name, artifact_version=version)
    model.full_clean()
    model.save()
    return model


def test_a_version_a_model_serves_is_kept_then_goes_with_only_its_own_files(
        platform_admin, client_for, tmp_path):
    artifact, v1, v2 = two_versions(tmp_path)
    model = register(v1)
    api = client_for(platform_admin)
    refused = api.delete(f"/api/v1/artifacts/{artifact.pk}/versions/1/")
    assert refused.status_code == 409, refused.data
    assert refused.data["needed_by"]["base_models"] == [{"id": model.pk, "name": "llama-mini"}]
    assert "llama-mini" in refused.data["detail"]
    assert ArtifactVersion.objects.filter(pk=v1.pk).exists()

    # Pointed at v2 instead: v1 goes. Its files v2 shares stay; v2 adds one, which v1 lacks, so
    # nothing of v1 is its own: no blob goes.
    model.artifact_version = v2
    model.save()
    shared = set(v1.files.values_list("blob_id", flat=True))
    deleted = api.delete(f"/api/v1/artifacts/{artifact.pk}/versions/1/")
    assert deleted.status_code == 204 and deleted["X-Bytes-Freed"] == "0"
    assert list(artifact.versions.values_list("number", flat=True)) == [2]
    assert all(console_store().has(d) for d in shared)
    entry = AuditLog.objects.get(action="delete_version")
    assert entry.changes["version"] == [1, None]
    assert api.delete(f"/api/v1/artifacts/{artifact.pk}/versions/1/").status_code == 404


def test_an_artifact_goes_with_its_versions_and_blobs_once_nothing_needs_them(
        platform_admin, acme, client_for, tmp_path, django_capture_on_commit_callbacks):
    artifact, v1, v2 = two_versions(tmp_path)
    model = register(v2)
    deployment = make_deployment(model, [acme.tenant], name="chat")  # applied revision: v2
    stopped = Instance.objects.create(deployment=deployment, state="stopped", model_version=v1)
    running = Instance.objects.create(deployment=deployment, state="ready", model_version=v1,
                                      ordinal=1)
    api = client_for(platform_admin)
    refused = api.delete(f"/api/v1/artifacts/{artifact.pk}/")
    assert refused.status_code == 409
    assert [d["name"] for d in refused.data["needed_by"]["deployments"]] == ["chat"]
    assert [m["name"] for m in refused.data["needed_by"]["base_models"]] == ["llama-mini"]

    # The running instance stops, the deployment and the model go: nothing needs it any more.
    Instance.objects.filter(pk=running.pk).update(state="stopped")
    Deployment.objects.filter(pk=deployment.pk).delete()
    model.delete()
    digests = set(Blob.objects.filter(files__version__artifact=artifact)
                  .values_list("sha256", flat=True))
    total = sum(Blob.objects.filter(sha256__in=digests).values_list("size", flat=True))
    assert all(console_store().has(d) for d in digests)
    with django_capture_on_commit_callbacks(execute=True):  # the files go once it commits
        deleted = api.delete(f"/api/v1/artifacts/{artifact.pk}/")
    assert deleted.status_code == 204 and int(deleted["X-Bytes-Freed"]) == total
    assert not Artifact.objects.filter(pk=artifact.pk).exists()
    assert not Blob.objects.filter(sha256__in=digests).exists()
    assert not any(console_store().has(d) for d in digests)
    assert AuditLog.objects.filter(action="delete", object_type__icontains="artifact").exists()
    del stopped  # deleted with its deployment


def test_a_stopped_instance_keeps_its_history_without_the_version(platform_admin, acme,
                                                                   client_for, tmp_path):
    artifact, v1, v2 = two_versions(tmp_path)
    model = register(v2)
    deployment = make_deployment(model, [acme.tenant], name="chat")
    Instance.objects.create(deployment=deployment, state="stopped", model_version=v1,
                            ordinal=1)  # an earlier one: history, which needs nothing
    stopped = Instance.objects.create(deployment=deployment, state="draining", model_version=v1)
    api = client_for(platform_admin)
    refused = api.delete(f"/api/v1/artifacts/{artifact.pk}/versions/1/")  # still serving
    assert refused.status_code == 409
    assert [d["name"] for d in refused.data["needed_by"]["deployments"]] == ["chat"]
    Instance.objects.filter(pk=stopped.pk).update(state="stopped")
    deleted = api.delete(f"/api/v1/artifacts/{artifact.pk}/versions/1/")
    assert deleted.status_code == 204
    stopped.refresh_from_db()
    assert stopped.model_version is None and stopped.deployment_id == deployment.pk


def test_a_rollback_target_keeps_its_version(platform_admin, acme, client_for, tmp_path):
    artifact, v1, v2 = two_versions(tmp_path)
    model = register(v1)
    deployment = make_deployment(model, [acme.tenant], name="chat")  # revision 1: v1
    # It runs (an instance on v2's files, so that it is not what keeps v1): the model's new
    # version is a new revision, pending until applied.
    Deployment.objects.filter(pk=deployment.pk).update(desired_state="running")
    Instance.objects.create(deployment=deployment, state="ready", model_version=v2)
    model.artifact_version = v2
    model.save()
    deployment.record_revision(by=platform_admin)
    revision = deployment.revisions.get(number=2)
    assert revision.model_version == v2 and deployment.applied_revision.number == 1
    rollout = deployment.apply(revision, by=platform_admin)  # from revision 1, active
    api = client_for(platform_admin)
    refused = api.delete(f"/api/v1/artifacts/{artifact.pk}/versions/1/")
    assert refused.status_code == 409
    assert [d["name"] for d in refused.data["needed_by"]["deployments"]] == ["chat"]
    # Finished: revision 2 applied, and revision 1 (v1) is what a rollback returns to.
    Rollout.objects.filter(pk=rollout.pk).update(state="succeeded")
    Deployment.objects.filter(pk=deployment.pk).update(applied_revision=revision)
    refused = api.delete(f"/api/v1/artifacts/{artifact.pk}/versions/1/")
    assert refused.status_code == 409
    assert [d["name"] for d in refused.data["needed_by"]["deployments"]] == ["chat"]
    # A newer rollout (to revision 3, from 2) leaves v1 to no one.
    third = DeploymentRevision.objects.create(deployment=deployment, number=3, spec=revision.spec,
                                              model_version=v2)
    Rollout.objects.create(deployment=deployment, from_revision=revision, to_revision=third,
                           state="succeeded")
    Deployment.objects.filter(pk=deployment.pk).update(applied_revision=third)
    assert api.delete(f"/api/v1/artifacts/{artifact.pk}/versions/1/").status_code == 204
    assert DeploymentRevision.objects.get(deployment=deployment, number=1).model_version is None


def test_tenants_delete_only_their_own_adapter_artifacts(acme, globex, base_model, client_for,
                                                          tmp_path):
    adapter = adapter_from_artifact(acme.tenant, base_model, tmp_path, "helpdesk")
    artifact = adapter.artifact_version.artifact
    assert client_for(globex.owner).delete(f"/api/v1/artifacts/{artifact.pk}/").status_code == 404
    assert client_for(acme.member).delete(f"/api/v1/artifacts/{artifact.pk}/").status_code == 403
    owner = client_for(acme.owner)
    refused = owner.delete(f"/api/v1/artifacts/{artifact.pk}/")
    assert refused.status_code == 409
    assert refused.data["needed_by"]["adapters"] == [{"id": adapter.pk, "name": str(adapter)}]
    LoraAdapter.objects.filter(pk=adapter.pk).delete()
    assert owner.delete(f"/api/v1/artifacts/{artifact.pk}/").status_code == 204
    assert not Artifact.objects.filter(pk=artifact.pk).exists()


def test_the_console_confirms_names_what_needs_it_and_deletes(platform_admin, acme, tmp_path):
    artifact, v1, v2 = two_versions(tmp_path)
    model = register(v1)
    client = Client()
    client.force_login(platform_admin)
    page = client.get(f"/artifacts/{artifact.pk}/").content.decode()
    assert f'href="/artifacts/{artifact.pk}/delete/"' in page
    assert f'href="/artifacts/{artifact.pk}/versions/1/delete/"' in page

    blocked = client.get(f"/artifacts/{artifact.pk}/versions/1/delete/").content.decode()
    assert 'id="delete-blocked"' in blocked and 'data-dependents="base_models"' in blocked
    assert "llama-mini" in blocked and 'value="delete"' not in blocked
    assert client.post(f"/artifacts/{artifact.pk}/versions/1/delete/",
                       {"confirm": "delete"}).status_code == 409
    assert artifact.versions.count() == 2

    page = client.get(f"/artifacts/{artifact.pk}/versions/2/delete/").content.decode()
    assert 'id="no-dependents"' in page and 'id="delete-note"' in page
    assert "12\xa0bytes of files" in page  # only v2's own file, README.md, is freed
    done = client.post(f"/artifacts/{artifact.pk}/versions/2/delete/", {"confirm": "delete"})
    assert done.status_code == 302 and done["Location"] == f"/artifacts/{artifact.pk}/"
    assert list(artifact.versions.values_list("number", flat=True)) == [1]

    model.delete()
    whole = client.get(f"/artifacts/{artifact.pk}/delete/").content.decode()
    assert "1 version(s) go with it" in whole
    done = client.post(f"/artifacts/{artifact.pk}/delete/", {"confirm": "delete"})
    assert done.status_code == 302 and done["Location"] == "/artifacts/"
    assert not Artifact.objects.filter(pk=artifact.pk).exists()

    outsider = Client()
    outsider.force_login(acme.owner)
    assert outsider.get(f"/artifacts/{v1.artifact_id}/delete/").status_code in (403, 404)


def test_a_tenants_files_count_against_its_quota_until_deleted_in_the_portal(
        acme, base_model, client_for, tmp_path, settings):
    adapter = adapter_from_artifact(acme.tenant, base_model, tmp_path, "helpdesk")
    version = adapter.artifact_version
    assert LoraAdapter.objects.storage_used(acme.tenant) == version.total_bytes
    # An upload past what is left is refused before anything is kept, with the reason.
    acme.tenant.storage_quota_mb = 1
    acme.tenant.save()
    api = client_for(acme.owner)
    big = [{"path": "adapter_model.safetensors", "size": 1024 * 1024, "sha256": "ab" * 32}]
    refused = api.post(f"/api/v1/artifacts/{version.artifact_id}/uploads/", {"files": big},
                       format="json")
    assert refused.status_code == 400 and "storage quota" in str(refused.data["files"])
    assert not version.artifact.imports.filter(source="upload").exists()

    client = Client()
    client.force_login(acme.owner)
    page = client.get("/portal/acme/adapters/").content.decode()
    assert 'id="adapter-files"' in page and 'data-files="helpdesk"' in page
    # The adapter serves the version: the version's page says so and offers no delete.
    url = f"/portal/acme/adapters/files/{version.artifact_id}/versions/1/delete/"
    assert 'id="delete-blocked"' in client.get(url).content.decode()
    assert client.post(url, {"confirm": "delete"}).status_code == 409
    # Deleting the adapter with its files frees the storage.
    confirm = client.get(f"/portal/acme/adapters/{adapter.pk}/delete/").content.decode()
    assert 'name="delete_files" value="1" checked' in confirm
    client.post(f"/portal/acme/adapters/{adapter.pk}/delete/", {"confirm": "delete",
                                                            "delete_files": "1"})
    assert not LoraAdapter.objects.filter(pk=adapter.pk).exists()
    assert not Artifact.objects.filter(pk=version.artifact_id).exists()
    assert LoraAdapter.objects.storage_used(acme.tenant) == 0


def test_a_version_no_adapter_serves_is_deleted_in_the_portal_and_others_cannot(
        acme, globex, base_model, tmp_path):
    adapter = adapter_from_artifact(acme.tenant, base_model, tmp_path, "helpdesk")
    version = adapter.artifact_version
    LoraAdapter.objects.filter(pk=adapter.pk).delete()  # the files stay, as the API leaves them
    url = f"/portal/acme/adapters/files/{version.artifact_id}/versions/1/delete/"
    for user, status in ((globex.owner, 404), (acme.member, 403)):
        other = Client()
        other.force_login(user)
        assert other.post(url, {"confirm": "delete"}).status_code == status
    client = Client()
    client.force_login(acme.admin)
    assert "No adapter serves these files" in client.get(url).content.decode()
    done = client.post(url, {"confirm": "delete"})
    assert done.status_code == 302 and done["Location"] == "/portal/acme/adapters/"
    assert not Artifact.objects.filter(pk=version.artifact_id).exists()


def test_a_platform_admin_reaches_a_tenants_adapter_upload_from_its_console_page(
        platform_admin, acme):
    client = Client()
    client.force_login(platform_admin)
    page = client.get("/tenants/acme/").content.decode()
    assert 'id="upload-for-tenant" href="/portal/acme/adapters/"' in page
    portal = client.get("/portal/acme/adapters/").content.decode()
    assert 'id="folder-upload"' in portal and 'id="upload-form"' in portal
