"""A benchmark's load clients stop sending once the benchmark is gone.

Each tenant's load is vLLM's benchmark client in a process of its own session
(`stream_bench.Client`), so a `timeout` or Ctrl-C aimed at the benchmark does not reach it. It
used to go on sending until its prompts ran out: on the GPU host a benchmark killed by its
call's time limit left one such client sending 16 concurrent requests for the next quarter of an
hour, beside the runs measured after it (docs/gpu.md). Real processes here: the benchmark (a
Python process that starts a client and hands it a job of thousands of prompts), vLLM's client
in the engine's venv, and an upstream on loopback that answers like vLLM, counting requests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.gateway_bench import free_port
from benchmarks.stream_bench import ENGINE_PYTHON, TOKENIZER, PacedUpstream

ROOT = Path(__file__).resolve().parents[2]
PATH = "/v1/chat/completions"


class CountingUpstream(PacedUpstream):
    seen: list[float] = []

    def respond(self, path: str, body: bytes) -> None:
        if path == PATH:
            self.seen.append(time.monotonic())
        super().respond(path, body)


@pytest.fixture
def upstream():
    """The paced upstream on a loopback port, on an event loop of its own thread."""
    CountingUpstream.seen = []
    loop = asyncio.new_event_loop()
    port = free_port()
    server = loop.run_until_complete(
        loop.create_server(lambda: CountingUpstream(0.05), "127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield port
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    server.close()


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_client_stops_sending_once_its_benchmark_is_killed(upstream, tmp_path):
    argv = ["--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{upstream}",
            "--endpoint", PATH, "--model", "tiny-llama", "--tokenizer", str(TOKENIZER),
            "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4",
            "--random-range-ratio", "0", "--num-prompts", "3000", "--max-concurrency", "2",
            "--num-warmups", "0", "--seed", "1", "--temperature", "0", "--ignore-eos",
            "--disable-tqdm", "--save-detailed"]
    benchmark = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from benchmarks import stream_bench
        stream_bench.ENGINE_PYTHON = Path({str(ENGINE_PYTHON)!r})
        client = stream_bench.Client(Path({str(tmp_path / "client.log")!r}))
        print(client.proc.pid, flush=True)
        client.run({argv!r}, "key")
    """)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    client = int(benchmark.stdout.readline())
    try:
        # About 3,000 x 0.2 s / 2 = 5 minutes of load, once vLLM is imported and the prompts made.
        wait_for(lambda: len(CountingUpstream.seen) >= 6, 180, "the load to start")
        os.kill(benchmark.pid, signal.SIGKILL)
        benchmark.wait(10)
        killed = len(CountingUpstream.seen)
        time.sleep(3)
        after = len(CountingUpstream.seen)
        # At most the next request of each of its 2 concurrent streams was already on its way.
        assert after - killed <= 2, (killed, after)
        time.sleep(2)
        assert len(CountingUpstream.seen) == after, "still sending after its benchmark was killed"
        # Its job ends (the rest of its prompts not sent) and the process exits.
        wait_for(lambda: not psutil.pid_exists(client)
                 or psutil.Process(client).status() == psutil.STATUS_ZOMBIE, 60,
                 "the client process to exit")
    finally:
        if psutil.pid_exists(client):
            os.killpg(client, signal.SIGKILL)
        if benchmark.poll() is None:
            benchmark.kill()
