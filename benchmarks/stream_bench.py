"""The gateway at the engine's pace, measured with vLLM's own benchmark client.

    .venv/bin/python benchmarks/stream_bench.py                       # engine + paced mock, c=1, 32
    .venv/bin/python benchmarks/stream_bench.py --compare ca779e4     # the same, against a commit
    .venv/bin/python benchmarks/stream_bench.py --full                # the whole matrix (long)
    .venv/bin/python benchmarks/stream_bench.py --upstreams paced --tls --no-relay
                                     # the gateway to TLS upstreams against plain HTTP

The load is `vllm.benchmarks.serve` (what `vllm bench serve` runs), imported once in a client
process of the engine's virtual environment (the only one that has vLLM) and called once per
measurement: `--backend openai-chat`, streaming, the random dataset (`--input-len` and
`--output-len` tokens, the tiny model's tokenizer), `--max-concurrency` 1, 32 or 64. For
non-streamed requests ("whole") the client process registers one more request function with
vLLM's client, the same chat request with `"stream": false` (its time to first token is its
end-to-end latency).

Sides, measured interleaved (one measurement of every side per round, the order reversed every
other round, because this machine's speed drifts by 2x over minutes):
- `direct`: the upstream itself;
- `relay`: a bare TCP relay in its own process (benchmarks/gateway_bench.py: no HTTP parsing,
  no limits), the floor that one more process hop costs here;
- `gateway w<N> <limits|nolimits>`: the gateway (uvicorn, N workers) with a tenant that has RPM
  and TPM limits (admission and settlement: two Redis round trips) or none (one); flow
  control on (the default), and with `--flow on off` also a gateway with it off
  (`GATEWAY_FLOW_CONTROL`, sides named `... noflow`): what it costs, measured in the same run;
- with `--tls`, the same gateways reaching the same mock upstream processes on a second port
  where each serves TLS as an engine does (a client certificate of the benchmark's CA
  required), sides named `tls ...`; their ratio to the plain-HTTP gateway is printed;
- with `--compare COMMIT`, the same gateways running that commit's code, from a git worktree
  the benchmark creates in a temporary folder (and removes), on their own database.

Upstreams:
- `engine`: the real CPU vLLM engine (tiny model), started as node agents start CPU engines
  (under SCHED_IDLE; gateway_bench.py's docstring says why);
- `paced`: a mock (`PacedUpstream`) that streams its chunks at a fixed interval (`--pace-ms`)
  and costs next to no CPU: the gateway's own cost per chunk without the engine's noise;
- `instant`: the same mock answering at once, every chunk in one write.

Per measurement it prints requests/s, TTFT p50/p99, ITL p50, end-to-end p50/p99 and failures;
for the relay and gateways also their CPU time per request and per relayed chunk (from /proc,
less their idle background CPU; "per chunk" is the CPU per request over the chunks of one
response, per-request work included), and for the gateways the CPU their Redis spent per
request (it too is taken from the engine's cores). After the rounds, per cell: each side's
ratio of totals (requests over time, all rounds together) to direct, and added median TTFT and
end-to-end latency over the pooled samples. `--profile N` then runs N more (unrecorded)
streamed measurements at 32 concurrent of each code's first gateway while py-spy samples its
worker, and prints the top functions.

Everything runs on 127.0.0.1 and stops by itself; each measurement is bounded by its number of
prompts (`--prompts`, `--prompts-single` one at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: the project
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gateway_bench import (  # noqa: E402
    ENGINE_SECRET,
    ROOT,
    InstantUpstream,
    cpu_seconds,
    free_port,
    gateway_env,
    kill_group,
    seed_gateway_db,
    spawn,
    start_engine,
    start_gateway,
    start_redis,
    stop_all,
    wait_http,
)
from serving_app.engine import benchclient  # noqa: E402

ENGINE_PYTHON = ROOT / "var" / "engine-venv" / "bin" / "python"
TOKENIZER = ROOT / "var" / "models" / "tiny-llama"
MODELS = {"engine": "tiny-llama", "paced": "paced", "instant": "instant"}
WHOLE_BACKEND = "openai-chat-whole"


# -- the paced mock upstream ------------------------------------------------------------------
class PacedUpstream(InstantUpstream):
    """An OpenAI-shaped upstream whose streams send one chunk every `interval` seconds, shaped
    like vLLM's (a role chunk, one chunk per token, the last with its finish reason, the usage
    chunk when asked for, `[DONE]`), chunked transfer encoding like vLLM's server. The number
    of tokens is the request's `max_completion_tokens`/`max_tokens`. With `interval` 0 every
    chunk goes out in one write. A non-streamed request is answered after `interval` times its
    tokens. Timers, not tasks: a paced stream costs this process a callback per chunk."""

    def __init__(self, interval: float) -> None:
        super().__init__()
        self.interval = interval

    def respond(self, path: str, body: bytes) -> None:
        if path not in ("/v1/chat/completions", "/v1/completions"):
            super().respond(path, body)
            return
        request = json.loads(body or b"{}")
        tokens = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
        model = request.get("model", "m")
        chat = path == "/v1/chat/completions"
        usage = {"prompt_tokens": 32, "completion_tokens": tokens,
                 "total_tokens": 32 + tokens}
        base = {"id": "chatcmpl-paced" if chat else "cmpl-paced",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1, "model": model}
        if not request.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": " x" * tokens},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": " x" * tokens, "finish_reason": "length"})
            payload = json.dumps({**base, "object": "chat.completion" if chat else
                                  "text_completion", "choices": [choice],
                                  "usage": usage}).encode()
            if self.interval:
                asyncio.get_running_loop().call_later(self.interval * tokens, self._send, 200,
                                          b"application/json", payload)
            else:
                self._send(200, b"application/json", payload)
            return

        def event(choice: dict[str, Any] | None, finish: str | None = None) -> bytes:
            data = {**base, "choices": [choice] if choice else []}
            if choice is not None:
                choice["finish_reason"] = finish
            else:
                data["usage"] = usage
            raw = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(raw), raw)

        def token(i: int) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": " x"}, "logprobs": None}
            return {"index": 0, "text": " x", "logprobs": None}

        events = []
        if chat:
            events.append(event({"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None}))
        events += [event(token(i), "length" if i == tokens - 1 else None)
                   for i in range(tokens)]
        if (request.get("stream_options") or {}).get("include_usage"):
            events.append(event(None))
        self.write_stream(events)

    def write_stream(self, events: list[bytes]) -> None:
        """An SSE stream's chunks (chunked transfer encoding) and `[DONE]`: all in one write,
        or one every `interval` seconds."""
        done = b"data: [DONE]\n\n"
        events.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        if not self.interval:
            self.transport.write(head + b"".join(events))
            return
        self.transport.write(head + events[0])
        self._tick(iter(events[1:]))

    def _tick(self, events) -> None:
        if self.transport.is_closing():
            return
        chunk = next(events, None)
        if chunk is not None:
            self.transport.write(chunk)
            asyncio.get_running_loop().call_later(self.interval, self._tick, events)


def _paced_main(port: int, interval: float, tls_port: int = 0, tls_dir: str = "") -> None:
    serve_upstream(lambda: PacedUpstream(interval), port, tls_port, tls_dir)


def serve_upstream(factory: Any, port: int, tls_port: int = 0, tls_dir: str = "") -> None:
    """Serve the protocol `factory` makes on 127.0.0.1:`port` until killed (uvloop if any);
    with `tls_port`, the same upstream also on that port as an engine serves (TLS with the
    certificate in `tls_dir`, a client certificate of its CA required)."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(factory, "127.0.0.1", port)
        if tls_port:
            # Here, not at the top: the client process imports this module in the engine's
            # environment, which has no Django.
            from serving_app import pki

            await loop.create_server(factory, "127.0.0.1", tls_port,
                                     ssl=pki.engine_server_context(Path(tls_dir)))
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def make_tls_dir(folder: Path) -> Path:
    """A console CA of the benchmark's own: the upstreams' certificate (`node`) and the
    gateway's (`console`), as `ENGINE_TLS_DIR` holds them on a console host (no CA key: the
    gateway makes nothing)."""
    # Here, not at the top: the client process imports this module in the engine's
    # environment, which has no Django.
    from serving_app import pki

    folder.mkdir(mode=0o700)
    ca = pki.make_ca("stream_bench CA")
    (folder / "ca.pem").write_text(ca.cert_pem)
    pki.write_pair(folder, "node", pki.issue(ca, "node:bench", names=pki.LOCAL_NAMES,
                                             server=True))
    pki.write_pair(folder, "console", pki.issue(ca, "console"))
    return folder


