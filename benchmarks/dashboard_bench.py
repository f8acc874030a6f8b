"""Dashboard benchmark: every dashboard data endpoint against 10 million usage events.

    .venv/bin/python benchmarks/dashboard_bench.py [--events 10000000] [--reuse]

Creates (or reuses, with --reuse) a scratch PostgreSQL database (`console_dashbench` on the
server of DATABASE_URL, default postgres://postgres@127.0.0.1:5432), migrates it, and fills it
inside PostgreSQL (generate_series, no row travels through Python): tenants, N usage events over
30 days in arrival order, and the per-minute and per-hour rollups computed from those events
exactly as the usage writer keeps them, plus a GPU node with a day of samples. Then it times
each dashboard data endpoint (the view, its queries, the plotly figures and the JSON) for every
range, and a baseline in the same run: the same 24-hour totals computed from the raw events,
which is what a dashboard without rollups would have to do. Target: under 500 ms per endpoint.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TENANTS = 8
MODELS = ("llama-8b", "llama-70b", "support-style")
DAYS = 30


def database_url(name: str) -> str:
    base = urlparse(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"))
    if base.scheme not in ("postgres", "postgresql"):
        base = urlparse("postgres://postgres@127.0.0.1:5432/postgres")
    return base._replace(path=f"/{name}").geturl()


def ensure_database(url: str) -> None:
    import psycopg

    parsed = urlparse(url)
    admin = parsed._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                              [parsed.path.lstrip("/")]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{parsed.path.lstrip("/")}"')


def setup_django(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ.setdefault("DEBUG", "true")  # a development run: the development SECRET_KEY
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _tables() -> dict[str, str]:
    from serving_app.models.usage import UsageEvent, UsageHour, UsageMinute

    return {"event": UsageEvent._meta.db_table, "minute": UsageMinute._meta.db_table,
            "hour": UsageHour._meta.db_table}


def generate(events: int) -> None:
    from django.db import connection, transaction

    from serving_app.models import Gpu, GpuSample, Node
    from tenants_app.models import Tenant

    t = _tables()
    started = time.perf_counter()
    with connection.cursor() as cur:
        cur.execute(f"TRUNCATE {t['event']}, {t['minute']}, {t['hour']}")
    Tenant.objects.filter(slug__startswith="bench-").delete()
    Node.objects.filter(name="bench-gpu").delete()
    tenants = [
        Tenant.objects.create(slug=f"bench-{i}", name=f"Bench tenant {i}",
                              monthly_token_budget=5_000_000_000,
                              latency_objective_ms=500 + 250 * i)
        for i in range(TENANTS)
    ]
    first = tenants[0].pk
    models = "ARRAY[" + ", ".join(f"'{m}'" for m in MODELS) + "]"
    # Events in arrival order over the last 30 days; a skewed tenant mix; log-normal latency.
    insert_events = f"""
        INSERT INTO {t['event']} (request_id, created_at, tenant_id, api_key_id, endpoint, model,
            adapter, deployment_id, instance_id, status_code, error_code, stream, prompt_tokens,
            completion_tokens, reserved_tokens, ttft_ms, latency_ms)
        SELECT 'bench-' || g,
               now() - interval '{DAYS} days' + (g::float8 / %(n)s) * interval '{DAYS} days',
               {first} + (floor(power(random(), 2) * {TENANTS}))::int,
               1, 'chat.completions', ({models})[1 + (g %% {len(MODELS)})], '', 1, 1,
               CASE WHEN r < 0.010 THEN 429 WHEN r < 0.015 THEN 500 ELSE 200 END,
               CASE WHEN r < 0.010 THEN 'rate_limited' WHEN r < 0.015 THEN 'upstream' ELSE '' END,
               (g %% 3) <> 0, 20 + (random() * 800)::int, 5 + (random() * 300)::int, 512,
               CASE WHEN (g %% 3) <> 0 THEN lat * 0.2 END, lat
        FROM (
            SELECT g, random() AS r,
                   exp(ln(300 + (g %% {TENANTS}) * 120)
                       + 0.6 * (random() + random() + random() - 1.5) * 2) AS lat
            FROM generate_series(%(lo)s, %(hi)s) AS g
        ) AS s
    """
    with connection.cursor() as cur:
        cur.execute("SET synchronous_commit = off")
        cur.execute("SET maintenance_work_mem = '512MB'")
    # Loading into a table without its secondary indexes and building them afterwards is
    # several times faster than maintaining five btrees row by row.
    restore = _drop_secondary_indexes(t["event"])
    chunk = 2_000_000
    for lo in range(1, events + 1, chunk):
        hi = min(lo + chunk - 1, events)
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(insert_events, {"n": events, "lo": lo, "hi": hi})
        print(f"  events {hi:>11,} / {events:,}  ({time.perf_counter() - started:5.1f} s)",
              flush=True)
    with connection.cursor() as cur:
        for statement in restore:
            cur.execute(statement)
    print(f"  event indexes rebuilt  ({time.perf_counter() - started:5.1f} s)", flush=True)
    from serving_app.models.usage import LATENCY_BUCKETS_MS, LATENCY_FIELDS, TTFT_FIELDS

    hist = []
    for source in ("latency_ms", "ttft_ms"):
        lower = None
        for bound in LATENCY_BUCKETS_MS:
            cond = f"{source} <= {bound}" + (f" AND {source} > {lower}" if lower else "")
            hist.append(f"count(*) FILTER (WHERE {cond})")
            lower = bound
    columns = ", ".join((*LATENCY_FIELDS, *TTFT_FIELDS))
    for table, unit in (("minute", "minute"), ("hour", "hour")):
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(f"""
                INSERT INTO {t[table]} (bucket, tenant_id, model, deployment_id, requests, errors,
                    server_errors, rate_limited, prompt_tokens, completion_tokens,
                    latency_ms_total, latency_ms_max, ttft_ms_total, ttft_ms_max, ttft_count,
                    {columns})
                SELECT date_trunc('{unit}', created_at), tenant_id, model,
                       coalesce(deployment_id, 0), count(*),
                       count(*) FILTER (WHERE status_code >= 400),
                       count(*) FILTER (WHERE status_code >= 500),
                       count(*) FILTER (WHERE status_code = 429),
                       sum(prompt_tokens), sum(completion_tokens), sum(latency_ms),
                       max(latency_ms), coalesce(sum(ttft_ms), 0), coalesce(max(ttft_ms), 0),
                       count(ttft_ms), {", ".join(hist)}
                FROM {t['event']} GROUP BY 1, 2, 3, 4
            """)
            cur.execute(f"SELECT count(*) FROM {t[table]}")
            rows = cur.fetchone()[0]
        print(f"  {table} rollups: {rows:,} rows  ({time.perf_counter() - started:5.1f} s)",
              flush=True)
    with connection.cursor() as cur:
        cur.execute(f"ANALYZE {t['event']}; ANALYZE {t['minute']}; ANALYZE {t['hour']}")
    from django.utils import timezone

    node = Node.objects.create(name="bench-gpu", queue="node.bench-gpu",
                               last_heartbeat=timezone.now(), inventory_source="nvml")
    gpus = [Gpu.objects.create(node=node, index=i, uuid=f"BENCH-{i}", name="NVIDIA H200",
                               memory_total_bytes=141 * 2**30, memory_used_bytes=2**30)
            for i in range(8)]
    with connection.cursor() as cur:
        cur.execute(f"""
            INSERT INTO {GpuSample._meta.db_table} (gpu_id, at, memory_used_bytes,
                utilization_percent)
            SELECT gpu, now() - m * interval '1 minute', (40 + random() * 60)::bigint << 30,
                   random() * 100
            FROM unnest(%s::bigint[]) AS gpu, generate_series(0, 1439) AS m
        """, [[g.pk for g in gpus]])
    print(f"  generated in {time.perf_counter() - started:.1f} s", flush=True)


def _drop_secondary_indexes(table: str) -> list[str]:
    """Drop every index of `table` but its primary key; return the statements that restore
    them (unique constraints as constraints)."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("""
            SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint
            WHERE conrelid = %s::regclass AND contype = 'u'
        """, [table])
        constraints = cur.fetchall()
        cur.execute("""
            SELECT i.indexname, i.indexdef FROM pg_indexes i
            WHERE i.tablename = %s AND i.indexname NOT IN (
                SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass)
        """, [table, table])
        indexes = cur.fetchall()
        for name, _ in constraints:
            cur.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
        for name, _ in indexes:
            cur.execute(f'DROP INDEX "{name}"')
    return [f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}'
            for name, definition in constraints] + [definition for _, definition in indexes]


def _time(fn, repeat: int) -> tuple[float, float]:
    fn()  # warm: connection, plans, caches
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), max(samples)


def measure(repeat: int) -> int:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import RequestFactory

    from tenants_app.models import Tenant
    from ui_app.console import dashboards
    from ui_app.portal import views as portal_views

    t = _tables()
    with connection.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {t['event']}")
        events = cur.fetchone()[0]
        cur.execute(f"SELECT count(*) FROM {t['minute']}")
        minutes = cur.fetchone()[0]
        cur.execute(f"SELECT count(*) FROM {t['hour']}")
        hours = cur.fetchone()[0]
    print(f"\n{events:,} usage events · {minutes:,} minute rollups · {hours:,} hour rollups")
    user, _ = get_user_model().objects.get_or_create(username="bench-admin",
                                                     defaults={"is_staff": True})
    tenant = Tenant.objects.filter(slug="bench-0").first()
    factory = RequestFactory()

    def endpoint(name: str, key: str, portal: bool = False):
        def call() -> None:
            request = factory.get("/", {"range": key})
            request.user = user
            if portal:
                response = portal_views.TenantDashboardDataView.as_view()(
                    request, slug=tenant.slug, name=name)
            else:
                response = dashboards.DashboardDataView.as_view()(request, name=name)
            assert response.status_code == 200, response.status_code
        return call

    def baseline() -> None:
        with connection.cursor() as cur:
            cur.execute(f"""SELECT tenant_id, count(*), sum(prompt_tokens),
                                   sum(completion_tokens)
                            FROM {t['event']} WHERE created_at >= now() - interval '24 hours'
                            GROUP BY tenant_id""")
            cur.fetchall()

    base_ms, base_max = _time(baseline, repeat)
    print(f"\nbaseline: 24 h totals per tenant from raw events: median {base_ms:7.1f} ms "
          f"(max {base_max:.1f})\n")
    print(f"{'endpoint':<28}{'range':>6}{'median ms':>11}{'max ms':>9}{'vs baseline':>13}")
    worst = 0.0
    cases = [(n, False) for n in ("usage", "latency", "gpus")] + [("usage", True),
                                                                  ("latency", True)]
    for name, portal in cases:
        for key in ("1h", "24h", "7d", "30d"):
            median, peak = _time(endpoint(name, key, portal), repeat)
            worst = max(worst, median)
            label = f"{'portal' if portal else 'console'} {name}"
            print(f"{label:<28}{key:>6}{median:>11.1f}{peak:>9.1f}{median / base_ms:>12.2f}x")
    verdict = "PASS" if worst < 500 else "FAIL"
    print(f"\nslowest endpoint median: {worst:.1f} ms (target < 500 ms): {verdict}")
    return 0 if worst < 500 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--database", default="console_dashbench")
    parser.add_argument("--reuse", action="store_true", help="keep the data already generated")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    url = database_url(args.database)
    ensure_database(url)
    setup_django(url)
    if not args.reuse:
        print(f"generating {args.events:,} usage events and their rollups in {args.database}")
        generate(args.events)
    return measure(args.repeat)


if __name__ == "__main__":
    raise SystemExit(main())
