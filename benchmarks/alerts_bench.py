"""Alert evaluation benchmark: 1,000 rules over 30 days of rollups for 100 tenants, per beat.

    .venv/bin/python benchmarks/alerts_bench.py [--rounds 7] [--reuse]

Creates (or reuses, with --reuse) a scratch PostgreSQL database (`console_alertbench` on the
server of DATABASE_URL), migrates it and fills it inside PostgreSQL (generate_series): 100
tenants with budgets and latency objectives, 3 models each on 10 deployments, 8 GPU nodes of 8
GPUs; 30 days of hour rollups (every hour of every tenant and model), 30 days of minute rollups
(one minute in ten), a day of ten-second rollups (one bucket in four: what the default retention
keeps) and a day of GPU samples every 10 s. Latency, TTFT and failures differ per tenant and
model, so some rules fire. Then 1,000 rules: 9 per tenant (latency and TTFT percentiles over
1 to 60 minutes, failure and 429 rates, per tenant and per model, budgets at 80% and 100%) and
100 platform ones (GPU utilisation and memory per node, failures and latency per deployment,
the cluster, crash loops, lost nodes, the metering lag).

It times evaluation rounds exactly as beat runs them (`alerts_app.evaluate.evaluate()`: read,
judge, write the changes and the notifications, in one transaction; the first round creates
the alerts, the next ones are the steady state) against a baseline in the same run: reading the
rollups once, the data a round needs without any rule (the month of hour rollups per tenant for
the budgets and the last hour of ten-second rollups per tenant, model and deployment). Target:
under 1 s per round. Notifications are created and queued as in a worker, to Celery's in-memory
broker: nothing leaves the process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.dashboard_bench import database_url, ensure_database  # noqa: E402

TENANTS = 100
MODELS = ("llama-8b", "llama-70b", "qwen-7b")
DEPLOYMENTS = 10
NODES, GPUS = 8, 8
DAYS = 30


def setup(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ["CELERY_BROKER_URL"] = "memory://localhost/"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ.setdefault("DEBUG", "true")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _histogram_columns(fields: tuple[str, ...], index: str, count: str) -> list[str]:
    """SQL putting 70% of `count` in bucket `index` and 30% in the next one."""
    out = []
    for i, _ in enumerate(fields):
        out.append(f"CASE WHEN {index} = {i} THEN ({count} * 7) / 10 "
                   f"WHEN {index} + 1 = {i} THEN {count} - ({count} * 7) / 10 ELSE 0 END")
    return out


def generate() -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction
    from django.utils import timezone

    from alerts_app.models import Alert, AlertRule, AlertTransition, Channel, Notification
    from serving_app.models import BaseModel, Deployment, Gpu, GpuSample, Node
    from serving_app.models.usage import (
        LATENCY_FIELDS,
        TTFT_FIELDS,
        UsageHour,
        UsageMinute,
        UsageTenSecond,
        bucket_index,
    )
    from tenants_app.models import Tenant

    started = time.perf_counter()

    def say(what: str) -> None:
        print(f"  {what}  ({time.perf_counter() - started:5.1f} s)", flush=True)

    for model in (Notification, AlertTransition, Alert, AlertRule, Channel):
        model.objects.all().delete()
    with connection.cursor() as cur:
        for model in (UsageHour, UsageMinute, UsageTenSecond, GpuSample):
            cur.execute(f"TRUNCATE {model._meta.db_table}")
    Deployment.objects.filter(name__startswith="bench-").delete()
    Tenant.objects.filter(slug__startswith="bench-").delete()
    Node.objects.filter(name__startswith="bench-").delete()
    BaseModel.objects.filter(name__startswith="bench-").delete()
    get_user_model().objects.filter(username="bench-admin").delete()

    with transaction.atomic():
        tenants = [Tenant.objects.create(
            slug=f"bench-{i}", name=f"Bench {i}",
            # One tenant in ten is past 80% of its budget, whatever day of the month it is.
            monthly_token_budget=2_000_000_000 if i % 10 else 10_000_000 + i,
            latency_objective_ms=400 + 10 * i) for i in range(TENANTS)]
        base = BaseModel.objects.create(name="bench-base", path="/nonexistent")
        deployments = [Deployment.objects.create(name=f"bench-{d}", base_model=base,
                                                 desired_state="running")
                       for d in range(DEPLOYMENTS)]
        nodes = [Node.objects.create(name=f"bench-node-{n}", queue=f"node.bench-node-{n}",
                                     last_heartbeat=timezone.now()) for n in range(NODES)]
        gpus = [Gpu.objects.create(node=node, index=g, uuid=f"BENCH-{node.pk}-{g}",
                                   name="NVIDIA H200", memory_total_bytes=141 * 2**30)
                for node in nodes for g in range(GPUS)]
        Channel.objects.create(name="bench ops", kind="webhook", url="https://example.com/ops",
                               min_severity="critical")
        for tenant in tenants[:10]:
            Channel.objects.create(tenant=tenant, name="hook", kind="webhook",
                                   url="https://example.com/t")
    with connection.cursor() as cur:
        cur.execute("CREATE TEMP TABLE bench_tm (tenant_id bigint, model text, deployment_id "
                    "bigint, lb int, tb int, fail int)")
        rows = []
        for i, tenant in enumerate(tenants):
            for m, model in enumerate(MODELS):
                latency = 150 + (i % 10) * 45 + m * 60  # some tenants above their objective
                rows.append((tenant.pk, model, deployments[(i + m) % DEPLOYMENTS].pk,
                             bucket_index(latency), bucket_index(latency / 4),
                             8 if i % 17 == 0 else 1))  # percent of 5xx
        cur.executemany("INSERT INTO bench_tm VALUES (%s, %s, %s, %s, %s, %s)", rows)
        cur.execute("SET synchronous_commit = off")
    columns = ", ".join((*LATENCY_FIELDS, *TTFT_FIELDS))
    hist = ", ".join((*_histogram_columns(LATENCY_FIELDS, "lb", "n"),
                      *_histogram_columns(TTFT_FIELDS, "tb", "n")))
    plans = (
        (UsageHour, "1 hour", f"{DAYS} days", 1.0, 1500),
        (UsageMinute, "1 minute", f"{DAYS} days", 0.1, 40),
        (UsageTenSecond, "10 seconds", "1 day", 0.25, 8),
    )
    for rollup, step, span, density, per_bucket in plans:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(f"""
                INSERT INTO {rollup._meta.db_table} (bucket, tenant_id, model, deployment_id,
                    requests, errors, server_errors, rate_limited, prompt_tokens,
                    completion_tokens, latency_ms_total, latency_ms_max, ttft_ms_total,
                    ttft_ms_max, ttft_count, {columns})
                SELECT b, tenant_id, model, deployment_id, n, (n * fail) / 100 + n / 50,
                       (n * fail) / 100, n / 50, n * 300, n * 120, n * 400.0, 4000.0,
                       n * 90.0, 900.0, n, {hist}
                FROM (
                    SELECT date_trunc('second', b) AS b, tm.*,
                           ({per_bucket} + floor(random() * {per_bucket}))::int AS n
                    FROM generate_series(now() - interval '{span}', now(),
                                         interval '{step}') AS b, bench_tm tm
                    WHERE random() < {density}
                ) AS s
                ON CONFLICT DO NOTHING
            """)
            cur.execute(f"SELECT count(*) FROM {rollup._meta.db_table}")
            say(f"{rollup._meta.model_name}: {cur.fetchone()[0]:,} rows")
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"""
            INSERT INTO {GpuSample._meta.db_table} (gpu_id, at, memory_used_bytes,
                utilization_percent)
            SELECT gpu, now() - s * interval '10 seconds', (60 + random() * 70)::bigint << 30,
                   CASE WHEN gpu %% 5 = 0 THEN 92 + random() * 8 ELSE random() * 80 END
            FROM unnest(%s::bigint[]) AS gpu, generate_series(0, 8639) AS s
        """, [[g.pk for g in gpus]])
        cur.execute(f"SELECT count(*) FROM {GpuSample._meta.db_table}")
        say(f"GPU samples: {cur.fetchone()[0]:,} rows")
        cur.execute("ANALYZE")
    make_rules(tenants, deployments, nodes)
    say(f"{AlertRule.objects.count()} rules")


def make_rules(tenants: list, deployments: list, nodes: list) -> None:
    from alerts_app.models import AlertRule

    own = [
        ("latency", "tenant", 500, 60), ("latency", "tenant", 450, 300),
        ("ttft", "tenant", 120, 900), ("error_rate", "tenant", 5, 300),
        ("rate_limited", "tenant", 10, 3600), ("budget_used", "tenant", 80, 60),
        ("budget_used", "tenant", 100, 60), ("latency", "model", 600, 300),
        ("error_rate", "model", 5, 60),
    ]
    rules = [AlertRule(tenant=t, name=f"{metric} {scope} {threshold}", metric=metric,
                       scope=scope, threshold=threshold, window_seconds=window,
                       for_seconds=0 if metric in ("budget_used", "error_rate") else 60,
                       min_requests=1)
             for t in tenants for metric, scope, threshold, window in own]
    platform = [
        *[("gpu_utilization", "node", n.name, 90, 60) for n in nodes],
        *[("gpu_memory", "node", n.name, 95, 300) for n in nodes],
        *[("error_rate", "deployment", d.name, 5, 60) for d in deployments],
        *[("latency", "deployment", d.name, 500, 60) for d in deployments],
        *[("ttft", "deployment", d.name, 200, 300) for d in deployments],
        ("latency", "cluster", "", 500, 60), ("error_rate", "cluster", "", 5, 60),
        ("crash_loop", "cluster", "", 0, 60), ("node_lost", "cluster", "", 0, 60),
        ("metering_lag", "cluster", "", 60, 60),
    ]
    existing = AlertRule.objects.count() + len(rules)
    for i in range(1000 - existing - len(platform)):  # per tenant, each model
        platform.append(("latency", "tenant", tenants[i % len(tenants)].slug, 700 + i, 300))
    rules += [AlertRule(name=f"platform {metric} {target}", metric=metric, scope=scope,
                        target=target, threshold=threshold, window_seconds=window,
                        for_seconds=30, severity="critical", min_requests=1)
              for metric, scope, target, threshold, window in platform]
    for rule in rules:
        rule.full_clean(validate_unique=False)
    AlertRule.objects.bulk_create(rules)


def _time(fn, repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def measure(rounds: int) -> int:
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext

    from alerts_app.evaluate import evaluate
    from alerts_app.models import Alert, AlertRule, Notification
    from serving_app.models.usage import UsageHour, UsageMinute, UsageTenSecond

    with connection.cursor() as cur:
        for model in (UsageHour, UsageMinute, UsageTenSecond):
            cur.execute(f"SELECT count(*) FROM {model._meta.db_table}")
            print(f"{model._meta.model_name}: {cur.fetchone()[0]:,} rows", end=" · ")
    print(f"{AlertRule.objects.filter(enabled=True).count()} rules enabled")

    def baseline() -> None:
        with connection.cursor() as cur:
            cur.execute(f"""SELECT tenant_id, sum(prompt_tokens + completion_tokens)
                            FROM {UsageHour._meta.db_table}
                            WHERE bucket >= date_trunc('month', now()) GROUP BY tenant_id""")
            cur.fetchall()
            sums = ", ".join(f"sum({c})" for c in ("requests", "server_errors", "rate_limited",
                                                    "ttft_count"))
            hists = ", ".join(f"sum({f.name})" for f in UsageTenSecond._meta.fields
                              if f.name.startswith(("latency_le_", "ttft_le_")))
            cur.execute(f"""SELECT tenant_id, model, deployment_id, {sums}, {hists}
                            FROM {UsageTenSecond._meta.db_table}
                            WHERE bucket >= now() - interval '1 hour'
                            GROUP BY 1, 2, 3""")
            cur.fetchall()

    baseline()  # warm
    base = _time(baseline, 5)
    print(f"\nbaseline, the rollups read once: median {statistics.median(base):7.1f} ms "
          f"(max {max(base):.1f})")
    Alert.objects.all().delete()
    times = []
    for i in range(rounds):
        reset_queries()
        with CaptureQueriesContext(connection) as queries:
            started = time.perf_counter()
            result = evaluate()
            elapsed = (time.perf_counter() - started) * 1000
        times.append(elapsed)
        print(f"round {i + 1}: {elapsed:7.1f} ms  {len(queries):4d} queries  "
              f"{result.readings:5d} readings  {len(result.transitions):4d} transitions  "
              f"{result.notifications:4d} notifications")
    steady = times[1:] or times
    print(f"\nalerts: {Alert.objects.count()} ({Alert.objects.filter(state='firing').count()} "
          f"firing), notifications queued: {Notification.objects.count()}")
    median = statistics.median(steady)
    print(f"first round (creates the alerts): {times[0]:.1f} ms; steady rounds: median "
          f"{median:.1f} ms, max {max(steady):.1f} ms; "
          f"{median / statistics.median(base):.2f}x the baseline")
    worst = max(times)
    verdict = "PASS" if worst < 1000 else "FAIL"
    print(f"slowest round: {worst:.1f} ms (target < 1000 ms): {verdict}")
    return 0 if worst < 1000 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", default="console_alertbench")
    parser.add_argument("--reuse", action="store_true", help="keep the data already generated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    url = database_url(args.database)
    ensure_database(url)
    setup(url)
    if not args.reuse:
        print(f"generating 30 days of rollups for {TENANTS} tenants in {args.database}")
        generate()
    return measure(args.rounds)


if __name__ == "__main__":
    raise SystemExit(main())
