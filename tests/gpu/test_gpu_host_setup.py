"""What a GPU host's node needs before an engine starts: its engine interpreter and the versions
it reports, capacity-test models (random weights), the CPU cores nearest each GPU (NVML's CPU
affinity, from an NVML snapshot recorded on an H200), and one engine sizing its KV cache per GPU
at a time."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.core.exceptions import ValidationError
from django.utils import timezone

from serving_app.engine import environment, starting
from serving_app.engine.launch import PLUGINS, build_launch_spec
from serving_app.fleet.sync import store_inventory
from serving_app.management.commands.gpu_check import SHAPES, write_shape
from serving_app.modelfiles import ModelFilesError, config_parameters, read_model
from serving_app.models import BaseModel, Gpu, Instance, Node
from serving_app.placement import inventory
from tests.factories import make_deployment, make_tenant

pytestmark = pytest.mark.django_db
FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER = Path(django_settings.BASE_DIR) / "var" / "models" / "tiny-llama"


# -- the engine interpreter -------------------------------------------------------------------
def test_the_engine_venv_reports_its_versions():
    python = environment.interpreter(django_settings.ENGINE_VENV)
    versions = environment.probe(python)
    assert versions["vllm"] and versions["torch"] and versions["python"].startswith("3.")
    assert "error" not in versions


def test_an_interpreter_without_vllm_or_missing_says_so():
    assert "vLLM is not installed" in environment.probe(sys.executable)["error"]
    assert "could not be run" in environment.probe("/nonexistent/python3")["error"]


def test_a_nodes_interpreter_and_pythonpath_run_the_engine(base_model):
    deployment = make_deployment(base_model, [make_tenant("acme")], name="host-python")
    instance = Instance.objects.create(deployment=deployment, port=18300)
    spec = build_launch_spec(instance, python="/usr/bin/python3", pythonpath="/opt/vllm-site")
    start = spec.argv.index("/usr/bin/python3")  # after `chrt --idle 0` for a CPU engine
    assert spec.argv[start:start + 3] == ["/usr/bin/python3", "-m",
                                          "vllm.entrypoints.openai.api_server"]
    # The node's vLLM folder, after the console's plugins' (the engines' key middleware).
    assert spec.env["PYTHONPATH"] == f"{PLUGINS}{os.pathsep}/opt/vllm-site"
    default = build_launch_spec(instance, engine_env="/e")
    assert "/e/bin/python" in default.argv and default.env["PYTHONPATH"] == str(PLUGINS)


# -- capacity-test models ---------------------------------------------------------------------
def test_parameter_counts_from_configs_match_the_real_checkpoints():
    llama3 = {**SHAPES["llama3-8b-shape"], "vocab_size": 128256}
    qwen = {**SHAPES["qwen25-7b-shape"], "vocab_size": 152064}
    llama2 = {**SHAPES["llama2-7b-shape"], "vocab_size": 32000}
    assert config_parameters(llama3) == 8_030_261_248
    assert config_parameters(qwen) == 7_615_616_512
    assert config_parameters(llama2) == 6_738_415_616


def test_a_capacity_test_model_needs_a_config_and_a_tokenizer_and_no_weights(tmp_path):
    folder = tmp_path / "llama3-8b-shape"
    write_shape(folder, SHAPES["llama3-8b-shape"], TOKENIZER)
    assert not list(folder.glob("*.safetensors"))
    arch = read_model(str(folder), dummy=True)
    # 6,987,976,704 parameters (the tiny tokenizer's 1,024-token vocabulary) x 2 B (bf16):
    # 13.02 GiB, which the engine on the H200 logged as 13.1 GiB with its LoRA slots.
    assert arch.weight_bytes == 13_975_953_408
    with pytest.raises(ModelFilesError, match="no .safetensors"):
        read_model(str(folder))
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ModelFilesError, match="needs a tokenizer"):
        read_model(str(folder), dummy=True)


def test_a_capacity_test_model_is_registered_and_started_with_random_weights(tmp_path):
    folder = tmp_path / "qwen25-7b-shape"
    write_shape(folder, SHAPES["qwen25-7b-shape"], TOKENIZER)
    model = BaseModel(name="qwen25-7b-shape", path=str(folder), load_format="dummy")
    model.full_clean()
    model.save()
    assert model.capacity_test and model.num_kv_heads == 4 and model.weight_bytes > 12 * 1024**3
    refused = BaseModel(name="no-weights", path=str(folder))
    with pytest.raises(ValidationError, match="safetensors"):
        refused.full_clean()
    deployment = make_deployment(model, [make_tenant("acme")], name="capacity")
    spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=18301))
    assert "--load-format=dummy" in spec.argv


# -- CPU cores nearest the GPU ----------------------------------------------------------------
def test_nvmls_cpu_affinity_reaches_the_gpu_row_and_pins_the_engine(base_model):
    snapshot = json.loads((FIXTURES / "h200_nvml_with_cpu_affinity.json").read_text())
    [gpu_info] = inventory.parse_snapshot(snapshot)
    assert gpu_info.cpu_affinity == list(range(16))
    node = Node.objects.create(name="h200", queue="node.h200", last_heartbeat=timezone.now())
    store_inventory(node, [gpu_info], Node.InventorySource.NVML)
    gpu = Gpu.objects.get(node=node)
    assert gpu.cpu_affinity == "0-15"
    assert starting.cpu_cores(node, [gpu]) == list(range(16))
    node.cpu_binding = "off"
    assert starting.cpu_cores(node, [gpu]) == []
    node.cpu_binding = "2-3,8"
    assert starting.cpu_cores(node, [gpu]) == [2, 3, 8]
    assert starting.cpu_cores(Node(cpu_binding=""), []) == []  # a CPU engine: not pinned
    deployment = make_deployment(base_model, [make_tenant("acme")], name="pinned")
    spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=18302),
                             gpus=[gpu], cpu_cores=[0, 1, 2, 3])
    assert spec.argv[:3] == ["taskset", "--cpu-list", "0-3"] and spec.cpu_cores == "0-3"


def test_cpu_lists_are_read_and_written_as_the_kernel_does():
    assert inventory.parse_cpulist("0-3, 8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert inventory.cpulist_text([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert inventory.cpus_of_mask([0xFFFF]) == list(range(16))
    assert inventory.cpus_of_mask([0, 1]) == [64]
    for bad in ("a-b", "3-1", "", "1-99999", "0-", "-3"):
        with pytest.raises(ValueError):
            inventory.parse_cpulist(bad)
    node = Node(name="n", queue="node.n", cpu_binding="0-3,2")
    node.clean()
    assert node.cpu_binding == "0-3"
    with pytest.raises(ValidationError) as error:
        Node(name="n", queue="node.n", cpu_binding="first four").clean()
    assert "cpu_binding" in error.value.message_dict


# -- one engine sizing its KV cache per GPU at a time -----------------------------------------
@pytest.mark.django_db(transaction=True)  # the waiting start records its phase from a thread
def test_a_second_engine_on_the_same_gpu_waits_until_the_first_has_sized_its_kv_cache(
        base_model):
    node = Node.objects.create(name="h200", queue="node.h200", last_heartbeat=timezone.now())
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-a", name="NVIDIA H200",
                             memory_total_bytes=150754820096)
    other = Gpu.objects.create(node=node, index=1, uuid="GPU-b", name="NVIDIA H200",
                               memory_total_bytes=150754820096)
    deployment = make_deployment(base_model, [make_tenant("acme")], name="shared-a")
    second = Instance.objects.create(deployment=deployment, node=node,
                                     state=Instance.State.STARTING, ordinal=1)
    first = starting.GpuSizing([gpu])
    assert first.acquire(second)
    acquired = threading.Event()
    waiting = starting.GpuSizing([gpu])
    thread = threading.Thread(target=lambda: waiting.acquire(second) and acquired.set())
    thread.start()
    deadline = time.monotonic() + 10
    while Instance.objects.get(pk=second.pk).startup.get("phase") != "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not acquired.is_set()
    assert starting.GpuSizing([other]).acquire(second)  # another GPU is not held
    first.release()
    assert acquired.wait(5)
    thread.join()
    waiting.release()
    # A queued start whose instance was stopped meanwhile gives up.
    holder = starting.GpuSizing([gpu])
    holder.acquire(second)
    Instance.objects.filter(pk=second.pk).update(state=Instance.State.STOPPING)
    assert starting.GpuSizing([gpu]).acquire(second) is False
    holder.release()

