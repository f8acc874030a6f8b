"""Gateway benchmark: direct to the engine versus through the gateway, same machine, same run.

    .venv/bin/python benchmarks/gateway_bench.py                 # engine and instant upstream
    .venv/bin/python benchmarks/gateway_bench.py --only instant  # the gateway's own cost only
    .venv/bin/python benchmarks/gateway_bench.py --seconds 20 --json var/gateway-bench.json

1. The real CPU vLLM engine (var/engine-venv, var/models/tiny-llama), 16-token completions, at 1
   and 32 concurrent requests: throughput ratio (gateway / direct) and added p50/p99 latency.
2. A minimal upstream that answers instantly (`InstantUpstream`, a raw asyncio HTTP server in its
   own process): the gateway's own cost per request and its requests per second per worker.

These machines are noisy (other processes come and go, and the CPU engine's own latency swings
by tens of percent from one second to the next), so direct and gateway are measured interleaved
rather than one after the other: one at a time, requests alternate between the sides (paired
samples); at higher concurrency, short slices alternate (direct, gateway, gateway, direct, ...)
and the ratio is of the totals. `--seconds` is the time per side. The gateway worker's CPU time
per request (from /proc, less its idle background CPU measured first) is printed as well.

Scheduling. vLLM's CPU backend busy-waits: its worker (pinned to core 0) and its scheduler
process (on the "reserved" core 1) spin in `sched_yield()` loops between steps. On a 2-core
machine nothing else then gets a CPU reliably: measured with pidstat under 32 concurrent
requests, the load generator got under 2% of a CPU while waiting in the run queue 90% of the
time or more, and the engine's throughput swung between about 300 and 30 requests/s from one
second to the next, direct as much as through the gateway (`nice` did not help). Node agents
therefore launch CPU engines under SCHED_IDLE (`ENGINE_CPU_SCHEDULING`, serving_app/engine/
launch.py), and so does this benchmark (`--engine-scheduling normal` for the old behaviour).
`--realtime N` instead runs the load generator, the gateway, the relay, the instant upstream and
the benchmark's Redis at SCHED_RR priority N (as root): another way to give them a CPU whenever
they are runnable; their CPU time still comes out of the engine's, every side alike.

`--relay` adds a third side: a bare TCP relay in its own process (no HTTP parsing, no limits),
the cheapest proxy there can be, to show what one more process hop costs here.

The gateway runs as `uvicorn console.asgi:application` with `--workers` workers (default one;
uvloop, httptools), a tenant with RPM and TPM limits (so admission and settlement both run: two
Redis round trips), against its own SQLite database under var/ and the benchmark's own Redis
(`--redis-url` to use another). Everything listens on 127.0.0.1; every phase is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
BODY = {"prompt": "Hello, my name is", "max_tokens": 16, "ignore_eos": True, "temperature": 0}


# -- the instant upstream ----------------------------------------------------------------------
class InstantUpstream(asyncio.Protocol):
    """An OpenAI-shaped server that answers at once: HTTP/1.1 keep-alive, fixed completions.

    `POST /v1/completions` and `/v1/chat/completions` answer a completion with usage (or a short
    stream); `/tokenize` counts one token per byte of the prompt; `status` forces an answer code
    (503 to test retries). `stats` counts requests per path and keeps the last body.
    """

    stats: dict[str, Any] = {"paths": {}, "last_body": None}

    def __init__(self, status: int = 200) -> None:
        self.status = status

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            path = head.split(" ", 2)[1]
            self.respond(path, body)

    def respond(self, path: str, body: bytes) -> None:
        paths = self.stats["paths"]
        paths[path] = paths.get(path, 0) + 1
        self.stats["last_body"] = body
        if self.status != 200:
            payload = json.dumps({"error": {"message": "busy", "type": "server_error",
                                            "param": None, "code": None}}).encode()
            self._send(self.status, b"application/json", payload)
            return
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = {}
        if path == "/tokenize":
            text = request.get("prompt") or json.dumps(request.get("messages"))
            self._send(200, b"application/json",
                       json.dumps({"count": len(str(text).encode())}).encode())
            return
        model = request.get("model", "m")
        usage = {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
        if request.get("stream"):
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
                     "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
            final = {**chunk, "choices": [], "usage": usage}
            events = [chunk, chunk, final]
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            self._send(200, b"text/event-stream", payload + b"data: [DONE]\n\n")
            return
        payload = json.dumps({
            "id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
            "choices": [{"index": 0, "text": " x" * 16, "finish_reason": "length",
                         "logprobs": None}],
            "usage": usage,
        }).encode()
        self._send(200, b"application/json", payload)

    def _send(self, status: int, content_type: bytes, payload: bytes) -> None:
        reason = b"OK" if status == 200 else b"Service Unavailable"
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, content_type, len(payload), payload)
        )


async def serve_instant(port: int, status: int = 200, ssl: Any = None) -> asyncio.AbstractServer:
    """`InstantUpstream` on `port`; with `ssl` (an `ssl.SSLContext`), over TLS as engines are
    (the tests' stand-in engines: `tests.engines.engine_tls()`)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: InstantUpstream(status), "127.0.0.1", port,
                                    ssl=ssl)


