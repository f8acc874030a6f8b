"""Dashboard data for the browser tests: a day of per-minute rollups and a month of hourly
ones for a few tenants and models (as the usage writer would leave them), GPUs with
reservations, and GPU samples."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

from django.utils import timezone

from serving_app.models import Deployment, Gpu, GpuSample, Instance, Node
from serving_app.models.usage import LATENCY_BUCKETS_MS, UsageHour, UsageMinute
from tests.factories import make_adapter, make_deployment, make_tenant

GIB = 2**30
MODELS = ("llama-mini", "support-style")


def dashboard_scene(base_model, root: Path) -> list:
    """Three tenants (objectives, budgets), a shared deployment with an adapter and one of its
    own, a day of minute rollups and a month of hourly ones, two GPUs with samples."""
    tenants = [
        make_tenant("support", name="Customer Service", latency_objective_ms=900,
                    monthly_token_budget=400_000_000, tokens_per_minute=2_000_000),
        make_tenant("codegen", name="Code Assistant", latency_objective_ms=1500,
                    monthly_token_budget=150_000_000, tokens_per_minute=2_000_000),
        make_tenant("content", name="Content Generation", latency_objective_ms=2500),
    ]
    adapter = make_adapter(tenants[0], base_model, root / "a", name="support-style")
    deployments = [
        make_deployment(base_model, tenants[:2], name="shared-chat", adapters=[adapter],
                        desired_state="running"),
        make_deployment(base_model, [tenants[2]], name="content-writer", desired_state="running"),
    ]
    seed_usage(tenants)
    seed_gpus(deployments)
    return tenants


def _counters(rng: random.Random, requests: int, typical_ms: float) -> dict:
    """Rollup counters for `requests` requests, from a sample of at most 20 latencies (scaled
    up), so a month of data is generated in well under a second."""
    row = {"requests": requests, "errors": 0, "rate_limited": 0, "prompt_tokens": 0,
           "completion_tokens": 0, "latency_ms_total": 0.0, "latency_ms_max": 0.0,
           "ttft_ms_total": 0.0, "ttft_count": requests}
    for bound in LATENCY_BUCKETS_MS:
        row[f"latency_le_{bound}"] = 0
    sample = min(requests, 20)
    if not sample:
        return row
    scale = requests / sample
    counted = 0
    for i in range(sample):
        latency = rng.lognormvariate(math.log(typical_ms), 0.5)
        row["latency_ms_max"] = max(row["latency_ms_max"], latency)
        share = round(scale * (i + 1)) - counted
        counted += share
        row["latency_ms_total"] += latency * share
        for bound in LATENCY_BUCKETS_MS:
            if latency <= bound:
                row[f"latency_le_{bound}"] += share
                break
    row["ttft_ms_total"] = row["latency_ms_total"] * 0.25
    row["prompt_tokens"] = int(requests * rng.uniform(150, 250))
    row["completion_tokens"] = int(requests * rng.uniform(80, 120))
    row["errors"] = min(requests, int(requests * rng.uniform(0, 0.04) + rng.random() * 1.2))
    row["rate_limited"] = row["errors"] // 2
    return row


def seed_usage(tenants: list, seed: int = 7) -> None:
    rng = random.Random(seed)
    now = timezone.now()
    start_minute = (now - timedelta(hours=24)).replace(second=0, microsecond=0)
    minutes = []
    hours: dict[tuple, dict] = defaultdict(lambda: defaultdict(float))
    for n, tenant in enumerate(tenants):
        typical = 250 + 200 * n
        for m in range(24 * 60):
            bucket = start_minute + timedelta(minutes=m)
            wave = 1 + math.sin((bucket.hour + n * 3) / 24 * 2 * math.pi)
            for model in MODELS[: 1 + (n % 2)]:
                requests = max(0, int(rng.gauss(2 + 3 * wave * (3 - n), 1)))
                if not requests:
                    continue
                row = _counters(rng, requests, typical)
                minutes.append(UsageMinute(bucket=bucket, tenant=tenant, model=model, **row))
                hour = hours[(bucket.replace(minute=0), tenant.pk, model)]
                for key, value in row.items():
                    hour[key] = max(hour[key], value) if key == "latency_ms_max" else \
                        hour[key] + value
        first_hour = start_minute.replace(minute=0)
        for h in range(1, 30 * 24):
            bucket = first_hour - timedelta(hours=h)
            requests = max(0, int(rng.gauss(200 * (3 - n), 40)))
            row = _counters(rng, requests, typical)
            hours[(bucket, tenant.pk, MODELS[0])] = row
    UsageMinute.objects.bulk_create(minutes, batch_size=2000)
    UsageHour.objects.bulk_create(
        [UsageHour(bucket=b, tenant_id=t, model=m, **{k: v for k, v in row.items()})
         for (b, t, m), row in hours.items()],
        batch_size=2000,
    )


def seed_gpus(deployments: list[Deployment], seed: int = 3) -> Node:
    """One GPU node with two H200s; each deployment holds part of one, with samples."""
    rng = random.Random(seed)
    now = timezone.now()
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a", address="10.0.0.5",
                               inventory_source="nvml", last_heartbeat=now)
    gpus = [
        Gpu.objects.create(node=node, index=i, uuid=f"GPU-{i:04d}", name="NVIDIA H200",
                           memory_total_bytes=141 * GIB, memory_used_bytes=(40 + 30 * i) * GIB,
                           utilization_percent=35.0 + 20 * i)
        for i in range(2)
    ]
    # One inventory report: rows older than the node's newest count as no longer reported.
    Gpu.objects.filter(node=node).update(updated_at=now)
    for n, deployment in enumerate(deployments):
        instance = Instance.objects.create(deployment=deployment, ordinal=0, node=node,
                                           state=Instance.State.READY, port=18300 + n,
                                           gpu_memory_fraction=0.3 + 0.1 * n)
        instance.gpus.set([gpus[n % 2]])
    samples = []
    for gpu in gpus:
        for m in range(0, 24 * 60, 2):
            at = now - timedelta(minutes=m)
            util = max(0.0, min(100.0, 40 + 30 * math.sin(m / 90 + gpu.index) + rng.gauss(0, 5)))
            samples.append(GpuSample(gpu=gpu, at=at, utilization_percent=util,
                                     memory_used_bytes=int((45 + 25 * gpu.index + util / 10)
                                                           * GIB)))
    GpuSample.objects.bulk_create(samples, batch_size=2000)
    return node
