"""How a shared deployment's engines are shared: the gateway's flow-control state in Redis, read
for the console (the keys are named here, in the domain, so that the gateway above and the
console name the same ones).

The gateway's admission and settlement scripts keep, per deployment, one queue per tenant,
the requests holding a slot with what each was charged (`<prefix>:cr`, their lease expiries
in `<prefix>:cx`) and per-minute counters (`<prefix>:m:<minute>`, kept two hours): per tenant
`n:` requests dispatched, `w:` milliseconds they waited in all, `b:` requests that had to
wait, `x:` requests that left the queue without a slot (timeout or disconnect) and `xw:`
milliseconds those had waited, `s:` weighted tokens served (input and output tokens weighted
by GATEWAY_FLOW_INPUT/OUTPUT_TOKEN_WEIGHT). `report()` turns
the last minutes of them into shares: a tenant's served share against its entitled share
(its `fair_share_weight` over the weights of the deployment's tenants), and Jain's fairness
index over the tenants that were backlogged (had a request waiting) in the window, each
tenant's service divided by its weight: 1.0 is perfectly fair, 1/n is one tenant taking all.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from serving_app.deployments import inflight
from serving_app.models import Deployment

WINDOW_MINUTES = 5
# How long the gateway keeps a minute's counters (gateway_app/flow.py sets their expiry from it).
STATS_KEPT_SECONDS = 2 * 3600
# A tenant with streamed latency objectives whose last request settled this long ago, with none
# in flight, is idle: the admission controller's budget no longer holds the others.
OBJECTIVE_IDLE_SECONDS = 0.5
# The admission controller (gateway_app/objectives.py) steps once per period and keeps this
# many steps of its history (`<prefix>:slo:h`): 5 minutes.
ADMISSION_PERIOD_SECONDS = 0.25
ADMISSION_HISTORY = 1200


def prefix(deployment_id: int) -> str:
    """The deployment's flow-control keys."""
    return f"gw:{{d{deployment_id}}}:fc"


@dataclass(frozen=True)
class TenantShare:
    tenant_id: int
    tenant: str
    band: int
    weight: int
    queued: int
    in_flight: int | None  # None without flow control: nothing holds a slot then
    dispatched: int
    waited: int
    left_queue: int
    mean_wait_ms: float | None
    served_tokens: float
    served_share: float | None
    entitled_share: float
    backlogged: bool


@dataclass(frozen=True)
class AdmissionPoint:
    at: float  # Unix time, seconds
    budget: int  # what the tenants without objectives were held to per instance
    ratio: float | None  # the worst measured / objective in the period; None: nothing measured
    ttft_ms: float | None
    tpot_ms: float | None

    @property
    def when(self) -> datetime:
        return datetime.fromtimestamp(self.at, UTC)


@dataclass(frozen=True)
class AdmissionState:
    """The admission controller's state on a deployment (`<prefix>:slo`, kept by the gateway's
    `gateway_app/objectives.py`): the budget per instance it holds the tenants without
    objectives to now, and its history."""

    active: bool  # a tenant with objectives has a request in flight or settled just now
    budget: int  # held to now (the full budget while idle)
    learned_budget: float  # what the controller has arrived at (applies while active)
    full_budget: int
    floor: int
    ttft_objective_ms: int | None  # the tightest among the deployment's tenants
    tpot_objective_ms: int | None
    ratio: float | None  # the last period's worst measured / objective
    ttft_ms: float | None
    tpot_ms: float | None
    history: list[AdmissionPoint]

    def changes(self, most: int = 12) -> list[AdmissionPoint]:
        """The history's points where the budget changed (the first one too), newest first."""
        found = [p for i, p in enumerate(self.history)
                 if i == 0 or p.budget != self.history[i - 1].budget]
        return found[::-1][:most]


@dataclass(frozen=True)
class FlowReport:
    deployment_id: int
    flow_control: bool
    window_minutes: int
    dispatched_now: dict[int, int]  # instance id -> requests it was sent and has not answered
    tenants: list[TenantShare]
    jain_index: float | None
    admission: AdmissionState | None = None  # platform admins only, where objectives apply


