"""The gateway's streaming and the tenants' fair sharing on a GPU host, with vLLM's own client.

On the GPU host, after `scripts/gpu_check.sh start` and `prepare` (docs/gpu.md):

    bash scripts/gpu_check.sh bench setup                  # deployments, tenants, engines started
    bash scripts/gpu_check.sh bench wait                   # until every engine is ready
    bash scripts/gpu_check.sh bench stream --json var/gpu-runs/stream.json
    bash scripts/gpu_check.sh bench fair --json var/gpu-runs/fair.json
    bash scripts/gpu_check.sh bench stop

and here, from the JSON brought back:

    .venv/bin/python benchmarks/gpu_bench.py plot fair.json --out docs/gpu-runs/.../frontier.png

It runs against the console as it is installed there (its database, Redis, gateway, node agent),
so what it measures is the product, not a bench set-up: the gateway at `--gateway` (uvicorn
with the console's settings), each engine started by the node agent from its deployment.

`setup` registers one base model per engine configuration (`bench-<config>`: the same files,
by default the capacity-test Llama-3-8B shape `prepare` writes; a model name is what the gateway
routes by, so each configuration gets its own), one `shared` deployment of each, and the tenants
below, and starts them all at once on the GPU (the placer's fractions; one engine sizes its KV
cache per GPU at a time). The configurations, all LoRA-enabled as a shared deployment is:

- `fcfs-8k`: vLLM's defaults (first come first served, 8,192 batched tokens), 128 sequences:
  the engine of the streaming benchmark and the FCFS reference of the fairness one;
- `prio-8k`: vLLM's priority scheduling (the gateway passes each tenant's tier);
- `fcfs-2k`, `prio-2k`: the same with 2,048 batched tokens, so that chunked prefill cuts a
  flood's long prompts into smaller pieces between the other requests' decode steps.

`stream`: streamed chat completions (`--backend openai-chat`, the random dataset, 256 tokens in
and 128 out, `--ignore-eos`) at each `--concurrency`, direct to the engine and through the
gateway (a tenant without limits, the deployment's flow control as shipped), interleaved, the
order reversed every other round. Per cell: output tokens/s through the gateway over direct
(totals of all rounds), and the median TTFT and ITL added.

`fair`: the three departments of the seed on one shared deployment (customer service: high
tier, weight 2, 2 concurrent, 256 in / 128 out; code assistant: normal tier, 8 concurrent,
768 / 256; content generation: low tier, a flood of 64 concurrent, 512 / 512), per engine
configuration: customer service alone, then all three under `fcfs` (flow control off, every
tenant in the same tier), `priority` (flow control off, tiers set: vLLM's priority scheduling
alone; priority engines only), and `flow` at each dispatch budget of `--budgets`. Every figure
is fairness_bench.py's: over the window in which all tenants overlap. The frontier: per point,
customer service's p95 over its p95 alone (same engine) against total output tokens/s over
FCFS's (`fcfs-8k` in `fcfs` mode). While each point runs, the engine's /metrics are sampled
(requests running and waiting, KV cache usage) to show the batch it ran. Then two equal
tenants, both backlogged at different concurrency (48 and 16), FCFS against flow control, for
`--pair-seconds` (60): Jain's index over their weighted served tokens (`--pair-only`: just
these two, on `--pair-config`). (The second tenant
arrives when the first holds every slot and no request is taken back, so it ramps up as slots
free: a 10 s window measures mostly that ramp.)

`fair --bursty` (issue 44; not yet run on a GPU): after customer service alone, customer service
in bursts (`--burst-on` 15 s on, `--burst-off` 35 s off) beside the flood and the code assistant
for `--bursty-seconds` (300), three times, one after the other on the same engine: FCFS, the
static budget `--bursty-budget`, and the shipped default budget with customer service's latency
objectives (`--cs-ttft-ms`, `--cs-tpot-ms`) held by the gateway's admission controller. The
figures (`benchmarks/bursts.py`): customer service's p95 after each burst's first 4 s over its
p95 alone, total tokens/s over FCFS's, tokens/s in the 2 s after each burst over FCFS's.

Everything it starts is stopped when it ends; `stop` stops the engines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's packages
    sys.path.insert(0, str(ROOT))

from benchmarks import bursts, stream_bench  # noqa: E402
from benchmarks.fairness_bench import (  # noqa: E402
    HIGH,
    LOW,
    NORMAL,
    Department,
    Loads,
    figures,
    pooled_waits,
    queue_waits,
    window_of,
)

STATE = ROOT / "var" / "gpu-bench.json"  # what `setup` made: keys, deployments
CONFIGS: dict[str, dict[str, Any]] = {
    "fcfs-8k": {"scheduling_policy": "fcfs", "max_num_batched_tokens": 8192,
                "max_num_seqs": 128},
    # vLLM's priority scheduling alone: the urgent batch cap off (left empty, it would be
    # automatic, customer service being high tier with an objective).
    "prio-8k": {"scheduling_policy": "priority", "max_num_batched_tokens": 8192,
                "max_num_seqs": 80, "urgent_batch_cap": 0},
    "fcfs-2k": {"scheduling_policy": "fcfs", "max_num_batched_tokens": 2048,
                "max_num_seqs": 80},
    "prio-2k": {"scheduling_policy": "priority", "max_num_batched_tokens": 2048,
                "max_num_seqs": 80, "urgent_batch_cap": 0},
    # fcfs-8k's batch under priority scheduling with the console's scheduler (issue 45): while
    # customer service's requests are in the engine, at most 16 others run
    # (vllm_plugins/console_scheduler.py).
    "urgent-8k": {"scheduling_policy": "priority", "max_num_batched_tokens": 8192,
                  "max_num_seqs": 128, "urgent_batch_cap": 16},
    # The same with 8 beside customer service: its steps shorter still while it is there.
    "urgent8-8k": {"scheduling_policy": "priority", "max_num_batched_tokens": 8192,
                   "max_num_seqs": 128, "urgent_batch_cap": 8},
}
DEFAULT_CONFIGS = "prio-8k,fcfs-8k,prio-2k,fcfs-2k"  # urgent-8k on request
REFERENCE = "fcfs-8k"  # FCFS on vLLM's defaults: the frontier's throughput reference
MAX_MODEL_LEN = 1280  # the longest request (768 + 256, 512 + 512) with its chat template
CS, CODE, CONTENT = "gpu-customer-service", "gpu-code-assistant", "gpu-content-generation"
STREAM_TENANT = "gpu-stream"
DEPARTMENTS = {d.slug: d for d in (
    Department(CS, "Customer service", HIGH, 2, 8, 256, 500, 256, 128),
    Department(CODE, "Code assistant", NORMAL, 1, 8, 1024, None, 768, 256),
    Department(CONTENT, "Content generation", LOW, 1, 64, 1024, None, 512, 512),
    # Room for issue 44's saturated pair (192 and 64 clients against 128 slots): at 64 each,
    # the 2026-12-07 run's team A had 128 of its 192 clients refused (429) and no pair formed.
    Department("gpu-team-a", "Team A", NORMAL, 1, 256, None, None, 256, 256),
    Department("gpu-team-b", "Team B", NORMAL, 1, 256, None, None, 256, 256),
)}


def log(message: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()


def client_python() -> Path:
    """vLLM's client runs in the engines' interpreter: the engine venv here, the host's own
    Python (vLLM on its PYTHONPATH) on a GPU host."""
    configured = os.environ.get("BENCH_CLIENT_PYTHON") or os.environ.get("NODE_ENGINE_PYTHON")
    if configured:
        return Path(configured)
    return stream_bench.ENGINE_PYTHON if stream_bench.ENGINE_PYTHON.exists() \
        else Path(sys.executable)


def catalog_changed(seconds: float = 2.5) -> None:
    """Tell every gateway worker to re-read the catalog (rows changed with update()), and give
    the ones that missed the message their periodic re-read."""
    from gateway_app.invalidation import catalog_changed as publish

    publish()
    time.sleep(seconds)


# -- setup ---------------------------------------------------------------------------------------
def setup(args: argparse.Namespace) -> None:
    from django.contrib.auth import get_user_model

    from serving_app.models import BaseModel, Deployment
    from tenants_app.models import ApiKey, Tenant

    source = BaseModel.objects.filter(name=args.model).first()
    if source is None:
        sys.exit(f"no base model {args.model!r}: run `scripts/gpu_check.sh prepare` first")
    admin = get_user_model().objects.filter(is_superuser=True).first()
    keys: dict[str, str] = {}
    for dep in [*DEPARTMENTS.values(),
                Department(STREAM_TENANT, "Streaming", NORMAL, 1, 100000, None, None, 256, 128)]:
        tenant, _ = Tenant.objects.update_or_create(slug=dep.slug, defaults={
            "name": dep.name, "priority_tier": dep.tier, "fair_share_weight": dep.weight,
            "max_concurrent_requests": dep.max_concurrency,
            "max_tokens_per_request": dep.max_tokens,
            "latency_objective_ms": dep.objective_ms, "requests_per_minute": None,
            "tokens_per_minute": None, "gpu_memory_quota_gib": 1000})
        tenant.full_clean()
        ApiKey.objects.filter(tenant=tenant, name="gpu-bench").delete()
        keys[dep.slug] = ApiKey.objects.create_key(tenant=tenant, name="gpu-bench",
                                                   created_by=admin)[1]
    deployments: dict[str, dict[str, Any]] = {}
    started = []
    for config in args.configs:
        name = f"bench-{config}"
        base = BaseModel.objects.filter(name=name).first() or BaseModel(name=name)
        base.path, base.load_format = source.path, source.load_format
        base.full_clean()
        base.save()
        old = Deployment.objects.filter(name=name).first()
        if old is not None:
            old.stop()
            old.delete()
        deployment = Deployment(
            name=name, base_model=base, created_by=admin, isolation_mode="shared",
            max_model_len=MAX_MODEL_LEN, max_loras=1, **CONFIGS[config])
        deployment.full_clean()
        deployment.save()
        deployment.tenants.set(Tenant.objects.filter(
            slug__in=[*DEPARTMENTS, STREAM_TENANT]))
        deployments[config] = {"id": deployment.pk, "model": name}
        started.append(deployment)
    for deployment in started:  # all at once, once every row exists
        deployment.start()
    STATE.write_text(json.dumps({"keys": keys, "deployments": deployments}, indent=1))
    log(f"started {', '.join(deployments)}; `bench wait` follows them to ready")


def state() -> dict[str, Any]:
    if not STATE.exists():
        sys.exit(f"{STATE} is missing: run `bench setup` first")
    return json.loads(STATE.read_text())


def instances(config: str) -> list[Any]:
    from serving_app.models import Instance

    return list(Instance.objects.active().filter(
        deployment_id=state()["deployments"][config]["id"]).select_related("node"))


def wait(args: argparse.Namespace) -> None:
    """Until every configuration's instance is ready (or failed, or `--timeout`); prints and
    writes (`--json`) each one's start: phases, seconds to ready, KV cache figures."""
    deadline = time.monotonic() + args.timeout
    configs = list(state()["deployments"])
    while True:
        rows = {c: instances(c) for c in configs}
        states = {c: [i.state for i in r] for c, r in rows.items()}
        done = all(r and all(i.state == "ready" for i in r) for r in rows.values())
        failed = any(s in ("failed", "crash_loop") for v in states.values() for s in v)
        if done or failed or time.monotonic() > deadline:
            break
        log(f"waiting: {states}")
        time.sleep(5)
    out = {}
    for config, found in rows.items():
        out[config] = [{
            "state": i.state, "port": i.port, "gpu_memory_fraction": i.gpu_memory_fraction,
            "seconds_to_ready": round((i.ready_at - i.started_at).total_seconds(), 1)
            if i.ready_at and i.started_at else None,
            "startup": i.startup, "last_error": i.last_error, "command": i.command}
            for i in found]
    print(json.dumps(out, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if not done:
        sys.exit(f"not every engine is ready: {states}")


def stop(args: argparse.Namespace) -> None:
    from serving_app.models import Deployment

    for config in state()["deployments"].values():
        deployment = Deployment.objects.filter(pk=config["id"]).first()
        if deployment is not None:
            deployment.stop()
    log("stop requested for every bench deployment")


# -- the engine's own view while a point runs ------------------------------------------------------
class EngineSampler:
    """Samples the engine's /metrics every `interval` s while a point runs: requests running
    and waiting, KV cache usage (the batch it ran, beside what the clients saw)."""

    GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
              "kv_usage": "vllm:kv_cache_usage_perc"}

    def __init__(self, url: str, key: str, interval: float = 0.5) -> None:
        self.url, self.key = url, key
        self.interval = interval
        # (perf_counter, value): the clock of vLLM's per-request start times (CLOCK_MONOTONIC,
        # the same in every process), so that only the measured window is summarized.
        self.samples: dict[str, list[tuple[float, float]]] = {k: [] for k in self.GAUGES}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def __enter__(self) -> EngineSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(5)

    @classmethod
    def gauges(cls, text: str) -> dict[str, float]:
        """The gauges of GAUGES found in a /metrics text."""
        out = {}
        for key, name in cls.GAUGES.items():
            found = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
            if found:
                out[key] = float(found.group(1))
        return out

    def loop(self) -> None:
        import httpx

        while not self.stop_event.wait(self.interval):
            try:
                text = engine_metrics(self.url, self.key, timeout=2)
            except httpx.HTTPError:
                continue
            now = time.perf_counter()
            for key, value in self.gauges(text).items():
                self.samples[key].append((now, value))

    def summary(self, begin: float, end: float) -> dict[str, Any]:
        """Means and maxima of the samples taken between `begin` and `end`."""
        out: dict[str, Any] = {}
        for key, timed in self.samples.items():
            values = [v for t, v in timed if begin <= t <= end]
            if values:
                out[key] = {"mean": round(statistics.fmean(values), 3),
                            "max": round(max(values), 3), "n": len(values)}
        return out


def engine_metrics(url: str, key: str, timeout: float) -> str:
    """The /metrics text of the engine at `url` (its key: every route but /health needs it);
    an HTTPError for any answer but 200, so that a refusal is never read as an idle engine."""
    from serving_app.engine.client import EngineClient

    return EngineClient(url, key).metrics(timeout=timeout)


def wait_idle(engines: dict[str, tuple[str, str]], seconds: float = 60.0
              ) -> dict[str, dict[str, Any]]:
    """Until no engine of `engines` (name -> base URL and key: every bench engine, as they
    share the GPU) has a request running or waiting, for at most `seconds`; returns what each
    reported last.
    A point measured beside someone else's load measures that load as well: on the GPU host a
    client of a benchmark killed by its call's time limit went on sending 16 concurrent
    requests through the runs after it (docs/gpu.md). Exits naming the busy engines."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        seen: dict[str, dict[str, Any]] = {}
        for name, (url, key) in engines.items():
            try:
                seen[name] = EngineSampler.gauges(engine_metrics(url, key, timeout=5))
            except httpx.HTTPError as exc:
                seen[name] = {"error": str(exc) or type(exc).__name__}
        busy = {name: g for name, g in seen.items()
                if "error" in g or g.get("running", 0) or g.get("waiting", 0)}
        if not busy:
            return seen
        if time.monotonic() > deadline:
            sys.exit(f"not measured: an engine was not idle before the point after {seconds:.0f} s"
                     f" ({busy}): another load is still sending to it (a client of a run cut "
                     f"short?); stop it and run again")
        time.sleep(1)


def bench_engines() -> dict[str, tuple[str, str]]:
    """Every engine `setup` started, by configuration: their base URLs and keys."""
    return {config: (inst.base_url, inst.secret) for config in state()["deployments"]
            for inst in instances(config)[:1]}


# -- streaming: direct against the gateway ---------------------------------------------------------
def stream(args: argparse.Namespace) -> None:
    st = state()
    config = args.config
    inst = instances(config)[0]
    model = st["deployments"][config]["model"]
    sides = {"direct": (inst.base_url, inst.secret),
             "gateway": (args.gateway.rstrip("/"), st["keys"][STREAM_TENANT])}
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "func"},
                               "config": config, "cells": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-stream-") as folder:
        client = stream_bench.Client(Path(folder) / "client.log")
        try:
            def once(side: str, concurrency: int, prompts: int, seed: int) -> dict[str, Any]:
                url, key = sides[side]
                argv = ["--backend", "openai-chat", "--base-url", url,
                        "--endpoint", "/v1/chat/completions", "--model", model,
                        "--tokenizer", args.tokenizer, "--dataset-name", "random",
                        "--random-input-len", str(args.input_len),
                        "--random-output-len", str(args.output_len),
                        "--random-range-ratio", "0", "--num-prompts", str(prompts),
                        "--max-concurrency", str(concurrency), "--num-warmups", "0",
                        "--seed", str(seed), "--temperature", "0", "--ignore-eos",
                        "--disable-tqdm", "--save-detailed"]
                return client.run(argv, key)

            wait_idle(bench_engines())
            log("warming up both sides (not recorded)")
            for side in sides:
                once(side, 32, 64, 1)
            seeds = itertools.count(100)
            for concurrency in args.concurrency:
                cell: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
                for round_no in range(args.rounds):
                    order = list(sides) if round_no % 2 == 0 else list(reversed(sides))
                    seed = next(seeds)  # both sides get the same prompts in a round
                    for side in order:
                        r = once(side, concurrency, concurrency * args.waves, seed)
                        row = {"duration": r["duration"], "completed": r["completed"],
                               "failed": r["failed"], "errors": r["errors"],
                               "output_tokens": sum(r["output_lens"]), "ttfts": r["ttfts"],
                               "itl_p50": r["itl_p50"], "e2els": r["e2els"]}
                        cell[side].append(row)
                        log(f"c={concurrency} round {round_no} {side}: "
                            f"{row['output_tokens'] / r['duration']:.0f} tok/s, TTFT p50 "
                            f"{statistics.median(r['ttfts']) * 1000:.1f} ms, failed "
                            f"{r['failed']}")
                results["cells"][str(concurrency)] = summarize_stream(cell)
        finally:
            client.close()
    print_stream(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def summarize_stream(cell: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": cell, "sides": {}}
    for side, rows in cell.items():
        ttfts = [t for r in rows for t in r["ttfts"]]
        itls = [r["itl_p50"] for r in rows if r["itl_p50"] is not None]
        out["sides"][side] = {
            "tok_s": sum(r["output_tokens"] for r in rows) / sum(r["duration"] for r in rows),
            "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "ttft_p99_ms": sorted(ttfts)[int(0.99 * (len(ttfts) - 1))] * 1000,
            "itl_p50_ms": statistics.median(itls) * 1000 if itls else None,
            "failed": sum(r["failed"] for r in rows)}
    direct, gateway = out["sides"]["direct"], out["sides"]["gateway"]
    out["throughput_ratio"] = gateway["tok_s"] / direct["tok_s"]
    out["ttft_p50_added_ms"] = gateway["ttft_p50_ms"] - direct["ttft_p50_ms"]
    if direct["itl_p50_ms"] is not None and gateway["itl_p50_ms"] is not None:
        out["itl_p50_added_ms"] = gateway["itl_p50_ms"] - direct["itl_p50_ms"]
    return out


def print_stream(results: dict[str, Any]) -> None:
    print(f"\nstreaming on {results['config']}: gateway against direct, all rounds pooled")
    print(f"{'conc':>5} {'direct tok/s':>12} {'gateway tok/s':>13} {'ratio':>6} "
          f"{'TTFT p50 direct':>15} {'added ms':>8} {'ITL added ms':>12} {'failed':>6}")
    for concurrency, cell in results["cells"].items():
        d, g = cell["sides"]["direct"], cell["sides"]["gateway"]
        print(f"{concurrency:>5} {d['tok_s']:12.0f} {g['tok_s']:13.0f} "
              f"{cell['throughput_ratio']:6.3f} {d['ttft_p50_ms']:15.1f} "
              f"{cell['ttft_p50_added_ms']:8.2f} {cell.get('itl_p50_added_ms', 0):12.3f} "
              f"{d['failed'] + g['failed']:6d}", flush=True)


# -- fair sharing --------------------------------------------------------------------------------
def configure(deployment_id: int, mode: str, budget: int | None) -> None:
    """Rows in `mode`'s state (fairness_bench.configure's modes), flow-control state cleared."""
    import redis
    from django.conf import settings

    from serving_app.deployments.sharing import prefix
    from serving_app.models import Deployment
    from tenants_app.models import Tenant

    for dep in DEPARTMENTS.values():
        Tenant.objects.filter(slug=dep.slug).update(
            priority_tier=NORMAL if mode == "fcfs" else dep.tier)
    Deployment.objects.filter(pk=deployment_id).update(
        flow_control=mode == "flow", dispatch_budget=budget if mode == "flow" else None)
    with redis.Redis.from_url(settings.GATEWAY["REDIS_URL"]) as client:
        for key in client.scan_iter(prefix(deployment_id) + "*"):
            client.delete(key)
    catalog_changed()


def fair(args: argparse.Namespace) -> None:
    st = state()
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "func"},
                               "configs": {}}
    three = [(CONTENT, args.flood_clients), (CS, args.cs_clients), (CODE, args.code_clients)]
    with tempfile.TemporaryDirectory(prefix="gpu-fair-") as folder:
        loads_by_config: dict[str, Loads] = {}
        try:
            for config in args.configs:
                dep_id = st["deployments"][config]["id"]
                loads = loads_by_config[config] = Loads(
                    args.gateway.rstrip("/"), st["keys"], Path(folder) / config,
                    args.max_prompts, departments=DEPARTMENTS,
                    model=st["deployments"][config]["model"], tokenizer=Path(args.tokenizer),
                    seconds_per_request=0.25)
                loads.folder.mkdir()
                out: dict[str, Any] = {}

                def point(name: str, plan: list[tuple[str, int]], mode: str,
                          budget: int | None = None, seconds: float = args.seconds,
                          lead: float = args.lead, config: str = config, dep_id: int = dep_id,
                          loads: Loads = loads, out: dict[str, Any] = out) -> None:
                    """One point: `mode`'s rows, the load of `plan`, the engine sampled (every
                    bench engine idle before it)."""
                    idle = wait_idle(bench_engines())
                    configure(dep_id, mode, budget)
                    first = instances(config)[0]
                    with EngineSampler(first.base_url, first.secret) as sampler:
                        run = loads.run(plan, seconds, lead)
                    fig = figures([run], DEPARTMENTS)
                    fig["engine"] = sampler.summary(*window_of(run))
                    fig["engines_before"] = idle
                    if mode == "flow":
                        fig["queue"] = pooled_waits([queue_waits(dep_id)])
                    out[name] = fig
                    cs = fig["tenants"].get(CS, {})
                    log(f"{config} {name}: CS p95 {cs.get('e2e_p95') or 0:.0f} ms, total "
                        f"{fig['tok_s']:.0f} tok/s, engine {fig['engine']}")

                pair = [("gpu-team-a", args.pair[0]), ("gpu-team-b", args.pair[1])]
                configure(dep_id, "fcfs", None)
                log(f"{config}: warming up (not measured)")
                loads.run(pair if args.pair_only else three, args.warmup, 1.0)
                if not args.pair_only:
                    point("alone", [(CS, args.cs_clients)], "fcfs", seconds=args.alone_seconds,
                          lead=0.0)
                if not args.pair_only and not args.bursty:
                    point("fcfs", three, "fcfs")
                    if CONFIGS[config]["scheduling_policy"] == "priority":
                        point("priority", three, "priority")
                    for budget in args.budgets:
                        point(f"flow-{budget}", three, "flow", budget)
                    if args.objectives_point:  # the controller's point on the frontier
                        objectives(args.cs_ttft_ms, args.cs_tpot_ms)
                        point("flow-objectives", three, "flow")
                        objectives(None, None)
                if args.bursty:
                    out.update(bursty(args, loads, dep_id, out["alone"]))
                if config == args.pair_config:
                    point("pair-fcfs", pair, "fcfs", seconds=args.pair_seconds)
                    point(f"pair-flow-{args.pair_budget or 'default'}", pair, "flow",
                          args.pair_budget or None, seconds=args.pair_seconds)
                results["configs"][config] = out
                if args.json:  # kept as it goes: a run cut short still leaves its points
                    Path(args.json).write_text(json.dumps(frontier(results), indent=1,
                                                          default=list))
        finally:
            for loads in loads_by_config.values():
                for client in loads.clients.values():
                    client.close()
    results = frontier(results)
    print_frontier(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=list))


def objectives(ttft_ms: int | None, tpot_ms: int | None) -> None:
    """Customer service's streamed latency objectives (None: none), before `configure`."""
    from tenants_app.models import Tenant

    Tenant.objects.filter(slug=CS).update(ttft_objective_ms=ttft_ms, tpot_objective_ms=tpot_ms)


