"""Price cards: what a token (or a GPU-second) costs, from a date on.

A `PriceCard` prices one base model (or one adapter on it) per million input, cached input and
output tokens; a `GpuPriceCard` prices a GPU-second of dedicated capacity by GPU model or MIG
profile. Each card is in force from its `effective_from` until the next card for the same thing
takes over; cards are never edited once in force (a price change is a new card, numbered by
`version`), so a past period keeps the prices it had. A request is priced at the card in force
when it arrived (`PriceTable.price_at`), and its cost is stored with its usage event.

Money is `Decimal` everywhere, never a float: prices carry six decimals per million tokens (nine
per GPU-second) and a request's cost is exact to twelve decimals. Every card of the platform is
in one currency (the first card's), so budgets and sums compare like with like.

The models are named by label ("serving_app.BaseModel"): this module sits on the models' bottom
floor with usage.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Self

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models, transaction
from django.db.models import Max, Q
from django.utils import timezone

from tenants_app.models import StaffOnlyQuerySet

__all__ = ["PER_MILLION", "GpuPriceCard", "PriceCard", "PriceTable", "TokenPrice"]

PER_MILLION = Decimal(1_000_000)
ZERO = Decimal(0)

_currency = RegexValidator(r"^[A-Z]{3}\Z", "An ISO 4217 code in capitals, such as USD or EUR.")


def _money(label: str, places: int = 6) -> models.DecimalField[Any, Any]:
    return models.DecimalField(
        label, max_digits=18, decimal_places=places, default=ZERO,
        validators=[MinValueValidator(ZERO)],
    )


@dataclass(frozen=True, slots=True)
class TokenPrice:
    """One card's token prices, per million tokens, in `currency`."""

    card_id: int
    currency: str
    input: Decimal
    cached_input: Decimal
    output: Decimal

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Decimal:
        """A request's exact cost: cached prompt tokens at the cached price, the rest of the
        prompt at the input price, completion tokens at the output price."""
        cached = min(max(cached_tokens, 0), max(prompt_tokens, 0))
        fresh = max(prompt_tokens, 0) - cached
        total = (fresh * self.input + cached * self.cached_input
                 + max(completion_tokens, 0) * self.output)
        return total / PER_MILLION


class CardQuerySet(StaffOnlyQuerySet[Any]):
    def in_force(self, at: datetime | None = None) -> Self:
        """Cards whose date has come (the latest of each priced thing is the one in force)."""
        return self.filter(effective_from__lte=at or timezone.now())


class _Card(models.Model):
    """What every card has: its currency, the date it takes over from, its version among the
    cards of the same thing (abstract)."""

    currency = models.CharField(
        max_length=3, default="USD", validators=[_currency],
        help_text="ISO 4217 code; every card of the platform uses the same one.")
    effective_from = models.DateTimeField(
        help_text="In force from this moment until a later card for the same thing takes over.")
    version = models.PositiveIntegerField(
        editable=False, default=0,
        help_text="1 for the first card of this thing, then one more for each change.")
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = CardQuerySet.as_manager()

    # The fields that say what is priced (the same thing's cards are versions of each other).
    SUBJECT: tuple[str, ...] = ()
    PRICES: tuple[str, ...] = ()

    class Meta:
        abstract = True
        ordering = ["-effective_from"]

    def save(self, *args: Any, **kwargs: Any) -> None:
        """A new card is the next version of its subject's."""
        if self.pk is None and not self.version:
            with transaction.atomic():
                latest = self.same_subject().aggregate(v=Max("version"))["v"] or 0
                self.version = latest + 1
                super().save(*args, **kwargs)
            return
        super().save(*args, **kwargs)

    def same_subject(self) -> models.QuerySet[Any]:
        return type(self)._default_manager.filter(
            **{name: getattr(self, name) for name in self.SUBJECT})

    @property
    def in_force_now(self) -> bool:
        return self.effective_from is not None and self.effective_from <= timezone.now()

    def clean(self) -> None:
        errors: dict[str, str] = {}
        other = _currencies_in_use(exclude=self)
        if other and self.currency not in other:
            errors["currency"] = (
                f"Every price card is in {', '.join(sorted(other))}; a card in another currency "
                "would make budgets and sums compare unlike amounts.")
        if self.pk is not None:
            stored = type(self)._default_manager.filter(pk=self.pk).first()
            if stored is not None and stored.in_force_now:
                changed = [name for name in (*self.PRICES, *self.SUBJECT, "currency",
                                             "effective_from")
                           if getattr(stored, name) != getattr(self, name)]
                for name in changed:
                    errors[name] = (
                        "This card is in force since "
                        f"{stored.effective_from:%Y-%m-%d %H:%M} UTC and is never changed, so "
                        "past requests keep their prices; add a new card from the date the "
                        "change applies.")
        if errors:
            raise ValidationError(errors)


