"""How a shared deployment's GPU reservation is charged to the tenants it serves: one rule.

A deployment may serve several tenants from one engine. Its reservation (GPU memory, GPU-seconds,
MIG slices) is split among them by ``charged_shares()``, which everything that charges tenants
uses: the GPU allocation dashboard and API (measured over their period), the quota check at
placement and what-if plans (entitled: nothing has run there). docs/placement.md, "Charging a
shared deployment", states the rule:

- a tenant's **entitled share** is its fair-share weight over the sum of the weights of the
  deployment's tenants;
- in one usage bucket (a rollup minute or hour) in which the deployment served tokens, a
  tenant's **measured share** is its weighted tokens over all weighted tokens served there;
- over a period, a tenant's share is the mean of its shares in the period's buckets, where a
  bucket without tokens counts the entitled share. Capacity that was reserved but idle is thus
  charged by entitlement, and busy time by use; with no usage at all the split is the entitled
  one.

Input and output tokens are weighted as in the Virtual Token Counter ("Fairness in Serving Large
Language Models", OSDI 2024): an output token costs twice an input token, because decoding holds
the engine's batch slot for every one of them.

Plain Python, no Django: ``accounting`` feeds it rows.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar

Id = TypeVar("Id", bound=Hashable)

PROMPT_TOKEN_WEIGHT = 1.0
COMPLETION_TOKEN_WEIGHT = 2.0


def weighted_tokens(prompt_tokens: float, completion_tokens: float) -> float:
    """The service one request's tokens stand for (input and output weighted)."""
    return prompt_tokens * PROMPT_TOKEN_WEIGHT + completion_tokens * COMPLETION_TOKEN_WEIGHT


def entitled_shares(weights: Mapping[Id, float]) -> dict[Id, float]:
    """Each tenant's weight over the sum of the weights (an empty mapping: no tenant)."""
    if any(w <= 0 for w in weights.values()):
        raise ValueError("fair-share weights must be positive")
    total = sum(weights.values())
    return {tenant: weight / total for tenant, weight in weights.items()}


def charged_shares(
    weights: Mapping[Id, float],
    busy_buckets: Iterable[Mapping[Id, float]] = (),
    buckets: int = 0,
) -> dict[Id, float]:
    """The rule: each tenant's share of a deployment's reservation over a period.

    ``weights``: the deployment's tenants and their fair-share weights. ``busy_buckets``: per
    usage bucket, the weighted tokens each tenant had served by the deployment (buckets with no
    tokens may be left out). ``buckets``: how many buckets the period holds; those not among the
    busy ones count the entitled share. Tokens of a tenant that is not in ``weights`` (no longer
    served) are ignored. The shares sum to 1.
    """
    entitled = entitled_shares(weights)
    if not entitled:
        return {}
    sums = dict.fromkeys(entitled, 0.0)
    busy = 0
    for bucket in busy_buckets:
        total = sum(bucket.get(tenant, 0.0) for tenant in entitled)
        if total <= 0:
            continue
        busy += 1
        for tenant in entitled:
            sums[tenant] += bucket.get(tenant, 0.0) / total
    if not busy:
        return entitled
    period = max(buckets, busy)
    idle = period - busy
    return {tenant: (sums[tenant] + idle * entitled[tenant]) / period for tenant in entitled}


def split_amount(total: int, shares: Mapping[Id, float]) -> dict[Id, int]:
    """Split a whole number (bytes) by ``shares`` so the parts add up to ``total`` exactly
    (largest remainder; ties go to the tenant listed first)."""
    if not shares:
        return {}
    raw = {tenant: total * share for tenant, share in shares.items()}
    parts = {tenant: int(value) for tenant, value in raw.items()}
    left = total - sum(parts.values())
    order = sorted(raw, key=lambda t: raw[t] - parts[t], reverse=True)
    for tenant in order[: max(left, 0)]:
        parts[tenant] += 1
    return parts


__all__ = [
    "COMPLETION_TOKEN_WEIGHT",
    "PROMPT_TOKEN_WEIGHT",
    "charged_shares",
    "entitled_shares",
    "split_amount",
    "weighted_tokens",
]
