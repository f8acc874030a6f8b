"""What-if plans: a fleet that is not running and the deployments to place on it."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.urls import reverse

from serving_app.models.basemodels import BaseModel
from serving_app.placement import fleetspec
from tenants_app.models import StaffOnlyQuerySet, Tenant


class FleetPlan(models.Model):
    """A what-if: a fleet that is not running (declared nodes, GPUs and MIG devices) and the
    deployments to place on it. Placing it (``placement.fleetplans``) starts nothing and
    reserves nothing; the GPU allocation page shows it beside the live allocation, labelled as
    a plan. Platform admins only: a plan may name any tenant, so tenants see none."""

    class Policy(models.TextChoices):
        BINPACK = "binpack", "Bin-pack (tightest fit)"
        SPREAD = "spread", "Spread (most free memory)"

    name = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    fleet = models.TextField(
        help_text=(
            "One node per line, NAME: GPUS in the declared-inventory format, MIG devices in "
            "brackets: 'gpu-a: 2xNVIDIA A100-SXM4-80GB:80GiB, "
            "2:NVIDIA A100-SXM4-80GB:80GiB[3g.40gb,3g.40gb]'."
        )
    )
    deployments = models.JSONField(
        default=list, blank=True,
        help_text=(
            'A list of deployments, placed in this order: {"name": ..., "model": a registered '
            'base model or an object with its architecture, "tenants": [slugs], "replicas", '
            '"isolation", "max_num_seqs", "max_model_len", ...} (docs/placement.md).'
        ),
    )
    policy = models.CharField(max_length=16, choices=Policy.choices, default=Policy.BINPACK)
    headroom = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0), MaxValueValidator(0.5)],
        help_text="Share of every GPU left unreserved. Empty: PLACEMENT_HEADROOM.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["-updated_at", "name"]
        verbose_name = "what-if plan"

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:fleetplan-detail", args=[self.pk])

    def clean(self) -> None:
        errors: dict[str, list[str]] = {}
        try:
            fleetspec.parse_fleet(self.fleet)
        except fleetspec.FleetSpecError as exc:
            errors["fleet"] = exc.messages
        try:
            planned = fleetspec.parse_plan_deployments(self.deployments)
        except fleetspec.FleetSpecError as exc:
            errors["deployments"] = exc.messages
        else:
            missing = self._missing_references(planned)
            if missing:
                errors["deployments"] = missing
        if errors:
            raise ValidationError(errors)

    @staticmethod
    def _missing_references(planned: list[fleetspec.PlanDeployment]) -> list[str]:
        slugs = {slug for d in planned for slug in d.tenants}
        known = set(Tenant.objects.filter(slug__in=slugs).values_list("slug", flat=True))
        names = {d.model for d in planned if d.model}
        models_known = set(BaseModel.objects.filter(name__in=names).values_list("name", flat=True))
        problems = []
        for number, d in enumerate(planned, start=1):
            where = f"deployment {number} ({d.name})"
            for slug in d.tenants:
                if slug not in known:
                    problems.append(f"{where}: there is no tenant {slug!r}")
            if d.model and d.model not in models_known:
                problems.append(
                    f"{where}: there is no base model {d.model!r}; register it, or give the "
                    "model's architecture as an object"
                )
        return problems
