"""Admission and settlement: one atomic Redis script each, so limits hold across any number of
gateway workers and hosts.

Per tenant (keys share the `{t<id>}` hash tag):
- requests per minute: a sliding log (sorted set of request ids scored by admission time);
- tokens per minute: a sliding log of reservations (sorted set + hash of tokens + running sum).
  Admission reserves the prompt estimate plus the most completion tokens the request may produce;
  settlement replaces the reservation by the engine's real count;
- concurrent requests: leases (sorted set scored by expiry), which expire by themselves if the
  gateway holding them dies;
- the monthly token budget: a counter per month (reservations and settled tokens). When it is
  missing (a new month, or Redis lost its data) it is seeded from what PostgreSQL has (this
  month's hourly rollups, read with the catalog) plus what the usage stream still holds for the
  tenant: a second counter per month, `unwritten`, that settlement raises by each event's tokens
  and the writer lowers when it stores the event (in the same transaction as the XDEL). So a
  Redis restart does not hand a tenant its month's tokens again.
The clock is Redis's own (`TIME`), so every worker and host agrees on the window.

- money budgets (`money.py`): a counter per budget's period or rolling window, the request's
  worst-case cost reserved on its key's and its tenant's, the actual cost settled. Their keys
  follow the others (`KEYS[9]` on) and their arguments come last, so a request without them
  sends nothing more.

Per instance, the same scripts keep the requests in flight (`serving_app.deployments.inflight`):
admission adds the request to the instance it will be sent to, settlement removes it, so the control
plane reads how many requests each instance still serves (to finish a drain) at no extra round trip.
That key is outside the tenant's hash tag (`allow-cross-slot-keys`: one Redis, or a cluster
that allows it).

Flow control (`flow.py`) rides on the same two scripts: admission queues the request on its
deployment and hands out free slots (often its own), settlement frees the request's slot and
hands it to the next waiter; the slots it counts are those per-instance in-flight sets. Its keys
are the deployment's and the instances', outside the tenant's hash tag too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gateway_app import flow, money
from gateway_app.catalog import TenantEntry
from gateway_app.errors import GatewayError
from gateway_app.resp import Arg

ADMIT = 0
RPM = 1
TPM = 2
CONCURRENCY = 3
BUDGET = 4
MONEY = 5

# `#!lua` (Redis 7 script flags): a full Redis (noeviction) refuses the whole script up front, so
# admission fails as the failure policy says. Without flags Redis would let a script that has
# already run one write (ZREMRANGEBYSCORE) go on writing, depending on the tenant's limits.
ADMIT_LUA = """#!lua flags=allow-cross-slot-keys
""" + flow.LUA_LIB + money.LUA_LIB + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local conc = tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
local need = tonumber(ARGV[6])
local window = tonumber(ARGV[7])
local lease = tonumber(ARGV[8])
local cutoff = now - window
local rpm_count, rpm_reset, used, tpm_reset = 0, 0, 0, 0

local function oldest_reset(key)
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if #first == 0 then return 0 end
  return math.max(0, tonumber(first[2]) + window - now)
end

if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
  rpm_count = redis.call('ZCARD', KEYS[1])
  if rpm_count >= rpm then
    local wait = oldest_reset(KEYS[1])
    return {1, rpm_count, wait, 0, 0, wait}
  end
end

if tpm > 0 then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff, 'LIMIT', 0, 5000)
  while #expired > 0 do
    local vals = redis.call('HMGET', KEYS[3], unpack(expired))
    local freed = 0
    for i = 1, #vals do freed = freed + (tonumber(vals[i]) or 0) end
    redis.call('HDEL', KEYS[3], unpack(expired))
    redis.call('ZREM', KEYS[2], unpack(expired))
    redis.call('DECRBY', KEYS[4], freed)
    expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff, 'LIMIT', 0, 5000)
  end
  used = tonumber(redis.call('GET', KEYS[4]) or '0')
  if used < 0 then used = 0; redis.call('SET', KEYS[4], 0) end
  if used + need > tpm then
    local wait = -1
    if need <= tpm then
      local excess = used + need - tpm
      local acc = 0
      wait = window
      local entries = redis.call('ZRANGE', KEYS[2], 0, 999, 'WITHSCORES')
      for i = 1, #entries, 2 do
        acc = acc + (tonumber(redis.call('HGET', KEYS[3], entries[i])) or 0)
        if acc >= excess then
          wait = math.max(0, tonumber(entries[i + 1]) + window - now)
          break
        end
      end
    end
    return {2, rpm_count, 0, used, oldest_reset(KEYS[2]), wait}
  end
end

if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
  if redis.call('ZCARD', KEYS[5]) >= conc then
    return {3, rpm_count, 0, used, 0, 1000}
  end
end

-- Money budgets: KEYS[9..] their counters; ARGV ends with the worst case, the counters'
-- lifetime, then each counter's limit, seed, span and bucket (money.ticket).
local mk = #KEYS - 8
local ma = #ARGV - 4 * mk - 1
for i = 1, mk do
  local a = ma + 4 * i - 2
  local spent = money_spent(KEYS[8 + i], ARGV[a + 1], tonumber(ARGV[a + 2]),
    tonumber(ARGV[a + 3]), ARGV[ma + 1])
  if spent + tonumber(ARGV[ma]) > tonumber(ARGV[a]) then
    return {5, rpm_count, 0, used, 0, -1, -1, i, spent}
  end
end

if budget > 0 then
  if redis.call('EXISTS', KEYS[6]) == 0 then
    local unwritten = math.max(0, tonumber(redis.call('GET', KEYS[7]) or '0'))
    redis.call('SET', KEYS[6], tonumber(ARGV[9]) + unwritten, 'EX', ARGV[10])
  end
  local spent = tonumber(redis.call('GET', KEYS[6]) or '0')
  if spent + need > budget then
    return {4, rpm_count, 0, used, 0, -1}
  end
  redis.call('INCRBY', KEYS[6], need)
  -- Which reservation the counter holds, so that settlement after a Redis loss (and a re-seed
  -- without it) does not take back tokens that were never added.
  redis.call('HSET', KEYS[3], 'b:' .. rid, need)
  redis.call('PEXPIRE', KEYS[3], window + lease)
end

if mk > 0 then
  for i = 1, mk do
    local a = ma + 4 * i - 2
    money_add(KEYS[8 + i], tonumber(ARGV[a + 2]), ARGV[a + 3], ARGV[ma], ARGV[ma + 1])
  end
  -- What the counters hold for this request, taken back by its settlement (not after a loss).
  redis.call('HSET', KEYS[3], 'm:' .. rid, ARGV[ma])
  redis.call('PEXPIRE', KEYS[3], window + lease)
end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, rid)
  redis.call('PEXPIRE', KEYS[1], window + 1000)
  rpm_count = rpm_count + 1
  rpm_reset = oldest_reset(KEYS[1])
end
if tpm > 0 then
  redis.call('ZADD', KEYS[2], now, rid)
  redis.call('HSET', KEYS[3], rid, need)
  redis.call('INCRBY', KEYS[4], need)
  for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], window + lease) end
  used = used + need
  tpm_reset = oldest_reset(KEYS[2])
end
if conc > 0 then
  redis.call('ZADD', KEYS[5], now + lease, rid)
  redis.call('PEXPIRE', KEYS[5], lease + 1000)
end
if ARGV[11] == '1' then
  redis.call('ZADD', KEYS[8], now + lease, rid)
  redis.call('PEXPIRE', KEYS[8], lease + 1000)
end
local granted = -1
if ARGV[12] == '1' then granted = fc_enter(13, rid, now, lease) end
return {0, rpm_count, rpm_reset, used, tpm_reset, 0, granted}
"""

