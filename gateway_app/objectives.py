"""The admission controller: streamed latency objectives held on a shared engine, by lowering the
other tenants' dispatch budget only while a tenant with objectives is active and near them.

On one engine every running request advances once per step, and a step's time grows with the
batch (docs/gpu.md): the only lever the gateway has on a tenant's time to first token (TTFT) and
time per output token (TPOT) is how many requests of the others it lets into the batch. A static
budget pays for that in throughput all the time, the latency tenant's idle time included; this
controller pays only while it matters.

Measuring (per worker, `LatencyWatch`). Every stream of a tenant with a TTFT or TPOT objective
(`Tenant.ttft_objective_ms`, `tpot_objective_ms`) on a flow-controlled deployment is watched as
it is relayed: its first token's time from the request's start (the gateway's queue included,
what the client sees), then every `PERIOD_SECONDS` the mean time between its tokens since the
last look. A stream still without a first token past its objective, or stalled past its TPOT
objective, counts with the time so far (a lower bound that is already a miss). Each worker
reports, per deployment, the worst ratio measured / objective over its streams in the period,
and the TTFT and TPOT behind it, to Redis (`CONTROL_LUA`), where reports of every worker are
merged by their maximum and the controller steps at most once a period (Redis's clock).

Deciding (`CONTROL_LUA`, one atomic step per period, shared by every worker): additive increase,
multiplicative decrease (AIMD) of the others' budget per instance on that worst ratio r:
- r above `HIGH` (0.9 of the objective): the budget is halved, down to a floor;
- r below `LOW` (0.7): it grows by 1/16 of the engine's full budget, up to the full budget;
- between the two, or no stream measured in the period: it holds.
Why AIMD: the engine's latency against its batch is monotonic but its shape moves with the
prompts and outputs in flight, so no fixed budget is right; halving reaches a safe batch in a
few periods (128 to 8 in one second) when an objective is about to be missed, and the slow
additive climb gives throughput back without overshooting into the next miss. The band between
LOW and HIGH keeps it from oscillating on every period's noise. The worst ratio rather than a
percentile: a period holds a few streams' tokens, too few for a percentile, and the objective
is missed by the slowest of them. The floor (`FLOOR_FRACTION` of the full budget, at least
`FLOOR_MIN`) keeps the others served: budget 8 of 130 held customer service within 1.23x of its
time alone on the H100 (docs/gpu.md).

Holding (`gateway_app/flow.py`, `fc_cap`): the budget applies only while a tenant with objectives
is active, that is, one of its requests holds a slot or settled less than
`OBJECTIVE_IDLE_SECONDS` ago (its client between two requests); idle, the others get the
engine's whole budget at the next dispatch. The budget learned is kept for the next burst, which
then meets the others already held back; it keeps climbing back while the objective is met.
The tenants with objectives themselves always have the full budget. With no such tenant on a
deployment nothing is reported, the state expires, and flow control is as without it: the
shipped default protects every tenant that states an objective, with no budget to tune.

Its state (budget over time, objectives, measured latency) is read for the console by
`serving_app.deployments.sharing.admission_state()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gateway_app.catalog import Snapshot, TenantEntry
from gateway_app.flow import LUA_LIB
from gateway_app.resp import Arg, PipelinedRedis, RedisReplyError, RedisUnavailable, Script
from serving_app.deployments.sharing import ADMISSION_HISTORY, ADMISSION_PERIOD_SECONDS, prefix

__all__ = ["CONTROL_SCRIPT", "LatencyWatch", "Observation", "Stream", "floor_of"]

log = logging.getLogger(__name__)

PERIOD_SECONDS = ADMISSION_PERIOD_SECONDS
HIGH = 0.9  # of the objective: lower the others' budget above this
LOW = 0.7  # raise it below this
DECREASE = 0.5
INCREASE_FRACTION = 1 / 16  # of the full budget, per period
FLOOR_FRACTION = 1 / 16
FLOOR_MIN = 2
STATE_TTL_SECONDS = 10  # the state outlives the last report by this: then nothing is capped

# ARGV: prefix, now in ms (0: Redis's clock; tests inject theirs), the instances' full budget,
# the floor, the worker's worst ratio in the period (-1: nothing measured), the TTFT and TPOT
# behind it in ms (-1: none), the objective tenants (",id,id,"), their tightest TTFT and TPOT
# objectives in ms (0: none). Returns the budget the others are held to now (the full one
# while the objective tenants are idle).
CONTROL_LUA = """#!lua flags=allow-cross-slot-keys
""" + LUA_LIB + """
local P, now = ARGV[1], tonumber(ARGV[2])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local full, floor = tonumber(ARGV[3]), tonumber(ARGV[4])
local ratio, ttft, tpot = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local K = P .. ':slo'
local s = redis.call('HMGET', K, 'budget', 'pending', 'pending_ttft', 'pending_tpot', 'stepped',
                     'seen')