def bursty(args: argparse.Namespace, loads: Loads, dep_id: int,
           alone: dict[str, Any]) -> dict[str, Any]:
    """Bursty customer service under `--bursty-modes` (FCFS, the static budget, the admission
    controller), one after the other (every bench engine idle before each): points named
    `bursty-<mode>`, compared by `frontier()`."""
    background = [(CONTENT, args.flood_clients), (CODE, args.code_clients)]
    alone_p95 = alone["tenants"].get(CS, {}).get("e2e_p95")
    modes: dict[str, dict[str, Any]] = {}
    for name, mode, budget, held in (
            ("fcfs", "fcfs", None, False),
            ("static", "flow", args.bursty_budget, False),
            ("objectives", "flow", None, True)):
        if name not in args.bursty_modes:
            continue
        wait_idle(bench_engines())
        objectives(args.cs_ttft_ms if held else None, args.cs_tpot_ms if held else None)
        configure(dep_id, mode, budget)
        flood, cs = bursts.run(loads.run, background, (CS, args.cs_clients),
                               args.bursty_seconds, args.burst_on, args.burst_off)
        modes[f"bursty-{name}"] = bursts.figures(flood, cs, alone_p95)
        modes[f"bursty-{name}"]["budget"] = budget
        log(f"bursty {name}: {modes[f'bursty-{name}']}")
        # The per-request detail itself, so that a figure can be computed again later.
        modes[f"bursty-{name}"]["detail"] = {"background": flood, "bursts": cs}
    objectives(None, None)
    return modes


