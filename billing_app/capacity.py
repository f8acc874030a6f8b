"""GPU capacity over a period, from the placement records: what the fleet had, what each
deployment held, and what no tenant held (idle), each priced at the GPU price card in force.

- A **unit** of capacity is a GPU (by its NVML name) or, on a GPU in MIG mode that has MIG
  devices, each MIG device (by its profile); it is in the fleet from its row's `created_at`.
- A **hold** is an instance on a unit, from its placement (`Instance.created_at`) until it
  stopped (`state_changed_at` of a stopped instance) or the period's end: all of the unit for
  a MIG device or a deployment with dedicated GPUs, else the instance's GPU memory fraction
  (as the allocation report counts it, `serving_app.fleet.report`). A multi-node instance's
  workers hold their GPUs for the same time. Only holds of deployments that serve at least one
  tenant count as held: the rest of a unit's time is idle.
- **Prices**: a unit's second costs its `GpuPriceCard` for (GPU model, MIG profile) in force at
  that second; a MIG device whose profile has no card of its own costs its GPU's card times its
  compute slices out of seven, rounded half-even to the nine decimals of a card. Time before
  any card is in force is counted in GPU-seconds at no cost.

The three sums are computed apart: `fleet_lines` from the units alone, `held_lines` hold by
hold, `idle_lines` by sweeping each unit's time for the moments no tenant held it. Arithmetic
is exact (`Decimal`, sixty digits, seconds exact to the microsecond), so held plus idle equals
the fleet to the last digit while no unit is reserved past its whole (docs/statements.md).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal, localcontext

from django.utils import timezone

from billing_app.periods import BillingPeriod, seconds_between
from serving_app.models import (
    Deployment,
    Gpu,
    GpuPriceCard,
    Instance,
    InstanceWorker,
    PriceCard,
)
from serving_app.placement.fleetspec import GPU_COMPUTE_SLICES, mig_slices

__all__ = [
    "CapacityLine", "Hold", "Placements", "PriceBook", "Unit", "fleet_lines", "held_lines",
    "idle_lines",
]

PRECISION = 60
ONE = Decimal(1)
ZERO = Decimal(0)
CARD_PLACES = Decimal("0.000000001")


@dataclass(frozen=True, slots=True)
class Unit:
    """A GPU or MIG device: what a GPU price card prices."""

    gpu_id: int
    label: str
    gpu_model: str
    mig_profile: str
    since: datetime


@dataclass(frozen=True, slots=True)
class Hold:
    """An instance's reservation of one unit, `share` of it over `[start, end)`."""

    instance_id: int
    deployment_id: int
    gpu_id: int
    share: Decimal
    start: datetime
    end: datetime


@dataclass(frozen=True, slots=True)
class CapacityLine:
    """GPU-seconds of one kind of unit on one UTC day at one price, and their cost; who they
    belong to is the key's business (a deployment, a unit's idle time, the fleet)."""

    owner: int
    day: date
    gpu_model: str
    mig_profile: str
    card_id: int | None
    unit_price: Decimal | None
    gpu_seconds: Decimal
    cost: Decimal


@dataclass
class _Card:
    start: datetime
    card_id: int
    price: Decimal


