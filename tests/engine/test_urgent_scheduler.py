"""The console's vLLM scheduler plugin (`vllm_plugins/console_scheduler.py`, issue 45) in the
real CPU engine: loaded with `--scheduler-cls`, it preempts the low-priority requests beyond its
cap when an urgent request arrives, and they resume and finish once it is done.

A private engine (the shared one runs without the plugin), the urgent priority 0: three long
requests of priority 5 and one of priority 3 fill its four slots, and nothing is preempted (the
priority-3 request is better than the others but not urgent: on a GPU a middle tier taken for
urgent capped the flood the whole run, docs/gpu.md); a request of priority 0 then arrives. With
a cap of 1, three are preempted (the engine's own counter and the plugin's log line say so), the
urgent request is served, and every request gets all of its tokens.
"""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from benchmarks.gateway_bench import free_port, kill_group
from serving_app.engine.client import engine_http
from serving_app.engine.launch import CPU_IDLE_PREFIX, tls_arguments
from tests import engine_slots
from tests.engines import ENGINE_PYTHON, MODELS, ROOT, Engine, engine_installed, wait_until

pytestmark = [pytest.mark.engine]
SECRET = "urgent-scheduler-secret"
# Long enough that the flood still runs when the urgent request arrives, on an idle machine too
# (400 tokens each ended within two seconds once, before it came).
LONG, SHORT = 2000, 16


@pytest.fixture(scope="module")
def urgent_engine(tmp_path_factory):
    if not engine_installed():
        pytest.skip("engine environment not installed (scripts/setup_engine.sh)")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", VLLM_API_KEY=SECRET,
               VLLM_ENABLE_V1_MULTIPROCESSING="0",  # as the shared engine's (tests/engines.py)
               PYTHONPATH=str(ROOT / "vllm_plugins"), LLM_CONSOLE_URGENT_BATCH_CAP="1",
               LLM_CONSOLE_URGENT_PRIORITY="0")
    log = tmp_path_factory.mktemp("urgent") / "engine.log"
    with engine_slots.slots().holding(1, "the urgent scheduler's engine"):
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*CPU_IDLE_PREFIX, str(ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(MODELS / "tiny-llama"), "--served-model-name", "tiny-llama",
                 "--dtype", "float32", "--scheduling-policy", "priority", "--max-num-seqs", "4",
                 "--scheduler-cls", "console_scheduler.UrgentBatchCapScheduler",
                 "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
                 "--max-model-len", "2048", *tls_arguments()],
                env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            wait_until(lambda: engine_http().get(f"{Engine(port, '').url}/health",
                                                 timeout=2).status_code == 200,
                       300, "engine start", proc)
            yield Engine(port, SECRET), log
        finally:
            kill_group(proc)


def ask(engine: Engine, priority: int, max_tokens: int) -> dict:
    resp = engine_http().post(f"{engine.url}/v1/completions", timeout=600,
                              headers={"authorization": f"Bearer {engine.secret}"},
                              json={"model": "tiny-llama", "prompt": "Tell me a long story",
                                    "max_tokens": max_tokens, "ignore_eos": True,
                                    "temperature": 0, "priority": priority})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_an_urgent_request_preempts_the_others_beyond_the_cap_and_they_resume(urgent_engine):
    server, log = urgent_engine
    answers: list[dict] = []
    flood = [threading.Thread(target=lambda p=priority: answers.append(ask(server, p, LONG)))
             for priority in (5, 5, 5, 3)]
    for thread in flood:
        thread.start()
    wait_until(lambda: server.metric("vllm:num_requests_running") == 4, 120,
               "four requests of priorities 5 and 3 running")
    assert server.metrics().get("vllm:num_preemptions_total", 0) == 0
    assert "urgent requests" not in log.read_text(errors="replace")
    urgent = ask(server, 0, SHORT)
    for thread in flood:
        thread.join(600)
    assert urgent["usage"]["completion_tokens"] == SHORT
    assert [a["usage"]["completion_tokens"] for a in answers] == [LONG] * 4
    assert server.metric("vllm:num_preemptions_total") >= 3
    text = log.read_text(errors="replace")
    assert "console scheduler: preempted 3 request(s) of lower priority" in text
    assert "no urgent request left" in text
