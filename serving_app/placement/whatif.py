"""What-if placement: a set of deployments placed on a declared fleet that is not running.

Plain Python, no Django: ``fleetplans`` resolves a ``FleetPlan``'s models and tenants from the
database and hands them here. The fleet's GPUs (MIG devices included) become an empty
``Placer``; the deployments are planned (``planner.plan_memory``) and placed one after another
in the order listed, each all or none, each charged to its tenants by their entitled shares
(``shares``: nothing has run), with their GPU memory quotas checked against what the plan itself
gives them. Nothing is started, reserved or written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from serving_app.enginespec import EngineSpec, InlineModel, ModelDefaults
from serving_app.placement.fleetspec import DeclaredNode, PlanDeployment

from .cluster import DEFAULT_HEADROOM, Node, Policy, gpu_slot_from_info
from .inventory import declared_gpu_infos
from .placer import Placer
from .planner import EngineSettings, MemoryPlan, ModelArchitecture, plan_memory
from .request import InstancePlacement, PlacementRequest, TenantShare
from .shares import split_amount


@dataclass(frozen=True)
class PlannedDeployment:
    """A plan's deployment with its model and tenants resolved; ``problem`` says why it
    cannot be planned at all (a model or tenant that does not exist). ``defaults``: what its
    engine settings fall back on, a registered base model's own (None: the architecture's,
    ``model_defaults()``)."""

    spec: PlanDeployment
    model: ModelArchitecture | None
    tenants: tuple[TenantShare, ...]
    problem: str | None = None
    defaults: ModelDefaults | None = None

    def engine_spec(self, model: ModelArchitecture) -> EngineSpec:
        return self.spec.engine_spec(self.defaults or model_defaults(model))


@dataclass
class Outcome:
    """Where one planned deployment went, or why not."""

    deployment: PlannedDeployment
    ok: bool
    reason: str | None = None
    memory: MemoryPlan | None = None
    placements: tuple[InstancePlacement, ...] = ()
    charged_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def reserved_bytes(self) -> int:
        return sum(i.reserved_bytes_per_gpu * i.gpu_count for i in self.placements)


def fleet_nodes(nodes: Sequence[DeclaredNode]) -> list[Node]:
    """The placer's view of a declared fleet: every node ready, nothing reserved."""
    return [
        Node(
            name=node.name,
            gpus=[gpu_slot_from_info(info)
                  for info in declared_gpu_infos(list(node.gpus), host=node.name)],
        )
        for node in nodes
    ]


def model_defaults(model: ModelArchitecture) -> InlineModel:
    """What an inline model's engine settings fall back on: its checkpoint's dtype ("auto")
    and quantization, and its max positions."""
    return InlineModel(max_position_embeddings=model.max_position_embeddings,
                       quantization=model.checkpoint_quantization or "")


def engine_settings(spec: PlanDeployment, engine: EngineSpec) -> EngineSettings:
    """The engine arguments that change memory, as a deployment with these settings would be
    launched (LoRA slots are always preallocated, as ``engine.launch`` passes them), with the
    plan's own planner options."""
    return EngineSettings.of(engine, adapters=True, lora_target_mlp=spec.lora_target_mlp,
                             target_kv_tokens=spec.target_kv_tokens,
                             enforce_eager=spec.enforce_eager)


def place_plan(
    nodes: Sequence[DeclaredNode],
    deployments: Sequence[PlannedDeployment],
    *,
    headroom: float = DEFAULT_HEADROOM,
    policy: str = Policy.BINPACK.value,
) -> tuple[Placer, list[Outcome]]:
    """Place ``deployments`` on the fleet in order; the placer returned holds the result."""
    placer = Placer(fleet_nodes(nodes), headroom=headroom, policy=policy)
    outcomes = []
    for planned in deployments:
        spec = planned.spec
        if planned.problem is not None or planned.model is None:
            outcomes.append(Outcome(planned, ok=False, reason=planned.problem))
            continue
        engine = planned.engine_spec(planned.model)
        try:
            memory = plan_memory(planned.model, engine_settings(spec, engine))
        except ValueError as exc:
            outcomes.append(Outcome(planned, ok=False, reason=str(exc)))
            continue
        request = PlacementRequest(
            deployment_id=spec.name,
            tenant_id=planned.tenants[0].tenant_id if planned.tenants else None,
            memory_bytes_per_gpu=memory.needed_bytes,
            replicas=spec.replicas,
            tensor_parallel_size=engine.tensor_parallel_size,
            pipeline_parallel_size=engine.pipeline_parallel_size,
            allow_multi_node=engine.allow_multi_node,
            num_layers=planned.model.num_layers,
            num_attention_heads=planned.model.num_attention_heads,
            num_kv_heads=planned.model.num_kv_heads,
            isolation=engine.isolation_mode,
            mps_thread_percentage=engine.mps_thread_percentage,
            tenants=planned.tenants,
        )
        result = placer.place(request)
        outcome = Outcome(planned, ok=result.ok, reason=result.reason, memory=memory,
                          placements=result.instances)
        if result.ok:
            shares = {str(t.tenant_id): t.share for t in planned.tenants}
            outcome.charged_bytes = split_amount(outcome.reserved_bytes, shares)
        outcomes.append(outcome)
    return placer, outcomes


__all__ = ["Outcome", "PlannedDeployment", "engine_settings", "fleet_nodes", "model_defaults",
           "place_plan"]
