"""Send realistic traffic through the gateway for each demo tenant, for a set time.

Each tenant gets its own fresh key (named `demo-traffic`, replacing an earlier one) and sends
chat completions to its adapter and to the base model, some streamed, so the dashboards have
requests, tokens and latency to show (and errors and 429s where a tenant's limits bite).

The traffic lasts `--seconds` (default `DEMO_TRAFFIC_SECONDS`, else 90): the `--max-requests`
requests are spread evenly over that time (`Pacer`), not sent as fast as the engine answers
(the tiny CPU model answered 600 requests in about 25 s, and the demo's traffic ended there).
It ends sooner only where the engine is too slow for the pace: no request starts after the
time is up.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from collections.abc import Callable

import httpx
from django.core.management.base import BaseCommand, CommandError

from serving_app.models import Deployment, Instance
from tenants_app.models import ApiKey, Tenant

PROMPTS = [
    "Where is my order?", "Write a python function that sorts a list.",
    "Summarize our refund policy in one line.", "Draft a short product description.",
    "How do I reset my password?", "Explain prefix caching to a new engineer.",
]


def positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {value}")
    return number


class Pacer:
    """Hands out the start times of `requests` requests spread evenly over `seconds` (one every
    seconds / requests, the first at once), to any number of threads.

    `wait_turn()` sleeps until the next start time and says whether to send: False once every
    request has had its turn or the time is up (a turn that comes late, behind a slow engine,
    is given up, not sent after the end). `clock` and `sleep` are `time.monotonic` and
    `time.sleep` unless a test passes its own."""

    def __init__(self, seconds: float, requests: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.interval = seconds / requests
        self.requests = requests
        self.clock, self.sleep = clock, sleep
        self.start = clock()
        self.end = self.start + seconds
        self._turns = 0
        self._lock = threading.Lock()

    def wait_turn(self) -> bool:
        with self._lock:
            if self._turns >= self.requests:
                return False
            at = self.start + self._turns * self.interval
            self._turns += 1
        delay = at - self.clock()
        if delay > 0:
            self.sleep(delay)
        return self.clock() < self.end


class Command(BaseCommand):
    help = "Generate gateway traffic for the demo tenants (bounded in time and count)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
        parser.add_argument("--seconds", type=positive,
                            default=os.environ.get("DEMO_TRAFFIC_SECONDS", "90"),
                            help="How long the traffic lasts (default: DEMO_TRAFFIC_SECONDS, "
                                 "else 90).")
        parser.add_argument("--max-requests", type=int, default=600,
                            help="Requests in all, spread evenly over --seconds.")
        parser.add_argument("--concurrency", type=int, default=3, help="Per tenant.")
        parser.add_argument("--wait-ready", type=float, default=600.0,
                            help="Seconds to wait for a ready engine first.")

    def handle(self, *args, base_url: str, seconds: float, max_requests: int, concurrency: int,
               wait_ready: float, **options) -> None:
        deadline = time.monotonic() + wait_ready
        while not Instance.objects.filter(state=Instance.State.READY).exists():
            if time.monotonic() > deadline:
                raise CommandError("No engine became ready; see the instances in the console.")
            time.sleep(2)
        time.sleep(3)  # let the gateway's catalog refresh see the ready instance
        plans = []
        for tenant in Tenant.objects.filter(deployments__isnull=False).distinct():
            ApiKey.objects.filter(tenant=tenant, name="demo-traffic").delete()
            _, secret = ApiKey.objects.create_key(tenant=tenant, name="demo-traffic")
            deployment = Deployment.objects.filter(tenants=tenant).first()
            if deployment is None:
                continue
            models = [deployment.base_model.name, *(
                a.name for a in deployment.adapters.filter(tenant=tenant))]
            plans.append((tenant, secret, models))
        if max_requests < 1:
            raise CommandError("--max-requests must be at least 1.")
        counts: dict[str, dict[int, int]] = {}
        lock = threading.Lock()
        pacer = Pacer(seconds, max_requests)

        def run(tenant: Tenant, secret: str, models: list[str]) -> None:
            client = httpx.Client(base_url=base_url, timeout=60,
                                  headers={"Authorization": f"Bearer {secret}"})
            rng = random.Random(hash(tenant.slug))
            while pacer.wait_turn():
                body = {"model": rng.choice(models), "max_tokens": rng.choice([8, 16, 32]),
                        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
                try:
                    if rng.random() < 0.3:
                        body["stream"] = True
                        with client.stream("POST", "/chat/completions", json=body) as response:
                            for _ in response.iter_lines():
                                pass
                            status = response.status_code
                    else:
                        status = client.post("/chat/completions", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                with lock:
                    per = counts.setdefault(tenant.slug, {})
                    per[status] = per.get(status, 0) + 1

        threads = [threading.Thread(target=run, args=plan, daemon=True)
                   for plan in plans for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.stdout.write(f"{sum(map(sum, (per.values() for per in counts.values())))} requests "
                          f"over {time.monotonic() - pacer.start:.0f} s")
        for slug, per in sorted(counts.items()):
            summary = ", ".join(f"{status or 'error'}: {n}" for status, n in sorted(per.items()))
            self.stdout.write(f"{slug}: {summary}")
