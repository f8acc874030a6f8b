"""Stop every engine this host runs, for a clean shutdown of a one-machine console (the demo)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from serving_app.engine import agent
from serving_app.models import Deployment, Instance


class Command(BaseCommand):
    help = "Mark all deployments stopped and stop their engine processes on this host."

    def handle(self, *args, **options) -> None:
        # One audited stop each; the engines are stopped right here, not by a reconcile.
        for deployment in Deployment.objects.exclude(desired_state=Deployment.DesiredState.STOPPED):
            deployment.stop(reconcile=False)
        for instance in Instance.objects.exclude(state=Instance.State.STOPPED).select_related(
            "node"
        ):
            config = agent.AgentConfig(
                name=instance.node.name if instance.node else "", address="127.0.0.1",
                engine_env="", gpus="",
            )
            outcome = agent.stop_instance(instance.pk, config)
            self.stdout.write(f"{instance}: {outcome}")
