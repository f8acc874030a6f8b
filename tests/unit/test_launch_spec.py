"""The launch spec maps every deployment setting to the vLLM flag an operator would type."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from serving_app import pki
from serving_app.engine.environment import interpreter
from serving_app.engine.launch import LOOPBACK_ONLY, build_launch_spec
from serving_app.models import BaseModel, Deployment, Gpu, Instance, LoraAdapter, Node
from tenants_app.models import PriorityTier, Tenant
from tests.factories import make_adapter, make_deployment, make_tenant

pytestmark = pytest.mark.django_db


def flag(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    raise ValueError(f"{name} not in {argv}")


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
    spec = build_launch_spec(instance, engine_env="/opt/engine", host="127.0.0.1")
    argv = spec.argv
    assert argv[:6] == ["chrt", "--idle", "0",
                        "/opt/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == base_model.path
    assert flag(argv, "--served-model-name") == "llama-mini"
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", "18555")
    assert "--api-key" not in argv and not any(instance.secret in arg for arg in argv)
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


def test_the_secret_is_only_in_the_process_environment(tenant, base_model):
    """Not on the command line (`ps` shows it to every local user), not in the environment that
    is recorded on the instance and shown, not taken from a recorded environment either."""
    deployment = make_deployment(base_model, [tenant], name="d")
    instance = Instance.objects.create(deployment=deployment, port=1,
                                       environment={"VLLM_API_KEY": "recorded-by-mistake"})
    spec = build_launch_spec(instance)
    assert spec.process_env()["VLLM_API_KEY"] == instance.secret
    assert "VLLM_API_KEY" not in spec.env
    assert instance.secret not in json.dumps([spec.argv, spec.env])
    assert instance.secret not in repr(spec)


def test_cpu_engines_run_idle_class_unless_configured_otherwise(tenant, base_model, settings):
    settings.ENGINE_CPU_SCHEDULING = "idle"
    deployment = make_deployment(base_model, [tenant], name="d")
    instance = Instance.objects.create(deployment=deployment, port=1)
    assert build_launch_spec(instance, engine_env="/e").argv[:4] == [
        "chrt", "--idle", "0", "/e/bin/python"]
    settings.ENGINE_CPU_SCHEDULING = "normal"
    assert build_launch_spec(instance, engine_env="/e").argv[0] == "/e/bin/python"


def test_a_one_rank_cpu_engine_runs_its_worker_in_engine_core_only_when_configured(
    tenant, base_model, settings
):
    deployment = make_deployment(base_model, [tenant], name="d")
    instance = Instance.objects.create(deployment=deployment, port=1)
    settings.ENGINE_CPU_WORKER = "process"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in build_launch_spec(instance, engine_env="/e").env
    settings.ENGINE_CPU_WORKER = "engine-core"
    spec = build_launch_spec(instance, engine_env="/e")
    assert spec.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # A GPU engine keeps vLLM's own process layout whatever the CPU setting says.
    gpu = Gpu.objects.create(node=Node.objects.create(name="gpu-a", queue="node.gpu-a"),
                             index=0, uuid="GPU-0", memory_total_bytes=80 * 1024**3)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in build_launch_spec(
        instance, engine_env="/e", gpus=[gpu]).env


def test_instance_secrets_never_look_like_an_option():
    from serving_app.models import new_instance_secret

    assert not any(new_instance_secret().startswith("-") for _ in range(2000))


def test_defaults_use_the_models_context_and_prefix_caching(tenant, base_model):
    deployment = make_deployment(base_model, [tenant], name="d")
    spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=1))
    assert flag(spec.argv, "--max-model-len") == "2048"
    assert "--enable-prefix-caching" in spec.argv
    assert "--scheduling-policy" not in spec.argv
    assert "--max-num-batched-tokens" not in spec.argv


def test_adapters_are_loaded_at_start_under_tenant_qualified_names(tenant, base_model, tmp_path):
    first = make_adapter(tenant, base_model, tmp_path / "a", "support")
    second = make_adapter(tenant, base_model, tmp_path / "b", "billing")
    deployment = make_deployment(base_model, [tenant], name="d", adapters=[first, second])
    spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=1))
    start = spec.argv.index("--lora-modules")
    assert [json.loads(arg) for arg in spec.argv[start + 1:start + 3]] == [
        {"name": "acme--support", "path": first.path, "base_model_name": "llama-mini"},
        {"name": "acme--billing", "path": second.path, "base_model_name": "llama-mini"},
    ]
    assert "--enable-lora" in spec.argv


# Parses command lines with the engine's own parser: the one `python -m
# vllm.entrypoints.openai.api_server` builds (vllm.entrypoints.launchers.api_server.entry.main).
PARSE_WITH_VLLM = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

parsed = []
for argv in json.load(sys.stdin):
    try:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(args)
    except SystemExit as exc:
        parsed.append({"exit": exc.code})
        continue
    parsed.append({
        "model": args.model, "served_model_name": args.served_model_name, "port": args.port,
        "api_key": args.api_key, "enable_lora": args.enable_lora,
        "kv_cache_dtype": args.kv_cache_dtype,
        "ssl": [args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs],
        "lora_modules": [[m.name, m.path, m.base_model_name] for m in args.lora_modules or []],
    })
print("PARSED " + json.dumps(parsed))
"""


