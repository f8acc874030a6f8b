"""Engine metrics end to end: the real CPU vLLM engine (the session's shared one, registered as
the ready instance of a deployment on node "local") is scraped as its node agent scrapes it, and
what is stored matches what the engine's own /metrics said at that moment; the API answers the
samples and the deployment page draws them.

Each scrape is bracketed by two reads of the engine's /metrics (summed line by line here, not
with the agent's parser): a gauge the scrape read lies between them, a counter too, and where
the two reads agree the sample holds exactly their value. At rest (no request in flight) both
reads agree on everything, so the last sample is checked exactly, and the increases of the
samples add up to the tokens the engine reported in its own responses.
"""

from __future__ import annotations

import json
import threading

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from serving_app.engine import scrape
from serving_app.engine.client import engine_http
from serving_app.models import BaseModel, EngineSample, Instance, Node
from tests.api.helpers import as_user
from tests.browser.conftest import shot, sign_in
from tests.engines import MODELS, wait_until
from tests.factories import make_deployment, make_tenant, make_user

pytestmark = pytest.mark.django_db(transaction=True)

GAUGES = {"requests_running": "vllm:num_requests_running",
          "requests_waiting": "vllm:num_requests_waiting"}
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total",
            "generation_tokens": "vllm:generation_tokens_total",
            "preemptions": "vllm:num_preemptions_total",
            "prefix_cache_queries": "vllm:prefix_cache_queries_total",
            "prefix_cache_hits": "vllm:prefix_cache_hits_total"}


def bracketed_scrape(engine):
    before = engine.metrics()
    [sample] = scrape.scrape_node("local")
    after = engine.metrics()
    for field, name in {**GAUGES, **{f"{k}_total": v for k, v in COUNTERS.items()}}.items():
        low, high = sorted((before[name], after[name]))
        assert low <= getattr(sample, field) <= high, (field, before[name], after[name])
    return before, sample, after


def idle(metrics: dict[str, float]) -> bool:
    return metrics[GAUGES["requests_running"]] == metrics[GAUGES["requests_waiting"]] == 0


def complete(engine, prompt: str, max_tokens: int, usage: list[dict], stream: bool = False,
             started: threading.Event | None = None):
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}
    headers = {"Authorization": f"Bearer {engine.secret}"}
    if not stream:
        reply = engine_http().post(engine.url + "/v1/completions", json=body, headers=headers,
                           timeout=120)
        usage.append(reply.raise_for_status().json()["usage"])
        return
    body["stream_options"] = {"include_usage": True}
    with engine_http().stream("POST", engine.url + "/v1/completions", json=body, headers=headers,
                      timeout=120) as reply:
        for line in reply.raise_for_status().iter_lines():
            if line.startswith("data: {"):
                if started is not None:
                    started.set()  # the first token is out: its prompt was processed
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage.append(chunk["usage"])


