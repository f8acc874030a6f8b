"""End to end: the management API, real Celery node agents and control worker, real vLLM engines.

These tests start processes and take minutes; they are the proof that a deployment defined in
the console becomes running engines that stay up without anyone watching.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket

import psutil
import pytest

from benchmarks.gateway_bench import kill_group
from serving_app.artifacts import sources
from serving_app.engine import supervisor
from serving_app.engine.client import engine_http
from serving_app.models import (
    Artifact,
    ArtifactVersion,
    Deployment,
    EngineSample,
    Instance,
    LoraAdapter,
    NodeCacheEntry,
)
from serving_app.models.revisions import Rollout
from tenants_app.models import ApiKey
from tests.api.helpers import as_user
from tests.engine.conftest import MODELS, Traffic, engine_sessions, instance_state, wait_for
from tests.gateway.conftest import start_gateway
from tests.unit.test_process_groups import session_members

pytestmark = [pytest.mark.engine, pytest.mark.celery]
State = Instance.State
START_TIMEOUT = 300  # a loaded 2-core machine has taken 100 s to start one


def complete(instance: Instance, model: str) -> dict:
    response = engine_http().post(
        f"{instance.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {instance.secret}"},
        json={"model": model, "prompt": "Hello there", "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def ready_instances(deployment_id: int) -> list[Instance]:
    return list(Instance.objects.select_related("node").filter(
        deployment_id=deployment_id, state=State.READY).order_by("ordinal"))


def register_model(admin, path=MODELS / "tiny-llama", name="tiny-llama") -> dict:
    response = as_user(admin).post("/api/v1/base-models/",
                                   {"name": name, "path": str(path), "dtype": "float32"},
                                   format="json")
    assert response.status_code == 201, response.data
    return response.data


def register_adapter(user, tenant: str, name: str, path) -> dict:
    response = as_user(user).post(
        "/api/v1/adapters/",
        {"tenant": tenant, "base_model": "tiny-llama", "name": name, "path": str(path)},
        format="json")
    assert response.status_code == 201, response.data
    return response.data


def create_deployment(admin, **fields) -> dict:
    """A deployment of the tiny model, eager: a CPU engine then skips torch.compile's warm-up,
    which nothing here is about (a start took 0.64 of the CPU seconds and 0.58 of the wall
    time: benchmarks/engine_start_bench.py, docs/testing.md)."""
    body = {"name": "chat", "base_model": "tiny-llama", "tenants": ["acme"], "max_model_len": 512,
            "max_num_seqs": 8, "dtype": "float32", "max_loras": 4, "max_lora_rank": 16,
            "enforce_eager": True, **fields}
    response = as_user(admin).post("/api/v1/deployments/", body, format="json")
    assert response.status_code == 201, response.data
    return response.data


def port_is_free(port: int) -> bool:
    return supervisor.port_is_free(port)


def artifact_version(name: str, folder, tenant=None) -> int:
    """The id of a version of `folder`'s files in the console's blob store (as an upload or an
    import would leave it)."""
    kind = "adapter" if tenant is not None else "model"
    artifact = Artifact.objects.create(name=name, kind=kind, tenant=tenant)
    return sources.import_console_folder(artifact, folder).pk


def register_artifact_adapter(user, tenant, name: str, folder) -> dict:
    response = as_user(user).post(
        "/api/v1/adapters/",
        {"tenant": tenant.slug, "base_model": "tiny-llama", "name": name,
         "artifact_version": artifact_version(name, folder, tenant)}, format="json")
    assert response.status_code == 201, response.data
    return response.data


@pytest.mark.engines(2)
def test_deployment_lifecycle_end_to_end(cluster, platform_admin, acme, tmp_path, live_server,
                                         settings, gateway_redis):
    """The model and the deployed adapters are artifact versions: each node agent fetches them
    from the console (Django's live server) into its own cache and starts its engine there. The
    second agent runs in a mount namespace where the model roots, the tenants' storage and the
    console's blob store are empty folders: a host sharing no filesystem with the console.
    (The broken adapter below is a legacy host-path one, no longer deployed by then.) At the
    end, a deleted adapter leaves both engines and both caches, and a new version of the
    model's files rolls out and back through the gateway with no failed request."""
    cluster.env.update(GATEWAY_REDIS_URL=gateway_redis, GATEWAY_CATALOG_REFRESH_SECONDS="0.5")
    cluster.start_control()
    caches = tmp_path / "caches"
    cluster.start_agent("cpu-a", {"NODE_CONSOLE_URL": live_server.url,
                                  "NODE_CACHE_DIR": str(caches / "cpu-a")})
    response = as_user(platform_admin).post("/api/v1/base-models/", {
        "name": "tiny-llama", "dtype": "float32",
        "artifact_version": artifact_version("tiny-llama", MODELS / "tiny-llama")}, format="json")
    assert response.status_code == 201, response.data
    model = response.data
    lora_a = register_artifact_adapter(platform_admin, acme.tenant, "support",
                                       MODELS / "tiny-llama-lora-a")
    lora_b = register_artifact_adapter(platform_admin, acme.tenant, "billing",
                                       MODELS / "tiny-llama-lora-b")
    # Five slots: on CPU one stays spare, so the runtime loads below (a third and a broken
    # fourth adapter) reach the engine rather than being refused for want of a slot.
    deployment = create_deployment(platform_admin, adapters=[lora_a["id"], lora_b["id"]],
                                   max_loras=5)
    client = as_user(platform_admin)
    assert client.post(f"/api/v1/deployments/{deployment['id']}/start/").status_code == 200

    # Ready, and serving the base model and each adapter.
    [instance] = wait_for(lambda: ready_instances(deployment["id"]), START_TIMEOUT, "ready")
    seen_pids = {instance.pid}
    assert sorted(instance.loaded_adapters) == ["acme--billing", "acme--support"]
    outputs = {model: complete(instance, model)["choices"][0]["text"]
               for model in ("tiny-llama", "acme--support", "acme--billing")}
    assert len(set(outputs.values())) == 3, outputs  # adapters visibly change the output
    # The node agent samples the engine's own metrics, at its interval: the completions' tokens
    # show up in the engine's counters as read, and later readings cover an interval.
    wait_for(lambda: EngineSample.objects.filter(
        instance=instance, generation_tokens_total__gt=0, interval_seconds__isnull=False,
    ).exists(), 30, "engine samples of the agent with the completions' tokens")
    api_view = client.get(f"/api/v1/instances/{instance.pk}/").data
    assert "--lora-modules" in api_view["command"]
    # The key is in the engine's environment only: on no command line that `ps` shows, not in
    # what the API shows; the adapters went over in vLLM's JSON form.
    assert instance.secret not in json.dumps(api_view, default=str)
    assert "VLLM_API_KEY" not in instance.environment
    assert supervisor.environ(instance.pid)["VLLM_API_KEY"] == instance.secret
    assert not [process for process in psutil.process_iter()
                if instance.secret in " ".join(supervisor.cmdline(process.pid))]
    modules = api_view["command"][api_view["command"].index("--lora-modules") + 1:][:2]
    assert sorted(json.loads(m)["name"] for m in modules) == ["acme--billing", "acme--support"]
    assert api_view["log_tail"]

    # The engine loads the model from this node's cache.
    assert f"--model={caches / 'cpu-a' / 'versions'}" in " ".join(api_view["command"])

    # A third adapter at runtime, without a restart (fetched into the cache before the load).
    lora_c = register_artifact_adapter(platform_admin, acme.tenant, "legal",
                                       MODELS / "tiny-llama-lora-c")
    response = client.patch(f"/api/v1/deployments/{deployment['id']}/",
                            {"adapters": [lora_a["id"], lora_b["id"], lora_c["id"]]},
                            format="json")
    assert response.status_code == 200, response.data
    wait_for(lambda: "acme--legal" in Instance.objects.get(pk=instance.pk).loaded_adapters,
             60, "runtime adapter load")
    assert complete(instance, "acme--legal")["choices"][0]["text"]
    assert Instance.objects.get(pk=instance.pk).pid == instance.pid

    # An adapter that fails to load leaves the engine serving, with the error on the adapter.
    broken_dir = tmp_path / "broken-adapter"
    shutil.copytree(MODELS / "tiny-llama-lora-c", broken_dir)
    broken = register_adapter(platform_admin, "acme", "broken", broken_dir)
    weights = broken_dir / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    client.patch(f"/api/v1/deployments/{deployment['id']}/",
                 {"adapters": [lora_a["id"], lora_b["id"], lora_c["id"], broken["id"]]},
                 format="json")
    wait_for(lambda: LoraAdapter.objects.get(pk=broken["id"]).last_error, 60, "load error")
    assert instance_state(instance.pk) == State.READY
    assert complete(instance, "acme--support")["choices"][0]["text"]
    client.patch(f"/api/v1/deployments/{deployment['id']}/",
                 {"adapters": [lora_a["id"], lora_b["id"], lora_c["id"]]}, format="json")

    # SIGKILL the engine: the supervisor notices and the reconciler brings it back. The leader's
    # children (EngineCore, workers) are orphaned by the kill; the agent must clear them.
    names = [psutil.Process(pid).name() for pid in session_members(instance.pid)]
    assert any("Worker" in name for name in names), f"no worker process of its own: {names}"
    os.kill(instance.pid, signal.SIGKILL)
    wait_for(lambda: Instance.objects.filter(pk=instance.pk, restarts=1).exists(), 60, "restart")
    restarted = wait_for(lambda: Instance.objects.filter(pk=instance.pk, state=State.READY,
                                                         restarts=1).first(),
                         START_TIMEOUT, "ready again")
    assert restarted.pid != instance.pid
    wait_for(lambda: not session_members(instance.pid), 30, "the killed engine's children gone")
    assert engine_sessions(instance.secret) == {restarted.pid}  # only the new engine's session
    seen_pids.add(restarted.pid)
    assert complete(restarted, "acme--legal")["choices"][0]["text"]

    # Restart the node agent: the engine is adopted, not duplicated or killed.
    cluster.stop_process("agent-cpu-a")
    cluster.start_agent("cpu-a")
    wait_for(lambda: "'adopted': 1" in cluster.log("agent-cpu-a"), 30, "adoption")
    adopted = Instance.objects.get(pk=instance.pk)
    assert (adopted.state, adopted.pid, adopted.port) == (State.READY, restarted.pid,
                                                           restarted.port)
    assert Instance.objects.filter(deployment_id=deployment["id"]).exclude(
        state=State.STOPPED).count() == 1
    assert complete(adopted, "tiny-llama")["choices"][0]["text"]

    # Scale to two instances; a second node agent on this machine, with its own queue and
    # cache, that cannot read the console's folders, takes one.
    cluster.start_agent("cpu-b", {"NODE_CONSOLE_URL": live_server.url,
                                  "NODE_CACHE_DIR": str(caches / "cpu-b")},
                        hidden=(MODELS.resolve(), settings.TENANT_STORAGE_ROOT,
                                settings.ARTIFACT_STORE_ROOT))
    response = client.post(f"/api/v1/deployments/{deployment['id']}/scale/", {"replicas": 2},
                           format="json")
    assert response.status_code == 200
    two = wait_for(lambda: len(ready_instances(deployment["id"])) == 2
                   and ready_instances(deployment["id"]), START_TIMEOUT, "two ready instances")
    assert {i.node.name for i in two} == {"cpu-a", "cpu-b"}
    on_b = next(i for i in two if i.node.name == "cpu-b")
    assert f"--model={caches / 'cpu-b' / 'versions'}" in " ".join(on_b.command)
    seen_pids.update(i.pid for i in two)
    ports = {i.port for i in two}
    for each in two:
        assert complete(each, "acme--billing")["choices"][0]["text"]

    # The third adapter deleted: both engines unload it, then both nodes drop its files.
    legal = ArtifactVersion.objects.get(pk=lora_c["artifact_version"]).digest
    assert all((caches / n / "versions" / legal).is_dir() for n in ("cpu-a", "cpu-b"))
    assert client.delete(f"/api/v1/adapters/{lora_c['id']}/").status_code == 204
    # Each agent drops the files, then its cache entry (not atomic together): waited for both.
    wait_for(lambda: not any("acme--legal" in i.loaded_adapters
                             for i in ready_instances(deployment["id"]))
             and not any((caches / n / "versions" / legal).exists() for n in ("cpu-a", "cpu-b"))
             and not NodeCacheEntry.objects.filter(version__digest=legal).exists(),
             60, "the deleted adapter unloaded, out of both caches and their entries")
    assert complete(two[1], "acme--billing")["choices"][0]["text"]

    # A new version of the model's files rolls out (one replica: at most two engines), with
    # traffic through the gateway, and back: the rollback starts the pinned old version again
    # from the files cpu-a's cache kept (the same blob, not fetched again).
    others = _roll_a_new_model_version_out_and_back(
        cluster, client, deployment["id"], model["id"], caches, acme, tmp_path, gateway_redis)
    seen_pids.update(i.pid for i in others)

    # Stop everything: no engine process left, every port free.
    assert client.post(f"/api/v1/deployments/{deployment['id']}/stop/").status_code == 200
    wait_for(lambda: not Instance.objects.filter(deployment_id=deployment["id"]).exclude(
        state=State.STOPPED).exists(), 60, "all stopped")
    for pid in seen_pids:
        assert not supervisor.is_alive(pid), pid
        assert session_members(pid) == [], f"processes of engine session {pid} remain"
    for each in [*two, *others]:  # nor anything started with an engine's key that left its session
        assert engine_sessions(each.secret) == set()
    for port in ports:
        assert port_is_free(port), port
    assert Deployment.objects.get(pk=deployment["id"]).desired_state == "stopped"


def _roll_a_new_model_version_out_and_back(cluster, client, deployment_id: int, model_id: int,
                                           caches, acme, tmp_path, gateway_redis
                                           ) -> list[Instance]:
    """Scale to one replica (cpu-a's stays), roll model files v2 out (its instance goes to the
    emptier node, cpu-b, which fetches v2) and roll back (the v1 instance goes to cpu-a, whose
    cache kept v1); the instances it started."""
    url = f"/api/v1/deployments/{deployment_id}/"
    assert client.post(url + "scale/", {"replicas": 1}, format="json").status_code == 200
    [old] = wait_for(lambda: len(live(deployment_id)) == 1 and live(deployment_id), 60,
                     "one instance left")
    assert old.node.name == "cpu-a"
    v1 = ArtifactVersion.objects.get(pk=old.model_version_id)
    weights = v1.files.get(path="model.safetensors").blob_id
    blob_a = caches / "cpu-a" / "blobs" / weights[:2] / weights
    kept = blob_a.stat().st_ino
    newer = tmp_path / "tiny-llama-v2"
    shutil.copytree(MODELS / "tiny-llama", newer)
    (newer / "README.md").write_text("Version 2 of the tiny model's files.\n")
    v2 = sources.import_console_folder(v1.artifact, newer)
    assert str(v2) == "tiny-llama v2"
    edited = client.patch(f"/api/v1/base-models/{model_id}/", {"artifact_version": v2.pk},
                          format="json")
    assert edited.status_code == 200, edited.data
    pending = client.get(url).data["pending_revision"]
    assert pending is not None

    _, secret = ApiKey.objects.create_key(tenant=acme.tenant, name="versions")
    gateway = start_gateway(cluster.env["DATABASE_URL"], workers=1,
                            GATEWAY_REDIS_URL=gateway_redis)
    # One thread, a request a second: enough to see a failed request at each switch, light
    # enough that each engine start beside it is not starved of the 2 cores (two threads
    # pausing 0.3 s made each start here take over 3 minutes under load).
    traffic = Traffic(gateway.client(secret, timeout=300), threads=1, pause=1.0)
    try:
        assert traffic.client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=4)
        traffic.start()
        applied = client.post(url + "apply/", {"strategy": "rolling"}, format="json")
        assert applied.status_code == 200, applied.data
        wait_for(lambda: _rollout(deployment_id).state != Rollout.State.RUNNING,
                 2 * START_TIMEOUT, "the rollout of the new files")
        assert _rollout(deployment_id).state == Rollout.State.SUCCEEDED
        [new] = live(deployment_id)
        assert (new.node.name, new.model_version_id, new.state) == ("cpu-b", v2.pk, State.READY)
        assert f"--model={caches / 'cpu-b' / 'versions' / v2.digest}" in " ".join(new.command)
        assert traffic.failures == [] and traffic.ok > 0, traffic.failures[:5]

        rolled = client.post(url + "rollback/")
        assert rolled.status_code == 200, rolled.data
        wait_for(lambda: _rollout(deployment_id).state != Rollout.State.RUNNING,
                 2 * START_TIMEOUT, "the rollback")
        assert _rollout(deployment_id).state == Rollout.State.SUCCEEDED
        [back] = live(deployment_id)
        assert (back.node.name, back.model_version_id, back.state) == ("cpu-a", v1.pk,
                                                                        State.READY)
        assert f"--model={caches / 'cpu-a' / 'versions' / v1.digest}" in " ".join(back.command)
        assert blob_a.stat().st_ino == kept  # served from the cache, not fetched again
        traffic.stop()
        assert traffic.failures == [] and traffic.ok > 0, traffic.failures[:5]
    finally:
        traffic.stop()
        kill_group(gateway.proc)
    return [new, back]


