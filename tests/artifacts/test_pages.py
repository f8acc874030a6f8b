"""The console's artifact pages: versions, files with sizes and digests, the nodes holding each
version with their fetch progress, and a failed import's reason; platform admins only."""

from __future__ import annotations

from django.test import Client

from serving_app.models import Artifact, ArtifactImport, Node, NodeCacheEntry


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_an_artifact_page_shows_versions_files_nodes_and_errors(
        platform_admin, acme, artifact_model):
    version = artifact_model.artifact_version
    node = Node.objects.create(name="gpu-2", queue="node.gpu-2")
    NodeCacheEntry.objects.create(node=node, version=version, state="fetching",
                                  bytes_total=version.total_bytes, bytes_done=1024,
                                  bytes_per_second=2048.0)
    ArtifactImport.objects.create(artifact=version.artifact, source="s3", state="failed",
                                  error="NoSuchBucket: the bucket does not exist")
    client = signed_in(platform_admin)
    listing = client.get("/artifacts/").content.decode()
    assert "llama-mini" in listing and "NoSuchBucket" in listing
    page = client.get(f"/artifacts/{version.artifact_id}/").content.decode()
    digest = version.files.get(path="model.safetensors").blob_id
    assert "model.safetensors" in page and digest in page and version.digest in page
    assert "gpu-2" in page and "1.0 KiB of" in page and "2.0 KiB/s" in page
    assert "NoSuchBucket: the bucket does not exist" in page
    assert "base model" in page and artifact_model.name in page
    model_page = client.get(f"/models/{artifact_model.pk}/").content.decode()
    assert "llama-mini v1" in model_page
    assert signed_in(acme.owner).get(f"/artifacts/{version.artifact_id}/").status_code in (
        302, 403)


def test_the_list_says_why_it_is_empty(platform_admin):
    page = signed_in(platform_admin).get("/artifacts/").content.decode()
    assert "No artifacts yet" in page
    assert not Artifact.objects.exists()