class PriceBook:
    """Every GPU price card, read once: a unit's time cut where a card takes over or a UTC day
    ends, each piece with its price."""

    def __init__(self, cards: Iterable[GpuPriceCard], currency: str = "USD") -> None:
        self.currency = currency
        self._cards: dict[tuple[str, str], list[_Card]] = defaultdict(list)
        for card in sorted(cards, key=lambda c: c.effective_from):
            self._cards[(card.gpu_model, card.mig_profile)].append(
                _Card(card.effective_from, card.pk, card.per_gpu_second))

    @classmethod
    def load(cls) -> PriceBook:
        """Every GPU card; the currency is every card's (token and GPU cards share one)."""
        cards = list(GpuPriceCard.objects.all())
        token = PriceCard.objects.values_list("currency", flat=True).first()
        return cls(cards, cards[0].currency if cards else token or "USD")

    def _cards_of(self, unit: Unit) -> tuple[list[_Card], Decimal]:
        """The cards that price `unit` and the factor on their price (a MIG device priced from
        its GPU's card: its slices out of seven)."""
        own = self._cards.get((unit.gpu_model, unit.mig_profile))
        if own or not unit.mig_profile:
            return own or [], ONE
        slices = mig_slices(unit.mig_profile)
        if slices is None:
            return [], ONE
        return self._cards.get((unit.gpu_model, ""), []), Decimal(slices) / GPU_COMPUTE_SLICES

    def pieces(self, unit: Unit, start: datetime, end: datetime
               ) -> Iterator[tuple[datetime, datetime, _Card | None, Decimal | None]]:
        """`[start, end)` cut at every card change and UTC midnight: (from, to, card, price
        per second), card and price None where no card was in force yet."""
        cards, factor = self._cards_of(unit)
        starts = [c.start for c in cards]
        at = start
        while at < end:
            i = bisect_right(starts, at)
            card = cards[i - 1] if i else None
            change = cards[i].start if i < len(cards) else end
            midnight = datetime.combine(at.astimezone(UTC).date() + timedelta(days=1),
                                        datetime.min.time(), UTC)
            until = min(end, change, midnight)
            price = None
            if card is not None:
                price = card.price if factor == ONE else (card.price * factor).quantize(
                    CARD_PLACES, ROUND_HALF_EVEN)
            yield at, until, card, price
            at = until


@dataclass
class Placements:
    """The units of the fleet and the holds on them over one period, read from the rows."""

    period: BillingPeriod
    units: dict[int, Unit]
    holds: list[Hold]
    tenants: dict[int, tuple[int, ...]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, period: BillingPeriod, now: datetime | None = None) -> Placements:
        """The month's units and holds, up to `now` in the current month (a statement never
        counts time that has not happened yet)."""
        period = BillingPeriod(period.start, min(period.end, max(now or timezone.now(),
                                                                 period.start)))
        gpus = list(Gpu.objects.select_related("node", "parent").order_by("node__name", "index"))
        carved = {g.parent_id for g in gpus if g.parent_id is not None}
        units: dict[int, Unit] = {}
        for gpu in gpus:
            if gpu.pk in carved:
                continue  # a GPU in MIG mode: its MIG devices are the units
            model = gpu.parent.name if gpu.parent is not None else gpu.name
            profile = gpu.mig_profile if gpu.parent_id is not None else ""
            label = f"{gpu.node.name} GPU {gpu.index}" + (f" {profile}" if profile else "")
            units[gpu.pk] = Unit(gpu.pk, label, model, profile, gpu.created_at)
        return cls(period, units, _holds(period, units), *_deployments(period))

    def tenant_holds(self) -> list[Hold]:
        """The holds of deployments that serve at least one tenant."""
        return [h for h in self.holds if self.tenants.get(h.deployment_id)]

    def window(self, unit: Unit) -> tuple[datetime, datetime] | None:
        return self.period.clip(unit.since, None)


def _stopped_at(instance: Instance) -> datetime | None:
    return instance.state_changed_at if instance.state == Instance.State.STOPPED else None


def _share(deployment: Deployment, fraction: float | None, gpu: Gpu) -> Decimal:
    if gpu.parent_id is not None or deployment.isolation_mode == Deployment.Isolation.DEDICATED:
        return ONE
    # repr() of the float is the decimal the form or the placer wrote (0.28, not 0.2800...017).
    return min(ONE, Decimal(repr(fraction or deployment.gpu_memory_utilization)))


def _holds(period: BillingPeriod, units: dict[int, Unit]) -> list[Hold]:
    instances = (
        Instance.objects.filter(gpus__isnull=False, created_at__lt=period.end)
        .exclude(state=Instance.State.STOPPED, state_changed_at__lte=period.start)
        .select_related("deployment").prefetch_related("gpus", "workers__gpus").distinct()
    )
    holds = []
    for instance in instances:
        span = period.clip(instance.created_at, _stopped_at(instance))
        if span is None:
            continue
        workers: list[InstanceWorker] = list(instance.workers.all())
        gpus = [*instance.gpus.all(), *(g for w in workers for g in w.gpus.all())]
        for gpu in gpus:
            unit = units.get(gpu.pk)
            if unit is None:
                continue
            start = max(span[0], unit.since)
            if start < span[1]:
                holds.append(Hold(instance.pk, instance.deployment_id, gpu.pk,
                                  _share(instance.deployment, instance.gpu_memory_fraction, gpu),
                                  start, span[1]))
    return holds