# Settle a finished request and append its usage event, in one round trip. Idempotent for the
# token log (the reservation is replaced, not decremented twice). For a tenant with a budget the
# event's tokens also go to this month's `unwritten` counter (KEYS[7]), and the entry names that
# counter and the tokens, so that the writer lowers it when the event is stored. The request
# leaves its instance's in-flight set (KEYS[8]).
# `allow-oom`: a request admitted before Redis filled up still settles and appends its event
# (Redis grows past maxmemory by at most the requests in flight; admission stops new ones).
SETTLE_LUA = """#!lua flags=allow-oom,allow-cross-slot-keys
""" + flow.LUA_LIB + money.LUA_LIB + """
local rid = ARGV[1]
local actual = tonumber(ARGV[2])
-- Money budgets: KEYS[9..] their counters; ARGV ends with the actual cost, then each
-- counter's span and bucket.
local mk = #KEYS - 8
if mk > 0 then money_settle_request(KEYS[2], rid, 8, #ARGV - 2 * mk, mk) end
if ARGV[4] == '1' then
  local old = tonumber(redis.call('HGET', KEYS[2], rid))
  if old then
    redis.call('HSET', KEYS[2], rid, actual)
    redis.call('INCRBY', KEYS[3], actual - old)
  end
end
if ARGV[5] == '1' then redis.call('ZREM', KEYS[4], rid) end
if ARGV[9] == '1' then redis.call('ZREM', KEYS[8], rid) end
if ARGV[6] == '1' then
  local held = tonumber(redis.call('HGET', KEYS[2], 'b:' .. rid))
  if held then redis.call('HDEL', KEYS[2], 'b:' .. rid) end
  if redis.call('EXISTS', KEYS[5]) == 1 then
    redis.call('INCRBY', KEYS[5], actual - (held or 0))
  end
end
if ARGV[6] == '1' and actual > 0 then
  redis.call('INCRBY', KEYS[7], actual)
  redis.call('EXPIRE', KEYS[7], ARGV[8])
  redis.call('XADD', KEYS[6], '*', 'e', ARGV[7], 'u', KEYS[7], 'n', actual)
else
  redis.call('XADD', KEYS[6], '*', 'e', ARGV[7])
end
local held = 0
if ARGV[10] == '1' then
  local t = redis.call('TIME')
  held = fc_settle(11, rid, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
return held
"""