# -- the load: vLLM's client, in the engine's environment -------------------------------------
def _client_main() -> None:
    """The client process (serving_app/engine/benchclient.py), with one more request function:
    for non-streamed requests ("whole"), vLLM's chat request with `"stream": false`."""
    from vllm.benchmarks.lib import endpoint_request_func as funcs

    async def whole_chat(request_func_input, session, pbar=None):
        """vLLM's chat request function with `"stream": false`: its time to first token is
        the whole response's."""
        payload = {"model": request_func_input.model_name or request_func_input.model,
                   "messages": funcs._get_chat_messages(request_func_input),
                   "max_completion_tokens": request_func_input.output_len, "stream": False}
        funcs._update_payload_common(payload, request_func_input)
        headers = funcs._get_headers("application/json")
        funcs._update_headers_common(headers, request_func_input)
        output = funcs.RequestFuncOutput(prompt_len=request_func_input.prompt_len)
        output.start_time = started = time.perf_counter()
        try:
            async with session.post(request_func_input.api_url, json=payload,
                                    headers=headers) as response:
                body = await response.read()
                if response.status == 200:
                    data = json.loads(body)
                    output.latency = output.ttft = time.perf_counter() - started
                    output.generated_text = data["choices"][0]["message"]["content"] or ""
                    output.output_tokens = data["usage"]["completion_tokens"]
                    output.success = True
                else:
                    output.error = f"{response.status} {body[:200]!r}"
        except Exception as exc:
            output.error = repr(exc)
        if pbar:
            pbar.update(1)
        return output

    benchclient.serve_jobs({WHOLE_BACKEND: whole_chat})


