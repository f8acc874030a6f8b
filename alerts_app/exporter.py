"""`/metrics`: the console's state and the gateway's traffic in Prometheus' text format.

Nothing is counted per request for this: the gateway's figures come from the all-time usage
rollup (`UsageTotal`), which the usage writer keeps with the other rollups from the usage
stream, so they are the same whichever uvicorn worker or gateway host served a request and
whichever console process is scraped. Counters are monotonic (the rollup only grows); an event
still in the stream counts at the writer's next batch (a few seconds). Each scrape is a handful
of queries: the totals (one row per tenant, model and deployment), deployments and instances,
the engines' latest samples, nodes and GPUs, GPU reservations, firing alerts, and the usage
stream's length and lag.

Labels are bounded: tenants by slug, models by a public name the console knows (base models and
adapters; anything else a client asked for counts under "other"), deployments and nodes by
name, engines by their ordinal in their deployment. Never key ids, request ids or user input.

The endpoint answers only `Authorization: Bearer <METRICS_SCRAPE_TOKEN>` (401 otherwise) and is
off (404) while that setting is empty.
"""

from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import redis
from django.conf import settings
from django.db.models import Count, Sum
from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from alerts_app.models import Alert
from serving_app.fleet.report import allocation
from serving_app.metering import health
from serving_app.models import BaseModel, Deployment, Gpu, Instance, LoraAdapter, Node
from serving_app.models.engine_metrics import EngineSample
from serving_app.models.usage import (
    LATENCY_BUCKETS_MS,
    LATENCY_FIELDS,
    TTFT_FIELDS,
    GuardrailTotal,
    UsageHour,
    UsageTotal,
)
from tenants_app.models import Tenant

PREFIX = "llm_console"
OTHER = "other"
# The histograms' buckets (ms): 1-2.5-5 per decade, 10 ms to 100 s, each a bound of the
# rollups' finer buckets, which add up to them exactly.
EXPORTED_BOUNDS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000)
_COUNTERS = ("requests", "errors", "server_errors", "rate_limited", "prompt_tokens",
             "completion_tokens", "latency_ms_total", "ttft_ms_total", "ttft_count")


def _cumulative(counts: list[float], total: float) -> list[tuple[str, float]]:
    """Prometheus buckets (`le`, cumulative count) from the rollups' per-bucket counts."""
    out = []
    running = 0.0
    exported = set(EXPORTED_BOUNDS)
    for bound, count in zip(LATENCY_BUCKETS_MS, counts, strict=True):
        running += count
        if bound in exported:
            out.append((floatToGoString(bound / 1000), running))
    out.append(("+Inf", total))
    return out


