"""The portal's guardrail pages: the tenant's policy (stricter than the platform floor only),
its test bench, its own patterns and deny-lists, and an API key's narrowing.

Owners and admins change them (403 otherwise); every member reads them and may use the test
bench, which changes nothing. Validation is the models' `full_clean()` through
`guardrails_app.forms`, so a weakening of the floor is a field error on the detector it names,
as in the API; the audit log records each change on its own (source "portal").
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views import View

from gateway_app.bench import engine_view
from guardrails_app.forms import BenchForm, PatternForm, PolicyForm
from guardrails_app.models import (
    FloorPolicy,
    KeyPolicy,
    TenantPattern,
    TenantPolicy,
    bench,
    tenant_detectors,
    tenant_policy,
)
from guardrails_app.policy import Direction
from tenants_app.models import ApiKey
from ui_app.scoping import TenantPage


class GuardrailsPage(TenantPage, View):
    """The guardrails section: the policy editor, the bench and the patterns on one page."""

    section = "guardrails"

    def detectors(self) -> dict[str, Any]:
        return tenant_detectors(TenantPattern.objects.for_tenant(self.tenant))

    def policy_form(self, data: Any = None) -> PolicyForm:
        row = (TenantPolicy.objects.for_tenant(self.tenant).first()
               or TenantPolicy(tenant=self.tenant))
        return PolicyForm(data, row=row, detectors=self.detectors(),
                          above=FloorPolicy.current(), disabled=not self.can_manage)

    def page(self, status: int = 200, **parts: Any) -> HttpResponse:
        parts.setdefault("form", self.policy_form())
        parts.setdefault("bench_form", BenchForm())
        parts.setdefault("pattern_form", PatternForm(tenant=self.tenant))
        return self.render("portal/guardrails.html", status=status,
                           patterns=TenantPattern.objects.for_tenant(self.tenant), **parts)


class GuardrailsView(GuardrailsPage):
    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.page()

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        form = self.policy_form(request.POST)
        if not form.is_valid():
            return self.page(status=400, form=form)
        try:
            form.save()
        except ValidationError:
            return self.page(status=400, form=form)
        messages.success(request, "Guardrail policy saved; the gateway applies it within "
                                  "seconds.")
        return redirect("portal:guardrails", slug=slug)


class GuardrailBenchView(GuardrailsPage):
    """Run the tenant's effective policy on pasted text, or on a whole request body as the
    gateway would (`gateway_app.bench`: the body the engine would receive, the findings per
    field, or the gateway's refusal). Any member: it changes nothing. Asked by the playground
    (`HX-Request`), it answers the engine's view alone, for the playground's last request."""

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        form = BenchForm(request.POST)
        partial = request.headers.get("HX-Request") == "true"
        if not form.is_valid():
            if partial:
                return self.render("portal/_engine_view.html", status=400, form_errors=form.errors)
            return self.page(status=400, bench_form=form)
        if form.whole_request:
            view = engine_view(self.tenant, form.cleaned_data["text"].encode())
            if partial:
                return self.render("portal/_engine_view.html", engine=view)
            return self.page(bench_form=form, engine=view)
        result = bench(self.tenant, form.cleaned_data["text"],
                       Direction(form.cleaned_data["direction"]))
        return self.page(bench_form=form, bench_result=result)


class GuardrailPatternsView(GuardrailsPage):
    """Add one of the tenant's own patterns or deny-lists."""

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        form = PatternForm(request.POST, tenant=self.tenant)
        if not form.is_valid():
            return self.page(status=400, pattern_form=form)
        pattern = form.save()
        messages.success(request, f"Pattern {pattern.name} added; name it in the policy to "
                                  "use it.")
        return redirect("portal:guardrails", slug=slug)


class GuardrailPatternDeleteView(GuardrailsPage):
    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        pattern = get_object_or_404(TenantPattern.objects.for_tenant(self.tenant), pk=pk)
        named = pattern.named_by()
        if named:
            messages.error(request, f"Pattern {pattern.name} is named by the policy of "
                                    f"{', '.join(named)}: take it out there first.")
            return redirect("portal:guardrails", slug=slug)
        pattern.delete()
        messages.success(request, f"Pattern {pattern.name} deleted.")
        return redirect("portal:guardrails", slug=slug)


class KeyGuardrailsView(TenantPage, View):
    """An API key's narrowing of the tenant's policy (stricter still)."""

    section = "keys"

    def form(self, key: ApiKey, data: Any = None) -> PolicyForm:
        row = KeyPolicy.objects.for_tenant(self.tenant).filter(api_key=key).first() \
            or KeyPolicy(api_key=key, tenant=self.tenant)
        return PolicyForm(data, row=row,
                          detectors=tenant_detectors(TenantPattern.objects.for_tenant(
                              self.tenant)),
                          above=tenant_policy(self.tenant), disabled=not self.can_manage)

    def key(self, pk: int) -> ApiKey:
        return get_object_or_404(ApiKey.objects.for_tenant(self.tenant), pk=pk)

    def get(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        key = self.key(pk)
        return self.render("portal/key_guardrails.html", key=key, form=self.form(key))

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        key = self.key(pk)
        form = self.form(key, request.POST)
        try:
            if not form.is_valid():
                raise ValidationError("invalid")
            form.save()
        except ValidationError:
            return self.render("portal/key_guardrails.html", status=400, key=key, form=form)
        messages.success(request, f"Guardrails of key {key.name} saved.")
        return redirect("portal:key-guardrails", slug=slug, pk=key.pk)
