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

from serving_app.placement.fleetspec import DeclaredNode, PlanDeployment

from . import placer as P
from .inventory import declared_gpu_infos
from .planner import EngineSettings, MemoryPlan, ModelArchitecture, plan_memory
from .shares import split_amount


@dataclass(frozen=True)
class PlannedDeployment:
    """A plan's deployment with its model and tenants resolved; ``problem`` says why it
    cannot be planned at all (a model or tenant that does not exist)."""

    spec: PlanDeployment
    model: ModelArchitecture | None
    tenants: tuple[P.TenantShare, ...]
    problem: str | None = None


@dataclass
class Outcome:
    """Where one planned deployment went, or why not."""

    deployment: PlannedDeployment
    ok: bool
    reason: str | None = None
    memory: MemoryPlan | None = None
    placements: tuple[P.InstancePlacement, ...] = ()
    charged_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def reserved_bytes(self) -> int:
        return sum(i.reserved_bytes_per_gpu * len(i.gpu_indexes) for i in self.placements)


def fleet_nodes(nodes: Sequence[DeclaredNode]) -> list[P.Node]:
    """The placer's view of a declared fleet: every node ready, nothing reserved."""
    return [
        P.Node(
            name=node.name,
            gpus=[P.gpu_slot_from_info(info)
                  for info in declared_gpu_infos(list(node.gpus), host=node.name)],
        )
        for node in nodes
    ]


def engine_settings(spec: PlanDeployment, model: ModelArchitecture) -> EngineSettings:
    """The engine arguments that change memory, as a deployment with these settings would be
    launched (LoRA slots are always preallocated, as ``engine.launch`` passes them)."""
    return EngineSettings(
        dtype=spec.dtype,
        quantization=spec.quantization or model.checkpoint_quantization or None,
        max_num_seqs=spec.max_num_seqs,
        max_model_len=spec.max_model_len or model.max_position_embeddings,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        tensor_parallel_size=spec.tensor_parallel_size,
        enable_lora=True,
        max_loras=spec.max_loras,
        max_lora_rank=spec.max_lora_rank,
        lora_target_mlp=spec.lora_target_mlp,
        target_kv_tokens=spec.target_kv_tokens,
        enforce_eager=spec.enforce_eager,
    )


def place_plan(
    nodes: Sequence[DeclaredNode],
    deployments: Sequence[PlannedDeployment],
    *,
    headroom: float = 0.10,
    policy: str = P.Policy.BINPACK.value,
) -> tuple[P.Placer, list[Outcome]]:
    """Place ``deployments`` on the fleet in order; the placer returned holds the result."""
    placer = P.Placer(fleet_nodes(nodes), headroom=headroom, policy=policy)
    outcomes = []
    for planned in deployments:
        spec = planned.spec
        if planned.problem is not None or planned.model is None:
            outcomes.append(Outcome(planned, ok=False, reason=planned.problem))
            continue
        try:
            memory = plan_memory(planned.model, engine_settings(spec, planned.model))
        except ValueError as exc:
            outcomes.append(Outcome(planned, ok=False, reason=str(exc)))
            continue
        request = P.PlacementRequest(
            deployment_id=spec.name,
            tenant_id=planned.tenants[0].tenant_id if planned.tenants else None,
            memory_bytes_per_gpu=memory.needed_bytes,
            replicas=spec.replicas,
            tensor_parallel_size=spec.tensor_parallel_size,
            num_attention_heads=planned.model.num_attention_heads,
            num_kv_heads=planned.model.num_kv_heads,
            isolation=spec.isolation,
            mps_thread_percentage=spec.mps_thread_percentage,
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


__all__ = ["Outcome", "PlannedDeployment", "engine_settings", "fleet_nodes", "place_plan"]