def _currencies_in_use(exclude: models.Model | None = None) -> set[str]:
    found: set[str] = set()
    for model in (PriceCard, GpuPriceCard):
        rows = model.objects.all()
        if exclude is not None and isinstance(exclude, model) and exclude.pk is not None:
            rows = rows.exclude(pk=exclude.pk)
        found.update(rows.values_list("currency", flat=True).distinct())
    return found


class PriceCard(_Card):
    """Token prices for one base model, or for one adapter on it (which then wins over the
    model's own card), per million tokens, from `effective_from` on."""

    base_model = models.ForeignKey(
        "serving_app.BaseModel", on_delete=models.PROTECT, related_name="price_cards")
    adapter = models.ForeignKey(
        "serving_app.LoraAdapter", null=True, blank=True, on_delete=models.PROTECT,
        related_name="price_cards",
        help_text="Empty: the base model's price, for itself and every adapter without a card.")
    input_per_million = _money("Input (per million tokens)")
    cached_input_per_million = _money(
        "Cached input (per million tokens)")
    output_per_million = _money("Output (per million tokens)")

    SUBJECT = ("base_model_id", "adapter_id")
    PRICES = ("input_per_million", "cached_input_per_million", "output_per_million")

    class Meta(_Card.Meta):
        verbose_name = "price card"
        constraints = [
            models.UniqueConstraint(
                fields=["base_model", "effective_from"], condition=Q(adapter__isnull=True),
                name="unique_model_price_from"),
            models.UniqueConstraint(
                fields=["base_model", "adapter", "effective_from"],
                condition=Q(adapter__isnull=False), name="unique_adapter_price_from"),
        ]

    def __str__(self) -> str:
        subject = self.adapter if self.adapter_id else self.base_model
        return f"{subject} v{self.version} from {self.effective_from:%Y-%m-%d}"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        adapter = self.adapter if self.adapter_id else None
        if adapter is not None and self.base_model_id and (
                adapter.base_model_id != self.base_model_id):
            errors["adapter"] = f"This adapter is not one of {self.base_model}'s."
        if self.base_model_id and self.effective_from is not None:
            clash = self.same_subject().filter(effective_from=self.effective_from)
            if self.pk is not None:
                clash = clash.exclude(pk=self.pk)
            if clash.exists():
                errors["effective_from"] = "This model already has a card from this moment."
        try:
            super().clean()
        except ValidationError as exc:
            errors.update({k: v[0] for k, v in exc.message_dict.items()})
        if errors:
            raise ValidationError(errors)

    def price(self) -> TokenPrice:
        return TokenPrice(self.pk, self.currency, self.input_per_million,
                          self.cached_input_per_million, self.output_per_million)


class GpuPriceCard(_Card):
    """The price of one GPU-second of dedicated capacity, by GPU model (as NVML names it, the
    GPUs' `name`) or by one MIG profile of it, from `effective_from` on."""

    gpu_model = models.CharField(
        max_length=100, help_text="As the node reports it, e.g. NVIDIA H100 80GB HBM3.")
    mig_profile = models.CharField(
        max_length=50, blank=True, help_text="A MIG profile (1g.10gb, ...); empty: a whole GPU.")
    per_gpu_second = _money("Per GPU-second", places=9)

    SUBJECT = ("gpu_model", "mig_profile")
    PRICES = ("per_gpu_second",)

    class Meta(_Card.Meta):
        verbose_name = "GPU price card"
        constraints = [
            models.UniqueConstraint(fields=["gpu_model", "mig_profile", "effective_from"],
                                    name="unique_gpu_price_from"),
        ]

    def __str__(self) -> str:
        profile = f" {self.mig_profile}" if self.mig_profile else ""
        return f"{self.gpu_model}{profile} v{self.version} from {self.effective_from:%Y-%m-%d}"


class PriceTable:
    """Every token price card, read once, answering "what did this cost at time t" without a
    query per request (the usage writer's batches, the gateway's catalog)."""

    def __init__(self, cards: Iterable[PriceCard]) -> None:
        self._by_subject: dict[tuple[int, int], tuple[list[float], list[TokenPrice]]] = {}
        for card in sorted(cards, key=lambda c: c.effective_from):
            key = (card.base_model_id, card.adapter_id or 0)
            times, prices = self._by_subject.setdefault(key, ([], []))
            times.append(card.effective_from.timestamp())
            prices.append(card.price())

    @classmethod
    def load(cls) -> PriceTable:
        return cls(PriceCard.objects.all())

    def __bool__(self) -> bool:
        return bool(self._by_subject)

    def price_at(self, base_model_id: int | None, adapter_id: int | None,
                 at: float) -> TokenPrice | None:
        """The card in force at `at` (a Unix time) for the adapter, else for its base model;
        None when neither has one yet."""
        if base_model_id is None:
            return None
        for key in ((base_model_id, adapter_id or 0), (base_model_id, 0)):
            found = self._by_subject.get(key)
            if found is None:
                continue
            times, prices = found
            i = bisect_right(times, at)
            if i:
                return prices[i - 1]
            if key[1] == 0:
                return None
        return None