class Client(benchclient.BenchClient):
    """The client process: vLLM imported once, one call per measurement (`run(argv, key)`)."""

    def __init__(self, log: Path, rt: list[str] | None = None) -> None:
        super().__init__(log, command=[*(rt or []), str(ENGINE_PYTHON), "-m",
                                       "benchmarks.stream_bench", "--client"])


# -- the sides ---------------------------------------------------------------------------------
@dataclass
class Side:
    """One way to reach the upstreams: `urls` per upstream kind, the key to use, and the
    process whose CPU time is counted (the relay, a gateway and its workers)."""

    name: str
    urls: dict[str, str]
    key: str
    pids: dict[str, int] = field(default_factory=dict)
    idle_cpu: dict[int, float] = field(default_factory=dict)
    redis_pid: int | None = None  # the gateways' Redis: its CPU counts against the engine too
    rounds: dict[tuple, list[dict[str, Any]]] = field(default_factory=dict)


class Profiler:
    """py-spy sampling one process while it runs (raw stacks, merged over several runs)."""

    def __init__(self, pid: int, folder: Path) -> None:
        self.pid = pid
        self.folder = folder
        self.files: list[Path] = []
        self.proc: subprocess.Popen | None = None
        self.spy = Path(sys.executable).parent / "py-spy"

    def start(self) -> None:
        out = self.folder / f"profile-{len(self.files)}.txt"
        self.files.append(out)
        self.proc = subprocess.Popen(
            [str(self.spy), "record", "-p", str(self.pid), "-r", "500", "-f", "raw", "-o",
             str(out), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(0.5)  # attached before the load starts

    def stop(self) -> None:
        """SIGINT makes py-spy write what it sampled; one that does not exit is killed."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                kill_group(self.proc, grace=1)
            self.proc = None

    def report(self, top: int = 15, wanted: tuple[str, ...] = (
            "gateway_app/", "uvicorn/", "httptools", "asyncio/", "uvloop", "resp.py")
               ) -> list[str]:
        """The functions the worker spent its (on-CPU) samples in: by own time (the leaf of
        each stack) and including callees (those whose file matches one of `wanted`), as
        percentages of all samples."""
        own: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        total = 0
        for path in self.files:
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                if not stack or not count.isdigit():
                    continue
                n = int(count)
                total += n
                frames = [_frame(f) for f in stack.split(";") if f]
                if frames:
                    own[frames[-1]] += n
                for name in set(frames):
                    inclusive[name] += n
        if not total:
            return ["(no samples)"]
        lines = [f"{total} samples; own time:"]
        lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top)]
        lines.append(f"including callees ({', '.join(w.strip('/') for w in wanted)}):")
        picked = [(name, n) for name, n in inclusive.most_common()
                  if any(w in name for w in wanted)][:top]
        lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in picked]
        return lines


def _frame(text: str) -> str:
    """`function (path/to/file.py:123)` as `function (to/file.py)`."""
    name, _, where = text.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    parts = where.split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


# -- measuring -----------------------------------------------------------------------------------
def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] * 1000


def _ms(value: float | None) -> str:
    return "   -  " if value is None else f"{value:6.2f}"


def vllm_argv(args: argparse.Namespace, url: str, upstream: str, mode: str,
              concurrency: int, seed: int) -> list[str]:
    """vLLM's client arguments for one measurement. `seed` picks the random prompts: a new one
    for every measurement, because the engine caches prefixes and the gateway salts them per
    tenant (direct and relay requests would hit what the other side sent, gateway requests
    never)."""
    prompts = args.prompts if concurrency > 1 else args.prompts_single
    return ["--backend", "openai-chat" if mode == "stream" else WHOLE_BACKEND,
            "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--model", MODELS[upstream], "--tokenizer", str(TOKENIZER),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--num-warmups", str(max(2, concurrency)),
            "--seed", str(seed), "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--save-detailed"]


def measure(client: Client, side: Side, args: argparse.Namespace, cell: tuple,
            seed: int, chunks_per_request: int, profiler: Profiler | None = None) -> dict:
    """One call of vLLM's client against one side. A profiled call is not recorded (the
    profiler takes CPU from everyone on this machine)."""
    upstream, mode, concurrency = cell
    argv = vllm_argv(args, side.urls[upstream], upstream, mode, concurrency, seed)
    pid = side.pids.get(upstream)
    cpu0, t0 = (cpu_seconds(pid), time.perf_counter()) if pid else (0.0, 0.0)
    redis0 = cpu_seconds(side.redis_pid) if side.redis_pid else 0.0
    if profiler:
        profiler.start()
    try:
        got = client.run(argv, side.key)
    finally:
        if profiler:
            profiler.stop()
    row: dict[str, Any] = {
        "rps": got["completed"] / got["duration"], "completed": got["completed"],
        "failed": got["failed"], "duration": got["duration"],
        "ttft_p50": _pct(got["ttfts"], 0.5), "ttft_p99": _pct(got["ttfts"], 0.99),
        "itl_p50": got["itl_p50"] * 1000 if got["itl_p50"] is not None else None,
        "e2e_p50": _pct(got["e2els"], 0.5), "e2e_p99": _pct(got["e2els"], 0.99),
        "ttfts": got["ttfts"], "e2els": got["e2els"], "errors": got["errors"],
    }
    if pid:
        # Every request the call made (warm-up included) went through; idle CPU taken out.
        cpu = cpu_seconds(pid) - cpu0 - side.idle_cpu[pid] * (time.perf_counter() - t0)
        handled = row["completed"] + row["failed"] + max(2, concurrency)
        row["cpu_ms_per_request"] = cpu * 1000 / handled
        row["cpu_us_per_chunk"] = cpu * 1e6 / (handled * chunks_per_request)
        if side.redis_pid:
            row["redis_ms_per_request"] = (cpu_seconds(side.redis_pid) - redis0) * 1000 / handled
    if profiler is None:
        side.rounds.setdefault(cell, []).append(row)
    return row


def print_row(cell: tuple, round_no: int, side: Side, row: dict) -> None:
    upstream, mode, concurrency = cell
    cpu = ""
    if "cpu_ms_per_request" in row:
        cpu = (f" | CPU {row['cpu_ms_per_request']:.3f} ms/req "
               f"{row['cpu_us_per_chunk']:5.1f} us/chunk")
        if "redis_ms_per_request" in row:
            cpu += f", Redis {row['redis_ms_per_request']:.3f} ms/req"
    print(f"{upstream:7} {mode:6} c={concurrency:<3} r{round_no} {side.name:24} "
          f"{row['rps']:7.1f} rps | TTFT {_ms(row['ttft_p50'])} / {_ms(row['ttft_p99'])} | ITL "
          f"{_ms(row['itl_p50'])} | e2e {_ms(row['e2e_p50'])} / {_ms(row['e2e_p99'])} ms | "
          f"failed {row['failed']}{cpu}", flush=True)
    for error in row["errors"][:3]:
        print(f"{'':30} error: {error}", flush=True)


def summarize(cell: tuple, sides: list[Side]) -> dict[str, Any]:
    """Per side, all rounds together: requests over time (ratio of totals to direct), pooled
    medians and the added median TTFT and end-to-end latency."""
    pooled = {}
    for side in sides:
        rounds = side.rounds.get(cell, [])
        if not rounds:
            continue
        ttfts = [x for r in rounds for x in r["ttfts"]]
        e2els = [x for r in rounds for x in r["e2els"]]
        duration = sum(r["duration"] for r in rounds)
        cpu = [r["cpu_ms_per_request"] for r in rounds if "cpu_ms_per_request" in r]
        chunk = [r["cpu_us_per_chunk"] for r in rounds if "cpu_us_per_chunk" in r]
        redis = [r["redis_ms_per_request"] for r in rounds if "redis_ms_per_request" in r]
        pooled[side.name] = {
            "rps": sum(r["completed"] for r in rounds) / duration if duration else 0.0,
            "failed": sum(r["failed"] for r in rounds),
            "ttft_p50": _pct(ttfts, 0.5), "ttft_p99": _pct(ttfts, 0.99),
            "itl_p50": statistics.median([r["itl_p50"] for r in rounds
                                          if r["itl_p50"] is not None] or [0.0]),
            "e2e_p50": _pct(e2els, 0.5), "e2e_p99": _pct(e2els, 0.99),
            "rounds_rps": [round(r["rps"], 1) for r in rounds],
            "cpu_ms_per_request": statistics.median(cpu) if cpu else None,
            "cpu_us_per_chunk": statistics.median(chunk) if chunk else None,
            "redis_ms_per_request": statistics.median(redis) if redis else None,
        }
    direct = pooled.get("direct")
    relay = pooled.get("relay")
    for row in pooled.values():
        if direct and direct["rps"]:
            row["ratio"] = row["rps"] / direct["rps"]
            for metric in ("ttft_p50", "e2e_p50"):
                if row[metric] is not None and direct[metric] is not None:
                    row[f"added_{metric}"] = row[metric] - direct[metric]
        if relay and relay["rps"]:
            row["vs_relay"] = row["rps"] / relay["rps"]
    for name, row in pooled.items():  # a TLS gateway against the same gateway over plain HTTP
        plain = pooled.get("gateway " + name.removeprefix("tls ")) if name.startswith(
            "tls ") else None
        if plain and plain["rps"]:
            row["vs_plain"] = row["rps"] / plain["rps"]
    return pooled


def print_summary(cell: tuple, pooled: dict[str, Any], chunks: int) -> None:
    upstream, mode, concurrency = cell
    print(f"\n== {upstream} {mode} c={concurrency}: all rounds ({chunks} chunks per request)")
    print(f"{'side':24} {'rps':>7} {'ratio':>6} {'TTFT p50':>9} {'(+added)':>9} {'p99':>7} "
          f"{'ITL p50':>7} {'e2e p50':>8} {'(+added)':>9} {'p99':>7} {'fail':>4} "
          f"{'CPU ms/req':>10} {'us/chunk':>8} {'Redis':>6}  rounds")
    for name, row in pooled.items():
        cpu = row["cpu_ms_per_request"]
        chunk = row["cpu_us_per_chunk"]
        redis = row["redis_ms_per_request"]
        print(f"{name:24} {row['rps']:7.1f} {row.get('ratio', 0):6.3f} "
              f"{_ms(row['ttft_p50']):>9} {row.get('added_ttft_p50', 0):+9.2f} "
              f"{_ms(row['ttft_p99']):>7} {_ms(row['itl_p50']):>7} {_ms(row['e2e_p50']):>8} "
              f"{row.get('added_e2e_p50', 0):+9.2f} {_ms(row['e2e_p99']):>7} "
              f"{row['failed']:4d} {'' if cpu is None else f'{cpu:.3f}':>10} "
              f"{'' if chunk is None else f'{chunk:.1f}':>8} "
              f"{'' if redis is None else f'{redis:.3f}':>6}  {row['rounds_rps']}")
    for name, row in pooled.items():
        if "vs_plain" in row:
            print(f"{name}: {row['vs_plain']:.3f} of the plain-HTTP gateway's requests/s")
    print(flush=True)


def chunks_per_request(url: str, model: str, output_len: int, mode: str) -> int:
    """Events in one streamed answer of the upstream (role, tokens, usage, [DONE])."""
    import httpx

    if mode != "stream":
        return 1
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": output_len, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {ENGINE_SECRET}"})
    return answer.content.count(b"data: ")


# -- another commit's code ------------------------------------------------------------------------
@contextlib.contextmanager
def worktree(commit: str, folder: Path):
    """That commit's tree, checked out (detached) in `folder` for the run, removed after."""
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=ROOT,
                   check=True, capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT,
                       capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


# -- main ------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstreams", nargs="+", choices=tuple(MODELS),
                        default=["engine", "paced"])
    parser.add_argument("--modes", nargs="+", choices=("stream", "whole"), default=["stream"],
                        help="streamed requests, and/or whole (non-streamed) ones")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--workers", nargs="+", type=int, default=[1],
                        help="gateway (uvicorn) workers; one gateway per value")
    parser.add_argument("--limits", nargs="+", choices=("on", "off"), default=["on"],
                        help="the tenant has RPM and TPM limits (on) or none (off)")
    parser.add_argument("--flow", nargs="+", choices=("on", "off"), default=["on"],
                        help="the gateways' flow control (GATEWAY_FLOW_CONTROL); one gateway "
                             "per value")
    parser.add_argument("--pin", action="store_true",
                        help="run the client, relay, gateways, mocks and Redis on the last core "
                             "only, off the core the engine computes on")
    parser.add_argument("--no-relay", action="store_true", help="leave out the bare TCP relay")
    parser.add_argument("--tls", action="store_true",
                        help="also gateways (sides `tls ...`) reaching the mock upstreams over "
                             "TLS with the console's client certificate, as engines are reached; "
                             "printed as a ratio to the same gateway over plain HTTP")
    parser.add_argument("--compare", default="", metavar="COMMIT",
                        help="also measure the gateway of this commit (a git worktree)")
    parser.add_argument("--full", action="store_true",
                        help="the whole matrix: every upstream and mode, 1/32/64 concurrent, "
                             "1 and 2 workers, limits on and off")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=300,
                        help="requests per measurement above one at a time")
    parser.add_argument("--prompts-single", type=int, default=30,
                        help="requests per measurement one at a time")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--pace-ms", type=float, default=10.0,
                        help="the paced mock's interval between chunks")
    parser.add_argument("--profile", type=int, default=0, metavar="RUNS",
                        help="after the rounds, RUNS more (unrecorded) streamed measurements at "
                             "32 concurrent of each code's first gateway, its worker sampled by "
                             "py-spy; print the top functions")
    parser.add_argument("--json", default="", help="also write every figure to this file")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.full:
        args.upstreams, args.modes = list(MODELS), ["stream", "whole"]
        args.concurrency, args.workers, args.limits = [1, 32, 64], [1, 2], ["on", "off"]
    if args.tls and "engine" in args.upstreams:
        parser.error("--tls measures the mock upstreams (paced, instant): an engine listens "
                     "with TLS or without, not both, so no same upstream serves both sides")
    return args


