"""The price cards' pages: every token and GPU-second card with the one in force marked, and
the forms that add a card (a price change is a new card from its date; docs/budgets.md)."""

from __future__ import annotations

from typing import Any

from django.urls import reverse
from django.views.generic import TemplateView

from serving_app.models import GpuPriceCard, PriceCard
from ui_app.console.base import ObjectCreateView
from ui_app.console.forms import GpuPriceCardForm, PriceCardForm
from ui_app.scoping import StaffPage


def _in_force_ids(cards: list[Any]) -> set[int]:
    """The card in force of each priced thing: the latest whose date has come."""
    current: dict[tuple[Any, ...], Any] = {}
    for card in cards:  # newest first
        key = tuple(getattr(card, name) for name in card.SUBJECT)
        if card.in_force_now and key not in current:
            current[key] = card
    return {card.pk for card in current.values()}


class PriceListView(StaffPage, TemplateView):
    template_name = "console/price_list.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        tokens = list(PriceCard.objects.select_related("base_model", "adapter__tenant")
                      .order_by("base_model__name", "adapter_id", "-effective_from"))
        gpus = list(GpuPriceCard.objects.order_by("gpu_model", "mig_profile", "-effective_from"))
        context.update(token_cards=tokens, gpu_cards=gpus, in_force=_in_force_ids(tokens),
                       gpu_in_force=_in_force_ids(gpus))
        return context


class PriceCardCreateView(ObjectCreateView[PriceCard, PriceCardForm]):
    model = PriceCard
    form_class = PriceCardForm
    noun = "price card"

    def cancel_url(self) -> str:
        return reverse("console:price-list")

    def get_success_url(self) -> str:
        return reverse("console:price-list")


class GpuPriceCardCreateView(ObjectCreateView[GpuPriceCard, GpuPriceCardForm]):
    model = GpuPriceCard
    form_class = GpuPriceCardForm
    noun = "GPU price card"

    def cancel_url(self) -> str:
        return reverse("console:price-list")

    def get_success_url(self) -> str:
        return reverse("console:price-list")
