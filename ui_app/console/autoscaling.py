"""The console's autoscaling page for a deployment (`/deployments/<id>/autoscaling/`): its policy
as a form (created on first save), validated by the model's `clean()` as in the API and the
admin. The deployment page shows the policy, the last decision and the changes made."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404

from serving_app.models import Deployment
from serving_app.models.autoscalers import Autoscaler
from ui_app.console.base import ObjectUpdateView
from ui_app.console.forms import AutoscalerForm


class DeploymentAutoscalingView(ObjectUpdateView):
    model = Autoscaler
    form_class = AutoscalerForm
    noun = "autoscaling of deployment"

    def get_object(self, queryset: Any = None) -> Autoscaler:
        deployment = get_object_or_404(Deployment, pk=self.kwargs["pk"])
        try:
            return deployment.autoscaler
        except Autoscaler.DoesNotExist:
            return Autoscaler(deployment=deployment)

    def get_success_url(self) -> str:
        return self.object.deployment.get_absolute_url()

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["cancel_url"] = self.object.deployment.get_absolute_url()
        return context
