"""Three departments on one engine: first come first served, vLLM's priority, and flow control.

    .venv/bin/python benchmarks/fairness_bench.py                  # the whole run (about 12 min)
    .venv/bin/python benchmarks/fairness_bench.py --quick          # a short smoke run (about 5 min)
    .venv/bin/python benchmarks/fairness_bench.py --budgets 2,4,8,16,32 --json var/fair.json

The case this product is built around: customer service, a code assistant and content generation
share one deployment. Here it is the real CPU vLLM engine (tiny model, under SCHED_IDLE as node
agents start it) with vLLM's priority scheduler (`--scheduling-policy priority`, max_num_seqs
64), behind a gateway (uvicorn, 2 workers) on its own PostgreSQL database (`bench_fairness`,
seeded afresh) and its own Redis. The tenants, with the settings of the case:

- customer service: high tier, at most 8 concurrent requests and 256 tokens per request, a 500 ms
  p95 objective; load: 2 concurrent requests (`--cs-clients`), short answers;
- code assistant: normal tier, at most 16 concurrent; load: steady at 4;
- content generation: low tier, fair-share weight 4, at most 64 concurrent; load: a flood at 32,
  long answers (about ten times its entitled share of the engine's sequences).

The load is vLLM's own benchmark client (`vllm.benchmarks.serve`, from the engine's virtual
environment, benchmarks/stream_bench.py's `Client`), one process per tenant, all three running
at once: `--backend openai-chat`, streaming, the random dataset, a new prompt seed each time.
Each client builds its prompts first and then waits for its cue: the flood starts first, the
others `--lead` seconds later; after `--seconds` every client stops sending (a stop file its
client process checks before each request) and the requests already sent complete. Every
figure is computed over the window in which all of them overlap, from each request's start
time and latency (vLLM's `--save-detailed` detail): from the last tenant's first request to the
first tenant's last completion. Latency and TTFT percentiles are over the requests that start
and end in the window; requests/s and output tokens/s over those that complete in it.

Modes, in one run on one engine (switched by updating the database rows, which every gateway
worker re-reads every 0.5 s here; the flow-control queues and counters are cleared between
runs):
- `fcfs`: flow control off and all tenants in the same tier, so vLLM's priority scheduler
  degenerates to arrival order;
- `priority`: flow control off, the tiers set: vLLM's priority alone;
- `flow`: the console's flow control (weighted bands, the default), tiers and weights set, the
  deployment's dispatch budget `--budget`.
Before them, customer service alone (no other load) gives its baseline latency. Per mode and
tenant it prints p50/p95/p99 end-to-end latency and TTFT, requests/s and output tokens/s; the
total; Jain's index over the tenants' weighted served tokens (prompt tokens x 1 + output tokens x
2, the gateway's default weights, divided by the tenant's fair-share weight; only content
generation is backlogged in this scenario, so the index mostly shows how little the others
ask for); then customer service's p95 under the flood against its p95 alone, and each mode's
total output tokens/s against FCFS's. After every flow-control run it also prints the gateway's
own queue statistics per tenant (`queue_waits`: how many of its requests had to wait in the
gateway's queue, and the mean wait), so that a tenant's latency can be told apart from queueing;
and after every mode the time to the engine's first bytes as the gateway recorded it per
streamed request (`engine_ttfts`), to set beside the client's TTFT.

Second scenario: two tenants of equal weight and tier, both backlogged (`--pair-clients`, 24
and 8 concurrent: with equal client counts first come first served is already even; unequal
demand is what shows whether equal weights get equal service), FCFS against flow control: each
one's weighted served tokens and Jain's index.

Budget sweep (`--budgets`): the three departments under flow control at each dispatch budget;
per budget customer service's p50/p95, the total output tokens/s and its ratio to FCFS, and
whether the issue's target holds there (customer service's p95 within 1.25x of alone and under
its objective, total throughput at least 0.9 of FCFS). On a CPU engine a smaller batch protects
latency and costs throughput: this is that trade-off.

`--reserved-slots N` sets the slots beyond the budget that customer service's high tier may
use (`GATEWAY_FLOW_RESERVED_SLOTS`, 2 by default; 0 to measure without the reserve).

`--rounds N` repeats the baseline and the three modes N times (samples pooled per mode). Each
run is bounded by its time (and each client by `--max-prompts`); everything listens on
127.0.0.1, and every process the benchmark starts is stopped when it ends, is interrupted or
fails. `--json FILE` keeps every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's packages
    sys.path.insert(0, str(ROOT))

from benchmarks.dashboard_bench import database_url, ensure_database  # noqa: E402
from benchmarks.gateway_bench import (  # noqa: E402
    ENGINE_SECRET,
    USAGE_STREAM,
    free_port,
    gateway_env,
    start_engine,
    start_gateway,
    start_redis,
    stop_all,
    wait_http,
)
from benchmarks.stream_bench import TOKENIZER, Client  # noqa: E402

DB_NAME = "bench_fairness"
RUN_MINUTES = 15  # longer than any one run: the counters a run's statistics are read from
MAX_NUM_SEQS = 64
TOKEN_WEIGHTS = (1.0, 2.0)  # GATEWAY_FLOW_INPUT_TOKEN_WEIGHT, _OUTPUT_ (their defaults)
HIGH, NORMAL, LOW = 1, 2, 3  # tenants_app.models.PriorityTier


@dataclass(frozen=True)
class Department:
    """A tenant of the shared deployment, its settings and its load."""

    slug: str
    name: str
    tier: int
    weight: int
    max_concurrency: int
    max_tokens: int | None
    objective_ms: int | None
    input_len: int
    output_len: int


CS, CODE, CONTENT = "customer-service", "code-assistant", "content-generation"
DEPARTMENTS = (
    Department(CS, "Customer service", HIGH, 1, 8, 256, 500, 64, 32),
    Department(CODE, "Code assistant", NORMAL, 1, 16, None, None, 128, 64),
    Department(CONTENT, "Content generation", LOW, 4, 64, None, None, 64, 128),
    Department("team-a", "Team A", NORMAL, 1, 64, None, None, 64, 48),
    Department("team-b", "Team B", NORMAL, 1, 64, None, None, 64, 48),
)
BY_SLUG = {d.slug: d for d in DEPARTMENTS}


# -- the database ----------------------------------------------------------------------------------
def seed(engine_port: int) -> tuple[int, dict[str, str]]:
    """One running deployment of the tiny model (priority scheduling, max_num_seqs 64) with its
    ready instance on the engine, and the tenants above with a key each. Returns the
    deployment's id and each tenant's key."""
    from serving_app.models import BaseModel, Deployment, Instance, Node
    from tenants_app.models import ApiKey, Tenant

    base = BaseModel(name="tiny-llama", path=str(ROOT / "var/models/tiny-llama"))
    base.full_clean()
    base.save()
    deployment = Deployment.objects.create(
        name="shared", base_model=base, desired_state="running", max_model_len=1024,
        max_num_seqs=MAX_NUM_SEQS, scheduling_policy="priority", flow_control=False)
    node, _ = Node.objects.get_or_create(name="bench-fair", defaults={"queue": "node.fair"})
    Instance.objects.create(deployment=deployment, node=node, port=engine_port, state="ready",
                            secret=ENGINE_SECRET)
    keys = {}
    for dep in DEPARTMENTS:
        tenant = Tenant.objects.create(
            slug=dep.slug, name=dep.name, priority_tier=dep.tier, fair_share_weight=dep.weight,
            max_concurrent_requests=dep.max_concurrency, max_tokens_per_request=dep.max_tokens,
            latency_objective_ms=dep.objective_ms)
        deployment.tenants.add(tenant)
        keys[dep.slug] = ApiKey.objects.create_key(tenant=tenant, name="bench")[1]
    return deployment.pk, keys


def configure(deployment_id: int, mode: str, budget: int | None, redis_url: str) -> None:
    """Put the rows in `mode`'s state, clear the flow-control state in Redis, and give every
    gateway worker time to re-read its catalog."""
    import redis

    from serving_app.deployments.sharing import prefix
    from serving_app.models import Deployment
    from tenants_app.models import Tenant

    for dep in DEPARTMENTS:
        Tenant.objects.filter(slug=dep.slug).update(
            priority_tier=NORMAL if mode == "fcfs" else dep.tier)
    Deployment.objects.filter(pk=deployment_id).update(
        flow_control=mode == "flow", dispatch_budget=budget if mode == "flow" else None)
    with redis.Redis.from_url(redis_url) as client:
        for key in client.scan_iter(prefix(deployment_id) + "*"):
            client.delete(key)
        client.delete(USAGE_STREAM)
    time.sleep(2.0)  # catalog re-read every 0.5 s (GATEWAY_CATALOG_REFRESH_SECONDS below)


def queue_waits(deployment_id: int) -> dict[str, dict[str, float]]:
    """Per tenant, the gateway's own flow-control statistics over the whole run (the flood's
    lead included; `serving_app.deployments.sharing`'s per-minute counters, which `configure()`
    clears before each run, read through this process's settings, i.e. the benchmark's Redis):
    requests dispatched, how many of them had to wait in the gateway's queue, and the mean
    wait of all of them. Where a tenant's latency goes when it is not the queue: the engine."""
    from serving_app.deployments.sharing import minute_stats
    from tenants_app.models import Tenant

    stats = minute_stats([deployment_id], time.time(), RUN_MINUTES)[deployment_id]
    out = {}
    for pk, slug in Tenant.objects.values_list("pk", "slug"):
        n = stats[f"n:{pk}"]
        if n:
            out[slug] = {"dispatched": n, "waited": stats[f"b:{pk}"], "wait_ms": stats[f"w:{pk}"]}
    return out


