"""`gpu_bench.py` measures a point only once every bench engine is idle: a load left over from
an earlier run (on the GPU host, a client of a benchmark killed by its call's time limit sent
16 concurrent requests through the runs after it) would be measured with the point. The
engines here are HTTP servers on loopback answering /metrics with an H200 engine's real text
(`fixtures/engine_metrics_h200.txt`), its request gauges set as each case needs, to a caller
with the engine's key only (as a console engine answers: `vllm_plugins/console_auth.py`): no
GPU here."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from benchmarks import gpu_bench

METRICS = (Path(__file__).parent / "fixtures" / "engine_metrics_h200.txt").read_text()
RUNNING = 'vllm:num_requests_running{engine="0",model_name="llama2-7b-shape"} 0.0'
WAITING = 'vllm:num_requests_waiting{engine="0",model_name="llama2-7b-shape"} 0.0'


class Engine:
    """/metrics of one engine whose running and waiting gauges are `self.running` and
    `self.waiting`, each a list of values served one per read, the last one kept."""

    def __init__(self, running: list[float], waiting: list[float] | None = None) -> None:
        self.running, self.waiting = running, waiting or [0.0]
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                if self.headers.get("Authorization") != f"Bearer {engine.key}":
                    self.send_response(401)
                    self.end_headers()
                    return
                body = METRICS.replace(RUNNING, RUNNING[:-3] + str(engine.next("running")))
                body = body.replace(WAITING, WAITING[:-3] + str(engine.next("waiting")))
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.key = f"key-{self.server.server_address[1]}"
        self.pair = (self.url, self.key)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def next(self, gauge: str) -> float:
        values = getattr(self, gauge)
        return values.pop(0) if len(values) > 1 else values[0]


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(*args, **kwargs) -> Engine:
        made.append(Engine(*args, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.server.shutdown()


def test_the_gauges_are_read_from_a_real_engines_metrics():
    assert gpu_bench.EngineSampler.gauges(METRICS) == {
        "running": 0.0, "waiting": 0.0, "kv_usage": 0.0}


def test_idle_engines_pass_at_once_and_what_they_reported_is_returned(engines):
    a, b = engines([0.0]), engines([0.0])
    seen = gpu_bench.wait_idle({"fcfs-8k": a.pair, "fcfs-2k": b.pair}, seconds=5)
    assert seen["fcfs-8k"]["running"] == 0 and seen["fcfs-2k"]["waiting"] == 0


def test_a_point_waits_for_the_requests_still_running_to_end(engines):
    a = engines([0.0])
    b = engines([3.0, 1.0, 0.0], waiting=[2.0, 0.0])  # the last point's requests ending
    seen = gpu_bench.wait_idle({"fcfs-8k": a.pair, "fcfs-2k": b.pair}, seconds=20)
    assert seen["fcfs-2k"]["running"] == 0
    assert b.running == [0.0]  # it was read until it was idle


def test_an_engine_that_stays_busy_stops_the_benchmark_naming_it(engines):
    a, busy = engines([0.0]), engines([16.0])
    with pytest.raises(SystemExit) as stopped:
        gpu_bench.wait_idle({"fcfs-8k": busy.pair, "fcfs-2k": a.pair}, seconds=2)
    message = str(stopped.value)
    assert message.startswith("not measured") and "fcfs-8k" in message
    assert "'running': 16.0" in message and "fcfs-2k" not in message


def test_an_engine_that_does_not_answer_is_not_taken_for_idle(engines):
    a = engines([0.0])
    pair = a.pair
    a.server.shutdown()
    a.server.server_close()
    with pytest.raises(SystemExit, match="not measured"):
        gpu_bench.wait_idle({"fcfs-8k": pair}, seconds=1)


def test_an_engine_that_refuses_the_key_is_not_taken_for_idle(engines):
    a = engines([0.0])
    with pytest.raises(SystemExit, match="not measured") as stopped:
        gpu_bench.wait_idle({"fcfs-8k": (a.url, "not its key")}, seconds=1)
    assert "401" in str(stopped.value)