# A request that skips admission (its tenant has no limit) enters its instance's in-flight set
# with this, written without waiting for the reply; a request retried on another instance moves
# with it (KEYS[2], the set it leaves). `allow-oom`: the count of what is being served must
# hold even when Redis is full.
INFLIGHT_LUA = """#!lua flags=allow-oom,allow-cross-slot-keys
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
if #KEYS > 1 then redis.call('ZREM', KEYS[2], ARGV[1]) end
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease + 1000)
return 1
"""


def month_key(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y%m")


def seconds_to_month_end(now: datetime | None = None) -> int:
    now = now or datetime.now(UTC)
    later = now.replace(day=28) + timedelta(days=4)
    nxt = later.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((nxt - now).total_seconds()))


class _Month:
    """This month's key and end, recomputed once the month is over (not at every request)."""

    key = ""
    ends_at = 0.0

    @classmethod
    def current(cls) -> tuple[str, float]:
        now = time.time()
        if now >= cls.ends_at:
            at = datetime.fromtimestamp(now, UTC)
            cls.key, cls.ends_at = month_key(at), now + seconds_to_month_end(at)
            _tenant_keys.clear()
        return cls.key, cls.ends_at


_tenant_keys: dict[int, list[str]] = {}


def tenant_keys(tenant_id: int) -> list[str]:
    month, _ = _Month.current()
    keys = _tenant_keys.get(tenant_id)
    if keys is None:
        tag = f"gw:{{t{tenant_id}}}"
        keys = _tenant_keys[tenant_id] = [
            f"{tag}:rpm",
            f"{tag}:tpm",
            f"{tag}:tpmv",
            f"{tag}:tpms",
            f"{tag}:conc",
            f"{tag}:budget:{month}",
            f"{tag}:unwritten:{month}",
        ]
    return keys


