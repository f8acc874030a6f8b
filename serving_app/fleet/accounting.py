"""Charging shared deployments to their tenants, from the database: weights and usage rollups in,
``shares.charged_shares()`` (the one rule) out.

- ``entitled_charges(deployment_ids)``: the split by fair-share weight alone. The quota check at
  placement uses it (nothing has run yet), and so does every reservation without a period.
- ``measured_charges(deployment_ids, period, held_since)``: the split by weighted tokens served
  over ``period``, read from the usage rollups bucket by bucket; buckets without tokens count
  the entitled share. The GPU allocation dashboard and API use it.

Rollups are kept per tenant and public model name, not per deployment, so tokens are attributed
the way the gateway's catalog routes them today: a tenant's tokens on a public name go to the
deployments that serve that name to the tenant (its base model, or the tenant's own adapter
attached to it; a base model's name wins), split evenly when several running deployments do.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Q, Sum

from serving_app.models import Deployment
from serving_app.models.usage import UsageHour, UsageMinute, UsageTenSecond
from serving_app.placement.shares import charged_shares, entitled_shares, weighted_tokens
from tenants_app.models import Tenant


@dataclass(frozen=True)
class Period:
    """What a measured split covers: ``[start, end)``, read from ``rollup`` (``UsageMinute`` or
    ``UsageHour``), whose buckets are ``bucket_seconds`` wide. ``key`` names a dashboard
    range ("24h")."""

    start: datetime
    end: datetime
    rollup: Any
    bucket_seconds: int
    key: str = ""

    def bucket_start(self, at: datetime) -> datetime:
        epoch = int(at.timestamp())
        return datetime.fromtimestamp(epoch - epoch % self.bucket_seconds, UTC)

    def buckets_from(self, since: datetime) -> int:
        """How many rollup buckets ``[since, end)`` touches (at least one)."""
        first = self.bucket_start(since)
        return max(1, math.ceil((self.end - first).total_seconds() / self.bucket_seconds))

    def seconds_from(self, since: datetime | None) -> float:
        """Seconds of the period from ``since`` (clipped to the period) to its end."""
        begin = self.start if since is None else max(self.start, since)
        return max(0.0, (self.end - begin).total_seconds())


@dataclass
class DeploymentCharge:
    """How one deployment is charged to its tenants (ids -> values)."""

    deployment_id: int
    weights: dict[int, int]
    entitled: dict[int, float]
    shares: dict[int, float]
    weighted_tokens: dict[int, float] = field(default_factory=dict)
    busy_buckets: int = 0
    buckets: int = 0

    @property
    def measured(self) -> bool:
        """Whether usage decided any of the split (else it is the entitled one)."""
        return self.busy_buckets > 0

    def as_pairs(self) -> tuple[tuple[int, float], ...]:
        """The shares as ``Allocation.shares`` takes them."""
        return tuple(self.shares.items())


def tenant_weights(deployment_ids: Iterable[int]) -> dict[int, dict[int, int]]:
    """Per deployment, its tenants (by pk order) and their fair-share weights: one query."""
    through = Deployment.tenants.through
    rows = (
        through.objects.filter(deployment_id__in=list(deployment_ids))
        .order_by("deployment_id", "tenant_id")
        .values_list("deployment_id", "tenant_id", "tenant__fair_share_weight")
    )
    weights: dict[int, dict[int, int]] = {}
    for deployment_id, tenant_id, weight in rows:
        weights.setdefault(deployment_id, {})[tenant_id] = weight or 1
    return weights


def entitled_charges(deployment_ids: Iterable[int]) -> dict[int, DeploymentCharge]:
    """The split by weight alone, for every deployment that serves at least one tenant."""
    return {
        dep: DeploymentCharge(dep, weights, entitled_shares(weights), entitled_shares(weights))
        for dep, weights in tenant_weights(deployment_ids).items()
        if weights
    }


def _routes(tenant_ids: set[int], deployment_ids: set[int]) -> dict[tuple[int, str], set[int]]:
    """(tenant, public name) -> the deployments that serve it: the running ones, and those of
    ``deployment_ids`` (which hold GPUs whatever they are asked to do now)."""
    running = Q(desired_state=Deployment.DesiredState.RUNNING) | Q(pk__in=deployment_ids)
    deployments = (
        Deployment.objects.filter(running, tenants__in=tenant_ids)
        .distinct()
        .select_related("base_model")
        .prefetch_related("tenants", "adapters")
    )
    base: dict[tuple[int, str], set[int]] = defaultdict(set)
    adapters: dict[tuple[int, str], set[int]] = defaultdict(set)
    for dep in deployments:
        served = {t.pk for t in dep.tenants.all()}
        for tenant in served:
            base[(tenant, dep.base_model.name)].add(dep.pk)
        for adapter in dep.adapters.all():
            if adapter.tenant_id in served:
                adapters[(adapter.tenant_id, adapter.name)].add(dep.pk)
    for key, deps in adapters.items():
        base.setdefault(key, deps)  # a base model's name wins, as in the gateway's catalog
    return dict(base)


def measured_charges(
    deployment_ids: Iterable[int],
    period: Period,
    held_since: Mapping[int, datetime] | None = None,
) -> dict[int, DeploymentCharge]:
    """The split by weighted tokens served over ``period`` (``shares.charged_shares``).

    A deployment's period starts at ``held_since`` (when its oldest active instance was placed)
    when that is later than ``period.start``: buckets before its reservation existed are not
    charged. One query for the weights, one for the deployments and one for the rollups.
    """
    held_since = held_since or {}
    weights = tenant_weights(deployment_ids)
    scope = {dep for dep, w in weights.items() if w}
    tenant_ids = {t for dep in scope for t in weights[dep]}
    routes = _routes(tenant_ids, scope)
    rows = (
        period.rollup.objects.in_scope(Tenant.objects.filter(pk__in=tenant_ids))
        .filter(bucket__gte=period.bucket_start(period.start), bucket__lt=period.end)
        .order_by()
        .values("bucket", "tenant_id", "model")
        .annotate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    )
    # deployment -> bucket -> tenant -> weighted tokens
    served: dict[int, dict[datetime, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        deps = routes.get((row["tenant_id"], row["model"]))
        if not deps:
            continue
        part = weighted_tokens(row["prompt"] or 0, row["completion"] or 0) / len(deps)
        if part <= 0:
            continue
        for dep in deps & scope:
            cell = served[dep][row["bucket"]]
            cell[row["tenant_id"]] = cell.get(row["tenant_id"], 0.0) + part
    charges = {}
    for dep in scope:
        since = max(period.start, held_since.get(dep, period.start))
        first = period.bucket_start(since)
        busy = [cell for bucket, cell in served.get(dep, {}).items() if bucket >= first]
        buckets = period.buckets_from(since)
        totals: dict[int, float] = defaultdict(float)
        for cell in busy:
            for tenant, value in cell.items():
                totals[tenant] += value
        charges[dep] = DeploymentCharge(
            deployment_id=dep,
            weights=weights[dep],
            entitled=entitled_shares(weights[dep]),
            shares=charged_shares(weights[dep], busy, buckets),
            weighted_tokens={t: totals.get(t, 0.0) for t in weights[dep]},
            busy_buckets=sum(1 for cell in busy if any(t in weights[dep] for t in cell)),
            buckets=buckets,
        )
    return charges


ROLLUP_SECONDS = {UsageTenSecond: 10, UsageMinute: 60, UsageHour: 3600}


def period_ending_now(span: timedelta, rollup: Any = UsageMinute, key: str = "",
                      now: datetime | None = None) -> Period:
    """The last ``span``, read from ``rollup`` (per-minute by default)."""
    end = now or datetime.now(UTC)
    return Period(end - span, end, rollup, ROLLUP_SECONDS[rollup], key)


__all__ = [
    "DeploymentCharge",
    "Period",
    "entitled_charges",
    "measured_charges",
    "period_ending_now",
    "tenant_weights",
]
