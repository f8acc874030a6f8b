"""Money budgets in the request path: what the gateway knows of them (read with the catalog),
a request's worst-case cost, and the Lua that reserves it and settles the actual inside the
admission and settlement scripts (`admission.py`): a request with money budgets costs no
round trip of its own.

A tenant's or key's hard budget is a counter in Redis, in nano-units of the price cards'
currency (integers: a cost of 1e-12 rounds up to 1e-9 here; PostgreSQL keeps it exact), inside
the tenant's hash tag:
- a calendar period's: one counter per period (`...:money:<budget>:<period start>`);
- a rolling window's (the last 24 hours, 7, 30 or 90 days): a hash per budget
  (`...:money:<budget>:r`) of 15-minute buckets (the field is the bucket's number, Unix time /
  900), their sum (`s`) and the oldest bucket still in the window (`lo`). Admission first drops
  the buckets that left the window from the sum, then checks. A request's cost counts in the
  bucket it was admitted in (its settlement corrects that bucket), as long as the bucket is in
  the window.
Admission reserves the request's worst case (its prompt estimate at the input price plus every
completion token it may produce at the output price) on every budget that covers it at once
(the key's and its tenant's: the key's budget sits inside its tenant's), atomically with the
tenant's other limits, or refuses; settlement takes the reservation back and adds the actual
cost. So concurrent requests on any number of workers overspend by at most one request's worst
case.

A counter missing (a new period, or Redis lost its data) is seeded from PostgreSQL: what
`KeyUsage` held for the period when the catalog was last read. A rolling window's seed is that
spend in slices of 1/24 of the window (an hour of a day's window), each counted in its slice's
last bucket: after a Redis loss a slice stays counted until its last 15 minutes leave the
window, so the re-seeded spend is never below the real one (above it by at most a slice).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db.models import Sum

from serving_app.models import KeyUsage, TokenPrice
from tenants_app.models import MoneyBudget
from tenants_app.periods import BUCKET_SECONDS, period_bounds, rolling_span

NANO = Decimal(10**9)
SEED_SLICES = 24
# Counters are kept this long past their period's end, so that late settlements still find them.
GRACE_SECONDS = 7 * 86400

# Lua for `admission.ADMIT_LUA` and `SETTLE_LUA`. `money_spent`: a budget's spend now, seeding a
# missing counter (a calendar period's seed is a number, a rolling window's `bucket:amount,...`)
# and, for a rolling window, first dropping the buckets that left it. `money_add`: an amount
# counted (reserved) now. `money_settle`: the difference between the actual cost and the
# reservation, in the bucket it was reserved in, if this Redis still has the counter and the
# bucket.
LUA_LIB = r"""
local function money_spent(key, seed, span, bucket, ttl)
  if span == 0 then
    if redis.call('EXISTS', key) == 0 then redis.call('SET', key, seed, 'EX', ttl) end
    return tonumber(redis.call('GET', key))
  end
  local oldest = bucket - span + 1
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 's', 0, 'lo', oldest)
    for b, v in string.gmatch(seed, '(%d+):(%d+)') do
      if tonumber(b) >= oldest then
        redis.call('HINCRBY', key, b, v)
        redis.call('HINCRBY', key, 's', v)
      end
    end
    redis.call('EXPIRE', key, ttl)
    return tonumber(redis.call('HGET', key, 's'))
  end
  local lo = tonumber(redis.call('HGET', key, 'lo') or oldest)
  if lo < oldest then
    -- Amounts stay strings (HINCRBY's integers), never Lua's doubles.
    local function drop(field, v)
      if string.sub(v, 1, 1) == '-' then v = string.sub(v, 2) else v = '-' .. v end
      redis.call('HINCRBY', key, 's', v)
      redis.call('HDEL', key, field)
    end
    if oldest - lo > 64 then
      local all = redis.call('HGETALL', key)
      for j = 1, #all, 2 do
        local b = tonumber(all[j])
        if all[j] ~= 's' and all[j] ~= 'lo' and b < oldest then drop(all[j], all[j + 1]) end
      end
    else
      for b = lo, oldest - 1 do
        local v = redis.call('HGET', key, b)
        if v then drop(b, v) end
      end
    end
    redis.call('HSET', key, 'lo', oldest)
  end
  return tonumber(redis.call('HGET', key, 's'))
end

local function money_add(key, span, bucket, amount, ttl)
  if span == 0 then
    redis.call('INCRBY', key, amount)
  else
    redis.call('HINCRBY', key, bucket, amount)
    redis.call('HINCRBY', key, 's', amount)
    redis.call('EXPIRE', key, ttl)
  end
end

local function money_settle(key, span, bucket, delta)
  if redis.call('EXISTS', key) == 0 then return end
  if span == 0 then
    redis.call('INCRBY', key, delta)
  elseif tonumber(bucket) >= tonumber(redis.call('HGET', key, 'lo') or bucket) then
    redis.call('HINCRBY', key, bucket, delta)
    redis.call('HINCRBY', key, 's', delta)
  end
end

-- A request's settlement: `hash` holds what it reserved (`m:<rid>`; gone after a Redis loss,
-- then the whole cost is added), KEYS[k0 + i] its counters, ARGV[a0] its actual cost, then each
-- counter's span and bucket.
local function money_settle_request(hash, rid, k0, a0, mk)
  local held = tonumber(redis.call('HGET', hash, 'm:' .. rid))
  if held then redis.call('HDEL', hash, 'm:' .. rid) end
  local delta = tonumber(ARGV[a0]) - (held or 0)
  for i = 1, mk do
    money_settle(KEYS[k0 + i], tonumber(ARGV[a0 + 2 * i - 1]), ARGV[a0 + 2 * i], delta)
  end