@dataclass(slots=True)
class Decision:
    """The script's answer, turned into response headers (and an error when refused)."""

    code: int
    rpm_count: int
    rpm_reset_ms: int
    tpm_used: int
    tpm_reset_ms: int
    wait_ms: int
    instance: int = -1  # flow control: the instance granted, 0 while waiting, -1 not used
    money_at: int = 0  # a money budget refused: its place among the ticket's (1-based)
    money_spent: int = 0  # and its spend (nano)


def duration(ms: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `250ms`."""
    if ms < 1000:
        return f"{max(0, int(ms))}ms"
    seconds = ms / 1000.0
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(math.ceil(seconds)), 60)
    return f"{minutes}m{rest}s"


def rate_headers(tenant: TenantEntry, decision: Decision | None) -> dict[str, str]:
    """`x-ratelimit-*` for the limits the tenant has (remaining after this request)."""
    headers: dict[str, str] = {}
    if decision is None:
        return headers
    if tenant.rpm:
        headers["x-ratelimit-limit-requests"] = str(tenant.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, tenant.rpm - decision.rpm_count))
        headers["x-ratelimit-reset-requests"] = duration(decision.rpm_reset_ms)
    if tenant.tpm:
        headers["x-ratelimit-limit-tokens"] = str(tenant.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, tenant.tpm - decision.tpm_used))
        headers["x-ratelimit-reset-tokens"] = duration(decision.tpm_reset_ms)
    return headers


def refusal(tenant: TenantEntry, decision: Decision, need: int) -> GatewayError:
    """The 429 for a refused admission, with `retry-after` the real time to wait."""
    headers = rate_headers(tenant, decision)
    wait_ms = decision.wait_ms
    if decision.code == BUDGET:
        wait_ms = seconds_to_month_end() * 1000
    if wait_ms >= 0:
        headers["retry-after"] = str(max(1, math.ceil(wait_ms / 1000)))
        headers["retry-after-ms"] = str(max(1, int(wait_ms)))
    if decision.code == RPM:
        message = (
            f"Rate limit reached for requests per min (RPM): Limit {tenant.rpm}, "
            f"Used {decision.rpm_count}. Please try again in {duration(wait_ms)}."
        )
        return GatewayError(429, message, code="rate_limit_exceeded", headers=headers)
    if decision.code == TPM:
        if wait_ms < 0:
            message = (
                f"Request too large for tokens per min (TPM): Limit {tenant.tpm}, "
                f"Requested {need}. Lower max_tokens or the prompt."
            )
        else:
            message = (
                f"Rate limit reached for tokens per min (TPM): Limit {tenant.tpm}, "
                f"Used {decision.tpm_used}, Requested {need}. "
                f"Please try again in {duration(wait_ms)}."
            )
        return GatewayError(429, message, code="rate_limit_exceeded", headers=headers)
    if decision.code == CONCURRENCY:
        message = (
            f"Too many concurrent requests: Limit {tenant.concurrency}. "
            "Please try again when one of your requests has finished."
        )
        return GatewayError(429, message, code="rate_limit_exceeded", headers=headers)
    message = (
        "You exceeded your current quota (monthly token budget "
        f"{tenant.budget}), please check your plan and billing details."
    )
    return GatewayError(
        429, message, code="insufficient_quota", error_type="insufficient_quota", headers=headers
    )


def admit_args(tenant: TenantEntry, request_id: str, need: int, window_ms: int, lease_ms: int,
               count_in_flight: bool = False, limits: bool = True) -> list[Arg]:
    """The admission script's arguments; `limits` False: none of the tenant's limits is charged
    (they were, by an admission before: only the in-flight count and flow control remain)."""
    return [
        request_id,
        (tenant.rpm or 0) if limits else 0,
        (tenant.tpm or 0) if limits else 0,
        (tenant.concurrency or 0) if limits else 0,
        (tenant.budget or 0) if limits else 0,
        need,
        window_ms,
        lease_ms,
        tenant.month_used,
        budget_ttl(),
        "1" if count_in_flight else "0",
    ]


def budget_ttl() -> int:
    """Seconds a month's budget counters are kept: past the month's end, so late settlements
    still find them."""
    return max(1, int(_Month.current()[1] - time.time())) + 7 * 86400
