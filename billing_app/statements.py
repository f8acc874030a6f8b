"""Statements: what each tenant cost over a month, by tokens and by GPU capacity, and the
fleet's idle capacity beside them.

- **Tokens** (showback): the month's usage events of the tenant, each at the token price in
  force when it arrived (its stored `cost`), summed by UTC day, public model, adapter and API
  key in one query.
- **Capacity** (showback): what the tenant's deployments held (`capacity.held_lines`): all of a
  deployment that serves the tenant alone (dedicated), and of a shared one its part by token
  share over the month, as the GPU accounting splits it (`fleet.accounting.measured_charges`:
  weighted tokens bucket by bucket, the entitled split where nobody used it).
- **Chargeback**: the tenant's `billing_basis` picks which of the two its statement bills.
- **The fleet's view**: every tenant's capacity, the idle line (`capacity.idle_lines`, from the
  placement records, never a difference) and the fleet's cost (`capacity.fleet_lines`).

Rounding (docs/statements.md): every amount is exact until it is shown. The fleet's total is
rounded half-even to the cent; the tenants' capacity amounts and the idle line get their cents
by largest remainder (each rounded down, the cents left over to the largest remainders, ties to
the first tenant by slug, idle last), so they add up to the fleet's total to the cent; the
tenant's own statement shows the same cents. Token totals are rounded half-even on their own.
Detail lines show six decimals and are not what a total adds up: a total is rounded once, from
exact amounts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import date
from decimal import ROUND_FLOOR, ROUND_HALF_EVEN, Decimal, localcontext
from typing import Any

from django.db.models import Count, QuerySet, Sum
from django.db.models.functions import TruncDate

from billing_app.capacity import (
    PRECISION,
    CapacityLine,
    Placements,
    PriceBook,
    fleet_lines,
    held_lines,
    idle_lines,
)
from billing_app.periods import BillingPeriod
from serving_app.fleet.accounting import Period
from serving_app.fleet.accounting import measured_charges as token_share_split
from serving_app.models import UsageEvent, UsageHour
from tenants_app.models import ApiKey, BillingBasis, Tenant

__all__ = ["FleetStatement", "Statement", "TokenLine", "TenantCapacityLine", "allocate_cents",
           "build", "cents", "shown"]

CENT = Decimal("0.01")
SHOWN = Decimal("0.000001")
ZERO = Decimal(0)


def cents(amount: Decimal) -> Decimal:
    """An amount rounded half-even to the cent."""
    return amount.quantize(CENT, ROUND_HALF_EVEN)


def shown(amount: Decimal | None) -> Decimal | None:
    """A detail line's amount as shown: six decimals, half-even."""
    return None if amount is None else amount.quantize(SHOWN, ROUND_HALF_EVEN)


def allocate_cents(amounts: list[Decimal], total: Decimal) -> list[Decimal]:
    """`amounts` (exact) rounded to cents that add up to `total` (a whole number of cents):
    each rounded down, then a cent more for the largest remainders (ties: the earlier one),
    or a cent less for the smallest should the amounts exceed the total."""
    floors = [a.quantize(CENT, ROUND_FLOOR) for a in amounts]
    left = int((total - sum(floors, ZERO)) / CENT)
    order = sorted(range(len(amounts)), key=lambda i: (-(amounts[i] - floors[i]), i))
    if left < 0:
        order = order[::-1]
    step = CENT if left > 0 else -CENT
    for i in order[: abs(left)] if order else []:
        floors[i] += step
    return floors


@dataclass(frozen=True, slots=True)
class TokenLine:
    """Requests of one tenant on one UTC day, model, adapter and key at one price card (None:
    none was in force), and their cost."""

    day: date
    model: str
    adapter: str
    api_key_id: int | None
    key_name: str
    card_id: int | None
    requests: int
    unpriced: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: Decimal

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cost_shown(self) -> Decimal | None:
        return shown(self.cost)


