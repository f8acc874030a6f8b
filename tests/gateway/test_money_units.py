"""Money budgets in the admission and settlement scripts on real Redis, without a gateway: a
reservation rides on the tenant's admission (no script of its own), a rolling window drops the
buckets that leave it (a rollover a day later), a counter Redis lost is re-seeded from what
the catalog read in PostgreSQL, calendar and rolling alike, and a cost a worker kept in memory
while Redis was down reaches the re-seeded counter. The clock is the ticket's (`now`):
a rolling window's bucket is chosen by the gateway, so a day later is a `now` a day later."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from decimal import Decimal

import redis

from gateway_app import admission, money
from gateway_app.dispatch import money_refusal
from gateway_app.metering import Meter
from serving_app.models.prices import TokenPrice
from tenants_app.periods import BUCKET_SECONDS, rolling_span
from tests.gateway.conftest import REDIS_URL
from tests.gateway.test_units import CONFIG, tenant

# A token costs 1e-3 (1,000,000 nano) in and out.
PRICE = TokenPrice(card_id=1, currency="USD", input=Decimal(1000), cached_input=Decimal(1000),
                   output=Decimal(1000))
TOKEN = 1_000_000
DAY = 86400


def limit(tenant_id: int, amount_tokens: int, seed: str = "", key_id: int = 0,
          rolling: bool = True, now: float = 0.0) -> money.MoneyLimit:
    """A hard budget of `amount_tokens` tokens' worth: a rolling day, or today in UTC."""
    start = now - now % DAY
    return money.MoneyLimit(
        budget_id=tenant_id * 10 + key_id, tenant_id=tenant_id, key_id=key_id,
        amount=amount_tokens * TOKEN, period="day", time_zone="UTC", start=start,
        end=start + DAY, seed=seed or ("" if rolling else "0"),
        span=rolling_span("day") if rolling else 0)


async def spend(meter: Meter, t, limits, tokens: int, now: float, actual: int | None = None):
    """Admit a request of `tokens` tokens' worst case at `now` and, if admitted, settle it at
    `actual` tokens (default: all of them)."""
    reserve = money.ticket(limits, PRICE, tokens * TOKEN, now)
    rid = f"m{time.time_ns()}"
    ticket, decision = await meter.admit(t, rid, tokens, money_ticket=reserve)
    if ticket.admitted:
        used = tokens if actual is None else actual
        await meter.settle(ticket, used, {"id": rid}, cost=used * TOKEN)
    return ticket, decision, reserve


def test_a_rolling_day_refuses_past_its_amount_and_frees_what_leaves_it_a_day_later():
    t = tenant()  # no other limit: the money budget alone makes the admission
    now = time.time()
    budgets = [limit(t.id, 100)]

    async def scenario():
        meter = Meter(CONFIG)
        try:
            first, _, _ = await spend(meter, t, budgets, 60, now)
            assert first.admitted
            later = now + 6 * 3600
            second, _, _ = await spend(meter, t, budgets, 30, later)
            assert second.admitted
            # 90 spent in the last 24 hours: 20 more does not fit, and says so.
            refused, decision, reserve = await spend(meter, t, budgets, 20, later + 60)
            assert not refused.admitted and decision.code == admission.MONEY
            assert decision.money_at == 1 and decision.money_spent == 90 * TOKEN
            error = money_refusal(reserve, decision)
            assert error.code == "insufficient_quota" and "per rolling day" in error.message
            # A day after the first request its 60 have left the window; the 30 have not.
            rolled, decision, _ = await spend(meter, t, budgets, 70, now + DAY + BUCKET_SECONDS)
            assert rolled.admitted
            full, decision, _ = await spend(meter, t, budgets, 1, now + DAY + BUCKET_SECONDS)
            assert not full.admitted and decision.money_spent == 100 * TOKEN
        finally:
            await meter.redis.aclose()

    asyncio.run(scenario())


def test_settlement_replaces_the_reservation_by_the_actual_cost_in_its_bucket():
    t = tenant(tpm=10_000)  # with another limit: the same admission carries both
    now = time.time()
    budgets = [limit(t.id, 100)]

    async def scenario():
        meter = Meter(CONFIG)
        try:
            ticket, _, _ = await spend(meter, t, budgets, 80, now, actual=10)
            assert ticket.admitted
            fits, _, _ = await spend(meter, t, budgets, 90, now)
            assert fits.admitted
            _, refused, _ = await spend(meter, t, budgets, 1, now)
            assert refused.code == admission.MONEY and refused.money_spent == 100 * TOKEN
        finally:
            await meter.redis.aclose()

    asyncio.run(scenario())


