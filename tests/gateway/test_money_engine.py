"""Money budgets against the real CPU engine: 32 concurrent requests spread over the session's
three gateway workers (its two servers: two workers and one) against a key budget that fits
about four of them overspend by at most one request's worst-case cost, at the engine's own
token counts; the refused ones answer OpenAI's `insufficient_quota`.

The same on a stand-in engine (exact counts, a pause per answer) is
`test_money_budgets.py`, which the fast mutation check runs."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from django.utils import timezone

from serving_app.models import PriceCard, UsageEvent
from tenants_app.models import MoneyBudget
from tests.gateway.conftest import drain_usage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]

COMPLETION = 8
PRICE = Decimal(1000)  # per million tokens, input and output: a token costs 0.001
REQUESTS = 32


def ask(url: str, secret: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120,
                      headers={"authorization": f"Bearer {secret}"},
                      json={"model": "tiny-llama", "prompt": "Count with me: one, two,",
                            "max_tokens": COMPLETION, "ignore_eos": True})


def test_32_concurrent_requests_on_three_workers_overspend_by_at_most_one_worst_case(
        world, gateways):
    PriceCard.objects.create(base_model=world.base, effective_from=timezone.now()
                             - timedelta(days=1), input_per_million=PRICE,
                             cached_input_per_million=PRICE, output_per_million=PRICE)
    first, second = gateways
    assert ask(first.url, world.acme_secret).status_code == 200
    drain_usage()
    probe = UsageEvent.objects.get(status_code=200, tenant=world.acme)
    worst = probe.reserved_tokens * PRICE / 10**6
    assert 0 < probe.cost < worst
    amount = probe.cost + 4 * worst
    MoneyBudget.objects.create(tenant=world.acme, api_key=world.acme_key, amount=amount,
                               period="day", time_zone="America/New_York")
    time.sleep(2)  # every worker re-reads its catalog on the invalidation (at worst in 0.5 s)
    # Two of every three requests to the two-worker server, the third to the one-worker one.
    urls = list(itertools.islice(itertools.cycle([first.url, first.url, second.url]),
                                 REQUESTS))
    with ThreadPoolExecutor(REQUESTS) as pool:
        answers = list(pool.map(lambda url: ask(url, world.acme_secret), urls))
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(ok) + len(refused) == REQUESTS, [a.status_code for a in answers]
    assert 4 <= len(ok) < REQUESTS and refused
    assert all(a.json()["usage"]["completion_tokens"] == COMPLETION for a in ok)
    error = refused[0].json()["error"]
    assert error["type"] == error["code"] == "insufficient_quota"
    drain_usage()
    spent = sum(e.cost for e in UsageEvent.objects.filter(status_code=200, tenant=world.acme))
    assert spent <= amount + worst, (spent, amount, worst, len(ok))
