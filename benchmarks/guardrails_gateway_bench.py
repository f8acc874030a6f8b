"""Guardrails through the real gateway: a tenant with a typical policy against the same tenant
without one, same gateway, same upstream, same run.

    .venv/bin/python benchmarks/guardrails_gateway_bench.py
    .venv/bin/python benchmarks/guardrails_gateway_bench.py --seconds 10 --stream-requests 60 \
        --json var/guardrails-gateway-bench.json

The gateway is `uvicorn console.asgi:application` as deployed (one worker; benchmarks/
gateway_bench.py starts it, its Redis and its SQLite database), in front of a mock upstream in
its own process (`ProseUpstream`) that answers at once, so what is measured is the gateway's
own work, not an engine's noise: the strictest view of what guardrails add (behind a real engine
the same milliseconds are a far smaller share). Two tenants with the same RPM and TPM limits
(admission and settlement run for both): `off` has no policy (the floor is empty), `on` has
the typical policy of benchmarks/guardrails_bench.py (floor and tenant merged into its own
policy: 11 input detectors including a three-term deny-list, 7 on output).

1. Latency, non-streamed chat completions whose user message is 1 KB or 8 KB of English prose
   with numbers, times and versions ("without PII": candidates for the prefilter, no entity)
   or the same with six entities (email, E.164 phone, China mobile, resident ID, card, IBAN).
   One request at a time, alternating off and on (paired samples, as gateway_bench.py does),
   `--seconds` per side and prompt: p50 and p99 of each side and their ratio on / off.
2. Streams: chat completions streamed with `--stream-tokens` tokens of prose (a word each),
   with or without the six entities, every chunk written at once (the gateway, not the
   upstream, is the bottleneck: the worst case for the hold-back's CPU) or `--pace-ms` apart.
   `--concurrency` clients in alternating slices of off and on: tokens per second (upstream
   tokens of completed streams over the slices' time) as a ratio on / off (the issue's target:
   at least 0.9), and TTFT (the first content byte) p50 added by the hold-back. The `on`
   answers are checked: no entity may reach the client (a leak is printed and fails the run).
3. A small request beside an adversarial one: a guarded 1 KB request's latency, one at a time,
   alone and while another client sends, back to back, `--adversary-mb` MB prompts of phone
   numbers (every one a match to validate) to the same worker, in alternating slices: p50 and
   p99 of each and their ratio (the issue's target: within 1.1x), and how the adversarial
   requests were answered (a 400 block, or the guard's time bound).

The run ends with one table of every row against its baseline in the same run (unguarded,
or the small request alone), the ratio, the issue's target and whether it is met:

    measure                          baseline    guarded   ratio  target  met
    1 KB without PII, p50 ms             1.23       1.36    1.11  <= 1.1  no
    ...

`--profile FOLDER` samples the gateway's worker with py-spy (500 Hz) through the sections it
runs and prints where its time went (own time, and including callees in the gateway and the
guardrails), the raw stacks kept in FOLDER.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gateway_bench import (  # noqa: E402
    ROOT,
    InstantUpstream,
    free_port,
    gateway_env,
    kill_group,
    paired,
    seed_gateway_db,
    spawn,
    start_gateway,
    start_redis,
    wait_http,
)
from benchmarks.guardrails_bench import FLOOR, PII, TENANT, prose, with_pii  # noqa: E402
from benchmarks.stream_bench import PacedUpstream, Profiler, serve_upstream  # noqa: E402
from guardrails_app.policy import effective  # noqa: E402

CODENAMES = ["Project Falcon", "Bluebird", "Orca-7"]
# The detector of each of guardrails_bench.PII's values, in order.
PII_DETECTORS = ["email", "phone", "cn_mobile", "cn_resident_id", "bank_card", "iban"]
MODEL = "instant"

# The guarded tenant: the same limits as the benchmark's "bench" tenant, the typical policy.
SEED_GUARDED = """
import json
from guardrails_app.models import TenantPattern, TenantPolicy
from serving_app.models import Deployment
from tenants_app.models import ApiKey, Tenant
policy = json.loads(POLICY)
bench = Tenant.objects.get(slug="bench")
tenant = Tenant.objects.create(slug="bench-guarded", name="Bench (guardrails)",
    requests_per_minute=bench.requests_per_minute, tokens_per_minute=bench.tokens_per_minute)
