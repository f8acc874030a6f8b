"""Send a short burst of realistic traffic through the gateway for each demo tenant.

Each tenant gets its own fresh key (named `demo-traffic`, replacing an earlier one) and sends
chat completions to its adapter and to the base model, some streamed, some over its limits,
so the dashboards have requests, tokens, latency, errors and 429s to show.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
from django.core.management.base import BaseCommand, CommandError

from serving_app.models import Deployment, Instance
from tenants_app.models import ApiKey, Tenant

PROMPTS = [
    "Where is my order?", "Write a python function that sorts a list.",
    "Summarize our refund policy in one line.", "Draft a short product description.",
    "How do I reset my password?", "Explain prefix caching to a new engineer.",
]


class Command(BaseCommand):
    help = "Generate gateway traffic for the demo tenants (bounded in time and count)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
        parser.add_argument("--seconds", type=float, default=60.0)
        parser.add_argument("--max-requests", type=int, default=600)
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
        counts: dict[str, dict[int, int]] = {}
        lock = threading.Lock()
        budget = [max_requests]
        stop_at = time.monotonic() + seconds

        def run(tenant: Tenant, secret: str, models: list[str]) -> None:
            client = httpx.Client(base_url=base_url, timeout=60,
                                  headers={"Authorization": f"Bearer {secret}"})
            rng = random.Random(hash(tenant.slug))
            while time.monotonic() < stop_at:
                with lock:
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
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
        for slug, per in sorted(counts.items()):
            summary = ", ".join(f"{status or 'error'}: {n}" for status, n in sorted(per.items()))
            self.stdout.write(f"{slug}: {summary}")