def _deployments(period: BillingPeriod) -> tuple[dict[int, tuple[int, ...]], dict[int, str]]:
    through = Deployment.tenants.through
    tenants: dict[int, list[int]] = defaultdict(list)
    for dep, tenant in through.objects.order_by("tenant_id").values_list(
            "deployment_id", "tenant_id"):
        tenants[dep].append(tenant)
    names = dict(Deployment.objects.values_list("pk", "name"))
    return {d: tuple(t) for d, t in tenants.items()}, names


def _priced(book: PriceBook, unit: Unit, start: datetime, end: datetime, share: Decimal,
            owner: int, into: dict[tuple[object, ...], list[Decimal]]) -> None:
    """`share` of `unit` over `[start, end)`, added to `into` per (owner, day, card)."""
    for begin, until, card, price in book.pieces(unit, start, end):
        seconds = share * seconds_between(begin, until)
        key = (owner, begin.date(), unit.gpu_model, unit.mig_profile,
               card.card_id if card else None, price)
        cell = into.setdefault(key, [ZERO, ZERO])
        cell[0] += seconds
        cell[1] += seconds * price if price is not None else ZERO


def _lines(cells: dict[tuple[object, ...], list[Decimal]]) -> list[CapacityLine]:
    return [
        CapacityLine(owner, day, model, profile, card, price, seconds, cost)  # type: ignore[arg-type]
        for (owner, day, model, profile, card, price), (seconds, cost) in sorted(
            cells.items(), key=lambda item: (item[0][0], item[0][1], str(item[0][2:4])))
    ]


def fleet_lines(placements: Placements, book: PriceBook) -> list[CapacityLine]:
    """Everything the fleet had over the period, per unit (`owner`: its GPU id)."""
    cells: dict[tuple[object, ...], list[Decimal]] = {}
    with localcontext(prec=PRECISION):
        for unit in placements.units.values():
            window = placements.window(unit)
            if window is not None:
                _priced(book, unit, *window, ONE, unit.gpu_id, cells)
    return _lines(cells)


def held_lines(placements: Placements, book: PriceBook) -> list[CapacityLine]:
    """What each tenant-serving deployment held (`owner`: its id), hold by hold."""
    cells: dict[tuple[object, ...], list[Decimal]] = {}
    with localcontext(prec=PRECISION):
        for hold in placements.tenant_holds():
            unit = placements.units[hold.gpu_id]
            _priced(book, unit, hold.start, hold.end, hold.share, hold.deployment_id, cells)
    return _lines(cells)


def idle_lines(placements: Placements, book: PriceBook) -> list[CapacityLine]:
    """The time no tenant held, per unit (`owner`: its GPU id): each unit's time cut at every
    hold's start and end, each piece idle for what its holds leave of the unit."""
    by_unit: dict[int, list[Hold]] = defaultdict(list)
    for hold in placements.tenant_holds():
        by_unit[hold.gpu_id].append(hold)
    cells: dict[tuple[object, ...], list[Decimal]] = {}
    with localcontext(prec=PRECISION):
        for unit in placements.units.values():
            window = placements.window(unit)
            if window is None:
                continue
            holds = by_unit.get(unit.gpu_id, [])
            edges = sorted({window[0], window[1],
                            *(t for h in holds for t in (h.start, h.end)
                              if window[0] < t < window[1])})
            for begin, until in zip(edges, edges[1:], strict=False):
                held = sum((h.share for h in holds if h.start <= begin and h.end >= until), ZERO)
                free = ONE - min(held, ONE)
                if free > 0:
                    _priced(book, unit, begin, until, free, unit.gpu_id, cells)
    return _lines(cells)