def frontier(results: dict[str, Any]) -> dict[str, Any]:
    """Each point: customer service's p95 over its p95 alone on the same engine, and total
    output tokens/s over FCFS's (the reference engine in fcfs mode, or failing that the
    point's own engine's)."""
    configs = results["configs"]
    reference = configs.get(REFERENCE, {}).get("fcfs")
    rows = []
    for config, points in configs.items():
        alone = points.get("alone", {}).get("tenants", {}).get(CS)
        base = reference or points.get("fcfs")
        for name, fig in points.items():
            if name == "alone" or name.startswith(("pair", "bursty")):
                continue
            cs = fig["tenants"].get(CS)
            if not cs or not alone or cs["e2e_p95"] is None or not alone["e2e_p95"]:
                # No customer-service request started and ended inside the window: a window
                # too short for this engine's speed. Shown, not plotted.
                rows.append({"config": config, "point": name, "unmeasured": True})
                continue
            row = {"config": config, "point": name, "cs_p50_ms": cs["e2e_p50"],
                   "cs_p95_ms": cs["e2e_p95"], "cs_alone_p95_ms": alone["e2e_p95"],
                   "cs_p95_vs_alone": cs["e2e_p95"] / alone["e2e_p95"],
                   "tok_s": fig["tok_s"],
                   "vs_fcfs": fig["tok_s"] / base["tok_s"] if base else None,
                   "fcfs_reference": config == REFERENCE and name == "fcfs"}
            row["target_met"] = bool(row["cs_p95_vs_alone"] <= 1.25
                                     and (row["vs_fcfs"] or 0) >= 0.8)
            rows.append(row)
    results["frontier"] = rows
    pairs = {}
    for config, points in configs.items():
        for name, fig in points.items():
            if name.startswith("pair"):
                pairs[f"{config} {name}"] = fig["jain"]
    results["pair_jain"] = pairs
    # A configuration run without FCFS (urgent-8k: the engine's FCFS is prio-8k's with every
    # tenant in one tier) is compared with another's FCFS on the same card, the reference's first.
    fcfs_runs = [points["bursty-fcfs"] for config, points in
                 sorted(configs.items(), key=lambda item: item[0] != REFERENCE)
                 if "bursty-fcfs" in points]
    results["bursty"] = {
        config: bursts.versus({name[len("bursty-"):]: fig for name, fig in points.items()
                               if name.startswith("bursty-")},
                              base=points.get("bursty-fcfs") or (fcfs_runs or [{}])[0])
        for config, points in configs.items() if any(n.startswith("bursty-") for n in points)}
    return results


