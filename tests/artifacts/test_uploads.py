"""Artifacts through the API: chunked resumable uploads with progress, versions made once per
set of files, base models and adapters registered from a version, tenants kept apart."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving_app.artifacts import sources
from serving_app.models import Artifact, ArtifactImport, ArtifactVersion, BaseModel, Blob
from serving_app.models.adapters import UPLOAD_RESERVED_FOR
from tests.artifacts.conftest import announce, model_artifact
from tests.factories import make_adapter_dir, make_model_dir


def put_chunk(client, record_id, digest, data, first, total):
    return client.generic(
        "PUT", f"/api/v1/artifact-imports/{record_id}/blobs/{digest}/", data,
        content_type="application/octet-stream",
        HTTP_CONTENT_RANGE=f"bytes {first}-{first + len(data) - 1}/{total}")


@pytest.fixture
def model_folder(tmp_path):
    return make_model_dir(tmp_path / "upload", "llama-up")


def test_a_model_uploaded_in_chunks_resumes_and_becomes_a_version(
        platform_admin, client_for, model_folder):
    client = client_for(platform_admin)
    created = client.post("/api/v1/artifacts/", {"name": "llama-up", "kind": "model"},
                          format="json")
    assert created.status_code == 201, created.content
    files = announce(model_folder)
    started = client.post(f"/api/v1/artifacts/{created.data['id']}/uploads/",
                          {"files": files}, format="json")
    assert started.status_code == 201, started.content
    record = started.data
    assert record["bytes_done"] == 0 and record["bytes_total"] == sum(f["size"] for f in files)
    weights = next(f for f in files if f["path"] == "model.safetensors")
    data = (model_folder / "model.safetensors").read_bytes()
    half = len(data) // 2
    first = put_chunk(client, record["id"], weights["sha256"], data[:half], 0, len(data))
    assert first.status_code == 200, first.content
    assert first.data["bytes_done"] == half
    # A client that lost track sends the second half again from 0: told where to resume.
    wrong = put_chunk(client, record["id"], weights["sha256"], data[half:], 0, len(data))
    assert wrong.status_code == 409 and wrong.data["received"] == half
    status = client.get(f"/api/v1/artifact-imports/{record['id']}/").data
    assert next(f for f in status["files"] if f["path"] == "model.safetensors")["received"] == half
    early = client.post(f"/api/v1/artifact-imports/{record['id']}/complete/")
    assert early.status_code == 400 and "config.json" in str(early.data)
    assert put_chunk(client, record["id"], weights["sha256"], data[half:], half,
                     len(data)).status_code == 200
    config = (model_folder / "config.json").read_bytes()
    config_digest = next(f["sha256"] for f in files if f["path"] == "config.json")
    assert put_chunk(client, record["id"], config_digest, config, 0,
                     len(config)).status_code == 200
    done = client.post(f"/api/v1/artifact-imports/{record['id']}/complete/")
    assert done.status_code == 200, done.content
    assert done.data["state"] == "done" and done.data["version"] == 1
    assert done.data["bytes_done"] == done.data["bytes_total"]
    version = ArtifactVersion.objects.get(artifact_id=created.data["id"])
    assert version.manifest() == sorted(files, key=lambda f: f["path"])
    model = client.post("/api/v1/base-models/", {"name": "llama-up",
                                                 "artifact_version": version.pk}, format="json")
    assert model.status_code == 201, model.content
    assert model.data["hidden_size"] == 128 and model.data["served_from"] == "llama-up v1"


def test_a_file_whose_bytes_do_not_match_its_digest_is_discarded(
        platform_admin, client_for, model_folder):
    client = client_for(platform_admin)
    artifact = Artifact.objects.create(name="x", kind="model")
    files = announce(model_folder)
    record = client.post(f"/api/v1/artifacts/{artifact.pk}/uploads/", {"files": files},
                         format="json").data
    config = next(f for f in files if f["path"] == "config.json")
    bad = b"{" + b" " * (config["size"] - 1)
    reply = put_chunk(client, record["id"], config["sha256"], bad, 0, len(bad))
    assert reply.status_code == 409 and reply.data["received"] == 0
    assert "upload it again" in str(reply.data["chunk"])
    assert not Blob.objects.exists()


def test_the_same_files_again_are_stored_once_and_give_the_same_version(
        platform_admin, client_for, tmp_path):
    artifact, version = model_artifact(tmp_path)
    client = client_for(platform_admin)
    files = announce(tmp_path / "src" / "llama-mini")
    record = client.post(f"/api/v1/artifacts/{artifact.pk}/uploads/", {"files": files},
                         format="json").data
    assert record["bytes_done"] == record["bytes_total"]  # every file already held
    done = client.post(f"/api/v1/artifact-imports/{record['id']}/complete/").data
    assert done["version"] == version.number == 1
    assert ArtifactVersion.objects.count() == 1


@pytest.mark.parametrize("files, field_text", [
    ([{"path": "../etc/passwd", "size": 1, "sha256": "a" * 64}], "relative"),
    ([{"path": "a", "size": -1, "sha256": "a" * 64}], "size"),
    ([{"path": "a", "size": 1, "sha256": "xyz"}], "sha256"),
    ([{"path": "a", "size": 1, "sha256": "a" * 64}] * 2, "twice"),
    ([], "files"),
])
def test_bad_announced_files_get_a_field_error_and_change_nothing(
        platform_admin, client_for, files, field_text):
    artifact = Artifact.objects.create(name="x", kind="model")
    reply = client_for(platform_admin).post(f"/api/v1/artifacts/{artifact.pk}/uploads/",
                                            {"files": files}, format="json")
    assert reply.status_code == 400 and "files" in reply.data
    assert field_text in str(reply.data)
    assert not artifact.imports.exists()


def test_a_version_is_immutable(db, tmp_path):
    _, version = model_artifact(tmp_path)
    version.total_bytes = 1
    with pytest.raises(ValueError, match="immutable"):
        version.save()


def test_tenants_upload_their_own_adapters_and_never_see_anothers(
        acme, globex, client_for, tmp_path):
    owner = client_for(acme.owner)
    created = owner.post("/api/v1/artifacts/", {"name": "lora", "kind": "adapter",
                                                "tenant": "acme"}, format="json")
    assert created.status_code == 201, created.content
    # A base model's files are the platform's; a member may not write.
    assert owner.post("/api/v1/artifacts/", {"name": "m", "kind": "model"},
                      format="json").status_code == 403
    member = client_for(acme.member)
    files = announce(make_adapter_dir(tmp_path, "lora"))
    assert member.post(f"/api/v1/artifacts/{created.data['id']}/uploads/", {"files": files},
                       format="json").status_code == 403
    record = owner.post(f"/api/v1/artifacts/{created.data['id']}/uploads/", {"files": files},
                        format="json").data
    other = client_for(globex.owner)
    assert other.get(f"/api/v1/artifacts/{created.data['id']}/").status_code == 404
    assert other.get(f"/api/v1/artifact-imports/{record['id']}/").status_code == 404
    assert other.post(f"/api/v1/artifact-imports/{record['id']}/complete/").status_code == 404
    assert created.data["id"] not in [a["id"] for a in other.get("/api/v1/artifacts/").data[
        "results"]]
    assert owner.post(f"/api/v1/artifacts/{created.data['id']}/imports/",
                      {"source": "s3", "bucket": "b"}, format="json").status_code == 403


def test_a_legacy_path_model_keeps_working_and_says_so(base_model):
    assert base_model.artifact_version is None and base_model.path
    assert base_model.source_label == "Path on every node (legacy)"
    assert BaseModel.objects.get(pk=base_model.pk).path == base_model.path


def test_staging_on_a_node_is_for_platform_admins_and_names_a_real_node(
        platform_admin, acme, client_for, artifact_model):
    url = f"/api/v1/artifacts/{artifact_model.artifact_version.artifact_id}/stage/"
    assert client_for(platform_admin).post(url, {"node": "nowhere"},
                                           format="json").status_code == 400
    assert client_for(platform_admin).post(url, {"node": "x\x00"},
                                           format="json").status_code == 400
    assert client_for(acme.owner).post(url, {"node": "nowhere"},
                                       format="json").status_code in (403, 404)


def test_an_upload_idle_for_a_day_is_abandoned_its_files_removed_and_its_chunks_refused(
        platform_admin, client_for, model_folder):
    """An upload that received nothing for `UPLOAD_RESERVED_FOR` no longer holds its size
    against the tenant's quota: going on with it would store files no quota check has seen, so
    its chunks and its completion are refused; beat's expiry fails it, saying why, removes its
    partial files, and leaves an upload that moved recently alone."""
    client = client_for(platform_admin)
    artifact = Artifact.objects.create(name="idle", kind="model")
    files = announce(model_folder)
    weights = next(f for f in files if f["path"] == "model.safetensors")
    data = (model_folder / "model.safetensors").read_bytes()
    idle, fresh = (client.post(f"/api/v1/artifacts/{artifact.pk}/uploads/", {"files": files},
                               format="json").data for _ in range(2))
    for record in (idle, fresh):
        assert put_chunk(client, record["id"], weights["sha256"], data[:10], 0,
                         len(data)).status_code == 200
    partial = sources._upload_dir(ArtifactImport.objects.get(pk=idle["id"]))
    assert partial.is_dir()
    ArtifactImport.objects.filter(pk=idle["id"]).update(
        updated_at=timezone.now() - UPLOAD_RESERVED_FOR - timedelta(minutes=1))

    late = put_chunk(client, idle["id"], weights["sha256"], data[10:20], 10, len(data))
    assert late.status_code == 400 and "abandoned" in str(late.data["upload"])
    assert (partial / weights["sha256"]).stat().st_size == 10  # nothing written
    assert client.post(f"/api/v1/artifact-imports/{idle['id']}/complete/").status_code == 400

    assert sources.expire_abandoned_uploads() == 1
    record = ArtifactImport.objects.get(pk=idle["id"])
    assert record.state == "failed" and "abandoned" in record.error
    assert not partial.exists()
    again = put_chunk(client, idle["id"], weights["sha256"], data[:10], 0, len(data))
    assert again.status_code == 400 and again.data["upload"] == [record.error]
    shown = client.get(f"/api/v1/artifact-imports/{idle['id']}/").data
    assert shown["state"] == "failed" and "abandoned" in shown["error"]
    # The other upload moved within the day: untouched, and it goes on.
    assert sources.expire_abandoned_uploads() == 0
    assert ArtifactImport.objects.get(pk=fresh["id"]).state == "waiting"
    assert put_chunk(client, fresh["id"], weights["sha256"], data[10:20], 10,
                     len(data)).status_code == 200
