"""`/metrics`: Prometheus' text format (parsed back with prometheus_client's own parser), the
tenant and model labels, bounded label values, and the scrape token."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from alerts_app.exporter import EXPORTED_BOUNDS
from alerts_app.models import Alert
from gateway_app.writer import persist
from serving_app.models import Instance, Node
from serving_app.models.usage import LATENCY_BUCKETS_MS, GuardrailMinute
from tests.alerts.conftest import make_rule, traffic
from tests.factories import make_engine_sample

pytestmark = pytest.mark.django_db
TOKEN = "scrape-me-please"


def scrape(client: Client | None = None, token: str | None = TOKEN) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = (client or Client()).get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture(autouse=True)
def _token(settings):
    settings.METRICS_SCRAPE_TOKEN = TOKEN


def test_counters_and_histograms_per_tenant_and_model(served):
    acme, globex, deployment = served  # base model "llama-mini" (tests.factories)
    now = timezone.now()
    traffic(acme, now - timedelta(hours=3), n=30, latency=120, ttft=40, model="llama-mini",
            deployment=deployment.pk)
    traffic(acme, now, n=5, latency=900, status=502, model="llama-mini",
            deployment=deployment.pk)
    traffic(acme, now, n=4, latency=1, status=429, model="llama-mini")
    traffic(globex, now, n=7, latency=2000, model="llama-mini", deployment=deployment.pk)
    traffic(globex, now, n=3, latency=5, status=404, model="no-such-model-x1")
    samples = scrape()
    acme_llama = {"tenant": "acme-co", "model": "llama-mini"}
    assert value(samples, "llm_console_requests_total", **acme_llama) == 39
    assert value(samples, "llm_console_server_errors_total", **acme_llama) == 5
    assert value(samples, "llm_console_rate_limited_total", **acme_llama) == 4
    assert value(samples, "llm_console_request_errors_total", **acme_llama) == 9
    assert value(samples, "llm_console_tokens_total", type="prompt", **acme_llama) == 390
    assert value(samples, "llm_console_tokens_total", type="completion", **acme_llama) == 195
    duration = "llm_console_request_duration_seconds"
    assert value(samples, f"{duration}_bucket", le="0.1", **acme_llama) == 4
    assert value(samples, f"{duration}_bucket", le="0.25", **acme_llama) == 34
    assert value(samples, f"{duration}_bucket", le="0.5", **acme_llama) == 34
    assert value(samples, f"{duration}_bucket", le="1.0", **acme_llama) == 39
    assert value(samples, f"{duration}_bucket", le="+Inf", **acme_llama) == 39
    assert value(samples, f"{duration}_count", **acme_llama) == 39
    assert value(samples, f"{duration}_sum", **acme_llama) == pytest.approx(
        (30 * 120 + 5 * 900 + 4 * 1) / 1000)
    assert value(samples, "llm_console_time_to_first_token_seconds_count", **acme_llama) == 30
    # A model name nobody serves is not a label value of its own.
    assert value(samples, "llm_console_requests_total", tenant="globex-co", model="other") == 3
    assert not any("no-such-model" in str(key) for key in samples)
    assert not any("key" in dict(labels) or "request_id" in dict(labels)
                   for _, labels in samples)


def test_state_of_deployments_instances_engines_nodes_and_alerts(served):
    _, _, deployment = served
    node = Node.objects.create(name="cpu-a", queue="node.cpu-a", last_heartbeat=timezone.now())
    ready = Instance.objects.create(deployment=deployment, node=node, state="ready")
    make_engine_sample(ready, timezone.now() - timedelta(seconds=30), requests_waiting=9)
    make_engine_sample(ready, timezone.now(), requests_waiting=3, requests_running=7,
                       kv_cache_usage=0.25, ttft_p95_ms=120.0)
    Instance.objects.create(deployment=deployment, node=node, ordinal=1, state="crash_loop")
    rule = make_rule(metric="crash_loop", scope="deployment", threshold=0, severity="critical")
    Alert.objects.create(rule=rule, scope_key="deployment:1", scope_label="d", state="firing")
    samples = scrape()
    assert value(samples, "llm_console_instances", deployment="llama", state="ready") == 1
    assert value(samples, "llm_console_instances", deployment="llama", state="crash_loop") == 1
    assert value(samples, "llm_console_instances", deployment="llama", state="starting") == 0
    assert value(samples, "llm_console_deployment_running", deployment="llama") == 1
    assert value(samples, "llm_console_node_up", node="cpu-a", state="ready") == 1
    assert value(samples, "llm_console_alerts_firing", severity="critical") == 1
    engine = {"deployment": "llama", "instance": "0"}
    assert value(samples, "llm_console_engine_requests_waiting", **engine) == 3  # the latest
    assert value(samples, "llm_console_engine_requests_running", **engine) == 7
    assert value(samples, "llm_console_engine_kv_cache_usage_ratio", **engine) == 0.25
    assert value(samples, "llm_console_engine_time_to_first_token_p95_seconds",
                 **engine) == pytest.approx(0.12)


def test_a_scrape_without_the_token_is_refused(settings):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        response = Client().get("/metrics", headers=headers)
        assert response.status_code == 401 and b"llm_console" not in response.content
    settings.METRICS_SCRAPE_TOKEN = ""
    assert Client().get("/metrics", headers={"Authorization": "Bearer "}).status_code == 404


def test_the_exported_histogram_bounds_are_rollup_bounds():
    """Each exported bucket is a sum of the rollups' buckets, exactly."""
    assert set(EXPORTED_BOUNDS) <= set(LATENCY_BUCKETS_MS)


