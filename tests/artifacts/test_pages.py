"""The console's artifact pages: versions, files with sizes and digests, the nodes holding each
version with their fetch progress, and a failed import's reason; platform admins only."""

from __future__ import annotations

from django.test import Client

from serving_app.models import Artifact, ArtifactImport, Instance, Node, NodeCacheEntry
from tests.factories import make_deployment


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


def test_instance_and_node_pages_show_staging_and_the_cache(platform_admin, acme,
                                                            artifact_model):
    version = artifact_model.artifact_version
    node = Node.objects.create(name="gpu-3", queue="node.gpu-3", cache_path="/srv/cache",
                               cache_quota_bytes=2**30, cache_used_bytes=3 * 2**20)
    NodeCacheEntry.objects.create(node=node, version=version, state="failed",
                                  error="llama-mini v1: HTTP 404")
    deployment = make_deployment(artifact_model, [acme.tenant])
    fetching = Instance.objects.create(deployment=deployment, node=node, staging={
        "artifact": "llama-mini v1", "bytes_done": 2**20, "bytes_total": 4 * 2**20,
        "bytes_per_second": 2**19, "eta_seconds": 6.0})
    failed = Instance.objects.create(deployment=deployment, node=node, ordinal=1, staging={
        "artifact": "llama-mini v1", "error": "llama-mini v1: the node's cache quota is full"})
    client = signed_in(platform_admin)
    page = client.get(f"/instances/{fetching.pk}/").content.decode()
    assert "1.0 MiB of 4.0 MiB at 512.0 KiB/s, about 6 s left" in page
    assert "llama-mini v1" in page
    assert "the node&#x27;s cache quota is full" in client.get(
        f"/instances/{failed.pk}/").content.decode()
    node_page = client.get(f"/nodes/{node.pk}/").content.decode()
    assert "/srv/cache" in node_page and "3.0 MiB of 1.0 GiB" in node_page
    assert "llama-mini v1: HTTP 404" in node_page


def test_a_deployments_instances_show_a_fetch_in_progress(platform_admin, acme, artifact_model,
                                                           client_for):
    deployment = make_deployment(artifact_model, [acme.tenant])
    instance = Instance.objects.create(deployment=deployment, state="staging", staging={
        "artifact": "llama-mini v1", "bytes_done": 2**20, "bytes_total": 4 * 2**20,
        "bytes_per_second": 2**19, "eta_seconds": 6.0})
    client = signed_in(platform_admin)
    page = client.get(f"/deployments/{deployment.pk}/instances/").content.decode()
    assert "fetching llama-mini v1: 1.0 MiB of 4.0 MiB at 512.0 KiB/s, about 6 s left" in page
    assert "Staging files" in page
    # The instance page's start-up panel, polled while it stages.
    panel = client.get(f"/instances/{instance.pk}/startup/").content.decode()
    assert "Staging files" in panel and 'hx-trigger="every 3s"' in panel
    assert "llama-mini v1: 1.0 MiB of 4.0 MiB at 512.0 KiB/s, about 6 s left" in panel
    # ...and the deployment in the API.
    [brief] = client_for(platform_admin).get(
        f"/api/v1/deployments/{deployment.pk}/").data["instances"]
    assert brief["state"] == "staging" and brief["staging"]["bytes_done"] == 2**20
