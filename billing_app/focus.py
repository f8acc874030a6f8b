"""Statements in the FinOps FOCUS 1.0 column layout: one row per statement line (a day's
tokens of a model, adapter and key; a day's GPU capacity of a deployment at one price), and in
the platform's export one per unit's idle day. Tenants are sub-accounts; `BilledCost` is what
the tenant's chargeback basis bills (the other basis' rows bill 0 and show their `ListCost`).

Columns, values and their meaning: docs/statements.md ("FOCUS export").
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from billing_app.statements import FleetStatement, Statement, shown
from tenants_app.models import BillingBasis

__all__ = ["COLUMNS", "rows", "write_csv"]

# FOCUS 1.0's columns (every one the specification requires, and ChargeFrequency), in its order.
COLUMNS = (
    "AvailabilityZone", "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency",
    "BillingPeriodEnd", "BillingPeriodStart", "ChargeCategory", "ChargeClass",
    "ChargeDescription", "ChargeFrequency", "ChargePeriodEnd", "ChargePeriodStart",
    "CommitmentDiscountCategory", "CommitmentDiscountId", "CommitmentDiscountName",
    "CommitmentDiscountStatus", "CommitmentDiscountType", "ConsumedQuantity", "ConsumedUnit",
    "ContractedCost", "ContractedUnitPrice", "EffectiveCost", "InvoiceIssuer", "ListCost",
    "ListUnitPrice", "PricingCategory", "PricingQuantity", "PricingUnit", "Provider",
    "Publisher", "RegionId", "RegionName", "ResourceId", "ResourceName", "ResourceType",
    "ServiceCategory", "ServiceName", "SkuId", "SkuPriceId", "SubAccountId", "SubAccountName",
    "Tags",
)
PLATFORM = "llm-console"
PLATFORM_NAME = "LLM console"
SERVICE = "LLM serving"


def _when(at: datetime | date) -> str:
    if not isinstance(at, datetime):
        at = datetime(at.year, at.month, at.day, tzinfo=UTC)
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _amount(value: Decimal | None) -> str | None:
    """Six decimals always, so a column of whole numbers still reads as decimal."""
    found = shown(value)
    return None if found is None else f"{found:f}"


def _card(kind: str, card_id: int | None) -> str:
    """The price's id: its card, or "unpriced" where none was in force (FOCUS wants one on
    every usage row)."""
    return "unpriced" if card_id is None else f"{kind}/{card_id}"


def _base(fleet: FleetStatement, day: date) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update({
        "BillingAccountId": PLATFORM, "BillingAccountName": PLATFORM_NAME,
        "BillingCurrency": fleet.currency,
        "BillingPeriodStart": _when(fleet.period.start),
        "BillingPeriodEnd": _when(fleet.period.end),
        "ChargePeriodStart": _when(day), "ChargePeriodEnd": _when(day + timedelta(days=1)),
        "ChargeCategory": "Usage", "ChargeFrequency": "Usage-Based",
        "InvoiceIssuer": PLATFORM_NAME, "Provider": PLATFORM_NAME, "Publisher": PLATFORM_NAME,
        "PricingCategory": "Standard", "ServiceCategory": "AI and Machine Learning",
        "ServiceName": SERVICE,
    })
    return row


def _costs(row: dict[str, Any], cost: Decimal, billed: bool) -> None:
    listed, nothing = _amount(cost), _amount(Decimal(0))
    row.update(ListCost=listed, ContractedCost=listed, BilledCost=listed if billed else nothing,
               EffectiveCost=listed if billed else nothing)


def _statement_rows(fleet: FleetStatement, statement: Statement) -> Iterator[dict[str, Any]]:
    tenant = statement.tenant
    by_tokens = statement.basis == BillingBasis.TOKENS
    for line in statement.tokens:
        row = _base(fleet, line.day)
        subject = f"{line.model} / {line.adapter}" if line.adapter else line.model
        row.update({
            "SubAccountId": tenant.slug, "SubAccountName": tenant.name,
            "ChargeDescription": f"{line.requests} requests to {subject} with {line.key_name}",
            "ConsumedQuantity": _amount(Decimal(line.tokens)), "ConsumedUnit": "Tokens",
            "PricingQuantity": _amount(Decimal(line.tokens)), "PricingUnit": "Tokens",
            "ResourceId": f"model/{subject}", "ResourceName": subject, "ResourceType": "Model",
            "SkuId": "tokens", "SkuPriceId": _card("price-card", line.card_id),
            "Tags": json.dumps({"basis": "tokens", "model": line.model, "adapter": line.adapter,
                                "api_key": line.key_name, "prompt_tokens": line.prompt_tokens,
                                "cached_tokens": line.cached_tokens,
                                "completion_tokens": line.completion_tokens}),
        })
        _costs(row, line.cost, by_tokens)
        yield row
    for cap in statement.capacity:
        row = _base(fleet, cap.day)
        kind = "share of a shared deployment" if cap.shared else "dedicated deployment"
        row.update({
            "SubAccountId": tenant.slug, "SubAccountName": tenant.name,
            "ChargeDescription": f"{cap.unit} GPU-seconds held by {cap.deployment} ({kind})",
            "ConsumedQuantity": _amount(cap.gpu_seconds), "ConsumedUnit": "GPU-Seconds",
            "PricingQuantity": _amount(cap.gpu_seconds), "PricingUnit": "GPU-Seconds",
            "ListUnitPrice": None if cap.unit_price is None else f"{cap.unit_price:f}",
            "ContractedUnitPrice": None if cap.unit_price is None else f"{cap.unit_price:f}",
            "ResourceId": f"deployment/{cap.deployment_id}", "ResourceName": cap.deployment,
            "ResourceType": "Deployment",
            "SkuId": f"gpu/{cap.unit}", "SkuPriceId": _card("gpu-price-card", cap.card_id),
            "Tags": json.dumps({"basis": "capacity", "shared": cap.shared,
                                "share": f"{cap.share:f}"}),
        })
        _costs(row, cap.cost, not by_tokens)
        yield row


def _idle_rows(fleet: FleetStatement) -> Iterator[dict[str, Any]]:
    for line in fleet.idle:
        unit = fleet.unit_labels.get(line.owner, str(line.owner))
        row = _base(fleet, line.day)
        row.update({
            "ChargeDescription": f"Idle capacity of {unit}: held by no tenant",
            "ConsumedQuantity": _amount(line.gpu_seconds), "ConsumedUnit": "GPU-Seconds",
            "PricingQuantity": _amount(line.gpu_seconds), "PricingUnit": "GPU-Seconds",
            "ListUnitPrice": None if line.unit_price is None else f"{line.unit_price:f}",
            "ContractedUnitPrice": None if line.unit_price is None else f"{line.unit_price:f}",
            "ResourceId": f"gpu/{line.owner}", "ResourceName": unit, "ResourceType": "GPU",
            "SkuId": f"gpu/{line.gpu_model} {line.mig_profile}".strip(),
            "SkuPriceId": _card("gpu-price-card", line.card_id),
            "Tags": json.dumps({"basis": "capacity", "idle": True}),
        })
        _costs(row, line.cost, billed=False)  # nobody is billed for idle capacity
        yield row


def rows(fleet: FleetStatement, with_idle: bool) -> list[dict[str, Any]]:
    """Every statement's rows (tenants by slug), then the idle rows when `with_idle` (the
    platform's export)."""
    found = [row for statement in fleet.statements for row in _statement_rows(fleet, statement)]
    if with_idle:
        found.extend(_idle_rows(fleet))
    return found


def write_csv(found: list[dict[str, Any]], out: Any) -> None:
    """The rows as CSV with a header of the FOCUS columns (a null is an empty cell)."""
    writer = csv.DictWriter(out, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(found)
