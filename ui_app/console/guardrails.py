"""The console's guardrail floor: the detectors and rules every tenant gets (platform admins).
A tenant's policy may only tighten it; a floor raised later wins over a tenant's weaker rule
(`guardrails_app.models.resolve`)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views import View

from guardrails_app.detectors import builtin
from guardrails_app.forms import PolicyForm
from guardrails_app.models import FloorPolicy
from ui_app.scoping import StaffPage


class FloorPolicyView(StaffPage, View):
    def form(self, data: Any = None) -> PolicyForm:
        row = FloorPolicy.objects.order_by("pk").first() or FloorPolicy()
        return PolicyForm(data, row=row, detectors=dict(builtin()))

    def page(self, request: HttpRequest, form: PolicyForm, status: int = 200) -> HttpResponse:
        return render(request, "console/guardrail_floor.html", {"form": form}, status=status)

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