@dataclass(frozen=True, slots=True)
class TenantCapacityLine:
    """The tenant's part of what one deployment held of one kind of GPU on one day at one
    price: all of it (dedicated) or its token share of a shared deployment."""

    day: date
    deployment_id: int
    deployment: str
    gpu_model: str
    mig_profile: str
    card_id: int | None
    unit_price: Decimal | None
    shared: bool
    share: Decimal
    gpu_seconds: Decimal
    cost: Decimal

    @property
    def cost_shown(self) -> Decimal | None:
        return shown(self.cost)

    @property
    def gpu_hours(self) -> Decimal:
        return (self.gpu_seconds / 3600).quantize(SHOWN, ROUND_HALF_EVEN)

    @property
    def unit(self) -> str:
        return f"{self.gpu_model} {self.mig_profile}".strip()


def _group(lines: Iterable[Any], key: Callable[[Any], Any],
           fields: tuple[str, ...]) -> list[dict[str, Any]]:
    groups: dict[Any, dict[str, Any]] = {}
    for line in lines:
        name = key(line)
        row = groups.setdefault(name, {"key": name, **{f: 0 for f in fields}})
        for f in fields:
            row[f] += getattr(line, f)
    rows = sorted(groups.values(), key=lambda r: str(r["key"]))
    for row in rows:
        if "cost" in row:
            row["cost_shown"] = shown(Decimal(row["cost"]))
    return rows


TOKEN_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")
CAPACITY_SUMS = ("gpu_seconds", "cost")


@dataclass
class Statement:
    """One tenant's month: its token lines and capacity lines, the totals of each (showback)
    and what it is billed (chargeback, by its `billing_basis`)."""

    tenant: Tenant
    period: BillingPeriod
    currency: str
    tokens: list[TokenLine] = field(default_factory=list)
    capacity: list[TenantCapacityLine] = field(default_factory=list)
    # Set by the fleet's reconciliation: this tenant's capacity cents among everyone's.
    capacity_cents: Decimal | None = None

    @property
    def token_cost(self) -> Decimal:
        return sum((line.cost for line in self.tokens), ZERO)

    @property
    def dedicated_cost(self) -> Decimal:
        return sum((line.cost for line in self.capacity if not line.shared), ZERO)

    @property
    def shared_cost(self) -> Decimal:
        return sum((line.cost for line in self.capacity if line.shared), ZERO)

    @property
    def capacity_cost(self) -> Decimal:
        with localcontext(prec=PRECISION):
            return sum((line.cost for line in self.capacity), ZERO)

    @property
    def gpu_seconds(self) -> Decimal:
        return sum((line.gpu_seconds for line in self.capacity), ZERO)

    @property
    def token_total(self) -> Decimal:
        return cents(self.token_cost)

    @property
    def capacity_total(self) -> Decimal:
        return self.capacity_cents if self.capacity_cents is not None else cents(
            self.capacity_cost)

    @property
    def basis(self) -> str:
        return self.tenant.billing_basis

    @property
    def basis_label(self) -> str:
        return BillingBasis(self.basis).label

    @property
    def billed(self) -> Decimal:
        """What the statement charges: one of the two totals, by the tenant's basis."""
        return self.capacity_total if self.basis == BillingBasis.CAPACITY else self.token_total

    @property
    def unpriced_requests(self) -> int:
        return sum(line.unpriced for line in self.tokens)

    @property
    def dedicated_shown(self) -> Decimal | None:
        return shown(self.dedicated_cost)

    @property
    def shared_shown(self) -> Decimal | None:
        return shown(self.shared_cost)

    @property
    def gpu_hours(self) -> Decimal:
        return (self.gpu_seconds / 3600).quantize(SHOWN, ROUND_HALF_EVEN)

    def token_tables(self) -> list[tuple[str, list[dict[str, Any]], str]]:
        """The token lines grouped three ways, each with what its empty table says."""
        return [
            ("model", self.by_model(), "No requests this month."),
            ("adapter", self.by_adapter(), "No requests to an adapter this month."),
            ("API key", self.by_key(), "No requests this month."),
        ]

    def by_model(self) -> list[dict[str, Any]]:
        return _group(self.tokens, lambda line: line.model, TOKEN_SUMS)

    def by_adapter(self) -> list[dict[str, Any]]:
        return _group([t for t in self.tokens if t.adapter],
                      lambda line: f"{line.model} / {line.adapter}", TOKEN_SUMS)

    def by_key(self) -> list[dict[str, Any]]:
        return _group(self.tokens, lambda line: line.key_name, TOKEN_SUMS)

    def by_deployment(self) -> list[dict[str, Any]]:
        rows = _group(self.capacity, lambda line: (line.deployment, line.unit, line.shared),
                      CAPACITY_SUMS)
        for row in rows:
            row["deployment"], row["unit"], row["shared"] = row["key"]
            row["gpu_hours"] = (row["gpu_seconds"] / 3600).quantize(SHOWN)
        return rows

    def by_day(self) -> list[dict[str, Any]]:
        days: dict[date, dict[str, Any]] = {
            day: {"day": day, "requests": 0, "tokens": 0, "token_cost": ZERO,
                  "gpu_seconds": ZERO, "capacity_cost": ZERO}
            for day in self.period.days()}
        for line in self.tokens:
            row = days[line.day]
            row["requests"] += line.requests
            row["tokens"] += line.tokens
            row["token_cost"] += line.cost
        for cap in self.capacity:
            row = days[cap.day]
            row["gpu_seconds"] += cap.gpu_seconds
            row["capacity_cost"] += cap.cost
        for row in days.values():
            row["token_cost_shown"] = shown(row["token_cost"])
            row["capacity_cost_shown"] = shown(row["capacity_cost"])
            row["gpu_hours"] = (row["gpu_seconds"] / 3600).quantize(SHOWN)
        return list(days.values())