def parse_with_vllm(argvs: list[list[str]]) -> list[dict]:
    """Runs the engine venv's vLLM parser over the argument lists (one subprocess for all:
    importing vLLM takes seconds)."""
    python = interpreter(django_settings.ENGINE_VENV)
    if not Path(python).exists():
        pytest.fail(f"The engine environment is missing ({python}): run scripts/setup_engine.sh")
    env = {k: v for k, v in os.environ.items()
           if k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([python, "-c", PARSE_WITH_VLLM], input=json.dumps(argvs),
                            capture_output=True, text=True, env=env, timeout=300, cwd="/")
    lines = [line for line in result.stdout.splitlines() if line.startswith("PARSED ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PARSED "))


def engine_args(argv: list[str]) -> list[str]:
    """What the engine's parser sees: after `python -m vllm.entrypoints.openai.api_server`."""
    return argv[argv.index("vllm.entrypoints.openai.api_server") + 1:]


HOSTILE = ["a,b", "k=v", "two words", "q\"uo'te", "-leading", "--port", "-O3", "ünï-名前",
           "a=b,c=d", "{\"name\": 1}", "back\\slash"]


def test_vllm_parses_hostile_adapter_names_and_paths_back_exactly(tenant, base_model, settings):
    """A name or path with a comma, "=", spaces, quotes, a leading "-" or non-ASCII reaches vLLM
    as exactly that name and path (the `name=path` form made the parser exit on "a,b": every
    tenant of a shared engine lost service at its next start). Names the model validators would
    refuse are stored directly: the command line must not depend on them."""
    settings.ENGINE_CPU_SCHEDULING = "idle"
    hostile_base = BaseModel.objects.create(name="-base,=x", path="-O3 /models/ä, b=c")
    adapters = [
        LoraAdapter.objects.create(tenant=tenant, base_model=hostile_base, name=f"n{i}{text}",
                                   path=f"/srv/adapters/{text}/p" if i % 2 else text)
        for i, text in enumerate(HOSTILE)
    ]
    deployment = make_deployment(base_model, [tenant], name="hostile", max_loras=2)
    deployment.base_model = hostile_base  # after full_clean: a path no validator would pass
    deployment.save()
    instance = Instance.objects.create(deployment=deployment, port=18123)
    spec = build_launch_spec(instance, adapters=adapters)

    plain = make_deployment(base_model, [tenant], name="plain")
    plain_spec = build_launch_spec(Instance.objects.create(deployment=plain, port=18124))
    fp8 = make_deployment(base_model, [tenant], name="fp8", kv_cache_dtype="fp8_e5m2")
    fp8_spec = build_launch_spec(Instance.objects.create(deployment=fp8, port=18125))

    hostile, no_adapters, fp8_kv = parse_with_vllm(
        [engine_args(spec.argv), engine_args(plain_spec.argv), engine_args(fp8_spec.argv)])
    assert "exit" not in hostile, hostile
    assert hostile["lora_modules"] == [[a.engine_name, a.path, "-base,=x"] for a in adapters]
    assert (hostile["model"], hostile["served_model_name"]) == ("-O3 /models/ä, b=c",
                                                               ["-base,=x"])
    assert (hostile["port"], hostile["api_key"], hostile["enable_lora"]) == (18123, None, True)
    assert no_adapters["lora_modules"] == [] and no_adapters["model"] == base_model.path
    assert (no_adapters["kv_cache_dtype"], fp8_kv["kv_cache_dtype"]) == ("auto", "fp8_e5m2")
    # The engine answers only a client certificate of the console CA (docs/security.md).
    certfile, keyfile = pki.node_paths()
    assert no_adapters["ssl"] == [str(certfile), str(keyfile), str(pki.ca_cert_path()),
                                  ssl.CERT_REQUIRED]


def test_a_one_node_engine_keeps_every_socket_but_its_api_on_loopback(tenant, base_model):
    """Its workers' gloo pairs and store, NCCL's bootstrap and vLLM's queues bind loopback
    whatever the host's name resolves to; the API server listens on the node's address, with
    TLS. A multi-node group's leader gives its peers the node's address instead."""
    deployment = make_deployment(base_model, [tenant], name="d")
    instance = Instance.objects.create(deployment=deployment, port=18126)
    spec = build_launch_spec(instance, host="10.0.0.7")
    assert flag(spec.argv, "--host") == "10.0.0.7"
    assert "--ssl-cert-reqs" in spec.argv
    assert {k: spec.env[k] for k in LOOPBACK_ONLY} == LOOPBACK_ONLY
    assert spec.env["GLOO_SOCKET_IFNAME"] == "lo" and spec.env["VLLM_HOST_IP"] == "127.0.0.1"


def test_every_api_server_checks_the_key_on_every_route(tenant, base_model, settings):
    """vLLM's own key check guards /v1 only: every engine's API server loads the console's
    middleware (`vllm_plugins/console_auth.py`) from the plugins' folder, first on its
    PYTHONPATH before the node's vLLM folder, and takes the key from its environment; with TLS
    off too (the key is then all that guards the routes)."""
    deployment = make_deployment(base_model, [tenant], name="d")
    instance = Instance.objects.create(deployment=deployment, port=18128)
    plugins = Path(django_settings.BASE_DIR) / "vllm_plugins"
    assert (plugins / "console_auth.py").is_file()
    for pythonpath, expected in (("", str(plugins)),
                                 ("/opt/vllm-site", f"{plugins}{os.pathsep}/opt/vllm-site")):
        spec = build_launch_spec(instance, pythonpath=pythonpath)
        assert flag(spec.argv, "--middleware") == "console_auth.EveryRouteNeedsKey"
        assert spec.env["PYTHONPATH"] == expected
        assert spec.secret_env == {"VLLM_API_KEY": instance.secret}
    settings.ENGINE_TLS = False
    assert flag(build_launch_spec(instance).argv, "--middleware") == \
        "console_auth.EveryRouteNeedsKey"


def test_engines_speak_plain_http_only_with_engine_tls_off(tenant, base_model, settings):
    deployment = make_deployment(base_model, [tenant], name="d")
    instance = Instance.objects.create(deployment=deployment, port=18127)
    assert instance.base_url.startswith("https://")
    settings.ENGINE_TLS = False
    assert not any(a.startswith("--ssl") for a in build_launch_spec(instance).argv)
    assert instance.base_url.startswith("http://")


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
    spec = build_launch_spec(instance, gpus=[gpu0, gpu1])
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-0,GPU-1"
    assert spec.argv[0] != "chrt"  # GPU engines keep normal scheduling
    assert flag(spec.argv, "--gpu-memory-utilization") == "0.5"
    assert "VLLM_CPU_KVCACHE_SPACE" not in spec.env

    mig_deployment = make_deployment(base_model, [tenant], name="mig", isolation_mode="mig")
    spec = build_launch_spec(Instance.objects.create(deployment=mig_deployment, port=2),
                             gpus=[mig])
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "MIG-abc"

    mps = make_deployment(base_model, [tenant], name="mps", isolation_mode="mps",
                          mps_thread_percentage=30)
    spec = build_launch_spec(Instance.objects.create(deployment=mps, port=3,
                                                     gpu_memory_fraction=0.25), gpus=[gpu1])
    assert spec.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    # In MiB, as the placer writes it (one function for both).
    assert spec.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20992M"


def test_placement_environment_wins_and_declared_gpus_keep_the_cpu_cache(tenant, base_model):
    node = Node.objects.create(name="cpu-gpu", queue="node.cpu-gpu")
    declared = Gpu.objects.create(node=node, index=0, uuid="DECLARED-0", name="L4",
                                  memory_total_bytes=24 * 2**30, declared=True)
    deployment = make_deployment(base_model, [tenant], name="placed")
    instance = Instance.objects.create(deployment=deployment, port=4,
                                       environment={"CUDA_VISIBLE_DEVICES": "MIG-xyz"})
    spec = build_launch_spec(instance, gpus=[declared])
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


def test_migration_hides_secrets_recorded_before_the_key_left_the_command_line(tenant,
                                                                              base_model):
    from importlib import import_module

    from django.apps import apps

    scrub = import_module("serving_app.migrations.0006_instance_secret_off_command_line").scrub
    deployment = make_deployment(base_model, [tenant], name="d")
    old = Instance.objects.create(deployment=deployment, port=1)
    Instance.objects.filter(pk=old.pk).update(
        command=["python", "--port", "1", "--api-key", old.secret, "--dtype", "float32"],
        environment={"CUDA_VISIBLE_DEVICES": "GPU-0", "VLLM_API_KEY": old.secret},
        log_tail=f"args: api_key={old.secret}\nready", last_error=f"key {old.secret} refused")
    new = Instance.objects.create(deployment=deployment, port=2)
    spec = build_launch_spec(new)
    Instance.objects.filter(pk=new.pk).update(command=spec.argv, environment=spec.env)
    scrub(apps, None)
    old = Instance.objects.get(pk=old.pk)
    assert old.command == ["python", "--port", "1", "--api-key", "********", "--dtype", "float32"]
    assert old.environment == {"CUDA_VISIBLE_DEVICES": "GPU-0"}
    assert old.log_tail == "args: api_key=********\nready"
    assert old.last_error == "key ******** refused"
    new = Instance.objects.get(pk=new.pk)
    assert (new.command, new.environment) == (spec.argv, spec.env)


def test_the_urgent_batch_cap_loads_the_consoles_scheduler_of_the_engines_kind(tenant,
                                                                                base_model):
    """With priority scheduling and a cap, the engine loads the console's scheduler plugin
    (vllm_plugins/ first on its PYTHONPATH, the cap in its environment): vLLM's synchronous
    scheduler's subclass on a CPU engine, the asynchronous one's on a GPU; without either, no
    plugin."""
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="H100",
                             memory_total_bytes=80 * 2**30)
    capped = make_deployment(base_model, [tenant], name="capped", scheduling_policy="priority",
                             urgent_batch_cap=8)
    cpu = build_launch_spec(Instance.objects.create(deployment=capped, port=1),
                            pythonpath="/opt/vllm-site")
    assert flag(cpu.argv, "--scheduler-cls") == "console_scheduler.UrgentBatchCapScheduler"
    assert cpu.env["LLM_CONSOLE_URGENT_BATCH_CAP"] == "8"
    assert cpu.env["LLM_CONSOLE_URGENT_PRIORITY"] == str(int(PriorityTier.HIGH)) == "1"
    plugins = Path(django_settings.BASE_DIR) / "vllm_plugins"
    assert cpu.env["PYTHONPATH"] == f"{plugins}{os.pathsep}/opt/vllm-site"
    assert (plugins / "console_scheduler.py").is_file()
    on_gpu = build_launch_spec(Instance.objects.create(deployment=capped, port=2), gpus=[gpu])
    assert flag(on_gpu.argv, "--scheduler-cls") == \
        "console_scheduler.AsyncUrgentBatchCapScheduler"

    fcfs = make_deployment(base_model, [tenant], name="fcfs", urgent_batch_cap=8)
    uncapped = make_deployment(base_model, [tenant], name="uncapped",
                               scheduling_policy="priority")
    for deployment in (fcfs, uncapped):
        spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=3))
        assert "--scheduler-cls" not in spec.argv
        assert "LLM_CONSOLE_URGENT_BATCH_CAP" not in spec.env


