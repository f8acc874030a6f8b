"""Money budgets across gateway workers: three uvicorn workers on real Redis and PostgreSQL
reserve each request's worst-case cost atomically and settle the actual, so 32 concurrent
requests against a key budget that fits a few overspend by at most one worst case; a spent
budget answers 429 `insufficient_quota` in OpenAI's shape; a key's budget sits inside its
tenant's; settlement counts the actual cost, not the reservation.

The upstream is a stand-in (`StandIn`, a thread of this process): an OpenAI-shaped server that
answers every chat completion with `max_completion_tokens` completion tokens after a pause (so
that concurrent requests are in flight together) and a fixed prompt count. The real engine
would cost a minute's start and answer at its own pace; what is tested is the gateway's
arithmetic on the counts an engine reports, which the stand-in reports exactly.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from django.utils import timezone

from benchmarks.gateway_bench import kill_group
from serving_app.models import PriceCard, UsageEvent
from tenants_app.models import MoneyBudget
from tests.engines import JsonStandin, serve_standin
from tests.gateway.conftest import (
    _test_database_url,
    drain_usage,
    make_world,
    start_gateway,
)

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT_TOKENS = 5  # what the stand-in reports
COMPLETION = 50
PAUSE = 0.6  # seconds each answer takes
PRICE = Decimal(1000)  # per million tokens, input and output: a token costs 0.001


class _Answer(JsonStandin):
    """Chat completions with exact counts, each after `PAUSE`."""

    def answer(self, body: dict) -> dict:
        time.sleep(PAUSE)
        completion = int(body.get("max_completion_tokens") or body.get("max_tokens")
                         or COMPLETION)
        return {
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1,
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "x"}}],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": completion,
                      "total_tokens": PROMPT_TOKENS + completion,
                      "prompt_tokens_details": {"cached_tokens": 0}},
        }


class StandIn:
    """An OpenAI-shaped upstream answering chat completions with exact counts (TLS, as engines
    serve)."""

    def __init__(self) -> None:
        self.server = serve_standin(_Answer)
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def standin():
    upstream = StandIn()
    yield upstream
    upstream.close()


@pytest.fixture(scope="module")
def three_workers(django_db_setup, django_db_blocker):
    """One gateway server of three workers for the module (each test makes its own rows)."""
    gateway = start_gateway(_test_database_url(), workers=3)
    yield gateway
    kill_group(gateway.proc)


@pytest.fixture
def setup(standin, three_workers):
    world = make_world(standin.port, "stand-in-secret")
    PriceCard.objects.create(base_model=world.base, effective_from=timezone.now()
                             - timedelta(days=1), input_per_million=PRICE,
                             cached_input_per_million=PRICE, output_per_million=PRICE)
    return world, three_workers


def ask(url: str, secret: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {secret}"},
                      json={"model": "tiny-llama", "max_completion_tokens": COMPLETION,
                            "messages": [{"role": "user", "content": "How much is this?"}]})


def probe(world, url: str) -> tuple[Decimal, Decimal]:
    """One request before any budget: its actual cost and its worst case (the tokens the
    gateway reserved, at the one price)."""
    assert ask(url, world.acme_secret).status_code == 200
    drain_usage()
    event = UsageEvent.objects.get(status_code=200, tenant=world.acme)
    assert event.cost == (PROMPT_TOKENS + COMPLETION) * PRICE / 10**6
    return event.cost, event.reserved_tokens * PRICE / 10**6


def budget(world, amount: Decimal, key: bool = True) -> None:
    MoneyBudget.objects.create(tenant=world.acme, api_key=world.acme_key if key else None,
                               amount=amount, period="day", time_zone="Europe/Berlin")
    time.sleep(2)  # every worker re-reads its catalog on the invalidation (at worst in 0.5 s)


def test_concurrent_requests_on_three_workers_overspend_by_at_most_one_worst_case(setup):
    world, gateway = setup
    actual, worst = probe(world, gateway.url)
    # Room for about four worst cases beyond what the probe spent.
    amount = actual + 4 * worst
    budget(world, amount)
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda _: ask(gateway.url, world.acme_secret), range(32)))
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(ok) + len(refused) == 32, [a.status_code for a in answers]
    assert ok and refused
    error = refused[0].json()["error"]
    assert error["type"] == "insufficient_quota" and error["code"] == "insufficient_quota"
    assert "key's budget" in error["message"] and int(refused[0].headers["retry-after"]) > 0
    drain_usage()
    spent = sum(e.cost for e in UsageEvent.objects.filter(status_code=200, tenant=world.acme))
    assert spent <= amount + worst, (spent, amount, worst, len(ok))


def test_settlement_counts_the_actual_cost_not_the_reservation(setup):
    world, gateway = setup
    actual, worst = probe(world, gateway.url)
    assert worst > actual
    # After the probe and three more requests' actual costs, one worst case still fits.
    budget(world, actual + 3 * actual + worst)
    codes = [ask(gateway.url, world.acme_secret).status_code for _ in range(6)]
    assert codes == [200, 200, 200, 200, 429, 429], codes


def test_a_keys_budget_is_inside_its_tenants(setup):
    world, gateway = setup
    actual, worst = probe(world, gateway.url)
    budget(world, Decimal(1000))  # the key's: room for everything
    budget(world, actual + actual + worst, key=False)  # the tenant's: two more requests
    codes = [ask(gateway.url, world.acme_secret).status_code for _ in range(4)]
    assert codes == [200, 200, 429, 429], codes
    refused = ask(gateway.url, world.acme_secret).json()["error"]
    assert "tenant's budget" in refused["message"]
