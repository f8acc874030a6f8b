"""The console's guardrail floor: the detectors and rules every tenant gets (platform admins).
A tenant's policy may only tighten it; a floor raised later wins over a tenant's weaker rule
(`guardrails_app.models.resolve`)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views import View

from guardrails_app.detectors import builtin
from guardrails_app.forms import GuardModelForm, PolicyForm
from guardrails_app.models import FloorPolicy, GuardModel
from ui_app.scoping import StaffPage


class GuardrailsConsolePage(StaffPage, View):
    """The console's guardrails page: the floor editor, and the deployments marked as guard
    models (the classifier stage) with the form that marks one."""

    def form(self, data: Any = None) -> PolicyForm:
        row = FloorPolicy.objects.order_by("pk").first() or FloorPolicy()
        return PolicyForm(data, row=row, detectors=dict(builtin()))

    def page(self, request: HttpRequest, form: PolicyForm | None = None, status: int = 200,
             guard_form: GuardModelForm | None = None) -> HttpResponse:
        return render(request, "console/guardrail_floor.html", {
            "form": form or self.form(),
            "guard_form": guard_form or GuardModelForm(),
            "guard_models": GuardModel.objects.select_related("deployment"),
        }, status=status)


class FloorPolicyView(GuardrailsConsolePage):
    """The floor editor."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return self.page(request, self.form())

    def post(self, request: HttpRequest) -> HttpResponse:
        form = self.form(request.POST)
        try:
            if not form.is_valid():
                raise ValidationError("invalid")
            form.save()
        except ValidationError:
            return self.page(request, form, status=400)
        messages.success(request, "Guardrail floor saved; every tenant's requests follow it "
                                  "within seconds.")
        return redirect("console:guardrail-floor")


class GuardModelsView(GuardrailsConsolePage):
    """Mark a deployment as a guard model."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return redirect("console:guardrail-floor")

    def post(self, request: HttpRequest) -> HttpResponse:
        guard_form = GuardModelForm(request.POST)
        if not guard_form.is_valid():
            return self.page(request, guard_form=guard_form, status=400)
        guard_form.save()
        messages.success(request, f"{guard_form.instance} is a guard model; policies may name "
                                  "it.")
        return redirect("console:guardrail-floor")


class GuardModelDeleteView(StaffPage, View):
    """Unmark a guard model, unless a policy still names it."""

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        return redirect("console:guardrail-floor")

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        row = get_object_or_404(GuardModel, pk=pk)
        named = row.named_by()
        if named:
            messages.error(request, f"{row} is named by {', '.join(named)}: change those "
                                    "policies first.")
        else:
            row.delete()
            messages.success(request, f"{row} is no longer a guard model.")
        return redirect("console:guardrail-floor")
