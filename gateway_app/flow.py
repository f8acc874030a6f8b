"""Flow control: each instance is sent at most its dispatch budget of requests at a time; the
rest wait in the gateway (not in the engine's queue), by priority band, then by fair share.

Everything lives in Redis, so it holds across every gateway worker and host, and is changed
only inside the admission and settlement scripts (`admission.py`), which carry the Lua below:

- per instance, `gw:{i<id>}:inflight`: a sorted set of the requests dispatched to it, scored by
  when their lease expires (Redis's clock). Its size is what the budget is checked against; a
  member whose gateway died expires with its lease. (The same key and members the control
  plane reads to finish a drain.) Those of its requests that hold one of the slots reserved
  for the upper bands beyond the budget (`GATEWAY_FLOW_RESERVED_SLOTS`) are also in
  `gw:{i<id>}:reserve`, and do not count against the budget.
- per deployment, under `gw:{d<id>}:fc`: a list of waiting request ids per tenant (`:q:<t>`),
  each waiter's details (`:w`), the backlogged tenants of each band scored by their virtual
  counter (`:b:<band>`), the bands with waiters (`:bands`), every tenant's virtual counter
  (`:v`), each band's counter (`:bv`, weighted bands), the requests in flight with what each
  was charged (`:cr`, `:cx` by lease expiry) summed per tenant (`:c`), and per-minute
  statistics (`:m:<min>`, read for the console by `serving_app.deployments.sharing`, which
  names these keys).

Fair share within a band is the virtual token counter (VTC, "Fairness in Serving Large Language
Models", OSDI 2024): a tenant's counter grows by the weighted tokens it is served divided by its
`fair_share_weight`; the waiter of the backlogged tenant with the smallest counter goes next. A
request is charged its reservation (prompt bound, every completion at its maximum) when it is
dispatched, and settlement replaces that by the engine's real count. A tenant that becomes
backlogged after idling is lifted to the least service settled among the backlogged tenants of
its band (a counter less the charges of that tenant's requests in flight, `:c`; or, with none,
the settled service of the band's last dispatch), so idling banks no credit beyond the others'
requests in flight. Lifted to their counters instead, it would trail them by their
reservations in flight, which settlement mostly gives back: beside a tenant holding every slot
it got every other freed slot while the other's refunds kept it ahead (docs/gpu.md).
Bands are strict (a band is served only while no higher band waits) or weighted (each band has
its own counter, grown by the weighted tokens it is served divided by the band's weight, and the
band with the smallest counter goes next, so a low band still progresses). Requests of the
upper bands (critical and high) may also take one of the slots reserved for them beyond the
budget when it is full, so that a flood of a lower band never makes them wait for its requests
to end; the slots within the budget are shared by band and fair share as before, so the reserve
takes nothing from the lower bands.

Where tenants with streamed latency objectives share the deployment, the admission controller
(`gateway_app/objectives.py`) keeps `:slo`: while one of them is active, a request of any other
tenant is dispatched only where the instance runs fewer requests than the controller's budget
(`fc_cap`); a waiter held back so lets a waiting objective tenant's request go first.

An admission while nobody waits in the deployment (the usual case) takes a shorter path in the
same script: with a slot free it is dispatched at once, charged and counted as queueing and then
dispatching it would have done, in less than half the Redis calls.

A waiter is woken cheaply: whichever script frees a slot (a settlement) or finds one (an
admission) pops the next waiter, records it on the instance and pushes `<request id>
<instance id>` onto its worker's list, which each worker reads with one blocking BLPOP loop. A
waiter that times out or whose client goes away runs one more script (`LEAVE_LUA`): still
queued, it leaves the queue; already granted, it uses the slot (timeout) or its settlement gives
the slot back and pops the next waiter (disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from gateway_app.catalog import InstanceEntry, TenantEntry
from gateway_app.config import GatewayConfig
from gateway_app.resp import Arg, PipelinedRedis, RedisReplyError, RedisUnavailable, Script
from serving_app.deployments.sharing import OBJECTIVE_IDLE_SECONDS, STATS_KEPT_SECONDS, prefix

__all__ = ["FlowControl", "Slot", "prefix"]

log = logging.getLogger(__name__)

BLOCK_SECONDS = 1
_DEPLOYMENT = re.compile(r"gw:\{d(\d+)\}:fc$")
WAKE_TTL_MS = 300_000  # a dead worker's list is dropped after this
STATS_TTL_MS = STATS_KEPT_SECONDS * 1000
# An objective tenant with nothing in flight for this long is idle: the others' budget is whole
# again (the admission controller, gateway_app/objectives.py).
OBJECTIVE_IDLE_MS = int(OBJECTIVE_IDLE_SECONDS * 1000)

# Shared by the admission and settlement scripts. `fa` is the index in ARGV of the first flow
# argument (see `enter_args()` / `settle_args()`).
LUA_LIB = r"""
local function fc_split(s, sep)
  local out = {}
  for part in string.gmatch(s, '[^' .. sep .. ']+') do out[#out + 1] = part end
  return out
end
local function fc_num(v) return string.format('%.17g', v) end

-- The instance among `spec` ("id:budget,...") that may take one more request, the least
-- loaded first, and whether it is one of its `extra` reserved slots; `cands` (",id,id,")
-- narrows it to instances that can serve the request. The requests on reserved slots (in
-- `gw:{i<id>}:reserve` as well) do not count against the budget; `reserve` is how many an
-- instance may have (0: none, nothing to read). `cap`, when not nil, lowers every budget to
-- it (the admission controller's budget for tenants without objectives, `fc_cap`).
local function fc_free(spec, cands, now, extra, reserve, cap)
  local best, best_n, best_r = nil, nil, false
  for _, item in ipairs(fc_split(spec, ',')) do
    local id, budget = string.match(item, '(%d+):(%d+)')
    if cands == '' or string.find(cands, ',' .. id .. ',', 1, true) then
      local key = 'gw:{i' .. id .. '}:inflight'
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
      local n = redis.call('ZCARD', key)
      local r = 0
      if reserve > 0 then
        local rkey = 'gw:{i' .. id .. '}:reserve'
        redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
        r = redis.call('ZCARD', rkey)
      end
      local limit = tonumber(budget)
      if cap and cap < limit then limit = cap end
      local in_budget = n - r < limit
      if (in_budget or r < extra) and (best_n == nil or n < best_n) then
        best, best_n, best_r = id, n, not in_budget
      end
    end
  end
  return best, best_r
end

-- Record request `rid` on instance `inst` until `expires`, on a reserved slot or not.
local function fc_take(inst, rid, expires, reserved)
  redis.call('ZADD', 'gw:{i' .. inst .. '}:inflight', expires, rid)
  if reserved then
    local rkey = 'gw:{i' .. inst .. '}:reserve'
    redis.call('ZADD', rkey, expires, rid)
    redis.call('PEXPIREAT', rkey, expires)
  end
end

local function fc_give_back(inst, rid)
  redis.call('ZREM', 'gw:{i' .. inst .. '}:inflight', rid)
  redis.call('ZREM', 'gw:{i' .. inst .. '}:reserve', rid)
end

-- `bws` holds the four bands' weights, then the reserve: slots beyond each instance's budget
-- that only requests of the upper bands (critical and high) may use, so that they need not
-- wait for a lower band's requests to end (the engine then runs them first, by priority).
local function fc_reserve(bws)
  return tonumber(bws[5] or '0')
end

local function fc_settled_hold(bws)
  return tonumber(bws[6] or '0')
end

local function fc_extra(bws, band)
  if tonumber(band) < 2 then return fc_reserve(bws) end
  return 0
end

local function fc_stat(P, now, field, by)
  if by == 0 then return end  -- the readers count a missing field as 0
  local key = P .. ':m:' .. math.floor(now / 60000)
  redis.call('HINCRBYFLOAT', key, field, by)
  redis.call('PEXPIRE', key, STATS_TTL)
end

local function fc_band(P, strict)
  if strict then
    local first = redis.call('ZRANGE', P .. ':bands', 0, 0)
    return first[1]
  end
  local best, best_v = nil, nil
  for _, b in ipairs(redis.call('ZRANGE', P .. ':bands', 0, -1)) do
    local v = tonumber(redis.call('HGET', P .. ':bv', b) or '0')
    if best_v == nil or v < best_v then best, best_v = b, v end
  end
  return best
end

local function fc_unqueue(P, band, t, rid)
  redis.call('LREM', P .. ':q:' .. t, 1, rid)
  redis.call('HDEL', P .. ':w', rid)
  if redis.call('LLEN', P .. ':q:' .. t) == 0 then
    redis.call('ZREM', P .. ':b:' .. band, t)
    if redis.call('ZCARD', P .. ':b:' .. band) == 0 then redis.call('ZREM', P .. ':bands', band) end
  end
end

-- Add `amount` weighted tokens (negative: a correction) to tenant `t` and its band.
local function fc_charge(P, band, t, weight, amount, bws)
  local v = tonumber(redis.call('HGET', P .. ':v', t) or '0') + amount / weight
  redis.call('HSET', P .. ':v', t, fc_num(v))
  if redis.call('ZSCORE', P .. ':b:' .. band, t) then
    redis.call('ZADD', P .. ':b:' .. band, v, t)
  end
  local bw = tonumber(bws[tonumber(band) + 1] or '1')
  redis.call('HINCRBYFLOAT', P .. ':bv', band, amount / bw)
end

-- A request holding a slot is recorded with what it was charged in its tenant's counter
-- (`:cr`: rid -> "tenant|amount"; `:cx`: rid scored by its lease's expiry), and each tenant's
-- requests in flight are summed (`:c`). A counter less that sum is the service the tenant has
-- been settled so far: the level a tenant becoming backlogged is lifted to (`fc_level`).
local function fc_unhold(P, rid)
  local e = redis.call('HGET', P .. ':cr', rid)
  if not e then return end  -- settled already, or its lease expired and it was swept
  redis.call('HDEL', P .. ':cr', rid)
  redis.call('ZREM', P .. ':cx', rid)
  local f = fc_split(e, '|')
  local left = tonumber(redis.call('HINCRBYFLOAT', P .. ':c', f[1], -tonumber(f[2])))
  if left <= 1e-6 then redis.call('HDEL', P .. ':c', f[1]) end
end

-- Holds whose lease expired without a settlement (their gateway died) are let go.
local function fc_sweep(P, now)
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', P .. ':cx', '-inf', now, 'LIMIT', 0, 64)) do
    fc_unhold(P, rid)
  end
end

-- The admission controller's state (gateway_app/objectives.py, which steps it): `:slo` holds
-- the deployment's tenants with streamed objectives (",id,id,"), the budget per instance it
-- allows the others, and when an objective tenant's request last settled (`seen`). It expires
-- when no gateway reports it any more (no such tenant left): then nothing is capped.
local function fc_slo(P)
  local s = redis.call('HMGET', P .. ':slo', 'tenants', 'budget', 'seen')
  if not s[1] or not s[2] then return nil end
  return {tenants = s[1], budget = math.floor(tonumber(s[2])), seen = tonumber(s[3] or '0')}
end

local function fc_has_objective(slo, t)
  return string.find(slo.tenants, ',' .. t .. ',', 1, true) ~= nil
end

-- An objective tenant is active while one of its requests holds a slot (`:c`, swept of dead
-- gateways' holds) or settled less than OBJECTIVE_IDLE ms ago (a client between two requests
-- is not idle). Idle, the others get the instances' whole budget back at once.
local function fc_slo_active(P, slo, now)
  if now - slo.seen < OBJECTIVE_IDLE then return true end
  fc_sweep(P, now)
  local held = redis.call('HMGET', P .. ':c', unpack(fc_split(slo.tenants, ',')))
  for _, h in ipairs(held) do
    if h and tonumber(h) > 1e-6 then return true end
  end
  return false
end

-- The budget a request of tenant `t` is held to below the instances' own: nil for none (no
-- objectives here, `t` has one, or their tenants are idle).
local function fc_cap(P, t, now)
  local slo = fc_slo(P)
  if not slo or fc_has_objective(slo, t) or not fc_slo_active(P, slo, now) then return nil end
  return slo.budget
end

-- The best waiting tenant with an objective: the first of the bands in their order, and of
-- its 64 lowest counters. Asked when the best waiter overall is capped and finds no slot.
local function fc_slo_waiter(P)
  local slo = fc_slo(P)
  if not slo then return nil end
  for _, b in ipairs(redis.call('ZRANGE', P .. ':bands', 0, -1)) do
    local tops = redis.call('ZRANGE', P .. ':b:' .. b, 0, 63, 'WITHSCORES')
    for i = 1, #tops, 2 do
      if fc_has_objective(slo, tops[i]) then return b, {tops[i], tops[i + 1]} end
    end
  end
  return nil
end

-- What a tenant of `band` that becomes backlogged is lifted to: the least service settled
-- among the band's backlogged tenants (counter less what their requests in flight were
-- charged), or with none, the settled service of the band's last dispatch. Not their counters:
-- those include the reservations of the requests they have in flight, most of which
-- settlement gives back, so a tenant arriving beside one that holds every slot would get only
-- every other freed slot while the other's refunds kept it ahead (the ramp in docs/gpu.md).
-- What it may bank is bounded by the others' requests in flight. Read among the 64 lowest
-- counters, so that the script's time stays bounded however many tenants wait: one further up
-- would have to hold more in flight than its lead, and missing it only lifts a little higher.
local function fc_level(P, band, now)
  local backlogged = redis.call('ZRANGE', P .. ':b:' .. band, 0, 63, 'WITHSCORES')
  if #backlogged == 0 then return tonumber(redis.call('HGET', P .. ':floor', band) or '0') end
  fc_sweep(P, now)
  local names = {}
  for i = 1, #backlogged, 2 do names[#names + 1] = backlogged[i] end
  local held = redis.call('HMGET', P .. ':c', unpack(names))
  local level = nil
  for i, _ in ipairs(names) do
    local settled = tonumber(backlogged[2 * i]) - tonumber(held[i] or '0')
    if level == nil or settled < level then level = settled end
  end
  return level
end

-- A slot settled by a tenant below its share (its settled service under the least of its
-- band's backlogged tenants) while others wait and none of its own requests does (its clients
-- are between two requests) is held for it `fc_settled_hold` ms. On a saturated engine the
-- slot would go to a waiter before that tenant's client has sent again, and since requests of
-- one length end in waves its next request would then wait for the next wave (docs/gpu.md):
-- the tenant would hold fewer slots than its share. The hold is a member of the instance's
-- in-flight set that expires like a lease (`hold:<rid>`) and an entry in the tenant's holds
-- (`:h:<t>`); the tenant's next request takes it (`fc_take_hold`). Returns the hold's length,
-- 0 when none: the settling worker pumps the waiters once it has passed, in case nothing else
-- does.
local function fc_hold(P, band, t, inst, rid, now, bws)
  local ms = fc_settled_hold(bws)
  if ms <= 0 or redis.call('LLEN', P .. ':q:' .. t) > 0 then return 0 end
  if redis.call('ZCARD', P .. ':b:' .. band) == 0 then return 0 end
  local settled = tonumber(redis.call('HGET', P .. ':v', t) or '0')
    - tonumber(redis.call('HGET', P .. ':c', t) or '0')
  if settled >= fc_level(P, band, now) then return 0 end
  local member = 'hold:' .. rid
  redis.call('ZADD', 'gw:{i' .. inst .. '}:inflight', now + ms, member)
  redis.call('ZADD', P .. ':h:' .. t, now + ms, inst .. ' ' .. member)
  redis.call('PEXPIRE', P .. ':h:' .. t, ms + 1000)
  return ms
end

-- The instance of a slot held for tenant `t` that can serve its request (`cands`), taken; nil
-- when none. A hold it cannot use is let go (the pump that follows hands it on).
local function fc_take_hold(P, t, now, cands)
  local key = P .. ':h:' .. t
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  for _, entry in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    redis.call('ZREM', key, entry)
    local inst, member = string.match(entry, '(%d+) (.+)')
    local held = redis.call('ZREM', 'gw:{i' .. inst .. '}:inflight', member) == 1
    if held and (cands == '' or string.find(cands, ',' .. inst .. ',', 1, true)) then
      return inst
    end
  end
  return nil
end

-- Dispatch request `rid` of tenant `t` (virtual counter `v`) to `inst`: record it and what it
-- is charged, make `t`'s settled service the band's floor, charge it, count it and the time it
-- waited.
local function fc_dispatch(P, now, band, t, v, rid, inst, reserved, lease, weight, charge,
                           waited, bws)
  fc_take(inst, rid, now + lease, reserved)
  local amount = charge / weight
  redis.call('HSET', P .. ':cr', rid, t .. '|' .. fc_num(amount))
  redis.call('ZADD', P .. ':cx', now + lease, rid)
  local held = tonumber(redis.call('HINCRBYFLOAT', P .. ':c', t, amount)) - amount
  redis.call('HSET', P .. ':floor', band, fc_num(tonumber(v) - held))
  fc_charge(P, band, t, weight, charge, bws)
  fc_stat(P, now, 'n:' .. t, 1)
  fc_stat(P, now, 'w:' .. t, waited)
end

-- Hand free slots to waiters, best first, until no slot or no waiter is left. A grant to
-- `self_rid` (the request being admitted) is returned instead of pushed to its worker.
local function fc_pump(P, now, strict, bws, spec, lease, self_rid)
  local mine = nil
  -- nil: every waiter; 'upper': a lower band found no slot, only the upper bands' reserve is
  -- left; 'slo': a waiter held to the controller's budget found none, only the tenants with
  -- objectives may still take one.
  local only = nil
  for _ = 1, 10000 do
    local band, top
    if only == 'upper' then
      band = redis.call('ZRANGE', P .. ':bands', 0, 0)[1]
      if not band or tonumber(band) >= 2 then break end
    elseif only == 'slo' then
      band, top = fc_slo_waiter(P)
      if not band then break end
    else
      band = fc_band(P, strict)
      if not band then break end
    end
    top = top or redis.call('ZRANGE', P .. ':b:' .. band, 0, 0, 'WITHSCORES')
    local t = top[1]
    local rid = redis.call('LINDEX', P .. ':q:' .. t, 0)
    local info = rid and redis.call('HGET', P .. ':w', rid)
    if not info then
      if rid then redis.call('LPOP', P .. ':q:' .. t) end
      if redis.call('LLEN', P .. ':q:' .. t) == 0 then fc_unqueue(P, band, t, '') end
    else
      local f = fc_split(info, '|')
      -- wake, weight, charge, deadline, enqueued, cands
      local cands = f[6] or ''
      if tonumber(f[4]) < now then
        fc_unqueue(P, band, t, rid)  -- its worker answers 503 (it has left, or will)
      else
        local cap = fc_cap(P, t, now)
        local inst, reserved = fc_free(spec, cands, now, fc_extra(bws, band), fc_reserve(bws),
                                       cap)
        if not inst then
          if cap and only == nil then
            only = 'slo'
          elseif only ~= nil or tonumber(band) < 2 or fc_reserve(bws) == 0 then
            break
          else
            only = 'upper'
          end
        else
          fc_unqueue(P, band, t, rid)
          fc_dispatch(P, now, band, t, top[2], rid, inst, reserved, lease, tonumber(f[2]),
                      tonumber(f[3]), now - tonumber(f[5]), bws)
          if rid == self_rid then
            mine = inst
          else
            redis.call('RPUSH', f[1], rid .. ' ' .. inst .. ' ' .. P)
            redis.call('PEXPIRE', f[1], WAKE_TTL)
          end
        end
      end
    end
  end
  return mine
end

-- Admission: queue the request, then hand out free slots. Returns the instance granted to it,
-- or 0 while it waits.
local function fc_enter(fa, rid, now, lease)
  local P, t, band, weight = ARGV[fa], ARGV[fa + 1], ARGV[fa + 2], tonumber(ARGV[fa + 3])
  local charge, wake, timeout = ARGV[fa + 4], ARGV[fa + 5], tonumber(ARGV[fa + 6])
  local strict, bws, spec, cands = ARGV[fa + 7] == '1', fc_split(ARGV[fa + 8], ','),
    ARGV[fa + 9], ARGV[fa + 10]
  if tonumber(ARGV[fa + 11] or '0') > 0 then now = tonumber(ARGV[fa + 11]) end
  local held = redis.call('EXISTS', P .. ':h:' .. t) == 1 and fc_take_hold(P, t, now, cands)
  if held then
    -- Its own slot, kept since its last request settled: no lift (it was below the others).
    fc_dispatch(P, now, band, t, redis.call('HGET', P .. ':v', t) or '0', rid, held, false,
                lease, weight, tonumber(charge), 0, bws)
    return tonumber(held)
  end
  if redis.call('EXISTS', P .. ':bands') == 0 then
    -- Nobody waits (the usual case): with a slot free, what queueing then the pump would do,
    -- in less than half the calls.
    local inst, reserved = fc_free(spec, cands, now, fc_extra(bws, band), fc_reserve(bws),
                                   fc_cap(P, t, now))
    if inst then
      local v = tonumber(redis.call('HGET', P .. ':v', t) or '0')
      local floor = tonumber(redis.call('HGET', P .. ':floor', band) or '0')
      if v < floor then v = floor; redis.call('HSET', P .. ':v', t, fc_num(v)) end
      fc_dispatch(P, now, band, t, fc_num(v), rid, inst, reserved, lease, weight,
                  tonumber(charge), 0, bws)
      return tonumber(inst)
    end
  end
  if redis.call('LLEN', P .. ':q:' .. t) == 0 then
    -- Becomes backlogged: lifted so that idling banks no credit.
    local v = tonumber(redis.call('HGET', P .. ':v', t) or '0')
    local floor = fc_level(P, band, now)
    if v < floor then v = floor; redis.call('HSET', P .. ':v', t, fc_num(v)) end
    if redis.call('ZCARD', P .. ':b:' .. band) == 0 then
      local bv = tonumber(redis.call('HGET', P .. ':bv', band) or '0')
      local lowest = nil
      for _, b in ipairs(redis.call('ZRANGE', P .. ':bands', 0, -1)) do
        local o = tonumber(redis.call('HGET', P .. ':bv', b) or '0')
        if lowest == nil or o < lowest then lowest = o end
      end
      if lowest and bv < lowest then redis.call('HSET', P .. ':bv', band, fc_num(lowest)) end
      redis.call('ZADD', P .. ':bands', tonumber(band), band)
    end
    redis.call('ZADD', P .. ':b:' .. band, v, t)
  end
  redis.call('RPUSH', P .. ':q:' .. t, rid)
  redis.call('HSET', P .. ':w', rid,
    table.concat({wake, weight, charge, now + timeout, now, cands}, '|'))
  local inst = fc_pump(P, now, strict, bws, spec, lease, rid)
  if inst then return tonumber(inst) end
  fc_stat(P, now, 'b:' .. t, 1)
  return 0
end

-- Settlement of a request that held a slot: free it, replace the dispatch charge by the real
-- weighted tokens, hold it for its tenant (`fc_hold`) or hand it on. Returns the hold's ms.
local function fc_settle(fa, rid, now)
  local P, t, band, weight = ARGV[fa], ARGV[fa + 1], ARGV[fa + 2], tonumber(ARGV[fa + 3])
  local charged, served, inst = tonumber(ARGV[fa + 4]), tonumber(ARGV[fa + 5]), ARGV[fa + 6]
  local strict, bws, spec, lease = ARGV[fa + 7] == '1', fc_split(ARGV[fa + 8], ','),
    ARGV[fa + 9], tonumber(ARGV[fa + 10])
  if tonumber(ARGV[fa + 11] or '0') > 0 then now = tonumber(ARGV[fa + 11]) end
  -- A slot of the upper bands' reserve is not held: it is not one of the budget's.
  local reserved = redis.call('ZSCORE', 'gw:{i' .. inst .. '}:reserve', rid)
  fc_give_back(inst, rid)
  fc_unhold(P, rid)
  local slo = fc_slo(P)
  if slo and fc_has_objective(slo, t) then redis.call('HSET', P .. ':slo', 'seen', now) end
  fc_charge(P, band, t, weight, served - charged, bws)
  fc_stat(P, now, 's:' .. t, served)
  local held = 0
  if not reserved then held = fc_hold(P, band, t, inst, rid, now, bws) end
  fc_pump(P, now, strict, bws, spec, lease, nil)
  return held
end
""".replace("STATS_TTL", str(STATS_TTL_MS)).replace("WAKE_TTL", str(WAKE_TTL_MS)).replace(
    "OBJECTIVE_IDLE", str(OBJECTIVE_IDLE_MS))

# A waiter that timed out or whose client went away: 0 when it left the queue, the instance when
# it had been granted one meanwhile, -1 when neither (dropped past its deadline).
LEAVE_LUA = """#!lua flags=allow-cross-slot-keys
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
""" + LUA_LIB + """
local P, rid, tenant, band, spec = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local info = redis.call('HGET', P .. ':w', rid)
if info then
  fc_unqueue(P, band, tenant, rid)
  fc_stat(P, now, 'x:' .. tenant, 1)
  fc_stat(P, now, 'xw:' .. tenant, now - tonumber(fc_split(info, '|')[5]))
  return 0
end
for _, item in ipairs(fc_split(spec, ',')) do
  local id = string.match(item, '(%d+):')
  if redis.call('ZSCORE', 'gw:{i' .. id .. '}:inflight', rid) then return tonumber(id) end
end
fc_stat(P, now, 'x:' .. tenant, 1)
return -1
"""
LEAVE_SCRIPT = Script(LEAVE_LUA)

# A slot nobody will use (its request went on without flow control, its admission's reply lost):
# free it and hand it on.
RELEASE_LUA = """#!lua flags=allow-cross-slot-keys
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
""" + LUA_LIB + """
fc_give_back(ARGV[3], ARGV[2])
fc_unhold(ARGV[1], ARGV[2])
fc_pump(ARGV[1], now, ARGV[4] == '1', fc_split(ARGV[5], ','), ARGV[6], tonumber(ARGV[7]), nil)
return 1
"""
RELEASE_SCRIPT = Script(RELEASE_LUA)

# Hand free slots to waiters: after a settled slot's hold has passed (`fc_hold`).
PUMP_LUA = """#!lua flags=allow-cross-slot-keys
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
""" + LUA_LIB + """
if tonumber(ARGV[6]) > 0 then now = tonumber(ARGV[6]) end
fc_pump(ARGV[1], now, ARGV[2] == '1', fc_split(ARGV[3], ','), ARGV[4], tonumber(ARGV[5]), nil)
return 1
"""
PUMP_SCRIPT = Script(PUMP_LUA)


def spec(instances: Iterable[InstanceEntry]) -> str:
    return ",".join(f"{i.id}:{i.budget}" for i in instances)


@dataclass(slots=True)
class Slot:
    """A request under flow control: what it was charged, and the instance it holds (0 while
    it waits, or once it left the queue without one)."""

    deployment_id: int
    tenant: TenantEntry
    charge: float
    spec: str
    cands: str
    instance_id: int = 0


class FlowControl:
    """One per worker: its wake-up list, the requests of this worker waiting for a slot, and
    the arguments the scripts need."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.wake_key = f"gw:fc:wake:{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        # A connection of its own: BLPOP blocks it.
        self.redis = PipelinedRedis(
            config.redis_url, config.redis_timeout + BLOCK_SECONDS, name=b"llm-console-flow"
        )
        self.waiters: dict[str, asyncio.Future[int]] = {}
        # Requests that left the queue after a grant whose message had not arrived yet: the
        # request handles that slot, the message is only dropped.
        self.left: set[str] = set()
        # The ready instances of a deployment (the worker's catalog), to hand a slot on.
        self.instances_of: Callable[[int], Iterable[InstanceEntry]] = lambda _: ()
        self._background: set[asyncio.Task[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        # The bands' weights, then the upper bands' reserve (`fc_reserve`), then how long a
        # settled slot is held for a tenant below its share (`fc_hold`).
        self._bands = ",".join(f"{w:g}" for w in (*config.flow_band_weights,
                                                    config.flow_reserved_slots,
                                                    config.flow_settled_hold_ms))
        # Tests replaying simulated time set this (ms, Redis's clock's scale); None: Redis's.
        self.clock: Callable[[], int] | None = None
        self._strict = "1" if config.flow_strict else "0"

    def start(self) -> None:
        self._task = asyncio.create_task(self._wake_loop(), name="gateway-flow-wake")

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.redis.aclose()

    async def _wake_loop(self) -> None:
        while True:
            try:
                reply = await self.redis.execute(b"BLPOP", self.wake_key, BLOCK_SECONDS)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("flow-control wake-ups unreachable: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if not reply:
                continue
            rid, inst, key = reply[1].decode().split(" ", 2)
            future = self.waiters.get(rid)
            if future is not None and not future.done():
                future.set_result(int(inst))
            elif rid in self.left:
                self.left.discard(rid)
            else:  # nobody waits for it here: give it back
                self._spawn(self._release(key, rid, int(inst)))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, key: str, rid: str, instance: int) -> None:
        match = _DEPLOYMENT.match(key)
        if match is None:
            return
        instances = spec(self.instances_of(int(match.group(1))))
        try:
            await self.redis_for_scripts.run_script(RELEASE_SCRIPT, [], [
                key, rid, instance, self._strict, self._bands, instances,
                self.config.lease_ms])
        except (RedisUnavailable, RedisReplyError) as exc:
            log.warning("flow-control slot of %s not released (expires with its lease): %s",
                        rid, exc)

    def abandon(self, request_id: str, slot: Slot) -> None:
        """The request goes on without flow control (its admission's reply was lost): take it
        out of the queue, or give back the slot it may have been granted, in the background."""
        self.forget(request_id)

        async def work() -> None:
            instance = await self.leave(request_id, slot)
            if instance:
                await self._release(prefix(slot.deployment_id), request_id, instance)

        self._spawn(work())

    def slot(self, deployment_id: int, tenant: TenantEntry, prompt: int, completion: int,
             instances: Iterable[InstanceEntry], cands: Iterable[InstanceEntry]) -> Slot:
        """A request's flow-control state before admission; `cands` are the instances that can
        serve it (all of the deployment's when equal)."""
        every = tuple(instances)
        able = tuple(cands)
        charge = (self.config.flow_input_weight * prompt
                  + self.config.flow_output_weight * completion)
        narrowed = "" if len(able) == len(every) else "," + ",".join(
            str(i.id) for i in able) + ","
        return Slot(deployment_id, tenant, charge, spec(every), narrowed)

    def enter_args(self, slot: Slot) -> list[Arg]:
        t = slot.tenant
        return [prefix(slot.deployment_id), t.id, t.priority, t.weight, f"{slot.charge:g}",
                self.wake_key, int(self.config.flow_queue_timeout * 1000), self._strict,
                self._bands, slot.spec, slot.cands, self.now()]

    def settle_args(self, slot: Slot, prompt: int, completion: int) -> list[Arg]:
        t = slot.tenant
        served = (self.config.flow_input_weight * prompt
                  + self.config.flow_output_weight * completion)
        return [prefix(slot.deployment_id), t.id, t.priority, t.weight, f"{slot.charge:g}",
                f"{served:g}", slot.instance_id, self._strict, self._bands, slot.spec,
                self.config.lease_ms, self.now()]

    def now(self) -> int:
        """The scripts' clock: 0 for Redis's own (`clock` is set only by simulations)."""
        return self.clock() if self.clock is not None else 0

    def pump_after(self, slot: Slot, hold_ms: int) -> None:
        """A settled slot is held for its tenant (`fc_hold`): once the hold has passed, hand
        it on if that tenant did not take it and nothing else did (in the background)."""
        async def work() -> None:
            await asyncio.sleep(hold_ms / 1000)
            try:
                await self.pump(slot)
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("flow-control waiters not pumped after a hold: %s", exc)

        self._spawn(work())

    async def pump(self, slot: Slot) -> None:
        """Hand the free slots of `slot`'s deployment to its waiters."""
        instances = spec(self.instances_of(slot.deployment_id)) or slot.spec
        await self.redis_for_scripts.run_script(PUMP_SCRIPT, [], [
            prefix(slot.deployment_id), self._strict, self._bands, instances,
            self.config.lease_ms, self.now()])

    def expect(self, request_id: str) -> asyncio.Future[int]:
        """Register before admission: a grant may arrive before the admission's reply."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.waiters[request_id] = future
        return future

    def forget(self, request_id: str) -> None:
        self.waiters.pop(request_id, None)

    async def leave(self, request_id: str, slot: Slot) -> int:
        """Leave the queue; the instance when a grant came first (0 if none), which the
        caller then uses or gives back through its settlement. With Redis unreachable: 0 (a
        waiter left behind is dropped once past its deadline)."""
        future = self.waiters.pop(request_id, None)
        args: list[Arg] = [prefix(slot.deployment_id), request_id, slot.tenant.id,
                           slot.tenant.priority, slot.spec]
        try:
            result = int(await self.redis_for_scripts.run_script(LEAVE_SCRIPT, [], args))
        except (RedisUnavailable, RedisReplyError) as exc:
            log.warning("%s could not leave the flow-control queue: %s", request_id, exc)
            return 0
        if result > 0 and (future is None or not future.done()):
            self.left.add(request_id)  # its grant's message is still to come
        return max(0, result)

    redis_for_scripts: PipelinedRedis  # the request path's connection (set by the Meter)