@dataclass
class FleetStatement:
    """The month for the platform: each tenant's statement, the idle capacity and the fleet."""

    period: BillingPeriod
    currency: str
    statements: list[Statement]
    idle: list[CapacityLine]
    fleet: list[CapacityLine]
    unit_labels: dict[int, str]
    idle_cents: Decimal = ZERO

    @property
    def idle_cost(self) -> Decimal:
        with localcontext(prec=PRECISION):
            return sum((line.cost for line in self.idle), ZERO)

    @property
    def idle_seconds(self) -> Decimal:
        return sum((line.gpu_seconds for line in self.idle), ZERO)

    @property
    def fleet_cost(self) -> Decimal:
        with localcontext(prec=PRECISION):
            return sum((line.cost for line in self.fleet), ZERO)

    @property
    def fleet_seconds(self) -> Decimal:
        return sum((line.gpu_seconds for line in self.fleet), ZERO)

    @property
    def fleet_total(self) -> Decimal:
        return cents(self.fleet_cost)

    @property
    def overheld(self) -> Decimal:
        """Held plus idle beyond the fleet's cost: zero unless a GPU was reserved past its
        whole (placement never does; a hand-made instance may)."""
        with localcontext(prec=PRECISION):
            held = sum((s.capacity_cost for s in self.statements), ZERO)
            return held + self.idle_cost - self.fleet_cost

    @property
    def token_total(self) -> Decimal:
        return sum((s.token_total for s in self.statements), ZERO)

    @property
    def billed_total(self) -> Decimal:
        return sum((s.billed for s in self.statements), ZERO)

    def idle_by_unit(self) -> list[dict[str, Any]]:
        rows = _group(self.idle, lambda line: line.owner, CAPACITY_SUMS)
        for row in rows:
            row["unit"] = self.unit_labels.get(row["key"], str(row["key"]))
            row["gpu_hours"] = (row["gpu_seconds"] / 3600).quantize(SHOWN)
        return rows

    def for_tenant(self, tenant: Tenant) -> Statement | None:
        return next((s for s in self.statements if s.tenant.pk == tenant.pk), None)


def _token_lines(period: BillingPeriod, tenants: QuerySet[Tenant]
                 ) -> dict[int, list[TokenLine]]:
    rows = (
        UsageEvent.objects.in_scope(tenants)
        .filter(created_at__gte=period.start, created_at__lt=period.end, tenant__isnull=False)
        .annotate(day=TruncDate("created_at"))
        .values("tenant_id", "day", "model", "adapter", "api_key_id", "price_card_id").order_by()
        .annotate(requests=Count("pk"), priced=Count("cost"), prompt=Sum("prompt_tokens"),
                  cached=Sum("cached_tokens"), completion=Sum("completion_tokens"),
                  cost=Sum("cost"))
    )
    keys = dict(ApiKey.objects.filter(tenant__in=tenants).values_list("pk", "name"))
    lines: dict[int, list[TokenLine]] = defaultdict(list)
    for row in rows:
        key = row["api_key_id"]
        lines[row["tenant_id"]].append(TokenLine(
            day=row["day"], model=row["model"] or "", adapter=row["adapter"] or "",
            api_key_id=key, key_name=keys.get(key, f"key {key} (deleted)") if key else "no key",
            card_id=row["price_card_id"],
            requests=row["requests"], unpriced=row["requests"] - row["priced"],
            prompt_tokens=row["prompt"] or 0, cached_tokens=row["cached"] or 0,
            completion_tokens=row["completion"] or 0, cost=Decimal(row["cost"] or 0),
        ))
    for found in lines.values():
        found.sort(key=lambda t: (t.day, t.model, t.adapter, t.key_name))
    return lines


