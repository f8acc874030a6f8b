"""The console's capacity tests: the deployment page's "Capacity" section (the newest curve
drawn with each tenant's objectives, what each objective costs, the form to run a test, its
progress and the past tests), starting and cancelling one, and the tenant form's "what these
objectives cost", priced as they are typed (htmx) and for the saved values without script."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views import View

from serving_app.metering.capacity_charts import CHARTS, capacity_figures
from serving_app.models import CapacityTest, Deployment
from serving_app.models.capacity import Refused, costs_on, defaults_for, objectives_of
from tenants_app.models import Tenant
from ui_app.console.forms import CapacityTestForm, ObjectivesForm
from ui_app.scoping import StaffPage

PAST_TESTS = 10


def capacity_context(deployment: Deployment, form: CapacityTestForm | None = None
                     ) -> dict[str, Any]:
    """The deployment page's "Capacity" section; `form`: one refused, shown with its errors
    (default: a new one with the deployment's defaults)."""
    tenants = list(deployment.tenants.order_by("slug"))
    curve = CapacityTest.objects.curves([deployment]).get(deployment.pk)
    defaults = defaults_for(deployment)
    defaults["concurrency"] = ", ".join(str(c) for c in defaults["concurrency"])
    return {
        "capacity_curve": curve,
        "capacity_figures": capacity_figures(curve, tenants),
        "capacity_charts": list(CHARTS),
        "tenant_costs": [(tenant, costs_on([deployment], objectives_of(tenant))[0].cost)
                         for tenant in tenants] if curve else [],
        "capacity_form": form or CapacityTestForm(initial=defaults),
        **tests_context(deployment),
    }


def tests_context(deployment: Deployment) -> dict[str, Any]:
    tests = list(deployment.capacity_tests.select_related("created_by")
                 .prefetch_related("points")[:PAST_TESTS])
    return {"deployment": deployment, "capacity_tests": tests,
            "capacity_live": next((t for t in tests if t.live), None)}


class DeploymentCapacityTestsPartial(StaffPage, View):
    """The progress and past tests, polled by the deployment page while a test is live."""

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(Deployment, pk=pk)
        return render(request, "console/_capacity_tests.html", tests_context(deployment))


class DeploymentCapacityTestView(StaffPage, View):
    """Run a capacity test (`CapacityTest.objects.start()`): queued on the node of one of the
    deployment's ready instances. Settings refused (by the form or by `start()`'s validation)
    come back as the deployment page with the form as typed and each message under its field
    (400); a test that cannot start now (none ready, one already running) is a message above
    the section. `page`: the deployment page's view (given by the URLconf: it imports this
    module)."""

    page: type[Any] | None = None

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = get_object_or_404(Deployment, pk=pk)
        form = CapacityTestForm(request.POST)
        if not form.is_valid():
            return self.refused(request, pk, form)
        try:
            test = CapacityTest.objects.start(deployment, request.user, **form.cleaned_data)
        except ValidationError as exc:
            for name, errors in exc.message_dict.items():
                form.add_error(name if name in form.fields else None, errors)
            return self.refused(request, pk, form)
        except Refused as exc:
            messages.error(request, f"Not started: {exc}")
        else:
            messages.success(request, f"Capacity test {test.pk} queued on {test.node_name}: it "
                                      "sends real load to the engine beside its tenants' "
                                      "traffic.")
        return _to_section(deployment)

    def refused(self, request: HttpRequest, pk: int, form: CapacityTestForm) -> HttpResponse:
        """The deployment page, its capacity form as typed with its errors (400)."""
        assert self.page is not None, "the URLconf gives the deployment page's view"
        view = self.page(capacity_form=form)
        view.setup(request, pk=pk)
        response: HttpResponse = view.get(request, pk=pk)
        response.status_code = 400
        return response


class CapacityTestCancelView(StaffPage, View):
    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        test = get_object_or_404(CapacityTest.objects.select_related("deployment"), pk=pk)
        try:
            test.cancel()
        except Refused as exc:
            messages.error(request, str(exc))
        else:
            messages.success(request, f"Capacity test {test.pk} cancelled: no more requests "
                                      "are sent (those in flight complete).")
        return _to_section(test.deployment)


def _to_section(deployment: Deployment) -> HttpResponse:
    response = redirect("console:deployment-detail", pk=deployment.pk)
    response["Location"] += "#capacity"
    return response


# -- the tenant form ------------------------------------------------------------------------------
def objective_costs_context(tenant: Tenant, data: Any | None = None) -> dict[str, Any]:
    """What objectives cost on each deployment `tenant` uses: `data`'s (typed in its form), or
    its saved ones."""
    saved = {"latency_objective_ms": tenant.latency_objective_ms,
             "ttft_objective_ms": tenant.ttft_objective_ms,
             "tpot_objective_ms": tenant.tpot_objective_ms}
    form = ObjectivesForm(data if data is not None else
                          {k: v for k, v in saved.items() if v is not None})
    deployments = tenant.deployments.select_related("base_model").order_by("name")
    return {"tenant": tenant, "objectives_form": form,
            "objective_costs": costs_on(deployments, form.objectives())}


class TenantObjectiveCostsPartial(StaffPage, View):
    """The tenant form's cost table for the values typed so far (htmx, on every change)."""

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        tenant = get_object_or_404(Tenant, slug=slug)
        return render(request, "console/_objective_costs.html",
                      objective_costs_context(tenant, request.GET))