def _instant_main(port: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        server = await serve_instant(port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the byte relay ------------------------------------------------------------------------------
class _Pipe(asyncio.Protocol):
    """One direction's receiving end: whatever arrives is written to `peer` as it comes."""

    def __init__(self, peer=None) -> None:
        self.peer = peer
        self.pending = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.pending += data
        else:
            self.peer.write(data)

    def connection_lost(self, exc) -> None:
        if self.peer is not None:
            self.peer.close()


def _relay_main(port: int, upstream: int) -> None:
    """A TCP relay between the load generator and the engine: no HTTP parsing, no admission, no
    metering; the cheapest proxy there can be. Measured as its own side to show what one extra
    hop through a process costs on this machine, apart from what the gateway does."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        connecting: set[asyncio.Task] = set()

        class Client(_Pipe):
            def connection_made(self, transport) -> None:
                super().connection_made(transport)
                task = loop.create_task(self.connect())
                connecting.add(task)
                task.add_done_callback(connecting.discard)

            async def connect(self) -> None:
                up_transport, _ = await loop.create_connection(
                    lambda: _Pipe(self.transport), "127.0.0.1", upstream)
                if self.transport.is_closing():  # the client left while we connected
                    up_transport.close()
                    return
                self.peer = up_transport
                if self.pending:
                    up_transport.write(self.pending)
                    self.pending = b""

        server = await loop.create_server(Client, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- helpers ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, headers: dict | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, headers=headers, timeout=2).status_code < 500:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up within {timeout}s")


def wait_redis(url: str, timeout: float) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            with redis.Redis.from_url(url) as client:
                client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def kill_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop a process started in its own session, and everything it started: SIGTERM, then
    SIGKILL after `grace` seconds (also used by the gateway tests' fixtures)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Stop processes started in sessions of their own: SIGTERM to all but the first (the
    benchmark's Redis, stopped last) at once, then wait for each, the last started first."""
    for proc in procs[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in reversed(procs):
        kill_group(proc)


FAILED: list[tuple[str, int, bytes]] = []  # (side, status, body) of every failed request


def _pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] * 1000 if values else float("nan")


def _summary(latencies: list[float], elapsed: float, failures: int) -> dict:
    return {
        "requests": len(latencies),
        "failures": failures,
        "rps": len(latencies) / elapsed if elapsed else 0.0,
        "p50_ms": _pct(latencies, 0.50),
        "p99_ms": _pct(latencies, 0.99),
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else float("nan"),
    }


async def _warm(session, url: str, headers: dict, payload: bytes, n: int) -> None:
    for _ in range(n):
        async with session.post(url, data=payload, headers=headers) as r:
            await r.read()


async def _timed(session, name: str, url: str, headers: dict, payload: bytes,
                 latencies: dict, failures: dict) -> None:
    """One request: its latency if it answered 200, else a failure (kept in FAILED)."""
    t0 = time.perf_counter()
    async with session.post(url, data=payload, headers=headers) as r:
        answer = await r.read()
        status = r.status
    if status == 200:
        latencies[name].append(time.perf_counter() - t0)
    else:
        failures[name] += 1
        FAILED.append((name, status, answer[:300]))


async def paired(sides: dict[str, tuple[str, dict]], body: dict, seconds: float) -> dict:
    """One request at a time, alternating between the sides: paired samples under the same
    conditions. `seconds` per side. Throughput one at a time is 1 / mean latency."""
    import aiohttp

    payload = json.dumps(body).encode()
    latencies: dict[str, list[float]] = {name: [] for name in sides}
    failures = dict.fromkeys(sides, 0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session:
        for url, headers in sides.values():
            await _warm(session, url, headers, payload, 4)
        stop_at = time.perf_counter() + seconds * len(sides)
        while time.perf_counter() < stop_at:
            for name, (url, headers) in sides.items():
                await _timed(session, name, url, headers, payload, latencies, failures)
    out = {name: _summary(latencies[name], sum(latencies[name]), failures[name])
           for name in sides}
    first, *others = sides
    for other in others:
        diffs = [b - a for a, b in zip(latencies[first], latencies[other], strict=False)]
        out[f"paired_median_diff_ms_{other}"] = (
            statistics.median(diffs) * 1000 if diffs else float("nan"))
    out["paired_median_diff_ms"] = out.get("paired_median_diff_ms_gateway")
    return out


async def sliced(sides: dict[str, tuple[str, dict]], body: dict, concurrency: int,
                 seconds: float, slices: int) -> dict:
    """Closed loop, `concurrency` clients, in alternating slices (A B B A A B ...) of
    seconds / slices each; a slice ends when its last request returns."""
    import aiohttp

    payload = json.dumps(body).encode()
    names = list(sides)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    failures = dict.fromkeys(names, 0)
    elapsed = dict.fromkeys(names, 0.0)
    per_slice: dict[str, list[float]] = {name: [] for name in names}
    connector = aiohttp.TCPConnector(limit=concurrency * len(sides))
    async with aiohttp.ClientSession(connector=connector) as session:
        for url, headers in sides.values():
            await _warm(session, url, headers, payload, min(concurrency, 8))
        order = []
        for i in range(slices):
            order += names if i % 2 == 0 else names[::-1]
        for name in order:
            url, headers = sides[name]
            stop_at = time.perf_counter() + seconds / slices

            async def client(name=name, url=url, headers=headers, stop_at=stop_at) -> None:
                while time.perf_counter() < stop_at:
                    await _timed(session, name, url, headers, payload, latencies, failures)

            started, before = time.perf_counter(), len(latencies[name])
            await asyncio.gather(*(client() for _ in range(concurrency)))
            took = time.perf_counter() - started
            elapsed[name] += took
            per_slice[name].append(round((len(latencies[name]) - before) / took, 1))
    out = {name: _summary(latencies[name], elapsed[name], failures[name]) for name in names}
    out["slices_rps"] = per_slice
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and its live children (uvicorn's workers), all their threads, from
    Linux's /proc/<pid>/task/<tid>/schedstat (nanoseconds: the clock-tick counters of
    /proc/<pid>/stat are 10 ms apart, too coarse for a few hundred requests)."""
    pids = [pid]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            pids.append(int(entry.name))
    total = 0
    for each in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{each}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


# -- setup (shared with benchmarks/stream_bench.py) -----------------------------------------------
SEED = """
import json, sys
from serving_app.models import BaseModel, Deployment, Instance, Node
from tenants_app.models import ApiKey, Tenant
args = json.loads(sys.argv[1])
Instance.objects.all().delete(); Deployment.objects.all().delete()
ApiKey.objects.all().delete(); Tenant.objects.all().delete(); BaseModel.objects.all().delete()
base = BaseModel(name="tiny-llama", path=args["model"]); base.full_clean(); base.save()
limits = dict(requests_per_minute=10_000_000, tokens_per_minute=1_000_000_000)
tenants = {"limits": Tenant.objects.create(slug="bench", name="Bench", **limits),
           "nolimits": Tenant.objects.create(slug="bench-free", name="Bench (no limits)")}
node, _ = Node.objects.get_or_create(name="bench", defaults={"queue": "node.bench"})
for kind, port in args["upstreams"].items():
    dep = Deployment.objects.create(name=f"bench-{kind}", base_model=base if kind == "engine"
        else BaseModel.objects.get_or_create(name=kind, defaults={"path": args["model"]})[0],
        desired_state="running", max_model_len=1024)
    dep.tenants.set(tenants.values())
    Instance.objects.create(deployment=dep, node=node, port=port, state="ready",
                            secret=args["secret"])
keys = {name: ApiKey.objects.create_key(tenant=t, name="bench")[1] for name, t in tenants.items()}
print(json.dumps(keys))
"""
ENGINE_SECRET = "bench-engine-secret"


def spawn(function: str, *args: Any, rt: list[str] | None = None) -> subprocess.Popen:
    """Run `benchmarks.<module>.<function>(*args)` in a process of its own (its own session, so
    `kill_group` stops it and whatever it started)."""
    module, name = function.rsplit(".", 1)
    return subprocess.Popen(
        [*(rt or []), sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
         f"from benchmarks.{module} import {name}; {name}(*{args!r})"],
        start_new_session=True)


def start_redis(rt: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """A Redis of the benchmark's own (no persistence) on a free port: (process, URL)."""
    port = free_port()
    proc = subprocess.Popen(
        [*(rt or []), "redis-server", "--bind", "127.0.0.1", "--port", str(port),
         "--save", "", "--appendonly", "no", "--loglevel", "warning"],
        start_new_session=True, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    wait_redis(url, 10)
    return proc, url


def start_engine(port: int, scheduling: str = "idle", extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, log: IO[bytes] | None = None
                 ) -> subprocess.Popen:
    """The real CPU engine (tiny model) as node agents launch it: under SCHED_IDLE unless
    `scheduling` is "normal" (serving_app.engine.launch.CPU_IDLE_PREFIX). `extra`: more vLLM
    flags (benchmarks/fairness_bench.py: `--scheduling-policy priority`); `env`: more of its
    environment; `log`: where its output goes (nowhere by default)."""
    engine_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                  **(env or {})}
    sched = ["chrt", "--idle", "0"] if scheduling == "idle" else []
    return subprocess.Popen(
        [*sched, str(ROOT / "var/engine-venv/bin/python"), "-m",
         "vllm.entrypoints.openai.api_server", "--model",
         str(ROOT / "var/models/tiny-llama"), "--served-model-name", "tiny-llama",
         "--dtype", "float32", "--max-model-len", "1024", "--api-key", ENGINE_SECRET,
         "--host", "127.0.0.1", "--port", str(port), *extra],
        env=engine_env, start_new_session=True, stdout=log or subprocess.DEVNULL,
        stderr=subprocess.STDOUT if log else subprocess.DEVNULL)


USAGE_STREAM = "gw:bench-usage"  # the gateways' usage events (nothing consumes them here)


def gateway_env(redis_url: str, database_url: str, code: Path = ROOT) -> dict[str, str]:
    """The environment of a gateway (and its migrate/seed commands) running the code in `code`
    (this checkout, or another commit's) on `database_url` and the benchmark's Redis."""
    return {"DEBUG": "true", **os.environ, "DJANGO_SETTINGS_MODULE": "console.settings",
            "PYTHONPATH": str(code), "DATABASE_URL": database_url,
            "MODEL_ROOTS": str(ROOT / "var" / "models"), "GATEWAY_REDIS_URL": redis_url,
            "LOG_LEVEL": "WARNING", "GATEWAY_USAGE_STREAM": USAGE_STREAM,
            # The benchmarks' upstreams speak plain HTTP (stream_bench.py --tls: TLS as well).
            "ENGINE_TLS": "false"}


def seed_gateway_db(env: dict[str, str], upstreams: dict[str, int],
                    code: Path = ROOT) -> dict[str, str]:
    """Migrate the gateway's database and seed it: one deployment per upstream (`engine` serves
    the tiny model as "tiny-llama", any other kind a model named after it), a tenant with RPM
    and TPM limits (both Redis round trips run) and one without. Returns each tenant's key
    ({"limits": ..., "nolimits": ...})."""
    python = sys.executable
    subprocess.run([python, "manage.py", "migrate", "-v0"], cwd=code, env=env, check=True)
    out = subprocess.run(
        [python, "manage.py", "shell", "-c", SEED.replace("sys.argv[1]", repr(json.dumps(
            {"model": str(ROOT / "var/models/tiny-llama"), "upstreams": upstreams,
             "secret": ENGINE_SECRET})))],
        cwd=code, env=env, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def start_gateway(env: dict[str, str], port: int, workers: int, code: Path = ROOT,
                  rt: list[str] | None = None) -> subprocess.Popen:
    """`uvicorn console.asgi:application` as deployed (uvloop, httptools, no access log)."""
    return subprocess.Popen(
        [*(rt or []), sys.executable, "-m", "uvicorn", "console.asgi:application", "--host",
         "127.0.0.1", "--port", str(port), "--workers", str(workers), "--loop",
         "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"],
        cwd=code, env=env, start_new_session=True)


def idle_cpu_rate(pid: int, seconds: float = 6.0) -> float:
    """Background work (catalog re-reads, the invalidation listener) costs CPU with no traffic
    too: its rate in CPU seconds per second, to take out of per-request figures."""
    idle0, t0 = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - idle0) / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("engine", "instant"), default=None)
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--slices", type=int, default=4,
                        help="alternating slices per side above one at a time")
    parser.add_argument("--redis-url", default="",
                        help="the gateway's Redis (default: one the benchmark starts itself)")
    parser.add_argument("--workers", type=int, default=1, help="gateway (uvicorn) workers")
    parser.add_argument("--realtime", type=int, default=0,
                        help="SCHED_RR priority of the load generator, gateway, relay, instant "
                             "upstream and the benchmark's Redis (root); 0 = normal scheduling")
    parser.add_argument("--engine-scheduling", choices=("idle", "normal"), default="idle",
                        help="the engine's CPU scheduling policy; idle (SCHED_IDLE) is what node "
                             "agents use for CPU engines (ENGINE_CPU_SCHEDULING)")
    parser.add_argument("--relay", action="store_true",
                        help="a third side: a bare TCP relay in front of the engine (no HTTP, no "
                             "limits), what one extra process hop costs on this machine")
    parser.add_argument("--no-limits", action="store_true",
                        help="a tenant without limits: no admission round trip (for comparison)")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args()
    rt = ["chrt", "-r", str(args.realtime)] if args.realtime else []
    procs: list[subprocess.Popen] = []
    results: dict[str, Any] = {"realtime_priority": args.realtime,
                               "engine_scheduling": args.engine_scheduling}
    upstreams: dict[str, int] = {}
    try:
        import redis

        redis_url = args.redis_url
        if not redis_url:
            redis_proc, redis_url = start_redis(rt)
            procs.append(redis_proc)
        client = redis.Redis.from_url(redis_url)
        client.delete(USAGE_STREAM)
        client.close()
        env = gateway_env(redis_url, f"sqlite:///{ROOT / 'var' / 'gateway-bench.sqlite3'}")
        if args.only in (None, "engine"):
            port = free_port()
            procs.append(start_engine(port, args.engine_scheduling))
            upstreams["engine"] = port
            if args.relay:
                relay_port = free_port()
                procs.append(spawn("gateway_bench._relay_main", relay_port, port, rt=rt))
        if args.only in (None, "instant"):
            port = free_port()
            procs.append(spawn("gateway_bench._instant_main", port, rt=rt))
            upstreams["instant"] = port
        keys = seed_gateway_db(env, upstreams)
        key = keys["nolimits" if args.no_limits else "limits"]
        gw_port = free_port()
        procs.append(start_gateway(env, gw_port, args.workers, rt=rt))
        gw_headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        direct_headers = {"Authorization": f"Bearer {ENGINE_SECRET}",
                          "Content-Type": "application/json"}
        wait_http(f"http://127.0.0.1:{gw_port}/v1/models", 60, gw_headers)
        gateway_pid = procs[-1].pid
        idle_rate = idle_cpu_rate(gateway_pid)
        print(f"gateway idle CPU: {idle_rate * 100:.1f}% of a core", flush=True)
        results["gateway_idle_cpu_fraction"] = idle_rate
        if args.realtime:  # after every child started: the engine must not inherit it
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(args.realtime))
        for kind, port in upstreams.items():
            if kind == "engine":
                wait_http(f"http://127.0.0.1:{port}/health", 240)
            model = "tiny-llama" if kind == "engine" else "instant"
            body = {**BODY, "model": model}
            sides = {"direct": (f"http://127.0.0.1:{port}/v1/completions", direct_headers)}
            if kind == "engine" and args.relay:
                sides["relay"] = (f"http://127.0.0.1:{relay_port}/v1/completions", direct_headers)
            sides["gateway"] = (f"http://127.0.0.1:{gw_port}/v1/completions", gw_headers)
            for concurrency in args.concurrency:
                cpu0, t0 = cpu_seconds(gateway_pid), time.perf_counter()
                if concurrency == 1:
                    got = asyncio.run(paired(sides, body, args.seconds))
                else:
                    got = asyncio.run(sliced(sides, body, concurrency, args.seconds, args.slices))
                cpu = cpu_seconds(gateway_pid) - cpu0 - idle_rate * (time.perf_counter() - t0)
                direct, via = got["direct"], got["gateway"]
                handled = via["requests"] + via["failures"]
                row = {
                    "direct": direct, "gateway": via,
                    "paired_median_diff_ms": got.get("paired_median_diff_ms"),
                    "slices_rps": got.get("slices_rps"),
                    "throughput_ratio": via["rps"] / direct["rps"] if direct["rps"] else 0.0,
                    "added_p50_ms": via["p50_ms"] - direct["p50_ms"],
                    "added_p99_ms": via["p99_ms"] - direct["p99_ms"],
                    "gateway_cpu_ms_per_request": cpu * 1000 / handled if handled else None,
                }
                results[f"{kind}@{concurrency}"] = row
                print(f"{kind:8} c={concurrency:<3} direct {direct['rps']:7.1f} rps "
                      f"p50 {direct['p50_ms']:6.2f} p99 {direct['p99_ms']:6.2f} ms | gateway "
                      f"{via['rps']:7.1f} rps p50 {via['p50_ms']:6.2f} p99 {via['p99_ms']:6.2f} ms"
                      f" | ratio {row['throughput_ratio']:.2f} added p50 "
                      f"{row['added_p50_ms']:+.2f} p99 {row['added_p99_ms']:+.2f} ms"
                      f" | gateway CPU {row['gateway_cpu_ms_per_request'] or 0:.3f} ms/request"
                      f" | failures {direct['failures']}/{via['failures']}", flush=True)
                if "relay" in got:
                    relay = got["relay"]
                    row["relay"] = relay
                    row["relay_throughput_ratio"] = (
                        relay["rps"] / direct["rps"] if direct["rps"] else 0.0)
                    print(f"{'':8} c={concurrency:<3} relay {relay['rps']:7.1f} rps p50 "
                          f"{relay['p50_ms']:6.2f} p99 {relay['p99_ms']:6.2f} ms | ratio "
                          f"{row['relay_throughput_ratio']:.2f} added p50 "
                          f"{relay['p50_ms'] - direct['p50_ms']:+.2f} ms | gateway / relay "
                          f"{via['rps'] / relay['rps'] if relay['rps'] else 0:.2f}", flush=True)
                    if got.get("paired_median_diff_ms_relay") is not None:
                        print(f"{'':8} c=1   median of paired differences (relay - direct): "
                              f"{got['paired_median_diff_ms_relay']:+.2f} ms", flush=True)
                if row["slices_rps"]:
                    print(f"{'':8} c={concurrency:<3} requests/s per slice: " + "; ".join(
                        f"{k} {v}" for k, v in row["slices_rps"].items()), flush=True)
                if row["paired_median_diff_ms"] is not None:
                    print(f"{'':8} c=1   median of paired differences (gateway - direct): "
                          f"{row['paired_median_diff_ms']:+.2f} ms", flush=True)
        if "instant@1" in results:
            row = results["instant@1"]
            print(f"gateway's own cost per request (instant upstream, one at a time): "
                  f"{row['added_p50_ms']:.3f} ms added at p50, "
                  f"{row['gateway_cpu_ms_per_request']:.3f} ms of gateway CPU")
        instant = [r for k, r in results.items() if k.startswith("instant@")]
        if instant:
            best = max(r["gateway"]["rps"] for r in instant)
            cpu = min(r["gateway_cpu_ms_per_request"] or 1e9 for r in instant)
            print(f"gateway requests/s with {args.workers} worker(s) (instant upstream): "
                  f"{best:.0f} measured "
                  f"(sharing 2 cores with the load generator and the upstream); "
                  f"{1000 / cpu:.0f} per worker on a fully used core from its CPU time per "
                  "request")
        for side, status, text in FAILED[:10]:
            print(f"failed request ({side}): {status} {text.decode(errors='replace')}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        for proc in reversed(procs):
            kill_group(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