local budget = math.min(full, tonumber(s[1] or full))
local pending, p_ttft, p_tpot = tonumber(s[2] or -1), tonumber(s[3] or -1), tonumber(s[4] or -1)
-- Every worker's report is merged into the period's worst.
pending, p_ttft, p_tpot = math.max(pending, ratio), math.max(p_ttft, ttft), math.max(p_tpot, tpot)
redis.call('HSET', K, 'tenants', ARGV[8], 'full', full, 'floor', floor,
           'ttft_objective', ARGV[9], 'tpot_objective', ARGV[10], 'pending', pending,
           'pending_ttft', p_ttft, 'pending_tpot', p_tpot)
local active = fc_slo_active(P, {tenants = ARGV[8], seen = tonumber(s[6] or 0)}, now)
if now - tonumber(s[5] or 0) >= PERIOD then
  if active and pending >= 0 then
    if pending > HIGH then
      budget = math.max(floor, budget * DECREASE)
    elseif pending < LOW then
      budget = math.min(full, budget + math.max(1, full * INCREASE))
    end
  end
  local held = full
  if active then held = math.floor(budget) end
  redis.call('HSET', K, 'budget', fc_num(budget), 'stepped', now, 'ratio', pending,
             'ttft', p_ttft, 'tpot', p_tpot, 'pending', -1, 'pending_ttft', -1,
             'pending_tpot', -1)
  redis.call('RPUSH', K .. ':h', table.concat({now, held, pending, p_ttft, p_tpot}, '|'))
  redis.call('LTRIM', K .. ':h', -HISTORY, -1)
