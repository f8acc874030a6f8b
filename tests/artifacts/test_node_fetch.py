"""Node caches fetching from the console over real HTTP (Django's live server): per-node
credentials, range requests that resume, corrupt files fetched again, a tenant's adapter only
for a node that serves the tenant, a folder of a node's host imported through the console, and
the node agent starting an engine only on verified files (a failed fetch fails the start and
names the artifact)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest

from serving_app import blobstore, lifecycle
from serving_app.artifacts import fetch, peer, staging
from serving_app.artifacts.cache import NodeCache
from serving_app.blobstore import FileEntry, manifest_digest, manifest_of
from serving_app.deployments import draining
from serving_app.engine import agent, supervisor
from serving_app.models import (
    AdapterFileRemoval,
    Artifact,
    ArtifactImport,
    ArtifactVersion,
    Instance,
    Node,
    NodeCacheEntry,
)
from serving_app.models.events import Event, Kind
from tests.artifacts.conftest import adapter_from_artifact, announce
from tests.factories import make_deployment, make_model_dir

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def node_config(live_server, tmp_path):
    def build(name: str, quota: int = 50_000_000) -> staging.NodeCacheConfig:
        Node.objects.get_or_create(name=name, defaults={"queue": f"node.{name}"})
        return staging.NodeCacheConfig(node=name, root=tmp_path / f"cache-{name}",
                                       quota_bytes=quota, console_url=live_server.url)
    return build


def place(deployment, node_name: str) -> Instance:
    return Instance.objects.create(deployment=deployment, node=Node.objects.get(name=node_name))


def blob_url(live_server, digest: str) -> str:
    return f"{live_server.url}{fetch.BLOB_PATH}{digest}"


def test_the_blob_endpoint_wants_the_nodes_own_token(live_server, node_config, artifact_model):
    config = node_config("node-a")
    digest = artifact_model.artifact_version.files.first().blob_id
    assert httpx.get(blob_url(live_server, digest)).status_code == 401
    staging.node_token("node-a")
    wrong = fetch.auth_header("node-a", "not-its-token")
    assert httpx.get(blob_url(live_server, digest), headers=wrong).status_code == 401
    right = fetch.auth_header("node-a", staging.node_token(config.node))
    assert httpx.get(blob_url(live_server, digest), headers=right).status_code == 200


def test_a_fetch_resumes_with_a_range_request(live_server, node_config, artifact_model,
                                               tmp_path):
    config = node_config("node-a")
    stored = artifact_model.artifact_version.files.get(path="model.safetensors")
    entry = FileEntry(stored.path, stored.size, stored.blob_id)
    fetcher = fetch.http_fetcher(config.console_url, "node-a", staging.node_token("node-a"))
    partial = tmp_path / "partial"
    # Marked bytes where the first 100 would be: a ranged answer appends after them.
    partial.write_bytes(b"\x01" * 100)
    fetcher(entry, partial, lambda n: None)
    data = partial.read_bytes()
    assert len(data) == stored.size and data[:100] == b"\x01" * 100


def test_an_instance_is_staged_from_the_console_and_a_corrupt_file_is_fetched_again(
        live_server, node_config, artifact_model, acme):
    config = node_config("node-b")
    instance = place(make_deployment(artifact_model, [acme.tenant]), "node-b")
    assert instance.model_version == artifact_model.artifact_version  # pinned at creation
    staging.stage_instance(instance, config)
    folder = Path(instance.deployment.base_model.path)
    assert folder.is_relative_to(config.root)
    version = artifact_model.artifact_version
    assert manifest_digest(manifest_of(folder)) == version.digest
    entry = NodeCacheEntry.objects.get(node__name="node-b", version=version)
    assert entry.state == "ready" and entry.bytes_done == version.total_bytes
    instance.refresh_from_db()
    assert instance.staging["bytes_done"] == version.total_bytes
    node = Node.objects.get(name="node-b")
    assert node.cache_used_bytes == version.total_bytes and node.cache_path == str(config.root)
    with (folder / "model.safetensors").open("r+b") as handle:
        handle.seek(10)
        handle.write(b"corrupt!")
    staging.stage_instance(instance, config)
    assert manifest_digest(manifest_of(folder)) == version.digest


def test_a_node_fetches_a_tenants_adapter_only_while_it_serves_the_tenant(
        live_server, node_config, artifact_model, acme, globex, tmp_path):
    config = node_config("node-c")
    adapter = adapter_from_artifact(acme.tenant, artifact_model, tmp_path)
    # node-c runs globex's deployment only.
    place(make_deployment(artifact_model, [globex.tenant]), "node-c")
    with pytest.raises(staging.StagingError, match=r"acme/lora v1: .*HTTP 404"):
        staging.adapter_folder(adapter, config)
    assert NodeCacheEntry.objects.get(node__name="node-c").state == "failed"
    place(make_deployment(artifact_model, [acme.tenant], adapters=[adapter]), "node-c")
    folder = staging.adapter_folder(adapter, config)
    assert (folder / "adapter_config.json").is_file()


def test_a_folder_on_a_node_is_imported_through_the_console(live_server, node_config, tmp_path,
                                                            monkeypatch):
    config = node_config("node-d")
    # The agent runs on another host: the console's blob store is not on its disk. The live
    # server's threads (the console) keep the real one; this thread (the agent) sees an empty one.
    console_store = blobstore.console_store
    agents_disk = blobstore.BlobStore(tmp_path / "not-the-console-store")
    monkeypatch.setattr(blobstore, "console_store", lambda: (
        agents_disk if threading.current_thread() is threading.main_thread()
        else console_store()))
    folder = make_model_dir(tmp_path / "on-node-d", "weights")
    artifact = Artifact.objects.create(name="weights", kind="model")
    record = ArtifactImport.objects.create(
        artifact=artifact, source=ArtifactVersion.Source.NODE_FOLDER,
        node=Node.objects.get(name="node-d"), detail={"folder": str(folder)})
    assert staging.import_node_folder(record.pk, config) == "done"
    record.refresh_from_db()
    assert record.state == "done" and record.bytes_done == record.bytes_total
    assert record.version.manifest() == announce(folder)
    # Another node cannot send blobs for it.
    other = node_config("node-e")
    reply = httpx.put(blob_url(live_server, "0" * 64), content=b"x", headers={
        **fetch.auth_header("node-e", staging.node_token(other.node)), "X-Import": str(record.pk)})
    assert reply.status_code == 403


def test_the_agent_starts_no_engine_when_the_files_cannot_be_fetched(
        node_config, artifact_model, acme, monkeypatch, tmp_path):
    config = node_config("node-f")
    monkeypatch.setenv("NODE_CACHE_DIR", str(config.root))
    monkeypatch.setenv("NODE_CONSOLE_URL", "http://127.0.0.1:9")  # nothing listens there
    instance = place(make_deployment(artifact_model, [acme.tenant]), "node-f")
    outcome = agent.start_instance(instance.pk, agent.AgentConfig(
        name="node-f", address="127.0.0.1", engine_env="", gpus=""))
    instance.refresh_from_db()
    assert outcome == "failed" and (instance.pid, instance.port) == (None, None)
    assert instance.last_error.startswith("Staging llama-mini v1: ")
    assert instance.staging["error"].startswith("llama-mini v1: ")


@pytest.fixture
def agent_on(node_config, monkeypatch):
    """A node agent's start path for `name`, its cache fetching from the live console, and
    what each of its fetches saw of the instance. The engine's launch is replaced by a recorder
    that refuses (this test is about what comes before it; real launches are in tests/engine)."""
    seen: dict = {"fetches": [], "launches": []}

    def build(name: str, on_fetch=None):
        config = node_config(name)
        monkeypatch.setenv("NODE_CACHE_DIR", str(config.root))
        monkeypatch.setenv("NODE_CONSOLE_URL", config.console_url)
        monkeypatch.setattr(staging, "PROGRESS_SECONDS", 0)
        fetch_one = NodeCache._fetch_one

        def watched(cache, entry, fetcher, progress):
            row = Instance.objects.values("pk", "state", "port", "pid", "staging").get(
                node__name=name, state__in=["staging", "stopped"])
            seen["fetches"].append(row)
            if on_fetch is not None:
                on_fetch(row)
            return fetch_one(cache, entry, fetcher, progress)

        def launch(argv, env, log_path):
            seen["launches"].append({
                "argv": argv, "state": Instance.objects.get(node__name=name).state,
                "entries": dict(NodeCacheEntry.objects.filter(node__name=name).values_list(
                    "version__artifact__name", "state"))})
            raise OSError("no engine in this test")

        monkeypatch.setattr(NodeCache, "_fetch_one", watched)
        monkeypatch.setattr(supervisor, "launch", launch)
        return agent.AgentConfig(name=name, address="127.0.0.1", engine_env="", gpus="")

    build.seen = seen
    return build


def test_an_instance_stages_its_files_before_it_takes_a_port_or_starts_an_engine(
        agent_on, artifact_model, acme, tmp_path):
    config = agent_on("node-s")
    adapter = adapter_from_artifact(acme.tenant, artifact_model, tmp_path)
    instance = place(make_deployment(artifact_model, [acme.tenant], adapters=[adapter]),
                     "node-s")
    assert agent.start_instance(instance.pk, config) == "failed"  # the launch recorder refuses
    fetches, [launch] = agent_on.seen["fetches"], agent_on.seen["launches"]
    # Every file fetched while the instance was staging, with nothing of the node held...
    assert len(fetches) == artifact_model.artifact_version.files.count() + \
        adapter.artifact_version.files.count()
    assert {(f["state"], f["port"], f["pid"]) for f in fetches} == {("staging", None, None)}
    assert any(f["staging"].get("artifact") == "acme/lora v1" for f in fetches)
    # ...and the engine launched only once both versions were verified in the cache, on them.
    assert launch["state"] == "starting"
    assert launch["entries"] == {"llama-mini": "ready", "lora": "ready"}
    command = " ".join(launch["argv"])
    versions = str(Path(os.environ["NODE_CACHE_DIR"]) / "versions")
    assert f"--model={versions}/{artifact_model.artifact_version.digest}" in command
    assert f"{versions}/{adapter.artifact_version.digest}" in command
    staged = Event.objects.get(kind=Kind.STAGED, instance=instance)
    assert "verified in the cache of node-s" in staged.message
    assert staged.data["adapters"] == ["acme--lora"]


def test_a_stop_during_staging_leaves_nothing_launched(agent_on, artifact_model, acme):
    def stop_it(row):
        draining.request_stop(Instance.objects.get(pk=row["pk"]), "test")

    config = agent_on("node-t", on_fetch=stop_it)
    instance = place(make_deployment(artifact_model, [acme.tenant]), "node-t")
    outcome = agent.start_instance(instance.pk, config)
    assert outcome == "cancelled (stopped while staging)"
    instance.refresh_from_db()
    assert (instance.state, instance.port, instance.pid) == ("stopped", None, None)
    assert agent_on.seen["launches"] == []


def test_a_node_fetches_from_a_peer_that_holds_the_files(
        live_server, node_config, artifact_model, acme, tmp_path):
    """node-a fetched the model from the console and serves its cache; node-b, whose console
    address leads nowhere, gets every file from node-a, verified."""
    first = node_config("node-a")
    place(make_deployment(artifact_model, [acme.tenant]), "node-a")
    staging.stage_version(artifact_model.artifact_version, first)
    server = peer.PeerServer(first).start()
    try:
        second = node_config("node-b")
        second.console_url = "http://127.0.0.1:9"  # nothing listens there
        folder = staging.stage_version(artifact_model.artifact_version, second)
        version = artifact_model.artifact_version
        assert manifest_digest(manifest_of(folder)) == version.digest
        assert sorted(server.served) == sorted(f.blob_id for f in version.files.all())
        # A node without the peer's token gets nothing from it.
        digest = version.files.first().blob_id
        assert httpx.get(f"{server.url}{fetch.BLOB_PATH}{digest}").status_code == 401
    finally:
        server.stop()


def test_a_peer_serves_a_tenants_adapter_only_to_a_node_serving_the_tenant(
        live_server, node_config, artifact_model, acme, globex, tmp_path):
    adapter = adapter_from_artifact(acme.tenant, artifact_model, tmp_path)
    holder = node_config("node-a")
    place(make_deployment(artifact_model, [acme.tenant], adapters=[adapter]), "node-a")
    staging.adapter_folder(adapter, holder)
    server = peer.PeerServer(holder).start()
    try:
        other = node_config("node-c")
        place(make_deployment(artifact_model, [globex.tenant]), "node-c")
        digest = adapter.artifact_version.files.first().blob_id
        headers = fetch.auth_header("node-c", staging.node_token("node-c"))
        assert httpx.get(f"{server.url}{fetch.BLOB_PATH}{digest}",
                         headers=headers).status_code == 404
        with pytest.raises(staging.StagingError, match="HTTP 404"):
            staging.adapter_folder(adapter, other)  # nor from the console
        assert server.served == []
    finally:
        server.stop()


def test_an_operator_prestages_a_version_on_a_node_before_any_instance(
        live_server, node_config, artifact_model, platform_admin, client_for):
    config = node_config("node-p")
    version = artifact_model.artifact_version
    reply = client_for(platform_admin).post(
        f"/api/v1/artifacts/{version.artifact_id}/stage/", {"node": "node-p"}, format="json")
    assert reply.status_code == 202 and reply.data["state"] == "fetching"
    # What the node's agent runs for the queued task:
    assert staging.prestage(version.pk, config) == "ready"
    assert NodeCacheEntry.objects.get(node__name="node-p", version=version).state == "ready"
    assert staging.versions_in_use("node-p") == set()  # held, though no instance uses it
    assert version.digest in {d for d, _ in config.cache().versions()}


def test_a_deleted_adapter_leaves_every_node_cache_once_no_engine_has_it(
        live_server, node_config, artifact_model, acme, tmp_path, monkeypatch):
    """The control side asks the nodes holding the version once every engine has unloaded the
    adapter (the reconciler asks them to: tests/engine); each node drops it unless an instance
    of its own still has it, and keeps everything else it holds."""
    asked: list[tuple[int, str]] = []
    monkeypatch.setattr(lifecycle, "free_cached_version",
                        lambda removal, queue: asked.append((removal, queue)))
    adapter = adapter_from_artifact(acme.tenant, artifact_model, tmp_path)
    digest = adapter.artifact_version.digest
    deployment = make_deployment(artifact_model, [acme.tenant], adapters=[adapter])
    configs, instances = {}, {}
    for name in ("node-a", "node-b"):
        configs[name] = node_config(name)
        instances[name] = place(deployment, name)
        Instance.objects.filter(pk=instances[name].pk).update(
            state="ready", loaded_adapters=["acme--lora"])
        staging.stage_version(artifact_model.artifact_version, configs[name])
        staging.adapter_folder(adapter, configs[name])
    model_bytes = artifact_model.artifact_version.total_bytes

    adapter.delete()
    removal = AdapterFileRemoval.objects.get(engine_name="acme--lora")
    assert (removal.version_digest, removal.path) == (digest, "")
    assert AdapterFileRemoval.objects.remove_released() == 0 and asked == []  # still loaded
    Instance.objects.filter(pk=instances["node-a"].pk).update(loaded_adapters=[])
    assert AdapterFileRemoval.objects.remove_released() == 0 and asked == []  # node-b has it
    assert staging.free_version(removal.pk, configs["node-b"]) == "in use"
    Instance.objects.filter(pk=instances["node-b"].pk).update(loaded_adapters=[])
    assert AdapterFileRemoval.objects.remove_released() == 0
    assert sorted(asked) == [(removal.pk, "node.node-a"), (removal.pk, "node.node-b")]
    AdapterFileRemoval.objects.remove_released()
    assert len(asked) == 2  # asked again only a minute later

    for name, config in configs.items():  # what each node's agent runs for the task
        assert staging.free_version(removal.pk, config).startswith("freed ")
        cache = config.cache()
        assert not cache.version_dir(digest).exists()
        assert [d for d, _ in cache.versions()] == [artifact_model.artifact_version.digest]
        assert cache.used_bytes() == model_bytes
        assert Node.objects.get(name=name).cache_used_bytes == model_bytes
        staging.stage_version(artifact_model.artifact_version, config)  # still whole
    assert not NodeCacheEntry.objects.filter(version__digest=digest).exists()
    assert AdapterFileRemoval.objects.remove_released() == 1
    assert AdapterFileRemoval.objects.get(pk=removal.pk).removed_at is not None
