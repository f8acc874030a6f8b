"""Store what an engine logged at its start as its base model's measured profile.

    python manage.py measure_model INSTANCE_ID

The capacity test of a model the planner does not model (or whose figures an operator wants
measured): deploy it once (a node with room for it, settings as it will run), let the engine
start, then run this with the instance's id. The weights, peak activation, non-torch memory,
CUDA graphs and KV cache figures its start logged (`Instance.startup`) are stored on the base
model with the settings; the planner then uses them, marked "measured", for engines with the
same settings. A figure the engine did not log (the CPU engine logs no memory split) is stored
as absent.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from serving_app.fleet.read import PlanningError, record_measured_profile
from serving_app.models import Instance


class Command(BaseCommand):
    help = "Store an instance's logged start-up figures as its base model's measured profile."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("instance", type=int, help="The instance whose start to read.")

    def handle(self, *args: Any, **options: Any) -> None:
        instance = Instance.objects.select_related(
            "deployment__base_model", "node").filter(pk=options["instance"]).first()
        if instance is None:
            raise CommandError(f"No instance {options['instance']}.")
        try:
            profile = record_measured_profile(instance)
        except PlanningError as exc:
            raise CommandError(str(exc)) from exc
        model = instance.deployment.base_model.name
        absent = ", ".join(profile.absent()) or "none"
        self.stdout.write(f"{model}: measured profile stored ({profile.source}); absent: {absent}")