def waiting(deployment_id: int) -> int:
    """Requests waiting in the gateway's queue for the deployment now, from the waiters' details
    the admission script keeps (`<prefix>:w`: wake list, weight, charge, deadline, ...). A
    waiter past its queue deadline is not counted: its worker has answered 503, or died and
    left it for the next dispatch to drop. Raises `redis.RedisError` when Redis cannot be read."""
    now_ms = time.time() * 1000
    details: list[bytes] = inflight.client().hvals(prefix(deployment_id) + ":w")  # type: ignore[assignment]
    return sum(float(detail.split(b"|")[3]) > now_ms for detail in details)


def _measured(raw: bytes | None) -> float | None:
    value = float(raw or -1)
    return None if value < 0 else value


def admission_state(deployment_id: int) -> AdmissionState | None:
    """The admission controller's state, None where no gateway holds objectives on the
    deployment (no tenant of it has one, or it is not under flow control). Active as the
    gateway's scripts judge it (`fc_slo_active`): a tenant with objectives has charges in
    flight (`<prefix>:c`) or settled a request just now. Raises `redis.RedisError` when Redis
    cannot be read."""
    client = inflight.client()
    key = prefix(deployment_id) + ":slo"
    with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(key)
        pipe.lrange(key + ":h", 0, -1)
        pipe.hgetall(prefix(deployment_id) + ":c")
        state, history, charges = pipe.execute()
    if not state or b"budget" not in state:
        return None
    tenants = [t for t in state[b"tenants"].split(b",") if t]
    seen = float(state.get(b"seen") or 0) / 1000
    active = (any(float(charges.get(t) or 0) > 1e-6 for t in tenants)
              or time.time() - seen < OBJECTIVE_IDLE_SECONDS)
    learned, full = float(state[b"budget"]), int(state[b"full"])
    points = []
    for item in history:
        at, budget, ratio, ttft, tpot = item.decode().split("|")
        points.append(AdmissionPoint(int(at) / 1000, int(float(budget)), _measured(ratio),
                                     _measured(ttft), _measured(tpot)))
    return AdmissionState(
        active=active, budget=int(learned) if active else full, learned_budget=learned,
        full_budget=full, floor=int(state[b"floor"]),
        ttft_objective_ms=int(state[b"ttft_objective"]) or None,
        tpot_objective_ms=int(state[b"tpot_objective"]) or None,
        ratio=_measured(state.get(b"ratio")), ttft_ms=_measured(state.get(b"ttft")),
        tpot_ms=_measured(state.get(b"tpot")), history=points)



def jain_index(values: Iterable[float]) -> float | None:
    """(sum x)^2 / (n sum x^2): 1 when all equal; None without values."""
    xs = list(values)
    square = sum(x * x for x in xs)
    if not xs or square == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * square)


