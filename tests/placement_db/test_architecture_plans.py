"""Architecture-aware plans through the console: a capacity-test model registered from a real
``config.json`` keeps it, the plan (API and deployment page) names each term's rule, a layout
the planner does not model is refused with its reason, and a measured profile stored from an
engine's logged start is used instead, marked "measured"."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from serving_app.engine.startup import StartupProgress
from serving_app.fleet.read import model_architecture, record_measured_profile
from serving_app.models import BaseModel, Instance
from tests.api.helpers import as_user
from tests.factories import make_deployment
from tests.placement_db.placement_helpers import make_node

pytestmark = pytest.mark.django_db

CONFIGS = Path(__file__).resolve().parent.parent / "placement" / "fixtures" / "configs"
GPU_FIXTURES = Path(__file__).resolve().parent.parent / "gpu" / "fixtures"


def page_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def capacity_model(tmp_path: Path, shape: str) -> BaseModel:
    folder = tmp_path / shape
    folder.mkdir()
    shutil.copy(CONFIGS / f"{shape}.json", folder / "config.json")
    (folder / "tokenizer_config.json").write_text("{}")
    model = BaseModel(name=shape.replace(".", "-"), path=str(folder),
                      load_format=BaseModel.LoadFormat.DUMMY)
    model.full_clean()
    model.save()
    return model


def test_a_mixture_of_experts_model_is_planned_with_every_expert(tmp_path, platform_admin,
                                                                 acme):
    make_node("node-a", "1xNVIDIA H100 80GB HBM3:80GiB")
    model = capacity_model(tmp_path, "qwen3-30b-a3b")
    # Registered with its config and every expert's weights: 30,532,122,624 x 2 B.
    assert model.weight_bytes == 30_532_122_624 * 2
    assert model.config["num_experts"] == 128
    # 2 x 48 layers x 4 KV heads x 128 x 2 B, on the model's page as well.
    assert model.kv_bytes_per_token == 98_304
    deployment = make_deployment(model, [acme.tenant], max_num_seqs=16, max_model_len=8192)
    body = as_user(platform_admin).get(f"/api/v1/deployments/{deployment.pk}/plan/").data
    memory = body["memory"]
    assert memory["kv_bytes_per_token"] == 98_304 and memory["source"] == "formula"
    rules = {row["term"]: row["rule"] for row in memory["rules"]}
    assert "128 experts (top 8, width 768) on 48 layers" in rules["Architecture"]
    assert "fused MoE workspaces" in rules["Activations"]
    page = page_client(platform_admin).get(f"/deployments/{deployment.pk}/plan/")
    assert b"data-plan-rules" in page.content and b"fused MoE workspaces" in page.content


def test_a_state_space_model_is_refused_then_planned_from_its_measured_profile(
        tmp_path, platform_admin, acme):
    node = make_node("node-a", "1xNVIDIA H100 80GB HBM3:80GiB")
    model = capacity_model(tmp_path, "mamba-2.8b")  # registers: no attention heads needed
    deployment = make_deployment(model, [acme.tenant], max_num_seqs=16, max_model_len=2048)
    client = as_user(platform_admin)
    body = client.get(f"/api/v1/deployments/{deployment.pk}/plan/").data
    assert body["ok"] is False and not body.get("memory")
    assert body["reason"].startswith("Not planned automatically: model_type 'mamba' has "
                                     "state-space or linear-attention layers")
    page = page_client(platform_admin).get(f"/deployments/{deployment.pk}/plan/")
    assert b"Cannot be placed: Not planned automatically" in page.content

    # The capacity test: one start of the engine; what it logged (here the verbatim lines of
    # an H100 start, tests/gpu/fixtures) is read into the instance's startup figures.
    progress = StartupProgress()
    progress.feed((GPU_FIXTURES / "startup_eager_mps_h100.log").read_text().splitlines(), 1.0)
    instance = Instance.objects.create(deployment=deployment, ordinal=0, node=node,
                                       state="ready", startup=progress.to_dict())
    call_command("measure_model", str(instance.pk))
    model.refresh_from_db()
    assert model.measured_profile["weights_gib"] == 1.84
    assert model.measured_profile["kv_cache_tokens"] == 73632

    body = client.get(f"/api/v1/deployments/{deployment.pk}/plan/").data
    memory = body["memory"]
    assert memory["source"] == "measured"
    # 1.84 GiB of weights; KV 2.25 GiB / 73,632 tokens = 32,811 B/token; 0.5 GiB activation;
    # 0.16 GiB non-torch + 0.0 GiB graphs.
    assert memory["weight_bytes"] == int(1.84 * 1024**3)
    assert memory["kv_bytes_per_token"] == round(2.25 * 1024**3 / 73632)
    assert memory["activation_bytes"] == int(0.5 * 1024**3)
    assert memory["runtime_overhead_bytes"] == int(0.16 * 1024**3)
    rules = {row["term"]: row["rule"] for row in memory["rules"]}
    assert rules["Weights"].startswith("measured: 1.84 GiB per GPU (instance ")
    page = page_client(platform_admin).get(f"/deployments/{deployment.pk}/plan/")
    assert b"data-measured" in page.content


def test_terms_the_engine_did_not_log_are_marked_absent(tmp_path, acme):
    node = make_node("node-a", "1xNVIDIA H100 80GB HBM3:80GiB")
    model = capacity_model(tmp_path, "qwen3-8b")
    deployment = make_deployment(model, [acme.tenant], max_num_seqs=16, max_model_len=4096)
    # A CPU engine logs its weights and KV cache, no memory split.
    cpu = StartupProgress()
    cpu.feed(["INFO [gpu_model_runner.py:1] Model loading took 15.3 GiB and 9.1 seconds",
              "INFO [kv_cache_utils.py:1] CPU KV cache size: 7,168 tokens",
              "INFO [cpu_worker.py:1] Available KV cache memory: 1.0 GiB"], 1.0)
    instance = Instance.objects.create(deployment=deployment, ordinal=0, node=node,
                                       startup=cpu.to_dict())
    profile = record_measured_profile(instance)
    assert profile.absent() == ["peak activation", "non-torch memory", "CUDA graphs"]
    model.refresh_from_db()
    arch = model_architecture(model)
    assert arch.measured is not None and arch.measured.kv_cache_tokens == 7168


def test_a_start_that_logged_nothing_is_not_stored(tmp_path, acme):
    model = capacity_model(tmp_path, "qwen3-8b")
    deployment = make_deployment(model, [acme.tenant], max_num_seqs=16, max_model_len=4096)
    instance = Instance.objects.create(deployment=deployment, ordinal=0)
    with pytest.raises(CommandError, match="logged none of the figures"):
        call_command("measure_model", str(instance.pk))