def test_the_urgent_batch_cap_is_automatic_while_a_high_tier_tenant_has_an_objective(
        tenant, base_model):
    """Left empty, a priority-scheduled deployment's cap on a GPU is AUTO_URGENT_BATCH_CAP (8,
    the go measured on the GPU) once one of its active tenants is high tier or above with a
    latency objective, and no plugin otherwise; a cap set wins, and 0 turns the plugin off. The
    page's figure and the engine's environment agree. A CPU engine gets the plugin only from a
    cap set (there a custom class turns asynchronous scheduling off)."""
    other = make_tenant("normal-tier", priority_tier=PriorityTier.NORMAL,
                        ttft_objective_ms=200)
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="H100",
                             memory_total_bytes=80 * 2**30)

    def cap(deployment: Deployment, gpus: list[Gpu] | None = None) -> tuple[str | None, int]:
        """What an instance's engine would get, and what the deployment's page says."""
        spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=4),
                                 gpus=[gpu] if gpus is None else gpus)
        return spec.env.get("LLM_CONSOLE_URGENT_BATCH_CAP"), deployment.effective_urgent_batch_cap

    auto = make_deployment(base_model, [tenant, other], name="auto",
                           scheduling_policy="priority")
    # A normal-tier tenant's objective makes nothing urgent; a high-tier one without an
    # objective neither.
    Tenant.objects.filter(pk=tenant.pk).update(priority_tier=PriorityTier.HIGH)
    assert cap(auto) == (None, 0)
    none = dict.fromkeys(("latency_objective_ms", "ttft_objective_ms", "tpot_objective_ms"))
    for objective in none:
        Tenant.objects.filter(pk=tenant.pk).update(**{**none, objective: 900})
        assert cap(auto) == ("8", 8), objective
    assert list(auto.urgent_objective_tenants()) == [Tenant.objects.get(pk=tenant.pk)]
    assert cap(auto, gpus=[]) == (None, 8)  # a CPU engine: not automatically
    Tenant.objects.filter(pk=tenant.pk).update(status=Tenant.Status.SUSPENDED)
    assert cap(auto) == (None, 0)
    Tenant.objects.filter(pk=tenant.pk).update(status=Tenant.Status.ACTIVE,
                                                priority_tier=PriorityTier.CRITICAL)
    assert cap(auto) == ("8", 8)
    # Set by the operator: that number, or off; FCFS: never (no priority reaches the engine).
    for name, fields, expected in (("off", {"urgent_batch_cap": 0}, (None, 0)),
                                   ("set", {"urgent_batch_cap": 24}, ("24", 24)),
                                   ("fcfs", {"scheduling_policy": "fcfs"}, (None, 0))):
        fields.setdefault("scheduling_policy", "priority")
        deployment = make_deployment(base_model, [tenant], name=name, **fields)
        assert cap(deployment) == expected, name
        assert cap(deployment, gpus=[]) == expected, name