class ConsoleCollector:
    """Reads everything at collect time (one scrape: one read)."""

    def collect(self) -> Iterator[Metric]:
        yield from self._usage()
        yield from self._deployments()
        yield from self._engines()
        yield from self._nodes_and_gpus()
        yield from self._reservations()
        yield from self._alerts()
        yield from self._metering()

    def _usage(self) -> Iterator[Metric]:
        yield from self._per_tenant_and_model()
        yield from self._per_deployment()
        yield from self._budgets()
        yield from self._guardrails()

    def _guardrails(self) -> Iterator[Metric]:
        tenants = dict(Tenant.objects.values_list("pk", "slug"))
        findings = CounterMetricFamily(
            f"{PREFIX}_guardrail_findings",
            "Entities guardrails found, per direction (input, output), action (block, redact, "
            "detect) and category (PHONE, EMAIL, a tenant's own); never a value.",
            labels=["tenant", "direction", "action", "category"])
        rows = (GuardrailTotal.objects.order_by()
                .values_list("tenant_id", "direction", "action", "category")
                .annotate(Sum("count")))
        for tenant_id, direction, action, category, count in sorted(rows, key=str):
            slug = tenants.get(tenant_id)
            if slug is not None:  # a deleted tenant's history
                findings.add_metric([slug, direction, action, category], float(count or 0))
        yield findings

    def _per_deployment(self) -> Iterator[Metric]:
        names = dict(Deployment.objects.values_list("pk", "name"))
        requests = CounterMetricFamily(f"{PREFIX}_deployment_requests",
                                       "Requests routed to the deployment.",
                                       labels=["deployment"])
        failed = CounterMetricFamily(f"{PREFIX}_deployment_server_errors",
                                     "Requests to the deployment that failed on the serving "
                                     "side (5xx, engine errors).", labels=["deployment"])
        rows = (UsageTotal.objects.exclude(deployment_id=0).order_by()
                .values_list("deployment_id").annotate(Sum("requests"), Sum("server_errors")))
        for deployment_id, count, errors in rows:
            name = names.get(deployment_id)
            if name is not None:  # a deleted deployment's history
                requests.add_metric([name], float(count or 0))
                failed.add_metric([name], float(errors or 0))
        yield from (requests, failed)

    def _budgets(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(f"{PREFIX}_tenant_month_tokens",
                                 "Prompt plus completion tokens since the month began (UTC).",
                                 labels=["tenant"])
        budget = GaugeMetricFamily(f"{PREFIX}_tenant_monthly_token_budget",
                                   "The tenant's monthly token budget (tenants with one).",
                                   labels=["tenant"])
        month = UsageHour.objects.month_tokens(Tenant.objects.all())
        for tenant in Tenant.objects.only("slug", "monthly_token_budget"):
            used.add_metric([tenant.slug], month.get(tenant.pk, 0))
            if tenant.monthly_token_budget:
                budget.add_metric([tenant.slug], tenant.monthly_token_budget)
        yield from (used, budget)

    def _per_tenant_and_model(self) -> Iterator[Metric]:
        tenants = dict(Tenant.objects.values_list("pk", "slug"))
        known = set(BaseModel.objects.values_list("name", flat=True)) | set(
            LoraAdapter.objects.values_list("name", flat=True))
        rows = (UsageTotal.objects.order_by().values("tenant_id", "model")
                .annotate(*(Sum(c) for c in (*_COUNTERS, *LATENCY_FIELDS, *TTFT_FIELDS))))
        series: dict[tuple[str, str], list[float]] = {}
        names = [f"{c}__sum" for c in (*_COUNTERS, *LATENCY_FIELDS, *TTFT_FIELDS)]
        for row in rows:
            slug = tenants.get(row["tenant_id"])
            if slug is None:
                continue  # a deleted tenant's history
            key = (slug, row["model"] if row["model"] in known else OTHER)
            values = [float(row[n] or 0) for n in names]
            into = series.setdefault(key, [0.0] * len(names))
            for i, value in enumerate(values):
                into[i] += value
        labels = ["tenant", "model"]
        families = {
            c: CounterMetricFamily(f"{PREFIX}_{name}", text, labels=labels)
            for c, name, text in (
                ("requests", "requests", "Requests through the gateway."),
                ("errors", "request_errors", "Requests answered with a status of 400 or more."),
                ("server_errors", "server_errors",
                 "Requests that failed on the serving side (5xx, engine errors)."),
                ("rate_limited", "rate_limited", "Requests refused with 429."),
            )
        }
        tokens = CounterMetricFamily(f"{PREFIX}_tokens", "Tokens, prompt and completion.",
                                     labels=[*labels, "type"])
        latency = HistogramMetricFamily(f"{PREFIX}_request_duration_seconds",
                                        "Request latency at the gateway.", labels=labels)
        ttft = HistogramMetricFamily(f"{PREFIX}_time_to_first_token_seconds",
                                     "Time to the first token of streamed responses.",
                                     labels=labels)
        n = len(_COUNTERS)
        lat = slice(n, n + len(LATENCY_FIELDS))
        tt = slice(n + len(LATENCY_FIELDS), None)
        for (slug, model), values in sorted(series.items()):
            row = dict(zip(_COUNTERS, values[:n], strict=True))
            for counter, family in families.items():
                family.add_metric([slug, model], row[counter])
            tokens.add_metric([slug, model, "prompt"], row["prompt_tokens"])
            tokens.add_metric([slug, model, "completion"], row["completion_tokens"])
            latency.add_metric([slug, model], _cumulative(values[lat], row["requests"]),
                               row["latency_ms_total"] / 1000)
            ttft.add_metric([slug, model], _cumulative(values[tt], row["ttft_count"]),
                            row["ttft_ms_total"] / 1000)
        yield from families.values()
        yield from (tokens, latency, ttft)

    def _deployments(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily(f"{PREFIX}_deployment_replicas",
                                     "Instances a deployment asks for.", labels=["deployment"])
        running = GaugeMetricFamily(f"{PREFIX}_deployment_running",
                                    "1 if the deployment is to run.", labels=["deployment"])
        names = {}
        for d in Deployment.objects.only("name", "replicas", "desired_state"):
            names[d.pk] = d.name
            replicas.add_metric([d.name], d.replicas)
            running.add_metric([d.name], 1 if d.desired_state == "running" else 0)
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for deployment_id, state, count in (Instance.objects.order_by()
                                            .values_list("deployment_id", "state")
                                            .annotate(Count("id"))):
            counts[(names.get(deployment_id, str(deployment_id)), state)] += count
        instances = GaugeMetricFamily(f"{PREFIX}_instances", "Instances by state.",
                                      labels=["deployment", "state"])
        for name in names.values():
            for state in Instance.State.values:
                instances.add_metric([name, state], counts.get((name, state), 0))
        yield from (replicas, running, instances)

    def _engines(self) -> Iterator[Metric]:
        """Each running engine's latest sample (of the last few scrapes): what its own
        `/metrics` said at the node agent's last scrape."""
        labels = ["deployment", "instance"]
        families = {
            "requests_running": GaugeMetricFamily(
                f"{PREFIX}_engine_requests_running", "Requests the engine is running.",
                labels=labels),
            "requests_waiting": GaugeMetricFamily(
                f"{PREFIX}_engine_requests_waiting", "Requests waiting in the engine's queue.",
                labels=labels),
            "kv_cache_usage": GaugeMetricFamily(
                f"{PREFIX}_engine_kv_cache_usage_ratio", "The engine's KV-cache use, 0 to 1.",
                labels=labels),
            "ttft_p95_ms": GaugeMetricFamily(
                f"{PREFIX}_engine_time_to_first_token_p95_seconds",
                "p95 time to first token over the engine's last scrape interval.",
                labels=labels),
            "itl_p95_ms": GaugeMetricFamily(
                f"{PREFIX}_engine_inter_token_latency_p95_seconds",
                "p95 inter-token latency over the engine's last scrape interval.",
                labels=labels),
        }
        names = dict(Deployment.objects.values_list("pk", "name"))
        active = list(Instance.objects.active().values_list("pk", "deployment_id", "ordinal"))
        # The last few scrapes of every engine, newest first: the first seen is the latest.
        recent = timezone.now() - timedelta(seconds=max(
            300.0, 3 * settings.ENGINE_METRICS_INTERVAL_SECONDS))
        latest: dict[int, dict[str, Any]] = {}
        for row in (EngineSample.objects.filter(at__gte=recent,
                                                instance_id__in=[pk for pk, _, _ in active])
                    .order_by("-at").values("instance_id", *families)):
            latest.setdefault(row["instance_id"], row)
        for pk, deployment_id, ordinal in active:
            sample = latest.get(pk)
            if sample is None:
                continue
            label = [names.get(deployment_id, str(deployment_id)), str(ordinal)]
            for name, family in families.items():
                value = sample[name]
                if value is None:
                    continue
                family.add_metric(label, value / 1000 if name.endswith("_ms") else value)
        yield from families.values()

    def _nodes_and_gpus(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_node_up", "1 unless the node is lost.",
                               labels=["node", "state"])
        nodes = {}
        for node in Node.objects.all():
            nodes[node.pk] = node.name
            up.add_metric([node.name, node.state], 0 if node.state == "lost" else 1)
        util = GaugeMetricFamily(f"{PREFIX}_gpu_utilization_percent",
                                 "GPU utilisation at the last sample.", labels=["node", "gpu"])
        used = GaugeMetricFamily(f"{PREFIX}_gpu_memory_used_bytes", "GPU memory in use.",
                                 labels=["node", "gpu"])
        total = GaugeMetricFamily(f"{PREFIX}_gpu_memory_total_bytes", "GPU memory.",
                                  labels=["node", "gpu"])
        for gpu in Gpu.objects.filter(parent__isnull=True):
            labels = [nodes.get(gpu.node_id, str(gpu.node_id)), str(gpu.index)]
            total.add_metric(labels, gpu.memory_total_bytes)
            if gpu.utilization_percent is not None:
                util.add_metric(labels, gpu.utilization_percent)
            if gpu.memory_used_bytes is not None:
                used.add_metric(labels, gpu.memory_used_bytes)
        yield from (up, util, used, total)

    def _reservations(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(f"{PREFIX}_tenant_gpu_reserved_bytes",
                                   "GPU memory reserved by the tenants' deployments.",
                                   labels=["tenant"])
        per_tenant: dict[str, float] = defaultdict(float)
        for row in allocation():
            for part in row["by_tenant"]:
                if part["slug"]:
                    per_tenant[part["slug"]] += part["reserved_bytes"]
        for slug, size in sorted(per_tenant.items()):
            family.add_metric([slug], size)
        yield family

    def _alerts(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(f"{PREFIX}_alerts_firing", "Alerts firing, by severity.",
                                   labels=["severity"])
        counts = dict(Alert.objects.firing().order_by().values_list("rule__severity")
                      .annotate(Count("id")))
        for severity in ("info", "warning", "critical"):
            family.add_metric([severity], counts.get(severity, 0))
        yield family

    def _metering(self) -> Iterator[Metric]:
        client = redis.Redis.from_url(settings.GATEWAY["REDIS_URL"], socket_timeout=1.0,
                                      socket_connect_timeout=1.0)
        try:
            length, lag = health.metering_lag(client)
        except redis.RedisError:
            return
        finally:
            client.close()
        yield GaugeMetricFamily(f"{PREFIX}_usage_events_unwritten",
                                "Usage events in the stream not yet stored.", value=length)
        yield GaugeMetricFamily(f"{PREFIX}_metering_lag_seconds",
                                "Age of the oldest usage event not yet stored.", value=lag)


def _authorized(request: HttpRequest) -> bool:
    token = settings.METRICS_SCRAPE_TOKEN
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                             token.encode())


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    if not settings.METRICS_SCRAPE_TOKEN:
        raise Http404("metrics are off: set METRICS_SCRAPE_TOKEN")
    if not _authorized(request):
        response = HttpResponse("a scrape token is required\n", status=401,
                                content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConsoleCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)