def test_a_lost_rolling_window_is_re_seeded_and_old_slices_still_leave_it():
    t = tenant()
    now = time.time()
    bucket = int(now) // BUCKET_SECONDS
    # What PostgreSQL held: 50 tokens' worth 20 hours ago, 30 two hours ago, 40 two days ago
    # (outside the window: never counted).
    seed = ",".join(f"{bucket - hours * 4}:{tokens * TOKEN}"
                    for hours, tokens in ((48, 40), (20, 50), (2, 30)))
    budgets = [limit(t.id, 100, seed=seed)]

    async def scenario():
        meter = Meter(CONFIG)
        try:
            _, refused, _ = await spend(meter, t, budgets, 21, now)
            assert refused.code == admission.MONEY and refused.money_spent == 80 * TOKEN
            fits, _, _ = await spend(meter, t, budgets, 20, now)
            assert fits.admitted
            # Redis loses the counter: re-seeded from the same seed (the catalog's last read);
            # the 20 just spent are not in it (a gap of at most one catalog refresh).
            redis.Redis.from_url(REDIS_URL).delete(budgets[0].counter(bucket))
            _, again, _ = await spend(meter, t, budgets, 21, now)
            assert again.money_spent == 80 * TOKEN
            # Five hours later the 50 of 20 hours ago have left the window.
            _, later, _ = await spend(meter, t, budgets, 200, now + 5 * 3600)
            assert later.code == admission.MONEY and later.money_spent == 30 * TOKEN
        finally:
            await meter.redis.aclose()

    asyncio.run(scenario())


def test_a_keys_budget_and_its_tenants_are_charged_in_one_admission():
    t = tenant()
    now = time.time()
    key_budget = limit(t.id, 1000, key_id=7, rolling=False, now=now)
    tenant_budget = limit(t.id, 50, seed=str(20 * TOKEN), rolling=False, now=now)
    budgets = [key_budget, tenant_budget]

    async def scenario():
        meter = Meter(CONFIG)
        try:
            first, _, _ = await spend(meter, t, budgets, 30, now)
            assert first.admitted
            _, refused, reserve = await spend(meter, t, budgets, 1, now)
            assert refused.code == admission.MONEY and refused.money_at == 2
            assert "tenant's budget of 0.05 per day" in money_refusal(reserve, refused).message
            # The key's counter holds what it was charged: 30, no seed of its own.
            key_counter = key_budget.counter(int(key_budget.start))
            assert int(redis.Redis.from_url(REDIS_URL).get(key_counter)) == 30 * TOKEN
        finally:
            await meter.redis.aclose()

    asyncio.run(scenario())



def test_a_cost_kept_in_memory_while_redis_was_lost_reaches_the_re_seeded_counter(
        private_redis):
    t = tenant()
    now = time.time()
    # PostgreSQL had 10 tokens' worth when the catalog read it.
    budgets = [limit(t.id, 100, seed=str(10 * TOKEN), rolling=False, now=now)]

    async def scenario():
        meter = Meter(dataclasses.replace(CONFIG, redis_url=private_redis.url))
        try:
            ticket, _ = await meter.admit(t, "kept", 50,
                                          money_ticket=money.ticket(budgets, PRICE, 50 * TOKEN,
                                                                    now))
            assert ticket.admitted
            private_redis.kill()
            await meter.settle(ticket, 30, {"id": "kept"}, cost=30 * TOKEN)
            assert len(meter.buffer) == 1  # the event and its cost, in this worker's memory
            private_redis.start()  # empty: the counter is re-seeded without the 30
            _, before, _ = await spend(meter, t, budgets, 100, now)
            assert before.money_spent == 10 * TOKEN
            await meter._flush()
            assert not meter.buffer
            _, after, _ = await spend(meter, t, budgets, 100, now)
            assert after.money_spent == 40 * TOKEN
        finally:
            await meter.redis.aclose()

    asyncio.run(scenario())