def live(deployment_id: int) -> list[Instance]:
    return list(Instance.objects.select_related("node").filter(deployment_id=deployment_id)
                .exclude(state=State.STOPPED).order_by("ordinal"))


def _rollout(deployment_id: int) -> Rollout:
    return Rollout.objects.filter(deployment_id=deployment_id).latest("created_at")


@pytest.mark.engines(1)
def test_model_files_gone_fails_with_the_reason(cluster, platform_admin, acme, tmp_path):
    model_dir = tmp_path / "vanishing-model"
    shutil.copytree(MODELS / "tiny-llama", model_dir)
    cluster.start_control()
    cluster.start_agent("cpu-b")
    register_model(platform_admin, model_dir)
    (model_dir / "config.json").unlink()
    deployment = create_deployment(platform_admin)
    as_user(platform_admin).post(f"/api/v1/deployments/{deployment['id']}/start/")
    failed = wait_for(lambda: Instance.objects.filter(deployment_id=deployment["id"],
                                                      state=State.FAILED).first(), 60, "failed")
    assert "no config.json" in failed.last_error
    assert "no config.json" in failed.log_tail
    assert failed.pid is None


@pytest.mark.engines(1)
def test_port_already_taken_fails_with_the_reason(cluster, platform_admin, acme):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        cluster.start_control()
        cluster.start_agent("cpu-c")
        register_model(platform_admin)
        deployment = create_deployment(platform_admin, base_port=port)
        as_user(platform_admin).post(f"/api/v1/deployments/{deployment['id']}/start/")
        failed = wait_for(lambda: Instance.objects.filter(deployment_id=deployment["id"],
                                                          state=State.FAILED).first(),
                          60, "failed")
        assert f"Port {port} is already in use" in failed.last_error
        assert "already in use" in failed.log_tail
    finally:
        holder.close()