def print_frontier(results: dict[str, Any]) -> None:
    print(f"\n{'config':8} {'point':10} {'CS p50':>7} {'CS p95':>7} {'alone':>6} "
          f"{'p95/alone':>9} {'tok/s':>7} {'/FCFS':>6}  target")
    for r in results["frontier"]:
        if r.get("unmeasured"):
            print(f"{r['config']:8} {r['point']:10} no customer-service request in the window")
            continue
        print(f"{r['config']:8} {r['point']:10} {r['cs_p50_ms']:7.0f} {r['cs_p95_ms']:7.0f} "
              f"{r['cs_alone_p95_ms']:6.0f} {r['cs_p95_vs_alone']:9.2f} {r['tok_s']:7.0f} "
              f"{r['vs_fcfs'] or 0:6.2f}  {'met' if r['target_met'] else '-'}"
              f"{'  (FCFS)' if r['fcfs_reference'] else ''}")
    for name, jain in results["pair_jain"].items():
        print(f"two equal backlogged tenants, {name}: Jain {jain:.3f}")
    for config, modes in results.get("bursty", {}).items():
        for mode, fig in modes.items():
            print(f"bursty customer service, {config} {mode}: CS p95 / alone "
                  f"{fig['cs_p95_vs_alone'] or 0:.2f} (every request "
                  f"{fig.get('cs_p95_all_vs_alone') or 0:.2f}), tok/s / FCFS "
                  f"{fig['vs_fcfs'] or 0:.2f}, after bursts / FCFS "
                  f"{fig['after_vs_fcfs'] or 0:.2f}, issue 44 "
                  f"{'met' if fig['target_met'] else 'not met'}, issue 45 "
                  f"{'go' if fig.get('go_all_requests') else 'no go'}")