def minute_buckets(deployment_ids: Iterable[int], end: float,
                   minutes: int) -> dict[int, list[tuple[int, dict[str, float]]]]:
    """Per deployment: each of the `minutes` up to and including the one holding `end` (a Unix
    time), oldest first, as (minute start, its counters `n:<tenant>`, `w:<tenant>`, ...), in
    one round trip for all of them. Raises `redis.RedisError` when Redis cannot be read."""
    ids = list(deployment_ids)
    last = int(end // 60)
    span = range(last - minutes + 1, last + 1)
    with inflight.client().pipeline(transaction=False) as pipe:
        for deployment_id in ids:
            for m in span:
                pipe.hgetall(f"{prefix(deployment_id)}:m:{m}")
        buckets = iter(pipe.execute())
    return {
        deployment_id: [(m * 60, {field.decode(): float(value)
                                  for field, value in next(buckets).items()}) for m in span]
        for deployment_id in ids
    }


def minute_stats(deployment_ids: Iterable[int], end: float,
                 minutes: int) -> dict[int, dict[str, float]]:
    """Per deployment: its counters summed over the `minutes` up to `end` (`minute_buckets`)."""
    out: dict[int, dict[str, float]] = {}
    for deployment_id, buckets in minute_buckets(deployment_ids, end, minutes).items():
        stats: dict[str, float] = defaultdict(float)
        for _, counters in buckets:
            for field, value in counters.items():
                stats[field] += value
        out[deployment_id] = stats
    return out


def wait_series(deployment_ids: Iterable[int], end: float, minutes: int,
                tenant_ids: Iterable[int] | None = None
                ) -> dict[tuple[int, int], list[tuple[int, float | None]]]:
    """Per (deployment, tenant) with requests through the queue in the window: each minute's
    mean wait in milliseconds of the requests that went through it (dispatched, or left
    without a slot), None for a minute without any; `tenant_ids` narrows the tenants."""
    wanted = set(tenant_ids) if tenant_ids is not None else None
    out: dict[tuple[int, int], list[tuple[int, float | None]]] = {}
    for deployment_id, buckets in minute_buckets(deployment_ids, end, minutes).items():
        tenants = {int(f.partition(":")[2]) for _, counters in buckets for f in counters
                   if f.startswith(("n:", "x:"))}
        for tenant in sorted(tenants):
            if wanted is not None and tenant not in wanted:
                continue
            points: list[tuple[int, float | None]] = []
            for at, c in buckets:
                through = c.get(f"n:{tenant}", 0.0) + c.get(f"x:{tenant}", 0.0)
                waited = c.get(f"w:{tenant}", 0.0) + c.get(f"xw:{tenant}", 0.0)
                points.append((at, round(waited / through, 1) if through else None))
            out[(deployment_id, tenant)] = points
    return out


def in_flight_by_tenant(live: set[bytes], holds: dict[bytes, bytes]) -> dict[int, int]:
    """Per tenant, its requests holding a slot now: the flow-control holds (`<prefix>:cr`,
    request id -> "tenant|charge") whose lease has not expired (`live`, from `<prefix>:cx`)."""
    counts: dict[int, int] = defaultdict(int)
    for rid, value in holds.items():
        if rid in live:
            counts[int(value.split(b"|", 1)[0])] += 1
    return dict(counts)


def report(deployment: Deployment, minutes: int = WINDOW_MINUTES,
           tenant_ids: Iterable[int] | None = None) -> FlowReport:
    """The deployment's flow control over the last `minutes`. `tenant_ids` narrows the rows
    (a tenant sees only its own) and then leaves out the fairness index, which is about all.
    Raises `redis.RedisError` when Redis cannot be read."""
    client = inflight.client()
    key = prefix(deployment.pk)
    now_ms = time.time() * 1000
    stats = minute_stats([deployment.pk], now_ms / 1000, minutes)[deployment.pk]
    tenants = list(deployment.tenants.all())
    instances = list(deployment.instances.values_list("pk", flat=True))
    with client.pipeline(transaction=False) as pipe:
        for t in tenants:
            pipe.llen(f"{key}:q:{t.pk}")
        for i in instances:
            pipe.zcount(inflight.key(i), now_ms, "+inf")
        pipe.zrangebyscore(f"{key}:cx", now_ms, "+inf")
        pipe.hgetall(f"{key}:cr")
        *counts, live, holds = pipe.execute()
    queued = dict(zip((t.pk for t in tenants), counts[: len(tenants)], strict=True))
    dispatched_now = dict(zip(instances, counts[len(tenants):], strict=True))
    in_flight = in_flight_by_tenant(set(live), holds)
    total_weight = sum(t.fair_share_weight for t in tenants) or 1
    total_served = sum(stats[f"s:{t.pk}"] for t in tenants)
    rows = []
    for t in tenants:
        n, waited = int(stats[f"n:{t.pk}"]), int(stats[f"b:{t.pk}"])
        served = stats[f"s:{t.pk}"]
        rows.append(TenantShare(
            tenant_id=t.pk,
            tenant=t.slug,
            band=int(t.priority_tier),
            weight=t.fair_share_weight,
            queued=queued[t.pk],
            in_flight=in_flight.get(t.pk, 0) if deployment.flow_controlled else None,
            dispatched=n,
            waited=waited,
            left_queue=int(stats[f"x:{t.pk}"]),
            mean_wait_ms=round(stats[f"w:{t.pk}"] / n, 1) if n else None,
            served_tokens=served,
            served_share=round(served / total_served, 4) if total_served else None,
            entitled_share=round(t.fair_share_weight / total_weight, 4),
            backlogged=waited > 0 or queued[t.pk] > 0,
        ))
    index = jain_index(r.served_tokens / r.weight for r in rows if r.backlogged)
    if tenant_ids is not None:
        mine = set(tenant_ids)
        rows = [r for r in rows if r.tenant_id in mine]
        index = None
    return FlowReport(
        deployment_id=deployment.pk,
        flow_control=deployment.flow_controlled,
        window_minutes=minutes,
        dispatched_now=dispatched_now if tenant_ids is None else {},
        tenants=rows,
        jain_index=round(index, 4) if index is not None else None,
        admission=admission_state(deployment.pk) if tenant_ids is None else None,
    )
