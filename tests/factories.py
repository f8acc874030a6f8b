"""Factories for test data: users, tenants with their roles, and model/adapter folders.

Model folders written here hold a real config.json and real safetensors headers (the weights are
zero bytes), which is all the console reads when it registers a model; tests that run the engine
use the generated tiny model instead.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

from django.contrib.auth import get_user_model
from django.utils import timezone

from serving_app.models import (
    BaseModel,
    CapacityPoint,
    CapacityTest,
    Deployment,
    EngineSample,
    Instance,
    LoraAdapter,
)
from tenants_app.models import Membership, Role, Tenant

_counter = itertools.count(1)


def make_user(username: str | None = None, *, staff: bool = False, password: str = "pw-12345678"):
    username = username or f"user{next(_counter)}"
    user = get_user_model().objects.create_user(
        username=username, password=password, is_staff=staff, is_superuser=staff
    )
    return user


def make_tenant(slug: str | None = None, **fields) -> Tenant:
    slug = slug or f"tenant{next(_counter)}"
    tenant = Tenant(slug=slug, name=fields.pop("name", slug.title()), **fields)
    tenant.full_clean()
    tenant.save()
    return tenant


def add_member(tenant: Tenant, user, role: str = Role.MEMBER) -> Membership:
    return Membership.objects.create(tenant=tenant, user=user, role=role)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    sizes = {"F32": 4, "F16": 2, "BF16": 2}
    header: dict = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        handle.truncate(8 + len(raw) + offset)


def make_model_dir(
    root: Path,
    name: str = "llama-mini",
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    max_positions: int = 2048,
) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
        "vocab_size": vocab,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": ("F32", [vocab, hidden])}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = ("F32", [hidden, hidden])
        tensors[p + "self_attn.k_proj.weight"] = ("F32", [kv_heads * head_dim, hidden])
        tensors[p + "self_attn.v_proj.weight"] = ("F32", [kv_heads * head_dim, hidden])
        tensors[p + "self_attn.o_proj.weight"] = ("F32", [hidden, hidden])
        tensors[p + "mlp.gate_proj.weight"] = ("F32", [intermediate, hidden])
    write_safetensors(folder / "model.safetensors", tensors)
    return folder


def make_adapter_dir(
    root: Path, name: str = "lora", *, rank: int = 8, hidden: int = 128, layers: int = 2
) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "llama-mini",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for i in range(layers):
        for module in ("q_proj", "v_proj"):
            p = f"base_model.model.model.layers.{i}.self_attn.{module}."
            tensors[p + "lora_A.weight"] = ("F32", [rank, hidden])
            tensors[p + "lora_B.weight"] = ("F32", [hidden, rank])
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    return folder


def make_base_model(root: Path, name: str = "llama-mini", **arch) -> BaseModel:
    model = BaseModel(name=name, path=str(make_model_dir(root, name, **arch)))
    model.full_clean()
    model.save()
    return model


def make_adapter(tenant: Tenant, base: BaseModel, root: Path, name: str = "lora", **kw):
    folder = make_adapter_dir(root, f"{tenant.slug}-{name}", **kw)
    adapter = LoraAdapter(tenant=tenant, base_model=base, name=name, path=str(folder))
    adapter.full_clean()
    adapter.save()
    return adapter


def make_deployment(base: BaseModel, tenants: list[Tenant], name: str | None = None, **fields):
    adapters = fields.pop("adapters", [])
    deployment = Deployment(name=name or f"dep{next(_counter)}", base_model=base, **fields)
    deployment.full_clean()
    deployment.save()
    deployment.tenants.set(tenants)
    deployment.adapters.set(adapters)
    return deployment


def make_usage_minute(tenant: Tenant, at, requests: int, errors: int) -> None:
    """One minute of a tenant's rollups (`llama-mini`, every request at 250 ms), added to its
    hour as the rollup task would."""
    from serving_app.models.usage import UsageHour, UsageMinute  # noqa: PLC0415

    counters = {"requests": requests, "errors": errors, "latency_ms_total": 250.0 * requests,
                "latency_ms_max": 260.0, "latency_le_250": requests}
    UsageMinute.objects.create(bucket=at, tenant=tenant, model="llama-mini", **counters)
    hour, _ = UsageHour.objects.get_or_create(bucket=at.replace(minute=0), tenant=tenant,
                                              model="llama-mini")
    for name, value in counters.items():
        setattr(hour, name, max(getattr(hour, name), value) if name == "latency_ms_max"
                else getattr(hour, name) + value)
    hour.save()


def make_engine_sample(instance: Instance, at, **fields) -> EngineSample:
    """A sample as a node agent stores it; an interval's increases only with `interval_seconds`."""
    return EngineSample.objects.create(instance=instance, deployment_id=instance.deployment_id,
                                       at=at, **fields)


def make_capacity_test_dir(root: Path, name: str = "shape-only") -> Path:
    """A capacity-test model's folder: config.json and a tokenizer, no weights."""
    folder = make_model_dir(root, name)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


# What the H200 run of 2026-12-05 recorded (docs/gpu-runs/): the agent's reports as real data.
H200_RUN = Path(__file__).resolve().parents[1] / "docs/gpu-runs/2026-12-05-h200"


def h200_run(name: str) -> dict:
    """One scenario's results file of that run, e.g. "planner-sequential" or "mps"."""
    return json.loads((H200_RUN / f"{name}.json").read_text())


def h200_mps_status() -> dict:
    """The node's MPS daemon status, as the agent stored it during the run's MPS scenario."""
    return h200_run("mps")["checks"][0]["seen"]["mps"]


def h200_figures() -> dict:
    """What the sequential planner scenario recorded: the node's engine versions, NVML's CPU
    affinity, and each instance's `startup` and `cpu_cores` rows."""
    return h200_run("planner-sequential")["figures"]


# What vLLM answers to the node agent's canary generation (one token, its logprob), for the
# stand-in engines of the tests where no vLLM runs (serving_app/engine/canary.py).
STANDIN_CANARY_REPLY = b'{"choices": [{"text": "x", "logprobs": {"token_logprobs": [-1.5]}}]}'


# A capacity curve shaped like the H200's 8B one (docs/gpu.md): make_curve's rows.
H200_8B_CURVE = [(1, 210, 20, 4.7, 620), (8, 1548, 40, 4.9, 660), (32, 4898, 90, 5.4, 780),
                 (64, 8438, 180, 5.9, 940), (128, 12549, 400, 7.7, 1380)]


def make_curve(deployment, rows, node_name: str = "gpu-host"):
    """A capacity test of `deployment` that succeeded with `rows`: (concurrency, output tok/s,
    TTFT p95, time per output token p95, end-to-end p95), milliseconds."""
    test = CapacityTest.objects.create(
        deployment=deployment, node_name=node_name, state=CapacityTest.State.SUCCEEDED,
        concurrency=[c for c, *_ in rows], requests_per_level=max(16, *(c for c, *_ in rows)),
        levels_done=len(rows), started_at=timezone.now(), finished_at=timezone.now())
    for c, tok_s, ttft, tpot, e2e in rows:
        CapacityPoint.objects.create(test=test, concurrency=c, completed=16, output_tokens=2048,
                                     duration_s=2048 / tok_s, tokens_per_s=tok_s,
                                     ttft_p50_ms=ttft / 2, ttft_p95_ms=ttft,
                                     tpot_p50_ms=tpot / 2, tpot_p95_ms=tpot, e2e_p95_ms=e2e)
    return test