def main() -> int:
    args = parse_args()
    if args.client:
        _client_main()
        return 0
    # Stopped from outside (`timeout`, Ctrl-C): still stop everything it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs: list[subprocess.Popen] = []
    stack = contextlib.ExitStack()
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stream-bench-")))
    client: Client | None = None
    try:
        # `--pin`: everything but the engine on the last core (the engine's worker computes on
        # core 0, where vLLM's CPU backend pins it).
        rt = ["taskset", "-c", str((os.cpu_count() or 1) - 1)] if args.pin else None
        redis_proc, redis_url = start_redis(rt)
        procs.append(redis_proc)
        upstreams: dict[str, int] = {kind: free_port() for kind in args.upstreams}
        if "engine" in upstreams:
            procs.append(start_engine(upstreams["engine"]))
        # `--tls`: each mock upstream also listens with TLS, as engines do; the TLS gateways
        # reach the same upstream processes there.
        tls_dir = make_tls_dir(tmp / "engine-tls") if args.tls else None
        tls_ports = {kind: free_port() for kind in upstreams} if args.tls else {}
        for kind, interval in (("paced", args.pace_ms / 1000), ("instant", 0.0)):
            if kind in upstreams:
                procs.append(spawn("stream_bench._paced_main", upstreams[kind], interval,
                                   tls_ports.get(kind, 0), str(tls_dir or ""), rt=rt))
        sides = [Side("direct", {k: f"http://127.0.0.1:{p}" for k, p in upstreams.items()},
                      ENGINE_SECRET)]
        if not args.no_relay:
            relay = Side("relay", {}, ENGINE_SECRET)
            for kind, port in upstreams.items():  # one relay process per upstream
                relay_port = free_port()
                procs.append(spawn("gateway_bench._relay_main", relay_port, port, rt=rt))
                relay.urls[kind] = f"http://127.0.0.1:{relay_port}"
                relay.pids[kind] = procs[-1].pid
            sides.append(relay)
        codes: list[tuple[str, Path, dict[str, str]]] = [("gateway", ROOT, {})]
        if tls_dir is not None:
            codes.append(("tls", ROOT, {"ENGINE_TLS": "true", "ENGINE_TLS_DIR": str(tls_dir)}))
        if args.compare:
            label = subprocess.run(["git", "rev-parse", "--short", args.compare], cwd=ROOT,
                                   check=True, capture_output=True, text=True).stdout.strip()
            codes.append((label, stack.enter_context(worktree(args.compare, tmp / label)), {}))
        gateways = []
        for label, code, extra_env in codes:
            env = {**gateway_env(redis_url, f"sqlite:///{tmp / label}.sqlite3", code),
                   "CONSOLE_VAR_DIR": str(tmp / f"{label}-var"), **extra_env}
            keys = seed_gateway_db(env, tls_ports if extra_env else upstreams, code)
            for workers, flow in itertools.product(args.workers, args.flow):
                port = free_port()
                proc = start_gateway({**env, "GATEWAY_FLOW_CONTROL": str(flow == "on").lower()},
                                     port, workers, code, rt)
                procs.append(proc)
                url = f"http://127.0.0.1:{port}"
                gateways.append((proc, url, keys["limits"]))
                for limits in args.limits:
                    key = keys["limits" if limits == "on" else "nolimits"]
                    name = (f"{label} w{workers} {'limits' if limits == 'on' else 'nolimits'}"
                            + ("" if flow == "on" else " noflow"))
                    sides.append(Side(name, dict.fromkeys(upstreams, url), key,
                                      dict.fromkeys(upstreams, proc.pid),
                                      redis_pid=redis_proc.pid))
        for _proc, url, key in gateways:
            wait_http(url + "/v1/models", 60, {"Authorization": f"Bearer {key}"})
        if "engine" in upstreams:
            wait_http(f"{sides[0].urls['engine']}/health", 240)
        for kind in upstreams:  # also the relays'
            for side in sides[:2]:
                wait_http(side.urls[kind] + "/v1/models", 30,
                          {"Authorization": f"Bearer {ENGINE_SECRET}"})
        # Background CPU with no traffic (all at once), taken out of the per-request figures.
        idle = {pid: cpu_seconds(pid) for s in sides for pid in s.pids.values()}
        started = time.perf_counter()
        time.sleep(5.0)
        for pid in idle:
            idle[pid] = (cpu_seconds(pid) - idle[pid]) / (time.perf_counter() - started)
        for side in sides:
            side.idle_cpu = {pid: idle[pid] for pid in side.pids.values()}
        print("idle CPU: " + ", ".join(
            f"{s.name} {max(s.idle_cpu.values()) * 100:.1f}%" for s in sides if s.pids),
            flush=True)
        cells = [(u, m, c) for u in args.upstreams for m in args.modes
                 for c in args.concurrency if not (u == "paced" and m == "whole" and c == 1)]
        chunks = {(u, m): chunks_per_request(sides[0].urls[u], MODELS[u], args.output_len, m)
                  for u, m, _c in cells}
        client = Client(tmp / "client.log", rt)
        seeds = itertools.count()
        for round_no in range(args.rounds):
            for cell in cells:
                order = sides if round_no % 2 == 0 else sides[::-1]
                for side in order:
                    seed = next(seeds)
                    row = measure(client, side, args, cell, seed, chunks[cell[:2]])
                    print_row(cell, round_no, side, row)
        results: dict[str, Any] = {"args": vars(args), "cells": {}}
        for cell in cells:
            pooled = summarize(cell, sides)
            print_summary(cell, pooled, chunks[cell[:2]])
            results["cells"][" ".join(map(str, cell))] = {
                "summary": pooled,
                "rounds": {s.name: [{k: v for k, v in r.items() if k not in ("ttfts", "e2els")}
                                    for r in s.rounds.get(cell, [])] for s in sides},
            }
        firsts = {s.name.split()[0]: s for s in reversed(sides) if s.name not in
                  ("direct", "relay")}
        for upstream in args.upstreams if args.profile else []:
            cell = (upstream, "stream", 32)
            if cell[:2] not in chunks:
                chunks[cell[:2]] = chunks_per_request(sides[0].urls[upstream], MODELS[upstream],
                                                      args.output_len, "stream")
            for label, side in firsts.items():
                folder = tmp / f"profile-{upstream}-{label}"
                folder.mkdir()
                profiler = Profiler(_worker_pid(side.pids[upstream]), folder)
                for run in range(args.profile):
                    row = measure(client, side, args, cell, next(seeds), chunks[cell[:2]],
                                  profiler)
                    print_row(cell, run, side, row)
                report = profiler.report()
                results[f"profile {upstream} {label}"] = report
                print(f"profile of {side.name}'s worker, {upstream} stream c=32:")
                print("\n".join(report), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        if client is not None:
            client.close()
        stop_all(procs)
        stack.close()
    return 0


def _worker_pid(pid: int) -> int:
    """The process that serves requests: uvicorn itself with one worker, else its first
    worker."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        found = children.read_text().split()
        if found:
            return int(found[0])
    return pid


if __name__ == "__main__":
    sys.exit(main())
