"""The launch spec maps every deployment setting to the vLLM flag an operator would type."""

from __future__ import annotations

import pytest

from serving_app.engine.launch import build_launch_spec
from serving_app.models import Gpu, Instance, Node
from tests.factories import make_adapter, make_deployment, make_tenant

pytestmark = pytest.mark.django_db


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def tenant():
    return make_tenant("acme")


def test_engine_settings_map_to_flags(tenant, base_model, settings):
    settings.ENGINE_CPU_KVCACHE_GIB = 2
    settings.ENGINE_CPU_SCHEDULING = "idle"
    deployment = make_deployment(
        base_model, [tenant], name="chat", max_num_seqs=12, max_model_len=1024,
        max_num_batched_tokens=2048, gpu_memory_utilization=0.45, dtype="float32",
        enable_prefix_caching=False, scheduling_policy="priority", max_loras=3, max_lora_rank=32,
    )
    instance = Instance.objects.create(deployment=deployment, port=18555)
    spec = build_launch_spec(deployment, instance, engine_env="/opt/engine", host="127.0.0.1")
    argv = spec.argv
    assert argv[:6] == ["chrt", "--idle", "0",
                        "/opt/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == base_model.path
    assert flag(argv, "--served-model-name") == "llama-mini"
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", "18555")
    assert flag(argv, "--api-key") == instance.secret
    assert flag(argv, "--max-num-seqs") == "12"
    assert flag(argv, "--max-model-len") == "1024"
    assert flag(argv, "--max-num-batched-tokens") == "2048"
    assert flag(argv, "--gpu-memory-utilization") == "0.45"
    assert flag(argv, "--tensor-parallel-size") == "1"
    assert flag(argv, "--dtype") == "float32"
    assert "--no-enable-prefix-caching" in argv
    assert flag(argv, "--scheduling-policy") == "priority"
    assert (flag(argv, "--max-loras"), flag(argv, "--max-lora-rank")) == ("3", "32")
    assert "--lora-modules" not in argv
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in spec.env
    assert "********" in spec.masked_argv() and instance.secret not in spec.masked_argv()


def test_cpu_engines_run_idle_class_unless_configured_otherwise(tenant, base_model, settings):
    settings.ENGINE_CPU_SCHEDULING = "idle"
    deployment = make_deployment(base_model, [tenant], name="d")
    instance = Instance.objects.create(deployment=deployment, port=1)
    assert build_launch_spec(deployment, instance, engine_env="/e").argv[:4] == [
        "chrt", "--idle", "0", "/e/bin/python"]
    settings.ENGINE_CPU_SCHEDULING = "normal"
    assert build_launch_spec(deployment, instance, engine_env="/e").argv[0] == "/e/bin/python"


def test_instance_secrets_never_look_like_an_option():
    from serving_app.models import new_instance_secret

    assert not any(new_instance_secret().startswith("-") for _ in range(2000))


def test_defaults_use_the_models_context_and_prefix_caching(tenant, base_model):
    deployment = make_deployment(base_model, [tenant], name="d")
    spec = build_launch_spec(deployment, Instance.objects.create(deployment=deployment, port=1))
    assert flag(spec.argv, "--max-model-len") == "2048"
    assert "--enable-prefix-caching" in spec.argv
    assert "--scheduling-policy" not in spec.argv
    assert "--max-num-batched-tokens" not in spec.argv


def test_adapters_are_loaded_at_start_under_tenant_qualified_names(tenant, base_model, tmp_path):
    first = make_adapter(tenant, base_model, tmp_path / "a", "support")
    second = make_adapter(tenant, base_model, tmp_path / "b", "billing")
    deployment = make_deployment(base_model, [tenant], name="d", adapters=[first, second])
    spec = build_launch_spec(deployment, Instance.objects.create(deployment=deployment, port=1))
    start = spec.argv.index("--lora-modules")
    assert spec.argv[start + 1:start + 3] == [
        f"acme--support={first.path}", f"acme--billing={second.path}"]
    assert "--enable-lora" in spec.argv


def test_gpus_mig_and_mps_environment(tenant, base_model):
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    gpu0 = Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="A100",
                              memory_total_bytes=80 * 2**30)
    gpu1 = Gpu.objects.create(node=node, index=1, uuid="GPU-1", name="A100",
                              memory_total_bytes=80 * 2**30)
    mig = Gpu.objects.create(node=node, index=0, uuid="MIG-abc", name="A100 3g.40gb",
                             memory_total_bytes=40 * 2**30, parent=gpu0, mig_profile="3g.40gb")
    deployment = make_deployment(base_model, [tenant], name="tp", tensor_parallel_size=2)
    instance = Instance.objects.create(deployment=deployment, port=1, gpu_memory_fraction=0.5)
    spec = build_launch_spec(deployment, instance, gpus=[gpu0, gpu1])
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-0,GPU-1"
    assert spec.argv[0] != "chrt"  # GPU engines keep normal scheduling
    assert flag(spec.argv, "--gpu-memory-utilization") == "0.5"
    assert "VLLM_CPU_KVCACHE_SPACE" not in spec.env

    mig_deployment = make_deployment(base_model, [tenant], name="mig", isolation_mode="mig")
    spec = build_launch_spec(mig_deployment, Instance.objects.create(deployment=mig_deployment,
                                                                     port=2), gpus=[mig])
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "MIG-abc"

    mps = make_deployment(base_model, [tenant], name="mps", isolation_mode="mps",
                          mps_thread_percentage=30)
    spec = build_launch_spec(mps, Instance.objects.create(deployment=mps, port=3,
                                                          gpu_memory_fraction=0.25), gpus=[gpu1])
    assert spec.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert spec.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20G"


def test_placement_environment_wins_and_declared_gpus_keep_the_cpu_cache(tenant, base_model):
    node = Node.objects.create(name="cpu-gpu", queue="node.cpu-gpu")
    declared = Gpu.objects.create(node=node, index=0, uuid="DECLARED-0", name="L4",
                                  memory_total_bytes=24 * 2**30, declared=True)
    deployment = make_deployment(base_model, [tenant], name="placed")
    instance = Instance.objects.create(deployment=deployment, port=4,
                                       environment={"CUDA_VISIBLE_DEVICES": "MIG-xyz"})
    spec = build_launch_spec(deployment, instance, gpus=[declared])
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "MIG-xyz"
    assert "VLLM_CPU_KVCACHE_SPACE" in spec.env


def test_migration_renews_secrets_that_look_like_an_option(tenant, base_model):
    from importlib import import_module

    from django.apps import apps

    renew = import_module("serving_app.migrations.0004_instance_secrets_not_options").renew
    deployment = make_deployment(base_model, [tenant], name="d")
    broken = Instance.objects.create(deployment=deployment, port=1)
    fine = Instance.objects.create(deployment=deployment, port=2)
    Instance.objects.filter(pk=broken.pk).update(secret="-dashed")
    Instance.objects.filter(pk=fine.pk).update(secret="kept")
    renew(apps, None)
    renewed = Instance.objects.get(pk=broken.pk).secret
    assert len(renewed) == 48 and not renewed.startswith("-")
    assert Instance.objects.get(pk=fine.pk).secret == "kept"
