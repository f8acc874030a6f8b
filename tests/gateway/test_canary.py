"""The canary gate: an adapter loaded at run time whose generation fails is never routed to,
while the engine's /health answers 200 and its base model and other adapters are served.

The session's real CPU engine and gateways (tests/engines.py, tests/gateway/conftest.py); the node
agent's runtime load (`agent.sync_adapters`, what its Celery task runs) is called in this process
against that engine. The broken adapter is a copy of a good one with its lora_B weights set to
NaN, as a bad export leaves them: vLLM loads it (`/v1/load_lora_adapter` answers 200, `/v1/models`
lists it), and a plain request for it answers 200 with an empty text, but the canary (one token
with its logprob) answers 400 "Out of range float values are not JSON compliant".
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import openai
import pytest
from django.test import Client

from serving_app.engine import agent
from serving_app.engine.client import EngineClient, engine_http
from serving_app.models import Instance, LoraAdapter
from tests.api.helpers import as_user
from tests.gateway.conftest import MODELS

pytestmark = pytest.mark.django_db(transaction=True)
NAN_F32 = struct.pack("<f", float("nan"))


def nan_adapter(source: Path, folder: Path) -> Path:
    """A copy of the adapter at `source` whose lora_B tensors are all NaN (same shapes)."""
    shutil.copytree(source, folder)
    path = folder / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    for name, tensor in header.items():
        if "lora_B" in name:
            assert tensor["dtype"] == "F32", tensor
            start, end = (8 + length + offset for offset in tensor["data_offsets"])
            data[start:end] = NAN_F32 * ((end - start) // 4)
    path.write_bytes(bytes(data))
    return folder


def test_an_adapter_whose_generation_fails_is_never_routed_to(world, gateway, engine,
                                                              platform_admin, tmp_path):
    broken = LoraAdapter(tenant=world.acme, base_model=world.base, name="broken",
                         path=str(nan_adapter(MODELS / "tiny-llama-lora-c", tmp_path / "broken")))
    broken.full_clean()
    broken.save()
    world.deployment.adapters.add(broken)
    config = agent.AgentConfig(name="local", address="127.0.0.1", engine_env="", gpus="")
    client = gateway.client(world.acme_secret)
    try:
        outcome = agent.sync_adapters(world.instance.pk, config)

        # Loaded into the engine, which stays healthy; its canary failed, so it is not routed.
        engine_client = EngineClient(engine.url, engine.secret)
        assert engine_client.healthy()
        assert "acme--broken" in {m["id"] for m in engine_client.models()}
        # The gateway knows the model (it is in the tenant's catalog)...
        assert "broken" in {m.id for m in client.models.list().data}
        served_before = engine.metric("vllm:request_success_total")
        # ...and never sends it to the engine: a request for it gets an OpenAI-shaped 503, not
        # the engine's NaN-made empty answer. Until the gateway's catalog (refreshed every 0.5 s
        # here) has read the instance's loaded adapters, the 503 says only that no instance is
        # ready; from then on, for three refreshes, it also says the test generation failed.
        def refusal() -> str:
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="broken", prompt="Hello", max_tokens=2)
            assert refused.value.status_code == 503
            assert refused.value.code == "model_not_ready", refused.value.body
            return refused.value.message

        noted = "its test generation failed"
        deadline = time.monotonic() + 10
        while noted not in refusal():
            assert time.monotonic() < deadline, "the 503 never named the failed canary"
            time.sleep(0.1)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert noted in refusal()
        assert engine.metric("vllm:request_success_total") == served_before
        # The base model and the good adapters are served as before.
        for model in ("tiny-llama", "style"):
            assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices

        assert outcome == {"acme--broken": "canary failed"}
        instance = Instance.objects.get(pk=world.instance.pk)
        assert "acme--broken" in instance.loaded_adapters
        assert sorted(instance.routable_adapters) == ["acme--style", "globex--tone"]
        [problem] = instance.canary_problems
        assert problem.startswith("Canary failed for adapter acme--broken: HTTP 400: ")
        assert "Out of range float values are not JSON compliant" in problem
        # Shown on the instance's page, in the API and to the adapter's tenant.
        assert "Canary failed for adapter acme--broken" in _page(platform_admin, instance)
        api = as_user(platform_admin).get(f"/api/v1/instances/{instance.pk}/").json()
        assert api["canary_problems"] == [problem]
        assert "acme--broken" not in api["routable_adapters"]
        assert LoraAdapter.objects.get(pk=broken.pk).last_error.startswith(
            "Canary generation failed on tiny#0: HTTP 400")
    finally:
        # The session's engine is shared: unload the broken adapter.
        world.deployment.adapters.remove(broken)
        agent.sync_adapters(world.instance.pk, config)
    assert "acme--broken" not in {m["id"] for m in EngineClient(engine.url, engine.secret).models()}
    assert engine_http().get(engine.url + "/health", timeout=5).status_code == 200


def _page(user, instance: Instance) -> str:
    browser = Client()
    browser.force_login(user)
    return browser.get(instance.get_absolute_url()).content.decode()
