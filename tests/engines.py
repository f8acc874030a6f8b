"""The real CPU vLLM engine the gateway and browser suites share: one process for the whole test
session (the `engine` fixture in tests/conftest.py), serving the generated tiny model and two
tenants' adapters, launched at the scheduling class node agents give CPU engines."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from django.conf import settings

from benchmarks.gateway_bench import free_port, kill_group
from serving_app import pki
from serving_app.engine.client import engine_http
from serving_app.engine.launch import CPU_IDLE_PREFIX, tls_arguments
from tests import engine_slots

ROOT = Path(__file__).resolve().parents[1]
ENGINE_VENV = Path(settings.ENGINE_VENV)
ENGINE_PYTHON = ENGINE_VENV / "bin" / "python"
MODELS = ROOT / "var" / "models"
ENGINE_SECRET = "gateway-test-engine-secret"
# A second name for the same model, so that a deployment serving one tenant alone can use it.
PRIVATE_MODEL = "tiny-llama-private"


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Poll `check` until it returns true; on timeout, say what the last failed check raised."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - a check may fail until the thing is up
            last_error = exc
        time.sleep(0.2)
    cause = f" (the last check raised {last_error!r})" if last_error is not None else ""
    raise RuntimeError(f"{what} did not happen within {timeout}s{cause}")


@dataclass
class Engine:
    port: int
    secret: str

    @property
    def url(self) -> str:
        return f"{pki.engine_scheme()}://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        return self.metrics()[name]

    def metrics(self) -> dict[str, float]:
        """Every series of one read of the engine's /metrics, summed per name over its labels
        (read line by line, not with the parser the node agents use)."""
        text = engine_http().get(self.url + "/metrics", timeout=10).text
        totals: dict[str, float] = defaultdict(float)
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                totals[series.split("{", 1)[0]] += float(value)
        return totals


def engine_tls() -> ssl.SSLContext | None:
    """What a stand-in engine (a mock upstream the gateway reaches through an instance) serves
    with, as engines do: TLS with the node's certificate, a client certificate of the console
    CA required; None with `ENGINE_TLS` off."""
    if not settings.ENGINE_TLS:
        return None
    pki.ensure_local("")
    return pki.engine_server_context(pki.directory())


def serve_standin(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """An `http.server` stand-in engine on a free loopback port, served from a thread as engines
    serve: over TLS with a console CA client certificate required (`engine_tls`). Shut it down
    with `.shutdown()` and `.server_close()`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    context = engine_tls()
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class JsonStandin(BaseHTTPRequestHandler):
    """A stand-in engine's handler: every POST's JSON body answered with `answer(body)` as JSON
    (200, with its length, kept alive). Serve it with `serve_standin`."""

    protocol_version = "HTTP/1.1"

    def answer(self, body: dict) -> dict:
        raise NotImplementedError

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        payload = json.dumps(self.answer(body)).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


def engine_installed() -> bool:
    return (ENGINE_VENV / ".engine-install-complete").exists()


class SharedEngine:
    """The session's engine, started when a test first needs it and stopped when the tests of
    this process that use it are done (tests/conftest.py orders them one after the other), so
    that its engine slot (tests/engine_slots.py) goes to the engine chains for the rest of the
    run. Started again, on the same port, if a later test needs it after all."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.slot: list[int] = []

    @property
    def running(self) -> bool:
        return self.proc is not None

    def start(self) -> Engine:
        if self.proc is None:
            self.slot = engine_slots.slots().take(1, "the session's shared engine")
            try:
                self.proc = launch_engine(self.port, self.log)
            except BaseException:
                engine_slots.slots().give(self.slot)
                raise
        return Engine(self.port, ENGINE_SECRET)

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None
            engine_slots.slots().give(self.slot)


def launch_engine(port: int, log: Path) -> subprocess.Popen:
    """Start the engine on `port` and wait for its health check."""
    # The secret in the environment, as node agents start engines (never on the command line).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_API_KEY": ENGINE_SECRET,
           # Its worker inside EngineCore (ENGINE_CPU_WORKER=engine-core: docs/testing.md).
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for name in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH"):
        env.pop(name, None)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*CPU_IDLE_PREFIX, str(ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(MODELS / "tiny-llama"),
             "--served-model-name", "tiny-llama", PRIVATE_MODEL,
             "--dtype", "float32", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
             "--lora-modules", f"acme--style={MODELS / 'tiny-llama-lora-a'}",
             f"globex--tone={MODELS / 'tiny-llama-lora-b'}",
             "--scheduling-policy", "priority",
             # No torch.compile warm-up: 0.64 of a start's CPU (docs/testing.md).
             "--enforce-eager",
             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
             # As node agents start engines: only a caller with the console's certificate.
             *tls_arguments()],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_until(
            lambda: engine_http().get(f"{Engine(port, '').url}/health",
                                      timeout=2).status_code == 200,
            240, "engine start", proc,
        )
    except BaseException:
        kill_group(proc)
        raise
    return proc