for dep in Deployment.objects.all():
    dep.tenants.add(tenant)
TenantPattern.objects.create(tenant=tenant, name="codenames", kind="deny_list",
                             terms=json.loads(TERMS), category="CODENAME")
row = TenantPolicy(tenant=tenant, input=policy["input"], output=policy["output"])
row.full_clean(); row.save()
# 8 KB prompts: a context the mock upstream does not check (it counts 4 bytes a token).
Deployment.objects.update(max_model_len=32768)
print(json.dumps({"on": ApiKey.objects.create_key(tenant=tenant, name="bench")[1]}))
"""


class ProseUpstream(PacedUpstream):
    """An OpenAI-shaped chat upstream answering with prose: a non-streamed answer of 16 words,
    or a stream of `max_tokens` words (one SSE event each, chunked transfer encoding as vLLM's
    server), `text` cycled; every event in one write, or `interval` seconds apart."""

    def __init__(self, text: str, interval: float) -> None:
        super().__init__(interval)
        self.words = [f" {w}" for w in text.split(" ")]

    def respond(self, path: str, body: bytes) -> None:
        if path == "/tokenize":
            request = json.loads(body or b"{}")
            text = request.get("prompt") or json.dumps(request.get("messages"))
            self._send(200, b"application/json",
                       json.dumps({"count": len(str(text).encode()) // 4}).encode())
            return
        if path != "/v1/chat/completions":
            InstantUpstream.respond(self, path, body)
            return
        request = json.loads(body or b"{}")
        tokens = int(request.get("max_tokens") or 16)
        words = [self.words[i % len(self.words)] for i in range(tokens)]
        base = {"id": "chatcmpl-prose", "created": 1, "model": request.get("model", MODEL)}
        usage = {"prompt_tokens": 32, "completion_tokens": tokens, "total_tokens": 32 + tokens}
        if not request.get("stream"):
            payload = json.dumps({**base, "object": "chat.completion", "usage": usage,
                                  "choices": [{"index": 0, "finish_reason": "length",
                                               "message": {"role": "assistant",
                                                           "content": "".join(words[:16])}}]})
            self._send(200, b"application/json", payload.encode())
            return

        def event(data: dict[str, Any]) -> bytes:
            raw = b"data: " + json.dumps({**base, "object": "chat.completion.chunk", **data},
                                         separators=(",", ":")).encode() + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(raw), raw)

        events = [event({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                             "content": ""}}]})]
        events += [event({"choices": [{"index": 0, "delta": {"content": word},
                                       "finish_reason": "length" if i == tokens - 1 else None}]})
                   for i, word in enumerate(words)]
        events.append(event({"choices": [], "usage": usage}))
        self.write_stream(events)


def _upstream_main(port: int, text: str, interval: float) -> None:
    serve_upstream(lambda: ProseUpstream(text, interval), port)


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, **extra,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": prompt}]}


async def stream_once(session, url: str, headers: dict, payload: bytes) -> dict[str, Any]:
    """One streamed request: time to the first content byte, total time, the text received."""
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    async with session.post(url, data=payload, headers=headers) as response:
        if response.status != 200:
            return {"failed": response.status, "body": (await response.read())[:200]}
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(content)
    return {"ttft": ttft, "total": time.perf_counter() - t0, "text": "".join(parts)}


async def streams(sides: dict[str, tuple[str, dict]], body: dict, concurrency: int,
                  requests: int, slices: int) -> dict[str, dict[str, Any]]:
    """Closed loop, `concurrency` clients, alternating slices (off on on off ...) of
    `requests` / `slices` streams per side each."""
    import aiohttp

    payload = json.dumps(body).encode()
    out = {name: {"ttft": [], "total": [], "elapsed": 0.0, "done": 0, "failed": 0, "texts": []}
           for name in sides}
    per_slice = max(1, requests // slices)
    connector = aiohttp.TCPConnector(limit=concurrency * len(sides))
    async with aiohttp.ClientSession(connector=connector) as session:
        for url, headers in sides.values():  # warm-up
            await stream_once(session, url, headers, payload)
        order: list[str] = []
        for i in range(slices):
            order += list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            url, headers = sides[name]
            left = [per_slice]
            row = out[name]

            async def client(url=url, headers=headers, row=row, left=left) -> None:
                while left[0] > 0:
                    left[0] -= 1
                    got = await stream_once(session, url, headers, payload)
                    if "failed" in got or got["ttft"] is None:
                        row["failed"] += 1
                        continue
                    row["done"] += 1
                    row["ttft"].append(got["ttft"])
                    row["total"].append(got["total"])
                    row["texts"].append(got["text"])

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            row["elapsed"] += time.perf_counter() - started
    return out


async def beside_adversary(url: str, headers: dict, small: dict, big: dict, seconds: float,
                           slices: int) -> dict[str, Any]:
    """`small` one at a time, in alternating slices alone and while another client sends
    `big` back to back: the small requests' latencies per slice kind, the big ones' statuses."""
    import aiohttp

    small_payload, big_payload = json.dumps(small).encode(), json.dumps(big).encode()
    latencies: dict[str, list[float]] = {"alone": [], "beside": []}
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession() as session:

        async def one(payload: bytes) -> tuple[int, float]:
            t0 = time.perf_counter()
            async with session.post(url, data=payload, headers=headers) as response:
                await response.read()
                return response.status, time.perf_counter() - t0

        async def adversary(stop: asyncio.Event) -> None:
            while not stop.is_set():
                status, _ = await one(big_payload)
                statuses[status] = statuses.get(status, 0) + 1

        for _ in range(4):
            await one(small_payload)
        for i in range(slices * 2):
            kind = "alone" if i % 2 == 0 else "beside"
            stop = asyncio.Event()
            task = asyncio.create_task(adversary(stop)) if kind == "beside" else None
            if task is not None:
                await asyncio.sleep(0.2)  # the first adversarial request is in the guard
            end = time.perf_counter() + seconds / slices
            while time.perf_counter() < end:
                status, took = await one(small_payload)
                if status == 200:
                    latencies[kind].append(took)
            if task is not None:
                stop.set()
                await task
    return {"p50_ms": {k: pct(v, 0.5) for k, v in latencies.items()},
            "p99_ms": {k: pct(v, 0.99) for k, v in latencies.items()},
            "requests": {k: len(v) for k, v in latencies.items()},
            "adversary_statuses": statuses}


# (measure, baseline, guarded, target ratio or NaN, whether a higher ratio is better)
Row = tuple[str, float, float, float, bool]


def summary(results: dict[str, Any]) -> list[Row]:
    """Every measured row against its baseline of the same run: (measure, baseline, guarded,
    target ratio, whether a higher ratio is better)."""
    rows: list[Row] = []
    for name, got in results.items():
        if name == "small beside adversary":
            p50, p99 = got["p50_ms"], got["p99_ms"]
            rows.append(("1 KB beside 1 MB adversary, p50 ms", p50["alone"], p50["beside"],
                         1.1, False))
            rows.append(("1 KB beside 1 MB adversary, p99 ms", p99["alone"], p99["beside"],
                         float("nan"), False))
        elif name.startswith("stream "):
            rate = got["tokens_per_s"]
            rows.append((f"{name}, tokens/s", rate["off"], rate["on"], 0.9, True))
        else:
            target = 1.1 if "without PII" in name else float("nan")
            rows.append((f"{name.replace('KB', ' KB')}, p50 ms", got["off"]["p50_ms"],
                         got["on"]["p50_ms"], target, False))
    return rows


def print_summary(rows: list[Row]) -> None:
    print(f"\n{'measure':<36} {'baseline':>9} {'guarded':>9} {'ratio':>6} {'target':>7}  met")
    for label, base, guarded, target, higher in rows:
        ratio = guarded / base if base else float("nan")
        if target != target:  # no target for this row
            aim, met = "", ""
        else:
            aim = f"{'>=' if higher else '<='} {target:g}"
            met = "yes" if (ratio >= target if higher else ratio <= target) else "no"
        print(f"{label:<36} {base:>9.2f} {guarded:>9.2f} {ratio:>6.2f} {aim:>7}  {met}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="per side and prompt (latency rows)")
    parser.add_argument("--stream-tokens", type=int, default=512)
    parser.add_argument("--stream-requests", type=int, default=40, help="per side and row")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--pace-ms", type=float, nargs="+", default=[0.0, 10.0],
                        help="time between streamed chunks, one row each (0: all at once)")
    parser.add_argument("--sections", default="latency,streams,adversary",
                        help="which of latency, streams, adversary to run")
    parser.add_argument("--adversary-mb", type=float, default=1.0)
    parser.add_argument("--adversary-seconds", type=float, default=10.0,
                        help="of small requests, per kind (alone, beside the adversary)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--profile", default="",
                        help="sample the gateway's worker with py-spy into this folder and "
                             "print its top functions")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    policy = effective(FLOOR, TENANT)
    # The entities the output policy redacts: none of them may reach the client.
    redacted = [v for v, d in zip(PII, PII_DETECTORS, strict=True) if d in policy.output]
    results: dict[str, Any] = {}
    leaks = 0
    procs: list[subprocess.Popen] = []
    try:
        redis_proc, redis_url = start_redis()
        procs.append(redis_proc)
        answer = with_pii(rng, prose(rng, 4096))
        clean_answer = prose(rng, 4096)
        upstreams = {}
        for label, text in (("pii", answer), ("clean", clean_answer)):
            for pace in args.pace_ms:
                port = free_port()
                procs.append(spawn("guardrails_gateway_bench._upstream_main", port, text,
                                   pace / 1000))
                upstreams[(label, pace)] = port
        # One model name per upstream: the seed makes a deployment per kind; kinds other than
        # "engine" are served under their own name.
        kinds = {f"prose-{label}-{pace:g}": port for (label, pace), port in upstreams.items()}
        env = gateway_env(redis_url, f"sqlite:///{ROOT / 'var' / 'guardrails-bench.sqlite3'}")
        keys = seed_gateway_db(env, kinds)
        seeded = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c",
             SEED_GUARDED.replace("POLICY", repr(json.dumps(policy.to_dict())))
             .replace("TERMS", repr(json.dumps(CODENAMES)))],
            cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
        keys.update(json.loads(seeded.strip().splitlines()[-1]))
        gw_port = free_port()
        gateway = start_gateway(env, gw_port, 1)  # one worker: uvicorn runs it in-process
        procs.append(gateway)
        url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        headers = {side: {"Authorization": f"Bearer {keys[key]}",
                          "Content-Type": "application/json"}
                   for side, key in (("off", "limits"), ("on", "on"))}
        wait_http(f"http://127.0.0.1:{gw_port}/v1/models", 60, headers["off"])
        sides = {side: (url, headers[side]) for side in ("off", "on")}
        time.sleep(2)  # the catalog's first refresh has compiled the policy
        profiler = None
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            profiler = Profiler(gateway.pid, Path(args.profile))
            profiler.start()

        print(f"policy: {len(policy.input)} input rules, {len(policy.output)} output rules; "
              f"{args.seconds:g} s per side and prompt, one request at a time (ms)")
        print(f"{'prompt':<16} {'off p50 / p99':>16} {'on p50 / p99':>16} {'ratio p50':>9} "
              f"{'ratio p99':>9} {'added p50':>9}")
        model = f"prose-clean-{args.pace_ms[0]:g}"
        sections = set(args.sections.split(","))
        for size in (1024, 8192) if "latency" in sections else ():
            clean = prose(rng, size)
            for label, prompt in (("without PII", clean), ("with PII", with_pii(rng, clean))):
                got = asyncio.run(paired(sides, {**chat(prompt), "model": model}, args.seconds))
                off, on = got["off"], got["on"]
                row = {"off": off, "on": on, "ratio_p50": on["p50_ms"] / off["p50_ms"],
                       "ratio_p99": on["p99_ms"] / off["p99_ms"],
                       "added_p50_ms": on["p50_ms"] - off["p50_ms"]}
                results[f"{size // 1024}KB {label}"] = row
                print(f"{size // 1024} KB {label:<11} {off['p50_ms']:>7.2f} / "
                      f"{off['p99_ms']:>6.2f} {on['p50_ms']:>7.2f} / {on['p99_ms']:>6.2f} "
                      f"{row['ratio_p50']:>9.2f} {row['ratio_p99']:>9.2f} "
                      f"{row['added_p50_ms']:>+9.2f}   (failures {off['failures']}/"
                      f"{on['failures']}, {on['requests']} paired requests)", flush=True)

        print(f"\nstreams of {args.stream_tokens} tokens, {args.concurrency} concurrent, "
              f"{args.stream_requests} per side")
        print(f"{'answer':<22} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} "
              f"{'TTFT off p50':>12} {'on p50':>8} {'added':>8} {'e2e added p50':>13}")
        for (label, pace) in upstreams if "streams" in sections else ():
            body = chat("Tell me about our customer.", max_tokens=args.stream_tokens,
                        stream=True, model=f"prose-{label}-{pace:g}")
            got = asyncio.run(streams(sides, body, args.concurrency, args.stream_requests,
                                      args.slices))
            rate = {side: args.stream_tokens * got[side]["done"] / got[side]["elapsed"]
                    for side in got}
            leaked = [value for text in got["on"]["texts"] for value in redacted if value in text]
            leaks += len(leaked)
            row = {"tokens_per_s": rate, "ratio": rate["on"] / rate["off"],
                   "ttft_p50_ms": {s: pct(got[s]["ttft"], 0.5) for s in got},
                   "e2e_p50_ms": {s: pct(got[s]["total"], 0.5) for s in got},
                   "failed": {s: got[s]["failed"] for s in got}, "leaked": leaked}
            results[f"stream {label} pace {pace:g} ms"] = row
            name = f"{'with' if label == 'pii' else 'without'} PII, {pace:g} ms"
            ttft = row["ttft_p50_ms"]
            print(f"{name:<22} {rate['off']:>10.0f} {rate['on']:>10.0f} {row['ratio']:>6.2f} "
                  f"{ttft['off']:>12.2f} {ttft['on']:>8.2f} {ttft['on'] - ttft['off']:>+8.2f} "
                  f"{row['e2e_p50_ms']['on'] - row['e2e_p50_ms']['off']:>+13.2f}"
                  f"   (failed {row['failed']['off']}/{row['failed']['on']})", flush=True)
            if leaked:
                print(f"   LEAK: {len(leaked)} entities reached the client on the guarded side")

        if "adversary" in sections:
            size = int(args.adversary_mb * 1024 * 1024)
            big = {**chat(("+1 415 555 2671 " * (size // 16 + 1))[:size]), "model": model}
            small = {**chat(prose(rng, 1024)), "model": model}
            got = asyncio.run(beside_adversary(url, headers["on"], small, big,
                                               args.adversary_seconds, args.slices))
            p50, p99 = got["p50_ms"], got["p99_ms"]
            got["ratio_p50"] = p50["beside"] / p50["alone"] if p50["alone"] else float("nan")
            got["ratio_p99"] = p99["beside"] / p99["alone"] if p99["alone"] else float("nan")
            results["small beside adversary"] = got
            print(f"\na guarded 1 KB request, alone and beside {args.adversary_mb:g} MB "
                  "adversarial prompts to the same worker (ms)")
            print(f"alone p50 / p99 {p50['alone']:.2f} / {p99['alone']:.2f}   beside p50 / p99 "
                  f"{p50['beside']:.2f} / {p99['beside']:.2f}   ratio p50 {got['ratio_p50']:.2f} "
                  f"p99 {got['ratio_p99']:.2f}   ({got['requests']['alone']}/"
                  f"{got['requests']['beside']} requests; adversarial answers by status "
                  f"{got['adversary_statuses']})", flush=True)
        print_summary(summary(results))
        if profiler is not None:
            profiler.stop()
            print("\nwhere the gateway's worker spent its time (py-spy):")
            print("\n".join(profiler.report(20, wanted=("gateway_app/", "guardrails_app/",
                                                        "json/", "re2/"))))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        for proc in reversed(procs):
            kill_group(proc)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
