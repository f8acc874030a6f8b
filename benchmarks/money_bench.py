"""Money budgets' cost in the gateway: the same tenant's requests with and without a money
budget, through one gateway, in the same run, against an upstream that answers at once.

    .venv/bin/python benchmarks/money_bench.py                 # 10 s per side, one at a time
    .venv/bin/python benchmarks/money_bench.py --seconds 20 --workers 1

Two keys of one tenant that has RPM and TPM limits (admission and settlement run for both):
`plain` has no money budget, `money` has a hard one (a key budget inside a tenant budget would
charge both the same way; one is enough to run the scripts), with a price card in force for the
model, so each of its requests also reserves its worst-case cost and settles its actual cost (in
the same admission and settlement scripts as the tenant's other limits: no round trip of its
own). One request at a time, alternating
between the two keys (paired samples, `gateway_bench.paired`); the printed ratio is the money
side's mean latency over the plain side's, and the paired median difference in milliseconds.
The instant upstream (`gateway_bench.InstantUpstream`) makes the gateway's own time most of a
request's, so the ratio is the added cost against the gateway's time alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gateway_bench import (  # noqa: E402 - the path above first
    BODY,
    free_port,
    gateway_env,
    paired,
    seed_gateway_db,
    spawn,
    start_gateway,
    start_redis,
    stop_all,
    wait_http,
)

MONEY = """
import json
from decimal import Decimal
from datetime import timedelta
from django.utils import timezone
from serving_app.models import BaseModel, PriceCard
from tenants_app.models import ApiKey, MoneyBudget, Tenant
tenant = Tenant.objects.get(slug="bench")
MoneyBudget.objects.all().delete(); PriceCard.objects.all().delete()
PriceCard.objects.create(base_model=BaseModel.objects.get(name="instant"),
    effective_from=timezone.now() - timedelta(days=1), input_per_million=Decimal("0.15"),
    cached_input_per_million=Decimal("0.075"), output_per_million=Decimal("0.6"))
key, secret = ApiKey.objects.create_key(tenant=tenant, name="bench-money")
MoneyBudget.objects.create(tenant=tenant, api_key=key, amount=Decimal(10**6), period="month")
print(json.dumps({"money": secret}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per side")
    parser.add_argument("--workers", type=int, default=1, help="gateway (uvicorn) workers")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args()
    procs: list[subprocess.Popen] = []
    try:
        redis_proc, redis_url = start_redis()
        procs.append(redis_proc)
        database = ROOT / "var" / "money-bench.sqlite3"
        # A fresh database each run: the last run's price card protects the model the seed
        # deletes.
        database.unlink(missing_ok=True)
        env = gateway_env(redis_url, f"sqlite:///{database}")
        port = free_port()
        procs.append(spawn("gateway_bench._instant_main", port))
        keys = seed_gateway_db(env, {"instant": port})
        out = subprocess.run([sys.executable, "manage.py", "shell", "-c", MONEY], cwd=ROOT,
                             env=env, check=True, capture_output=True, text=True).stdout
        keys.update(json.loads(out.strip().splitlines()[-1]))
        gw_port = free_port()
        procs.append(start_gateway(env, gw_port, args.workers))
        url = f"http://127.0.0.1:{gw_port}/v1/completions"
        sides = {name: (url, {"Authorization": f"Bearer {keys[key]}",
                              "Content-Type": "application/json"})
                 for name, key in (("plain", "limits"), ("money", "money"))}
        wait_http(f"http://127.0.0.1:{gw_port}/v1/models", 60, sides["plain"][1])
        got = asyncio.run(paired(sides, {**BODY, "model": "instant"}, args.seconds))
        plain, money = got["plain"], got["money"]
        ratio = money["mean_ms"] / plain["mean_ms"]
        diff = got.get("paired_median_diff_ms_money")
        print(f"plain: {plain['requests']} requests, mean {plain['mean_ms']:.3f} ms, "
              f"{plain['failures']} failed")
        print(f"money: {money['requests']} requests, mean {money['mean_ms']:.3f} ms, "
              f"{money['failures']} failed")
        print(f"money / plain mean latency: {ratio:.3f}; paired median difference "
              f"{diff:.3f} ms")
        if args.json:
            Path(args.json).write_text(json.dumps({**got, "ratio": ratio}, indent=2))
        return 0 if not plain["failures"] and not money["failures"] else 1
    finally:
        stop_all(procs)


if __name__ == "__main__":
    sys.exit(main())