def engine_ttfts(redis_url: str) -> dict[str, list[float]]:
    """Per tenant, over the whole run, the time from each streamed request's arrival at the
    gateway to the engine's first bytes, as the gateway recorded it in its usage event
    (`ttft_ms`): its queue wait, its own work and the engine's time to a first token. Set
    beside the client's TTFT, it tells the gateway's part from the engine's."""
    import redis

    from tenants_app.models import Tenant

    slugs = dict(Tenant.objects.values_list("pk", "slug"))
    by_tenant: dict[str, list[float]] = {}
    with redis.Redis.from_url(redis_url) as client:
        for _id, fields in client.xrange(USAGE_STREAM):
            event = json.loads(fields[b"e"])
            if event.get("stream") and event.get("ttft_ms") is not None:
                by_tenant.setdefault(slugs.get(event["tenant"], "?"), []).append(
                    float(event["ttft_ms"]) / 1000)  # seconds, as vLLM's detail
    return by_tenant


def pooled_ttfts(runs: list[dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    pooled: dict[str, list[float]] = {}
    for run in runs:
        for slug, values in run.items():
            pooled.setdefault(slug, []).extend(values)
    return {slug: {"n": len(v), "p50": _pct(v, 0.50), "p95": _pct(v, 0.95)}
            for slug, v in pooled.items()}


def print_ttfts(ttfts: dict[str, dict[str, Any]]) -> None:
    print("to the engine's first bytes, as the gateway saw it (whole run, p50 / p95 ms): "
          + "; ".join(f"{slug} {_ms(t['p50']).strip()} / {_ms(t['p95']).strip()}"
                      for slug, t in ttfts.items()), flush=True)


def pooled_waits(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        for slug, row in run.items():
            into = out.setdefault(slug, {"dispatched": 0.0, "waited": 0.0, "wait_ms": 0.0})
            for field, value in row.items():
                into[field] += value
    for row in out.values():
        row["mean_wait_ms"] = row["wait_ms"] / row["dispatched"]
    return out


def print_waits(waits: dict[str, dict[str, float]]) -> None:
    print("gateway queue (whole run): " + "; ".join(
        f"{slug} {w['waited']:.0f} of {w['dispatched']:.0f} waited, mean wait "
        f"{w['mean_wait_ms']:.1f} ms" for slug, w in waits.items()), flush=True)


# -- the load ----------------------------------------------------------------------------------
class Loads:
    """One vLLM client process per tenant, and the gateway they call."""

    def __init__(self, url: str, keys: dict[str, str], folder: Path, max_prompts: int,
                 departments: dict[str, Department] | None = None, model: str = "tiny-llama",
                 tokenizer: Path = TOKENIZER, seconds_per_request: float = 0.02) -> None:
        """`departments` (default: this benchmark's), the public `model` name they call and
        the `tokenizer` their prompts are made with; `seconds_per_request`: the shortest time
        a request takes, which sizes each client's prompts for a measurement's length."""
        self.departments = departments or BY_SLUG
        self.model = model
        self.tokenizer = tokenizer
        self.seconds_per_request = seconds_per_request
        self.url = url
        self.keys = keys
        self.folder = folder
        self.max_prompts = max_prompts
        self.clients: dict[str, Client] = {}
        self.seeds = itertools.count(1000)
        self.runs = itertools.count()

    def client(self, slug: str) -> Client:
        if slug not in self.clients:
            self.clients[slug] = Client(self.folder / f"client-{slug}.log")
        return self.clients[slug]

    def argv(self, dep: Department, clients: int, seconds: float) -> list[str]:
        # Enough prompts for `seconds` at the shortest request time per client, within the cap.
        prompts = min(self.max_prompts, math.ceil(clients * seconds / self.seconds_per_request))
        return ["--backend", "openai-chat", "--base-url", self.url,
                "--endpoint", "/v1/chat/completions", "--model", self.model,
                "--tokenizer", str(self.tokenizer), "--dataset-name", "random",
                "--random-input-len", str(dep.input_len),
                "--random-output-len", str(dep.output_len), "--random-range-ratio", "0",
                "--num-prompts", str(prompts), "--max-concurrency", str(clients),
                "--num-warmups", "0", "--seed", str(next(self.seeds)), "--temperature", "0",
                "--ignore-eos", "--disable-tqdm", "--save-detailed"]

    def run(self, plan: list[tuple[str, int]], seconds: float, lead: float) -> dict[str, dict]:
        """Run the tenants of `plan` ((slug, concurrent requests), the first starting `lead`
        seconds before the others) together for about `seconds` after the last one started;
        then every client stops sending and the requests in flight complete. Returns vLLM's
        per-request detail per tenant."""
        run = next(self.runs)
        stop = self.folder / f"stop-{run}"
        results: dict[str, dict] = {}
        errors: list[BaseException] = []

        def one(slug: str, clients: int, length: float) -> None:
            try:
                results[slug] = self.client(slug).run(
                    self.argv(self.departments[slug], clients, length), self.keys[slug], str(stop),
                    str(self.folder / f"ready-{run}-{slug}"),
                    str(self.folder / f"go-{run}-{slug}"))
            except BaseException as exc:  # reported by the caller
                errors.append(exc)

        # Every client builds its prompts first, then waits for its cue: the flood's, `lead`
        # seconds later the others'.
        threads = []
        for n, (slug, clients) in enumerate(plan):
            length = seconds + (lead if n == 0 else 0)
            threads.append(threading.Thread(target=one, args=(slug, clients, length),
                                            daemon=True))
            threads[-1].start()
        deadline = time.monotonic() + 180
        while not all((self.folder / f"ready-{run}-{slug}").exists() for slug, _ in plan):
            if errors or time.monotonic() > deadline:
                for slug, _ in plan:
                    (self.folder / f"go-{run}-{slug}").touch()
                stop.touch()
                raise RuntimeError(f"a vLLM client did not get ready: {errors[:1]}")
            time.sleep(0.05)
        for n, (slug, _) in enumerate(plan):
            (self.folder / f"go-{run}-{slug}").touch()
            if n == 0 and len(plan) > 1:
                time.sleep(lead)
        time.sleep(seconds)
        stop.touch()
        for thread in threads:
            thread.join(300)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise RuntimeError("a vLLM client did not finish within 300 s of its stop")
        for slug, r in results.items():
            if not r["stopped"]:
                print(f"warning: {slug} ran out of prompts before the stop (--max-prompts)",
                      flush=True)
        return results


# -- figures ---------------------------------------------------------------------------------------
def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] * 1000


def window_of(results: dict[str, dict]) -> tuple[float, float]:
    """From the last tenant's first request to the first tenant's last completion."""
    begin = max(min(r["starts"]) for r in results.values() if r["starts"])
    end = min(max(s + e for s, e in zip(r["starts"], r["e2els"], strict=True))
              for r in results.values() if r["starts"])
    return begin, end


def figures(runs: list[dict[str, dict]], departments: dict[str, Department] | None = None
            ) -> dict[str, Any]:
    """Per tenant and in total, over each run's overlap window, all runs pooled (Jain's index
    weighs by `departments`' fair-share weights, default this benchmark's)."""
    departments = departments or BY_SLUG
    per: dict[str, dict[str, Any]] = {}
    total_seconds = 0.0
    spans = []  # per run: the window and each tenant's first start and last completion
    for results in runs:
        begin, end = window_of(results)
        total_seconds += max(end - begin, 0.0)
        t0 = min(min(r["starts"]) for r in results.values() if r["starts"])
        spans.append({"window": [begin - t0, end - t0], **{
            slug: [min(r["starts"]) - t0, max(s + e for s, e in zip(r["starts"], r["e2els"],
                                                                   strict=True)) - t0]
            for slug, r in results.items() if r["starts"]}})
        for slug, r in results.items():
            row = per.setdefault(slug, {"e2e": [], "ttft": [], "done": 0, "tokens": 0,
                                        "weighted": 0.0, "failed": 0, "errors": set()})
            row["failed"] += r["failed"]
            row["errors"].update(r["errors"])
            for start, e2e, ttft, n_in, n_out in zip(r["starts"], r["e2els"], r["ttfts"],
                                                    r["input_lens"], r["output_lens"],
                                                    strict=True):
                finish = start + e2e
                if not begin <= finish <= end:
                    continue
                row["done"] += 1
                row["tokens"] += n_out
                row["weighted"] += TOKEN_WEIGHTS[0] * n_in + TOKEN_WEIGHTS[1] * n_out
                if start >= begin:
                    row["e2e"].append(e2e)
                    row["ttft"].append(ttft)
    from serving_app.deployments.sharing import jain_index

    out: dict[str, Any] = {"window_s": total_seconds, "spans": spans, "tenants": {}}
    for slug, row in per.items():
        seconds = total_seconds or 1.0
        out["tenants"][slug] = {
            "requests": len(row["e2e"]), "failed": row["failed"],
            "errors": sorted(row["errors"])[:3],
            **{f"e2e_p{p}": _pct(row["e2e"], p / 100) for p in (50, 95, 99)},
            **{f"ttft_p{p}": _pct(row["ttft"], p / 100) for p in (50, 95, 99)},
            "rps": row["done"] / seconds, "tok_s": row["tokens"] / seconds,
            "weighted_tokens": row["weighted"],
        }
    tenants = out["tenants"]
    out["rps"] = sum(t["rps"] for t in tenants.values())
    out["tok_s"] = sum(t["tok_s"] for t in tenants.values())
    out["jain"] = jain_index(t["weighted_tokens"] / departments[slug].weight
                             for slug, t in tenants.items())
    return out


def _ms(value: float | None) -> str:
    return f"{value:7.0f}" if value is not None else "      -"


def print_mode(title: str, fig: dict[str, Any]) -> None:
    print(f"\n== {title}: window {fig['window_s']:.1f} s")
    print(f"{'tenant':20} {'n':>5} {'e2e p50':>7} {'p95':>7} {'p99':>7} {'TTFT p50':>8} "
          f"{'p95':>7} {'p99':>7} {'req/s':>7} {'tok/s':>7} {'failed':>6}")
    for slug, t in fig["tenants"].items():
        print(f"{slug:20} {t['requests']:5d} {_ms(t['e2e_p50'])} {_ms(t['e2e_p95'])} "
              f"{_ms(t['e2e_p99'])}  {_ms(t['ttft_p50'])} {_ms(t['ttft_p95'])} "
              f"{_ms(t['ttft_p99'])} {t['rps']:7.2f} {t['tok_s']:7.1f} {t['failed']:6d}")
        for error in t["errors"]:
            print(f"{'':20} error: {error}")
    jain = fig["jain"]
    print(f"{'total':20} {'':5} {'':7} {'':7} {'':7}  {'':7} {'':7} {'':7} {fig['rps']:7.2f} "
          f"{fig['tok_s']:7.1f}   Jain {jain if jain is None else f'{jain:.3f}'}", flush=True)


# -- main ------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=45.0,
                        help="each mode's measurement, after the flood's lead")
    parser.add_argument("--lead", type=float, default=5.0,
                        help="seconds the flood runs before the other tenants start")
    parser.add_argument("--alone-seconds", type=float, default=25.0,
                        help="customer service alone (its baseline)")
    parser.add_argument("--pair-seconds", type=float, default=30.0,
                        help="each mode of the two-tenant scenario")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times the baseline and the three modes are measured (pooled)")
    parser.add_argument("--budget", type=int, default=8,
                        help="the deployment's dispatch budget in the flow mode and the pair")
    parser.add_argument("--budgets", default="2,4,16,24,32",
                        help="comma-separated dispatch budgets to sweep in flow mode ('' none)")
    parser.add_argument("--cs-clients", type=int, default=2)
    parser.add_argument("--code-clients", type=int, default=4)
    parser.add_argument("--flood-clients", type=int, default=32)
    parser.add_argument("--pair-clients", default="24,8",
                        help="concurrent requests of the two equal tenants")
    parser.add_argument("--bands", choices=("weighted", "strict"), default="weighted",
                        help="GATEWAY_FLOW_BANDS of the gateway")
    parser.add_argument("--reserved-slots", type=int, default=2,
                        help="GATEWAY_FLOW_RESERVED_SLOTS of the gateway (the upper bands' "
                             "reserve beyond the budget; 0: none)")
    parser.add_argument("--max-prompts", type=int, default=4000,
                        help="cap on each client's prompts in one measurement")
    parser.add_argument("--quick", action="store_true",
                        help="a short smoke run: 12 s per mode, one budget swept")
    parser.add_argument("--json", default="", help="also write every figure to this file")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.lead, args.alone_seconds, args.pair_seconds = 12.0, 3.0, 8.0, 10.0
        args.budgets, args.rounds = "4", 1
    args.budget_list = [int(b) for b in args.budgets.split(",") if b.strip()]
    args.pair = [int(c) for c in args.pair_clients.split(",")]
    return args


def setup_django(redis_url: str) -> dict[str, str]:
    """This process's Django on the benchmark's database (migrated) and Redis; returns the
    gateway's environment."""
    import psycopg

    url = database_url(DB_NAME)
    with psycopg.connect(database_url("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')  # seeded afresh
    ensure_database(url)
    env = {**gateway_env(redis_url, url), "GATEWAY_CATALOG_REFRESH_SECONDS": "0.5",
           "GATEWAY_FLOW_QUEUE_TIMEOUT_SECONDS": "300"}
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return env


def main() -> int:
    args = parse_args()
    # Stopped from outside (`timeout`, Ctrl-C): still stop everything it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs: list[subprocess.Popen] = []
    loads: Loads | None = None
    results: dict[str, Any] = {"args": dict(vars(args))}
    with tempfile.TemporaryDirectory(prefix="fairness-bench-") as folder:
        try:
            redis_proc, redis_url = start_redis()
            procs.append(redis_proc)
            engine_port = free_port()
            procs.append(start_engine(engine_port, extra=(
                "--scheduling-policy", "priority", "--max-num-seqs", str(MAX_NUM_SEQS))))
            env = setup_django(redis_url)
            env["GATEWAY_FLOW_BANDS"] = args.bands
            env["GATEWAY_FLOW_RESERVED_SLOTS"] = str(args.reserved_slots)
            deployment_id, keys = seed(engine_port)
            port = free_port()
            procs.append(start_gateway(env, port, 2))
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/v1/models", 60, {"Authorization": f"Bearer {keys[CS]}"})
            wait_http(f"http://127.0.0.1:{engine_port}/health", 300)
            loads = Loads(url, keys, Path(folder), args.max_prompts)
            run_all(args, loads, deployment_id, redis_url, results)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2, default=list))
        finally:
            if loads is not None:
                for client in loads.clients.values():
                    client.close()
            stop_all(procs)
    return 0


def run_all(args: argparse.Namespace, loads: Loads, deployment_id: int, redis_url: str,
            results: dict[str, Any]) -> None:
    three = [(CONTENT, args.flood_clients), (CS, args.cs_clients), (CODE, args.code_clients)]
    configure(deployment_id, "fcfs", None, redis_url)
    print("warming up the engine (not measured) ...", flush=True)
    loads.run(three, 8.0, 2.0)
    modes = ("fcfs", "priority", "flow")
    runs: dict[str, list[dict[str, dict]]] = {"alone": [], **{m: [] for m in modes}}
    waits: list[dict[str, dict[str, float]]] = []
    ttfts: dict[str, list[dict[str, list[float]]]] = {m: [] for m in modes}
    for round_no in range(args.rounds):
        configure(deployment_id, "fcfs", None, redis_url)
        runs["alone"].append(loads.run([(CS, args.cs_clients)], args.alone_seconds, 0.0))
        print(f"round {round_no}: alone done", flush=True)
        for mode in modes:
            configure(deployment_id, mode, args.budget, redis_url)
            runs[mode].append(loads.run(three, args.seconds, args.lead))
            ttfts[mode].append(engine_ttfts(redis_url))
            if mode == "flow":
                waits.append(queue_waits(deployment_id))
            print(f"round {round_no}: {mode} done", flush=True)
    fig = {name: figures(r) for name, r in runs.items()}
    fig["flow"]["queue"] = pooled_waits(waits)
    for mode in modes:
        fig[mode]["engine_ttft"] = pooled_ttfts(ttfts[mode])
    results["three_departments"] = fig
    print_mode("customer service alone", fig["alone"])
    for mode in modes:
        print_mode(f"{mode}" + (f" (dispatch budget {args.budget})" if mode == "flow" else ""),
                   fig[mode])
        print_ttfts(fig[mode]["engine_ttft"])
        if mode == "flow":
            print_waits(fig[mode]["queue"])
    alone = fig["alone"]["tenants"][CS]
    fcfs_total = fig["fcfs"]["tok_s"]
    print(f"\ncustomer service alone: p50 {alone['e2e_p50']:.0f} ms, p95 "
          f"{alone['e2e_p95']:.0f} ms (objective {BY_SLUG[CS].objective_ms} ms)")
    print(f"{'mode':10} {'CS p50':>7} {'CS p95':>7} {'p95 / alone':>11} {'total tok/s':>11} "
          f"{'/ FCFS':>7}")
    for mode in modes:
        cs = fig[mode]["tenants"][CS]
        ratio = fig[mode]["tok_s"] / fcfs_total if fcfs_total else float("nan")
        print(f"{mode:10} {cs['e2e_p50']:7.0f} {cs['e2e_p95']:7.0f} "
              f"{cs['e2e_p95'] / alone['e2e_p95']:11.2f} {fig[mode]['tok_s']:11.1f} "
              f"{ratio:7.2f}", flush=True)

    pair = [("team-a", args.pair[0]), ("team-b", args.pair[1])]
    pair_fig = {}
    for mode in ("fcfs", "flow"):
        configure(deployment_id, mode, args.budget, redis_url)
        pair_fig[mode] = figures([loads.run(pair, args.pair_seconds, args.lead)])
        print_mode(f"two equal tenants ({args.pair[0]} and {args.pair[1]} concurrent), {mode}"
                   + (f" (dispatch budget {args.budget})" if mode == "flow" else ""),
                   pair_fig[mode])
    results["two_equal_tenants"] = pair_fig
    print("\nJain's index, two equal backlogged tenants: " + ", ".join(
        f"{mode} {f['jain']:.3f}" for mode, f in pair_fig.items()), flush=True)

    sweep = {args.budget: fig["flow"]}
    for budget in args.budget_list:
        if budget not in sweep:
            configure(deployment_id, "flow", budget, redis_url)
            sweep[budget] = figures([loads.run(three, args.seconds, args.lead)])
            sweep[budget]["queue"] = pooled_waits([queue_waits(deployment_id)])
            sweep[budget]["engine_ttft"] = pooled_ttfts([engine_ttfts(redis_url)])
            print_mode(f"flow, dispatch budget {budget}", sweep[budget])
            print_ttfts(sweep[budget]["engine_ttft"])
            print_waits(sweep[budget]["queue"])
    curve = []
    print(f"\n{'budget':>6} {'CS p50':>7} {'CS p95':>7} {'p95 / alone':>11} {'total tok/s':>11} "
          f"{'/ FCFS':>7}  target")
    for budget in sorted(sweep):
        cs = sweep[budget]["tenants"][CS]
        row = {"budget": budget, "cs_p50": cs["e2e_p50"], "cs_p95": cs["e2e_p95"],
               "cs_p95_vs_alone": cs["e2e_p95"] / alone["e2e_p95"],
               "tok_s": sweep[budget]["tok_s"],
               "vs_fcfs": sweep[budget]["tok_s"] / fcfs_total if fcfs_total else None}
        row["target_met"] = bool(row["cs_p95_vs_alone"] <= 1.25
                                 and cs["e2e_p95"] < BY_SLUG[CS].objective_ms
                                 and (row["vs_fcfs"] or 0) >= 0.9)
        curve.append(row)
        print(f"{budget:6d} {cs['e2e_p50']:7.0f} {cs['e2e_p95']:7.0f} "
              f"{row['cs_p95_vs_alone']:11.2f} {row['tok_s']:11.1f} {row['vs_fcfs']:7.2f}  "
              f"{'met' if row['target_met'] else 'not met'}", flush=True)
    results["budget_sweep"] = {"figures": sweep, "curve": curve}


if __name__ == "__main__":
    sys.exit(main())