end
redis.call('PEXPIRE', K, TTL)
redis.call('PEXPIRE', K .. ':h', TTL)
if active then return math.floor(budget) end
return full
""".replace("PERIOD", str(int(PERIOD_SECONDS * 1000))).replace("HIGH", repr(HIGH)).replace(
    "LOW", repr(LOW)).replace("DECREASE", repr(DECREASE)).replace(
    "INCREASE", repr(INCREASE_FRACTION)).replace("HISTORY", str(ADMISSION_HISTORY)).replace(
    "TTL", str(STATE_TTL_SECONDS * 1000))
CONTROL_SCRIPT = Script(CONTROL_LUA)


def floor_of(full: int) -> int:
    """The least budget the others are held to on an instance of budget `full`."""
    return min(full, max(FLOOR_MIN, math.ceil(full * FLOOR_FRACTION)))


@dataclass(frozen=True, slots=True)
class Observation:
    """A worker's worst measurement in a period: measured / objective (-1: nothing measured),
    and the TTFT and TPOT behind it in ms (-1: none)."""

    ratio: float = -1.0
    ttft_ms: float = -1.0
    tpot_ms: float = -1.0

    def worst(self, other: Observation) -> Observation:
        return Observation(max(self.ratio, other.ratio), max(self.ttft_ms, other.ttft_ms),
                           max(self.tpot_ms, other.tpot_ms))


@dataclass(slots=True, eq=False)
class Stream:
    """One streamed answer of a tenant with objectives, as relayed: `first_at`, `last_at` and
    `tokens` are kept by the relay (`gateway_app.proxy.StreamRelay`; one event per token)."""

    tenant: TenantEntry
    started: float  # time.perf_counter() when the request arrived
    first_at: Callable[[], float | None]
    last_at: Callable[[], float | None]
    tokens: Callable[[], int]
    ttft_seen: bool = False
    mark_at: float = 0.0  # the last token's time at the previous look
    mark_tokens: int = 0

    def look(self, now: float) -> Observation:
        """What this stream measured since the previous look (`now`: time.perf_counter())."""
        ttft_goal, tpot_goal = self.tenant.ttft_objective_ms, self.tenant.tpot_objective_ms
        found = Observation()
        first = self.first_at()
        if first is None:
            waited = (now - self.started) * 1000
            if ttft_goal and waited > ttft_goal:  # already a miss, however long it takes
                found = Observation(waited / ttft_goal, waited)
            return found
        if not self.ttft_seen:
            self.ttft_seen, self.mark_at, self.mark_tokens = True, first, 1
            ttft = (first - self.started) * 1000
            if ttft_goal:
                found = Observation(ttft / ttft_goal, ttft)
        last, tokens = self.last_at() or first, self.tokens()
        if tokens > self.mark_tokens and last > self.mark_at:
            tpot = (last - self.mark_at) * 1000 / (tokens - self.mark_tokens)
            self.mark_at, self.mark_tokens = last, tokens
        else:
            tpot = (now - self.mark_at) * 1000  # stalled: counts once past its objective
            if not tpot_goal or tpot <= tpot_goal:
                return found
        if tpot_goal:
            found = found.worst(Observation(tpot / tpot_goal, -1.0, tpot))
        return found


@dataclass(slots=True)
class LatencyWatch:
    """One per worker: the streams of tenants with objectives now relayed, per deployment, and
    the loop that reports them to the shared controller every period."""

    redis: PipelinedRedis
    snapshot: Callable[[], Snapshot] = Snapshot
    clock: Callable[[], float] = time.perf_counter  # the relay's clock (tests inject theirs)
    streams: dict[int, set[Stream]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="gateway-latency-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    @contextlib.contextmanager
    def watching(self, deployment_id: int, stream: Stream) -> Iterator[None]:
        """Watch `stream` while the body runs (the relay of its answer)."""
        streams = self.streams.setdefault(deployment_id, set())
        streams.add(stream)
        try:
            yield
        finally:
            streams.discard(stream)

    def measure(self, deployment_id: int, now: float) -> Observation:
        worst = Observation()
        for stream in self.streams.get(deployment_id, ()):
            worst = worst.worst(stream.look(now))
        return worst

    async def report(self, now_ms: int = 0) -> dict[int, int]:
        """Report every deployment with objective tenants (the period's worst measured here,
        or nothing), stepping the controller where a period has passed; the budget each holds
        the others to now. `now_ms` 0: Redis's clock (tests inject theirs)."""
        snapshot = self.snapshot()
        held: dict[int, int] = {}
        now = self.clock()
        for deployment_id, tenant_ids in snapshot.objectives.items():
            instances = snapshot.instances.get(deployment_id, ())
            tenants = [snapshot.tenants[t] for t in tenant_ids if t in snapshot.tenants]
            if not instances or not tenants:
                continue
            full = instances[0].budget
            seen = self.measure(deployment_id, now)
            ttft = min((t.ttft_objective_ms for t in tenants if t.ttft_objective_ms), default=0)
            tpot = min((t.tpot_objective_ms for t in tenants if t.tpot_objective_ms), default=0)
            args: list[Arg] = [
                prefix(deployment_id), now_ms, full, floor_of(full), f"{seen.ratio:.4f}",
                f"{seen.ttft_ms:.1f}", f"{seen.tpot_ms:.2f}",
                "," + ",".join(str(t.id) for t in tenants) + ",", ttft, tpot]
            held[deployment_id] = int(await self.redis.run_script(CONTROL_SCRIPT, [], args))
        return held

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(PERIOD_SECONDS)
            try:
                await self.report()
            except (RedisUnavailable, RedisReplyError) as exc:
                log.warning("latency objectives not reported: %s", exc)