end
"""

# The money part of a settlement that could not reach Redis, run when the worker's buffer of
# usage events is flushed (`Meter._flush`), beside the event's XADD. KEYS: the tenant's
# reservations hash, then the counters; ARGV: the request id, its actual cost, then each
# counter's span and bucket. Redis only unreachable: the reservation still held is replaced by
# the cost. Redis lost and re-seeded from PostgreSQL, which does not have this event yet: the
# cost is added, so the counter is not low by what the worker kept in memory.
RESETTLE_LUA = """#!lua flags=allow-oom,allow-cross-slot-keys
""" + LUA_LIB + """
money_settle_request(KEYS[1], ARGV[1], 1, 2, #KEYS - 1)
return 1
"""


def nano(amount: Decimal) -> int:
    """An amount in nano-units, rounded up (a reservation or a cost is never under-counted)."""
    return math.ceil(amount * NANO)


@dataclass(frozen=True, slots=True)
class MoneyLimit:
    """A hard money budget as the catalog read it: its amount and current period (Unix times)
    with what PostgreSQL had counted in that period (`seed`), in nano-units. A rolling window's
    `span` is its number of 15-minute buckets (0: calendar) and its `seed` the slices'
    `bucket:amount` list."""

    budget_id: int
    tenant_id: int
    key_id: int  # 0: the tenant's own budget
    amount: int
    period: str
    time_zone: str
    start: float
    end: float
    seed: str
    span: int = 0

    def window(self, now: float) -> tuple[float, int, str]:
        """The period holding `now`: its end, the bucket `now` is in (rolling) or its start
        (calendar), and its seed. Past the calendar period the catalog read, the next one
        (seeded with nothing: it began less than a catalog refresh ago)."""
        if self.span:
            bucket = int(now) // BUCKET_SECONDS
            return (bucket + 1) * BUCKET_SECONDS, bucket, self.seed
        if self.start <= now < self.end:
            return self.end, int(self.start), self.seed
        start, end = period_bounds(self.period, self.time_zone, datetime.fromtimestamp(now, UTC))
        return end.timestamp(), int(start.timestamp()), "0"

    def counter(self, start: int) -> str:
        if self.span:
            return f"gw:{{t{self.tenant_id}}}:money:{self.budget_id}:r"
        return f"gw:{{t{self.tenant_id}}}:money:{self.budget_id}:{start}"

    @property
    def label(self) -> str:
        return f"rolling {self.period}" if self.span else self.period


@dataclass(slots=True)
class MoneyTicket:
    """What a request reserves on its budgets' counters: their keys (after the admission
    script's own), the admission script's trailing arguments, and what settlement needs."""

    limits: list[MoneyLimit]
    keys: list[str]
    admit_args: list[int | str]
    settle_args: list[int | str]  # each counter's span and bucket
    reserved: int
    price: TokenPrice
    ends: list[float]

    def settle(self, actual: int) -> list[int | str]:
        """The settlement script's trailing arguments for an actual cost."""
        return [actual, *self.settle_args]


def ticket(limits: list[MoneyLimit], price: TokenPrice, need: int,
           now: float | None = None) -> MoneyTicket:
    """The reservation of `need` (nano) on `limits`, as the admission script takes it: the
    worst case and the counters' lifetime, then per counter its limit, seed, span and bucket."""
    now = time.time() if now is None else now
    keys: list[str] = []
    per_counter: list[int | str] = []
    settle: list[int | str] = []
    ends = []
    for limit in limits:
        end, bucket, seed = limit.window(now)
        keys.append(limit.counter(bucket))
        per_counter += [limit.amount, seed, limit.span, bucket]
        settle += [limit.span, bucket]
        ends.append(end)
    ttl = int(max(ends) - now) + GRACE_SECONDS
    if any(limit.span for limit in limits):
        ttl = max(ttl, max(limit.span for limit in limits) * BUCKET_SECONDS + GRACE_SECONDS)
    return MoneyTicket(limits, keys, [need, ttl, *per_counter], settle, need, price, ends)


def load_limits(now: datetime) -> dict[tuple[int, int], MoneyLimit]:
    """Every hard budget by (tenant id, key id or 0), with its period's spend so far."""
    limits: dict[tuple[int, int], MoneyLimit] = {}
    for budget in MoneyBudget.objects.filter(hard_limit=True):
        start, end = budget.bounds(now)
        if budget.rolling:
            span = rolling_span(budget.period)
            seed = _rolling_seed(budget, start, span)
        else:
            span = 0
            seed = str(nano(KeyUsage.objects.spend(budget.tenant_id, start,
                                                   key_id=budget.api_key_id)))
        limits[(budget.tenant_id, budget.api_key_id or 0)] = MoneyLimit(
            budget.pk, budget.tenant_id, budget.api_key_id or 0, nano(budget.amount),
            budget.period, budget.time_zone, start.timestamp(), end.timestamp(), seed, span)
    return limits


def _rolling_seed(budget: MoneyBudget, start: datetime, span: int) -> str:
    """The window's spend in slices of `span / SEED_SLICES` buckets, each as `bucket:nano` at
    the slice's last bucket (so it leaves the window last)."""
    rows = KeyUsage.objects.filter(tenant_id=budget.tenant_id, bucket__gte=start)
    if budget.api_key_id:
        rows = rows.filter(api_key_id=budget.api_key_id)
    width = max(1, span // SEED_SLICES)
    slices: dict[int, Decimal] = {}
    for row in rows.values("bucket").annotate(cost=Sum("cost")):
        bucket = int(row["bucket"].timestamp()) // BUCKET_SECONDS
        last = (bucket // width + 1) * width - 1
        slices[last] = slices.get(last, Decimal(0)) + row["cost"]
    return ",".join(f"{b}:{nano(c)}" for b, c in sorted(slices.items()) if c > 0)


def worst_case(price: TokenPrice, prompt_tokens: int, completion_tokens: int) -> int:
    """The most a request can cost (nano): no prompt token cached, every completion token."""
    return nano(price.cost(prompt_tokens, 0, completion_tokens))


def counted(client: Any, budgets: list[MoneyBudget], now: datetime) -> dict[int, int | None]:
    """What each budget's Redis counter holds now (nano; None: no counter, e.g. nothing was
    admitted this period yet), in one pipelined read: the spend the gateway counts, including
    the reservations of requests in flight. A rolling window's buckets that left it are left
    out (admission drops them at its next request)."""
    pipe = client.pipeline(transaction=False)
    for budget in budgets:
        start, _ = budget.bounds(now)
        if budget.rolling:
            pipe.hgetall(f"gw:{{t{budget.tenant_id}}}:money:{budget.pk}:r")
        else:
            pipe.get(f"gw:{{t{budget.tenant_id}}}:money:{budget.pk}:{int(start.timestamp())}")
    found: dict[int, int | None] = {}
    for budget, value in zip(budgets, pipe.execute(), strict=True):
        if not value:
            found[budget.pk] = None
        elif budget.rolling:
            oldest = int(now.timestamp()) // BUCKET_SECONDS - rolling_span(budget.period) + 1
            found[budget.pk] = sum(int(v) for k, v in value.items()
                                   if k.isdigit() and int(k) >= oldest)
        else:
            found[budget.pk] = int(value)
    return found
