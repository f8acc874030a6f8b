"""Placement benchmark: 500 deployments placed one after another on 100 nodes x 8 GPUs.

Usage::

    python benchmarks/placement_bench.py [--nodes 100] [--gpus 8] [--deployments 500]
                                         [--repeat 5] [--policy binpack|spread] [--seed 1]

The workload is seeded: 60% of nodes with A100-80GB, 30% with H200 (141 GB), 10% with L4
(24 GB); deployments sized by the memory planner from real configs (Llama-3.1-8B, Qwen2-7B,
Llama-2-13B, a 70B at TP 4/8) with random concurrency and context, 1-3 replicas, isolation
shared/MPS/dedicated. Each placement commits before the next one is placed.

Printed in the same run, so the ratios hold on any machine:

- ``build``: constructing the inventory (Node/GpuSlot objects) and the Placer's index;
- ``first-fit``: a trivial loop that puts each replica x TP GPU on the first GPU with room
  (floats, no index, no filters, no scoring): the floor a placer cannot beat by much;
- ``placer``: the real ``Placer.place()`` for all deployments, and per placement;
- ``plan``: the memory planner for the 500 deployments (done once per deployment);
- ``dry run``: ``Placer.plan()`` on the filled cluster, per call (the plan endpoint's cost).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving_app.placement.cluster import GpuSlot, Node  # noqa: E402
from serving_app.placement.placer import Placer  # noqa: E402
from serving_app.placement.planner import (  # noqa: E402
    EngineSettings,
    ModelArchitecture,
    plan_memory,
)
from serving_app.placement.request import PlacementRequest  # noqa: E402

MIB = 1024**2
GPU_KINDS = [  # (name, total bytes as NVML reports it, share of nodes)
    ("NVIDIA A100-SXM4-80GB", 81920 * MIB, 0.6),
    ("NVIDIA H200", 143771 * MIB, 0.3),
    ("NVIDIA L4", 23034 * MIB, 0.1),
]


def _model(layers, hidden, heads, kv_heads, params, vocab, max_pos, dtype, intermediate):
    return ModelArchitecture(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        weight_bytes=params * 2,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        torch_dtype=dtype,
        intermediate_size=intermediate,
    )


MODELS = {  # published config.json values and parameter counts
    "llama-3.1-8b": _model(32, 4096, 32, 8, 8_030_261_248, 128256, 131072, "bfloat16", 14336),
    "qwen2-7b": _model(28, 3584, 28, 4, 7_615_616_512, 152064, 131072, "bfloat16", 18944),
    "llama-2-13b": _model(40, 5120, 40, 40, 13_015_864_320, 32000, 4096, "float16", 13824),
    "llama-3.1-70b": _model(80, 8192, 64, 8, 70_553_706_496, 128256, 131072, "bfloat16", 28672),
}


@dataclass
class Workload:
    """A seeded cluster shape and a list of deployments (model, engine settings, request)."""

    nodes: int
    gpus: int
    deployments: list[tuple[str, EngineSettings, int, str]]


def build_nodes(count: int, gpus: int) -> list[Node]:
    nodes = []
    cut1 = int(count * GPU_KINDS[0][2])
    cut2 = cut1 + int(count * GPU_KINDS[1][2])
    for i in range(count):
        name, total, _ = GPU_KINDS[0 if i < cut1 else 1 if i < cut2 else 2]
        nodes.append(
            Node(
                name=f"node-{i:03d}",
                gpus=[
                    GpuSlot(index=g, uuid=f"GPU-{i:03d}-{g}", name=name, memory_total_bytes=total)
                    for g in range(gpus)
                ],
            )
        )
    return nodes


def make_workload(nodes: int, gpus: int, deployments: int, seed: int) -> Workload:
    rng = random.Random(seed)
    out = []
    for _ in range(deployments):
        model = rng.choices(list(MODELS), weights=[5, 3, 1, 1])[0]
        tp = {"llama-3.1-70b": rng.choice([4, 8]), "llama-2-13b": rng.choice([1, 2])}.get(model, 1)
        engine = EngineSettings(
            max_num_seqs=rng.choice([8, 16, 32, 64]),
            max_model_len=rng.choice([2048, 4096, 8192]) if model != "llama-2-13b" else 4096,
            tensor_parallel_size=tp,
            enable_lora=rng.random() < 0.3,
            max_loras=4,
            max_lora_rank=16,
        )
        replicas = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
        isolation = rng.choices(["shared", "mps", "dedicated"], weights=[7, 2, 1])[0]
        out.append((model, engine, replicas, isolation))
    return Workload(nodes, gpus, out)


def plan_requests(workload: Workload) -> list[PlacementRequest]:
    requests = []
    for i, (model, engine, replicas, isolation) in enumerate(workload.deployments):
        plan = plan_memory(MODELS[model], engine)
        requests.append(
            PlacementRequest(
                deployment_id=f"dep-{i}",
                tenant_id=f"tenant-{i % 40}",
                memory_bytes_per_gpu=plan.needed_bytes,
                replicas=replicas,
                tensor_parallel_size=engine.tensor_parallel_size,
                num_attention_heads=MODELS[model].num_attention_heads,
                isolation=isolation,
            )
        )
    return requests


def first_fit(nodes: list[Node], requests: list[PlacementRequest], headroom: float) -> int:
    """The trivial baseline: each replica x TP GPU on the first GPU with room; returns fits."""
    free = [[1.0 - headroom] * len(n.gpus) for n in nodes]
    totals = [[g.memory_total_bytes for g in n.gpus] for n in nodes]
    placed = 0
    for req in requests:
        for _ in range(req.replicas * req.tensor_parallel_size):
            done = False
            for ni, row in enumerate(free):
                for gi, room in enumerate(row):
                    need = req.memory_bytes_per_gpu / totals[ni][gi]
                    if need <= room:
                        row[gi] = room - need
                        done = True
                        break
                if done:
                    break
            placed += done
    return placed


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def run(args: argparse.Namespace) -> None:
    workload = make_workload(args.nodes, args.gpus, args.deployments, args.seed)
    t_plan, requests = timed(plan_requests, workload)

    builds, fits, places, dry = [], [], [], []
    ok = refused = 0
    instances = 0
    for _ in range(args.repeat):
        t_build, placer = timed(
            lambda: Placer(build_nodes(args.nodes, args.gpus), policy=args.policy)
        )
        builds.append(t_build)
        nodes = build_nodes(args.nodes, args.gpus)
        t_ff, _ = timed(first_fit, nodes, requests, 0.10)
        fits.append(t_ff)
        t_place, results = timed(lambda p=placer: [p.place(r) for r in requests])
        places.append(t_place)
        ok = sum(r.ok for r in results)
        refused = len(results) - ok
        instances = sum(len(r.instances) for r in results)
        probe = PlacementRequest("probe", "tenant-0", requests[0].memory_bytes_per_gpu)
        t_dry, _ = timed(lambda p=placer, q=probe: [p.plan(q) for _ in range(100)])
        dry.append(t_dry / 100)

    views = placer.allocation_view()
    used = [v for v in views if v.entries]
    mean_reserved = statistics.mean(v.reserved_fraction for v in used) if used else 0.0
    build, ff, place = statistics.median(builds), statistics.median(fits), statistics.median(places)
    n_gpus = args.nodes * args.gpus
    print(f"cluster: {args.nodes} nodes x {args.gpus} GPUs = {n_gpus} GPUs; policy {args.policy}")
    print(f"deployments: {len(requests)} ({ok} placed as {instances} instances, {refused} refused)")
    print(f"GPUs holding something: {len(used)}; their mean reserved share {mean_reserved:.0%}")
    print(f"median of {args.repeat} runs:")
    print(f"  build inventory + index : {build * 1e3:8.2f} ms")
    print(f"  first-fit baseline      : {ff * 1e3:8.2f} ms")
    print(
        f"  placer, all deployments : {place * 1e3:8.2f} ms  "
        f"({place / len(requests) * 1e6:.1f} us per placement)"
    )
    print(f"  memory planner, all     : {t_plan * 1e3:8.2f} ms (once)")
    print(f"  dry-run plan on the full cluster: {statistics.median(dry) * 1e6:.1f} us per call")
    print(f"ratios: placer / first-fit = {place / ff:.2f}x; placer / build = {place / build:.2f}x")
    print(f"target: placer under 1 s -> {'met' if place < 1.0 else 'NOT met'} ({place:.3f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--deployments", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--policy", choices=["binpack", "spread"], default="binpack")
    parser.add_argument("--seed", type=int, default=1)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