# -- the frontier as a picture -----------------------------------------------------------------
def merged(files: list[str]) -> dict[str, Any]:
    """The configurations of several `fair` runs (one call each on the GPU host: a call there
    lasts 10 minutes at most) as one result, its frontier computed again over all of them.
    Points merge by name within a configuration, so a `--pair-only` run adds its pair to the
    configuration's other points."""
    results: dict[str, Any] = {"runs": [], "configs": {}}
    for name in files:
        one = json.loads(Path(name).read_text())
        results["runs"].append({"file": Path(name).name, "args": one.get("args")})
        for config, points in one["configs"].items():  # a later file's point of a name wins
            results["configs"].setdefault(config, {}).update(points)
    return frontier(results)


def plot(args: argparse.Namespace) -> None:
    """The frontier of one or more `fair` results as a PNG (plotly draws it, Chromium renders
    it through Playwright), and with `--json` the merged figures."""
    import plotly.graph_objects as go
    from playwright.sync_api import sync_playwright

    results = merged(args.files)
    print_frontier(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=list))
    fig = go.Figure()
    measured = [r for r in results["frontier"] if not r.get("unmeasured")]
    for config in dict.fromkeys(r["config"] for r in measured):
        rows = [r for r in measured if r["config"] == config]
        fig.add_trace(go.Scatter(
            x=[r["vs_fcfs"] for r in rows], y=[r["cs_p95_vs_alone"] for r in rows],
            mode="markers+text", name=config, text=[r["point"] for r in rows],
            textposition="top center", marker={"size": 10}))
    ref = [r for r in measured if r["fcfs_reference"]]
    if ref:
        fig.add_trace(go.Scatter(x=[ref[0]["vs_fcfs"]], y=[ref[0]["cs_p95_vs_alone"]],
                                 mode="markers", name="FCFS (vLLM defaults)",
                                 marker={"size": 18, "symbol": "x", "color": "black"}))
    fig.add_shape(type="rect", x0=0.8, x1=1.2, y0=0, y1=1.25, line={"dash": "dot"},
                  fillcolor="rgba(0,160,0,0.08)")
    fig.add_annotation(x=1.0, y=1.2, text="target: p95 within 1.25x of alone at 0.8 of FCFS",
                       showarrow=False)
    fig.update_layout(
        title=args.title or "Customer service's p95 against total throughput, "
        "three departments on one engine",
        xaxis_title="total output tokens/s / FCFS", yaxis_title="customer service p95 / alone",
        width=1000, height=640, template="plotly_white")
    with tempfile.TemporaryDirectory() as folder:
        page_file = Path(folder) / "frontier.html"
        fig.write_html(page_file, include_plotlyjs=True, full_html=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium,
                                         args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1000, "height": 640})
            page.goto(page_file.as_uri())
            page.wait_for_selector(".main-svg")
            page.screenshot(path=args.out)
            browser.close()
    log(f"wrote {args.out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gateway", default=os.environ.get("GATEWAY_URL",
                                                            "http://127.0.0.1:8000"))
    common.add_argument("--tokenizer", default=str(ROOT / "var" / "models" / "tiny-llama"))
    common.add_argument("--json", default="")
    p = sub.add_parser("setup", parents=[common])
    p.add_argument("--model", default="llama3-8b-shape")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p = sub.add_parser("wait", parents=[common])
    p.add_argument("--timeout", type=float, default=560.0)
    sub.add_parser("stop", parents=[common])
    p = sub.add_parser("stream", parents=[common])
    p.add_argument("--config", default=REFERENCE)
    p.add_argument("--concurrency", default="32,64,128")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--waves", type=int, default=5, help="prompts per measurement / concurrency")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p = sub.add_parser("fair", parents=[common])
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--budgets", default="8,16,32,64")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--lead", type=float, default=3.0)
    p.add_argument("--alone-seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--cs-clients", type=int, default=2)
    p.add_argument("--code-clients", type=int, default=8)
    p.add_argument("--flood-clients", type=int, default=64)
    p.add_argument("--pair-config", default="prio-8k")
    p.add_argument("--pair-clients", default="48,16")
    p.add_argument("--pair-budget", type=int, default=32,
                   help="the pair's dispatch budget (0: the shipped default, none set)")
    # Long against the second tenant's ramp: it arrives when the first holds every slot and
    # gains them only as requests end (tests/gateway/test_flow_units.py, the closed-loop pair).
    p.add_argument("--pair-seconds", type=float, default=60.0)
    p.add_argument("--pair-only", action="store_true",
                   help="only the two equal tenants, on --pair-config (a call of its own)")
    p.add_argument("--max-prompts", type=int, default=4000)
    p.add_argument("--objectives-point", action="store_true",
                   help="also the shipped budget with customer service's objectives held")
    p.add_argument("--bursty", action="store_true",
                   help="also customer service in bursts: FCFS, static budget, objectives")
    p.add_argument("--bursty-modes", default="fcfs,static,objectives",
                   help="which of the three to run (each takes --bursty-seconds: one or two "
                        "per call of 10 minutes; `plot` merges the files)")
    p.add_argument("--bursty-seconds", type=float, default=300.0)
    p.add_argument("--burst-on", type=float, default=15.0)
    p.add_argument("--burst-off", type=float, default=35.0)
    p.add_argument("--bursty-budget", type=int, default=16,
                   help="the static budget compared (the best measured point: docs/gpu.md)")
    # Starting points from the H100's figures (ENGINE.md: 4.7 ms a token alone, 5.9 ms at 64).
    p.add_argument("--cs-ttft-ms", type=int, default=300)
    p.add_argument("--cs-tpot-ms", type=int, default=6)
    p = sub.add_parser("plot")
    p.add_argument("files", nargs="+")
    p.add_argument("--json", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    if isinstance(getattr(args, "bursty_modes", None), str):
        args.bursty_modes = [m.strip() for m in args.bursty_modes.split(",") if m.strip()]
    for name in ("configs", "budgets", "concurrency", "pair_clients"):
        if isinstance(getattr(args, name, None), str):
            items = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
            setattr(args, name, items if name == "configs" else [int(x) for x in items])
    if hasattr(args, "pair_clients"):
        args.pair = args.pair_clients
        if args.pair_config not in CONFIGS:
            parser.error(f"unknown --pair-config {args.pair_config!r}")
        if args.pair_only:
            args.configs = [args.pair_config]
        for slug, clients in zip(("gpu-team-a", "gpu-team-b"), args.pair, strict=False):
            if clients > DEPARTMENTS[slug].max_concurrency:
                parser.error(f"--pair-clients: {clients} clients for {slug}, whose key allows "
                             f"{DEPARTMENTS[slug].max_concurrency} at once (the rest would be "
                             "refused, not queued)")
    for config in getattr(args, "configs", []):
        if config not in CONFIGS:
            parser.error(f"unknown configuration {config!r}: one of {', '.join(CONFIGS)}")
    return args


def main() -> int:
    args = parse_args()
    if args.action == "plot":
        plot(args)
        return 0
    stream_bench.ENGINE_PYTHON = client_python()
    # Stopped from outside (`timeout`, Ctrl-C): the load clients are closed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    setup_django()
    {"setup": setup, "wait": wait, "stop": stop, "stream": stream, "fair": fair}[args.action](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