def test_per_deployment_failures_and_budgets(served):
    acme, _, deployment = served  # acme's budget: 1000 tokens
    traffic(acme, timezone.now(), n=8, status=503, model="llama-mini", deployment=deployment.pk)
    traffic(acme, timezone.now(), n=2, model="llama-mini", deployment=deployment.pk)
    samples = scrape()
    assert value(samples, "llm_console_deployment_requests_total", deployment="llama") == 10
    assert value(samples, "llm_console_deployment_server_errors_total", deployment="llama") == 8
    assert value(samples, "llm_console_tenant_month_tokens", tenant="acme-co") == 150
    assert value(samples, "llm_console_tenant_monthly_token_budget", tenant="acme-co") == 1000


def test_the_deploy_rules_and_dashboard_use_only_exported_metrics(served, gpu):
    """deploy/prometheus-rules.yml and deploy/grafana-dashboard.json name metrics this endpoint
    exports (a renamed metric would leave them silently empty)."""
    acme, _, deployment = served
    gpu.utilization_percent, gpu.memory_used_bytes = 50.0, 2**30
    gpu.save()
    instance = Instance.objects.create(deployment=deployment, node=gpu.node, state="ready",
                                       gpu_memory_fraction=0.5)
    instance.gpus.add(gpu)
    make_engine_sample(instance, timezone.now(), requests_waiting=1, kv_cache_usage=0.5)
    Node.objects.create(name="lost-one", queue="node.lost-one")
    traffic(acme, timezone.now(), n=2, model="llama-mini", deployment=deployment.pk, ttft=20)
    exported = {name for name, _ in scrape()}
    root = Path(__file__).resolve().parents[2] / "deploy"
    rules = yaml.safe_load((root / "prometheus-rules.yml").read_text())
    expressions = [r["expr"] for group in rules["groups"] for r in group["rules"]]
    dashboard = json.loads((root / "grafana-dashboard.json").read_text())
    expressions += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = {m for e in expressions for m in re.findall(r"llm_console_[a-z_]+", e)}
    assert named and named <= exported, named - exported
    samples = scrape()
    assert value(samples, "llm_console_tenant_gpu_reserved_bytes", tenant="acme-co") > 0


def test_guardrail_findings_are_a_counter_per_tenant_and_category(served):
    """The all-time guardrail rollup as `llm_console_guardrail_findings_total`: it sums every
    batch of events and keeps counting after minute rows are gone."""
    acme, globex, _ = served
    now = timezone.now()
    for i, (tenant, counts) in enumerate((
            (acme, {"input:block:SECRET": 1}),
            (acme, {"input:block:SECRET": 1, "output:redact:PHONE": 3}),
            (globex, {"input:detect:EMAIL": 2}))):
        persist([{"id": f"gr-{i}", "at": now.timestamp(), "tenant": tenant.pk,
                  "endpoint": "chat.completions", "model": "llama-mini", "status": 200,
                  "guardrails": counts}])
    GuardrailMinute.objects.all().delete()
    samples = scrape()
    name = "llm_console_guardrail_findings_total"
    assert value(samples, name, tenant="acme-co", direction="input", action="block",
                 category="SECRET") == 2
    assert value(samples, name, tenant="acme-co", direction="output", action="redact",
                 category="PHONE") == 3
    assert value(samples, name, tenant="globex-co", direction="input", action="detect",
                 category="EMAIL") == 2
    assert not [k for k in samples if k[0] == name and ("tenant", "globex-co") in k[1]
                and ("action", "block") in k[1]]
