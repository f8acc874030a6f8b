"""What each tenant may call: the one copy of the catalog rule.

The gateway builds its routes from it and the portal lists it, so the two cannot disagree. A
tenant may call the base model of every deployment that serves it and is meant to run, and its
own adapters attached to those deployments; where one of its adapters has a base model's name,
the base model wins (the adapter is not callable under that name).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import QuerySet

from serving_app.deployments import sharing
from serving_app.models import Deployment, LoraAdapter


@dataclass(frozen=True, slots=True)
class Served:
    """One public name a tenant may call on one deployment."""

    tenant_id: int
    public_name: str
    deployment: Deployment
    adapter: LoraAdapter | None  # None: the deployment's base model

    @property
    def parent(self) -> str | None:
        """The base model an adapter runs on (None for a base model)."""
        return self.deployment.base_model.name if self.adapter is not None else None


def served_models(deployments: QuerySet[Deployment]) -> list[Served]:
    """Every (tenant, public name, deployment) the rule allows among `deployments`, base models
    first, each group by deployment id. Three queries, whatever the number of rows."""
    running = (
        deployments.filter(desired_state=Deployment.DesiredState.RUNNING)
        .select_related("base_model", "applied_revision")
        .prefetch_related("tenants", "adapters__tenant")
        .order_by("pk")
    )
    bases: list[Served] = []
    adapters: list[Served] = []
    for dep in running:
        served = {t.pk for t in dep.tenants.all()}
        bases.extend(Served(tenant_id, dep.base_model.name, dep, None) for tenant_id in served)
        adapters.extend(
            Served(adapter.tenant_id, adapter.name, dep, adapter)
            for adapter in dep.adapters.all() if adapter.tenant_id in served
        )
    base_names = {(s.tenant_id, s.public_name) for s in bases}
    return bases + [s for s in adapters if (s.tenant_id, s.public_name) not in base_names]


@dataclass(frozen=True, slots=True)
class EngineShare:
    """A tenant's own flow-control figures on one running deployment it is served by (its
    co-tenants' never appear)."""

    model: str
    flow_control: bool
    share: sharing.TenantShare


def engine_shares(tenant_id: int) -> list[EngineShare]:
    """The tenant's share of each running deployment that serves it, against its entitlement,
    and its waits (`serving_app.deployments.sharing`). Raises `redis.RedisError` when Redis cannot
    be read."""
    running = (
        Deployment.objects.filter(tenants=tenant_id, desired_state=Deployment.DesiredState.RUNNING)
        .select_related("base_model")
        .order_by("base_model__name", "pk")
    )
    shares: list[EngineShare] = []
    for dep in running:
        flow_report = sharing.report(dep, tenant_ids=[tenant_id])
        shares.extend(EngineShare(dep.base_model.name, flow_report.flow_control, row)
                      for row in flow_report.tenants)
    return shares
