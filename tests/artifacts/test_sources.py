"""Versions from an S3-compatible bucket (moto's server, started here: a real S3-speaking HTTP
server) and from a Hugging Face repository (huggingface_hub's real code against a local
stand-in of the hub's HTTP API, tests/artifacts/hubstandin.py: no hub is reachable here)."""

from __future__ import annotations

import boto3
import pytest
from moto.server import ThreadedMotoServer

from serving_app.artifacts import sources
from serving_app.models import Artifact, ArtifactImport, ArtifactVersion, BaseModel
from tests.artifacts.conftest import announce
from tests.artifacts.hubstandin import hub_standin
from tests.factories import make_model_dir


@pytest.fixture(scope="module")
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def s3_import(artifact, endpoint, **detail):
    record = ArtifactImport.objects.create(
        artifact=artifact, source=ArtifactVersion.Source.S3,
        detail={"endpoint_url": endpoint, "access_key_id": "test", **detail},
        credential="test")
    return record, sources.run_import(record.pk)


def test_a_model_imported_from_an_s3_bucket(db, s3_endpoint, tmp_path):
    folder = make_model_dir(tmp_path, "llama-s3")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                      aws_access_key_id="test", aws_secret_access_key="test")
    s3.create_bucket(Bucket="models")
    for path in folder.iterdir():
        s3.upload_file(str(path), "models", f"llama/v1/{path.name}")
    s3.put_object(Bucket="models", Key="other/file", Body=b"not part of it")
    artifact = Artifact.objects.create(name="llama-s3", kind="model")
    record, outcome = s3_import(artifact, s3_endpoint, bucket="models", prefix="llama/v1")
    record.refresh_from_db()
    assert outcome == "done", record.error
    assert record.bytes_done == record.bytes_total > 0
    assert record.version.manifest() == announce(folder)
    assert "secret_access_key" not in record.version.source_detail
    model = BaseModel(name="llama-s3", artifact_version=record.version)
    model.full_clean()
    assert model.hidden_size == 128


def test_an_s3_import_that_fails_says_why(db, s3_endpoint):
    artifact = Artifact.objects.create(name="none", kind="model")
    record, outcome = s3_import(artifact, s3_endpoint, bucket="no-such-bucket", prefix="x")
    record.refresh_from_db()
    assert outcome == "failed" and record.state == "failed"
    assert "NoSuchBucket" in record.error and record.version is None


def test_a_model_imported_from_a_hugging_face_repository_at_a_revision(db, tmp_path):
    folder = make_model_dir(tmp_path, "tiny")
    artifact = Artifact.objects.create(name="tiny", kind="model")
    with hub_standin("acme/tiny", folder) as (endpoint, requested):
        record = ArtifactImport.objects.create(
            artifact=artifact, source=ArtifactVersion.Source.HUGGINGFACE,
            detail={"repo_id": "acme/tiny", "revision": "main", "endpoint": endpoint})
        outcome = sources.run_import(record.pk)
        record.refresh_from_db()
        assert outcome == "done", record.error
        assert any("/resolve/" in line for line in requested)  # files came over HTTP
        version = record.version
        assert version.manifest() == announce(folder)
        assert version.source_detail["commit"] == "c0ffee" * 6 + "abcd"
        missing = ArtifactImport.objects.create(
            artifact=artifact, source=ArtifactVersion.Source.HUGGINGFACE,
            detail={"repo_id": "acme/tiny", "revision": "nope", "endpoint": endpoint})
        assert sources.run_import(missing.pk) == "failed"
        missing.refresh_from_db()
        assert "nope" in missing.error or "Revision" in missing.error