def _split(amount: Decimal, shares: dict[int, Decimal]) -> dict[int, Decimal]:
    """`amount` split by `shares`, the parts adding up to it exactly: the largest share takes
    what the others' (exact to 1e-30) leave."""
    largest = max(shares, key=lambda t: (shares[t], -t))
    parts = {t: (amount * s).quantize(Decimal("1e-30")) for t, s in shares.items()
             if t != largest}
    parts[largest] = amount - sum(parts.values(), ZERO)
    return parts


def _capacity_lines(placements: Placements, lines: list[CapacityLine]
                    ) -> dict[int, list[TenantCapacityLine]]:
    period = placements.period  # up to now in the current month
    shared = {d for d in {line.owner for line in lines}
              if len(placements.tenants.get(d, ())) > 1}
    held_since: dict[int, Any] = {}
    for hold in placements.tenant_holds():
        if hold.deployment_id in shared:
            held_since[hold.deployment_id] = min(held_since.get(hold.deployment_id, hold.start),
                                                 hold.start)
    charges = token_share_split(
        shared, Period(period.start, period.end, UsageHour, 3600, period.key), held_since)
    out: dict[int, list[TenantCapacityLine]] = defaultdict(list)
    with localcontext(prec=PRECISION):
        for line in lines:
            tenants = placements.tenants[line.owner]
            charge = charges.get(line.owner) if line.owner in shared else None
            shares = ({t: Decimal(repr(charge.shares[t])) for t in tenants} if charge
                      else {tenants[0]: Decimal(1)})
            costs = _split(line.cost, shares)
            seconds = _split(line.gpu_seconds, shares)
            for tenant, share in shares.items():
                out[tenant].append(TenantCapacityLine(
                    day=line.day, deployment_id=line.owner,
                    deployment=placements.names.get(line.owner, f"deployment {line.owner}"),
                    gpu_model=line.gpu_model, mig_profile=line.mig_profile, card_id=line.card_id,
                    unit_price=line.unit_price, shared=charge is not None, share=share,
                    gpu_seconds=seconds[tenant], cost=costs[tenant]))
    return out


def build(period: BillingPeriod, tenants: QuerySet[Tenant]) -> FleetStatement:
    """The month's statements of `tenants` (a scoped queryset: `Tenant.objects.for_user()`),
    reconciled against the whole fleet: every tenant's capacity counts in the cents' allocation
    whoever asks, so a tenant's statement shows the cents the platform's view does."""
    book = PriceBook.load()
    placements = Placements.load(period)
    held = held_lines(placements, book)
    capacity = _capacity_lines(placements, held)
    tokens = _token_lines(period, tenants)
    everyone = list(Tenant.objects.filter(pk__in=set(capacity) | set(tokens)
                                          | set(tenants.values_list("pk", flat=True)))
                    .order_by("slug"))
    statements = [Statement(t, period, book.currency, tokens.get(t.pk, []),
                            capacity.get(t.pk, [])) for t in everyone]
    idle = idle_lines(placements, book)
    fleet = FleetStatement(period, book.currency, statements, idle,
                           fleet_lines(placements, book),
                           {u.gpu_id: u.label for u in placements.units.values()})
    allocated = allocate_cents([*(s.capacity_cost for s in statements), fleet.idle_cost],
                               fleet.fleet_total)
    for statement, amount in zip(statements, allocated, strict=False):
        statement.capacity_cents = amount
    fleet.idle_cents = allocated[-1]
    visible = set(tenants.values_list("pk", flat=True))
    fleet.statements = [s for s in statements if s.tenant.pk in visible]
    return fleet