def test_samples_match_the_engines_own_metrics_and_are_drawn(page, engine, transactional_db):
    admin = make_user("root-admin", staff=True)
    tiny = BaseModel(name="tiny-llama", path=str(MODELS / "tiny-llama"))
    tiny.full_clean()
    tiny.save()
    deployment = make_deployment(tiny, [make_tenant("acme")], name="metrics-chat",
                                 desired_state="running", max_model_len=1024)
    node = Node.objects.create(name="local", queue="node.local", address="127.0.0.1",
                               last_heartbeat=timezone.now())
    instance = Instance.objects.create(deployment=deployment, node=node, port=engine.port,
                                       state="ready", secret=engine.secret)

    # The engine is shared by the session: whatever an earlier test left running must be done
    # before the first reading, or its tokens would be counted here.
    wait_until(lambda: idle(engine.metrics()), 180, "the engine idle before the test")
    _, first, _ = bracketed_scrape(engine)
    assert first.interval_seconds is None  # the engine's first reading: no increases yet

    usage: list[dict] = []
    for n in range(3):
        complete(engine, f"metrics test {n}: tell a story", 8, usage)
    failures: list[Exception] = []
    started = [threading.Event() for _ in range(2)]

    def long_stream(n: int) -> None:
        try:
            complete(engine, f"a long story {n}", 900, usage, stream=True, started=started[n])
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            failures.append(exc)

    streams = [threading.Thread(target=long_stream, args=(n,)) for n in range(2)]
    for stream in streams:
        stream.start()
    try:
        # Both streams have their first token: a scrape now reads an engine that has seen all
        # five prompts. Whether they still run by then is the bracketing reads' to check: the
        # tiny model can finish them within a second, and the engine's running gauge may not
        # show them in between.
        wait_until(lambda: all(e.is_set() for e in started) or failures, 60,
                   "both streams started")
        before, busy, after = bracketed_scrape(engine)
    finally:
        for stream in streams:
            stream.join(120)
    assert failures == []
    assert busy.interval_seconds > 0
    assert before["vllm:prompt_tokens_total"] == busy.prompt_tokens_total
    assert sum(count for _, _, count in busy.ttft_buckets) == 5
    assert busy.ttft_p50_ms is not None and busy.itl_p95_ms is not None
    assert busy.requests_waiting == 0

    wait_until(lambda: idle(engine.metrics()), 120, "the engine idle")
    before, last, after = bracketed_scrape(engine)
    # At rest the two reads agree, so the sample holds exactly their values.
    checked = [*GAUGES.values(), *COUNTERS.values(), "vllm:kv_cache_usage_perc"]
    assert [before[name] for name in checked] == [after[name] for name in checked]
    assert (last.requests_running, last.requests_waiting) == (0, 0)
    for field, name in COUNTERS.items():
        assert getattr(last, f"{field}_total") == after[name], field
    assert last.kv_cache_usage == after["vllm:kv_cache_usage_perc"]
    # The increases of the samples after the first add up to what the engine counted for the
    # requests it answered, and each request's first token is in one interval's histogram.
    samples = list(EngineSample.objects.filter(instance=instance).order_by("at"))
    assert samples[0].pk == first.pk and samples[-1].pk == last.pk
    later = samples[1:]
    assert len(later) == 2 and len(usage) == 5
    assert sum(s.prompt_tokens for s in later) == sum(u["prompt_tokens"] for u in usage)
    assert sum(s.generation_tokens for s in later) == sum(
        u["completion_tokens"] for u in usage)
    assert sum(count for s in later for _, _, count in s.ttft_buckets) == len(usage)

    api = as_user(admin).get(f"/api/v1/deployments/{deployment.pk}/metrics/").json()
    assert [s["prompt_tokens_total"] for s in api["samples"]] == [
        s.prompt_tokens_total for s in samples]
    assert api["samples"][samples.index(busy)]["requests_running"] == busy.requests_running
    assert api["samples"][-1]["generation_tokens_total"] == after["vllm:generation_tokens_total"]

    sign_in(page, "root-admin")
    page.goto(f"/deployments/{deployment.pk}/?range=15m")
    for chart in ("queue", "kv_cache", "latency", "tokens"):
        expect(page.locator(f"#chart-{chart}")).to_have_attribute("data-rendered", "1")
        assert page.locator(f"#chart-{chart} .main-svg").count() >= 1
    # The queue chart may be all zeros (see above); the others have the requests' figures.
    for chart in ("latency", "tokens"):
        assert int(page.locator(f"#chart-{chart}").get_attribute("data-points")) > 0, chart
    expect(page.locator("#dashboard-tables table")).to_contain_text("#0")
    shot(page, "deployment-engine-metrics")
    page.goto(f"/instances/{instance.pk}/")
    expect(page.locator("#chart-tokens")).to_have_attribute("data-rendered", "1")
    assert page.js_errors == []