@pytest.mark.engines(1)
def test_engine_that_exits_at_start_fails_then_crash_loops(cluster, platform_admin, acme,
                                                             tmp_path):
    model_dir = tmp_path / "corrupt-model"
    shutil.copytree(MODELS / "tiny-llama", model_dir)
    cluster.env["CRASH_LOOP_RESTARTS"] = "1"
    cluster.start_control()
    cluster.start_agent("cpu-d")
    register_model(platform_admin, model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # header intact, tensors cut short
    deployment = create_deployment(platform_admin)
    as_user(platform_admin).post(f"/api/v1/deployments/{deployment['id']}/start/")
    failed = wait_for(lambda: Instance.objects.filter(deployment_id=deployment["id"],
                                                      state=State.FAILED).first(),
                      START_TIMEOUT, "failed")
    assert "exited during start" in failed.last_error
    assert "Traceback" in failed.log_tail or "Error" in failed.log_tail
    looping = wait_for(lambda: Instance.objects.filter(deployment_id=deployment["id"],
                                                       state=State.CRASH_LOOP).first(),
                       START_TIMEOUT, "crash loop")
    assert looping.restarts == 1
    assert looping.last_error.startswith("Crash loop: 1 restarts")
    assert "Last error: The engine" in looping.last_error  # the cause stays visible


def test_adapter_for_another_base_model_is_refused(platform_admin, acme, db):
    register_model(platform_admin)
    response = as_user(platform_admin).post(
        "/api/v1/adapters/",
        {"tenant": "acme", "base_model": "tiny-llama", "name": "wide",
         "path": str(MODELS / "tiny-wide-lora")},
        format="json")
    assert response.status_code == 400
    assert "another base model" in str(response.data["base_model"])
