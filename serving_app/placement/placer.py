"""Placement: choose a node and GPUs for every replica of a deployment, all replicas or none.

A ``Placer`` holds the cluster (``Node`` -> ``GpuSlot`` -> ``Allocation``) and places requests one
after another; a committed placement appends its ``Allocation`` objects to the ``GpuSlot``s, so the
next request sees them. ``Placer.plan()`` is the dry run: same answer, nothing kept. What it is
given and what it answers are declared beside it: the cluster in ``cluster``, the requests and
their answers in ``request``.

Rules:

- **Filters.** The node is ready and not lost; an instance's TP x PP GPUs (its ``world_size``)
  come from one node, or, where the request allows it (``allow_multi_node``) and no one node has
  room, from the fewest nodes that do, the same number of GPUs of one size on each (vLLM's
  multi-node executor gives every node ``world_size / nnodes`` ranks); the attention heads (and
  KV heads, when given) divide by the TP size; PP is at most the layers; the GPU memory quota of
  every tenant the deployment is charged to holds for its share (``PlacementRequest.tenants``).
- **Fit.** On every GPU the reserved fractions of its memory never exceed ``1 - headroom``
  (default 0.10). Fractions are whole hundredths, as vLLM's ``gpu_memory_utilization`` is given.
  Memory held by processes the console does not manage (``GpuSlot.other_used_bytes``) counts too.
- **Isolation.** ``dedicated``: whole empty GPUs, the instance gets ``1 - headroom``; ``shared``:
  a fraction of a GPU beside others; ``mps``: as shared, plus ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
  and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``; ``mig``: one free MIG device with enough memory,
  ``CUDA_VISIBLE_DEVICES`` set to its UUID (TP 1 only: a CUDA process sees one MIG device).
  A GPU in MIG mode takes only MIG placements; replicas of one deployment never share a GPU.
- **Score.** ``binpack`` (default): the tightest fit, so whole GPUs and nodes stay free for large
  deployments. ``spread``: the most free memory, so replicas land apart.

Speed: shared/MPS placements with TP 1 (the common case) are found through per-GPU-size buckets
indexed by free hundredths (at most 101 lookups per size class), not by scanning every GPU.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

from .cluster import (
    DEFAULT_HEADROOM,
    Allocation,
    GpuAllocationView,
    GpuSlot,
    Id,
    Isolation,
    MigSlot,
    Node,
    Policy,
    allocation_view,
    charged_bytes,
    fraction_pct,
)
from .inventory import GIB, MIB
from .request import (
    InstancePlacement,
    NodePart,
    PlacementError,
    PlacementRequest,
    PlacementResult,
    TenantShare,
)

# What an MPS client's own CUDA context takes out of its pinned-memory limit before vLLM asks
# for its share: on an H200 an engine pinned to 5,750 MiB saw 5.45 GiB free, 169 MiB less, and
# refused to start because it wanted 0.04 x 139.8 GiB (docs/gpu.md, "MPS").
MPS_CONTEXT_HEADROOM_BYTES = 512 * MIB


def mps_memory_limit(totals: list[int], fraction: float) -> str:
    """`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for devices of `totals` bytes, each pinned to `fraction`
    of its memory plus the CUDA context's headroom (vLLM's `gpu_memory_utilization` counts the
    context inside its share, but checks its share against what is free after the context
    was made): keyed by position among the visible devices, as MPS reads it, in MiB."""
    return ",".join(
        f"{i}={max(1, (int(total * fraction) + MPS_CONTEXT_HEADROOM_BYTES) // MIB)}M"
        for i, total in enumerate(totals)
    )


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


def _pct_up(n_bytes: int, total: int) -> int:
    """Bytes as whole hundredths of ``total``, rounded up (what vLLM must be given)."""
    return math.ceil(n_bytes * 100 / total - 1e-9)


class _GpuState:
    """Mutable per-GPU bookkeeping: reserved hundredths, exclusivity, deployments on it."""

    __slots__ = (
        "node",
        "gpu",
        "total",
        "reserved",
        "exclusive",
        "deployments",
        "free_migs",
        "bucket",
        "free",
        "empty",
    )

    def __init__(self, node: Node, gpu: GpuSlot) -> None:
        self.node = node
        self.gpu = gpu
        self.total = gpu.memory_total_bytes
        self.reserved = 0
        self.exclusive = False
        self.deployments: dict[Id, int] = {}
        self.free_migs: dict[str, MigSlot] = {m.uuid: m for m in gpu.mig_devices}
        self.bucket: int | None = None
        self.free = 0  # hundredths free under the cap; kept current by refresh()
        self.empty = False
        if gpu.other_used_bytes:
            self.reserved += _pct_up(gpu.other_used_bytes, self.total)
        for alloc in gpu.allocations:
            self._account(alloc, +1)

    def _account(self, alloc: Allocation, sign: int) -> None:
        count = self.deployments.get(alloc.deployment_id, 0) + sign
        if count:
            self.deployments[alloc.deployment_id] = count
        else:
            self.deployments.pop(alloc.deployment_id, None)
        if alloc.mig_uuid is not None:
            if sign > 0:
                self.free_migs.pop(alloc.mig_uuid, None)
            else:
                for mig in self.gpu.mig_devices:
                    if mig.uuid == alloc.mig_uuid:
                        self.free_migs[mig.uuid] = mig
            return
        self.reserved += sign * fraction_pct(alloc.fraction)
        if alloc.exclusive:
            self.exclusive = sign > 0

    def refresh(self, cap: int) -> None:
        """Recompute the cached ``free`` hundredths and ``empty`` flag after a change."""
        whole_gpu_usable = not (self.exclusive or self.gpu.mig_enabled)
        self.free = max(0, cap - self.reserved) if whole_gpu_usable else 0
        self.empty = whole_gpu_usable and self.reserved == 0 and not self.gpu.allocations


_by_free = operator.attrgetter("free")


class Placer:
    """Places deployments on a cluster, one after another, keeping the allocations it makes.

    ``headroom`` is the share of every GPU left unreserved (rounded to hundredths). Which nodes
    are ready and not lost is read when the placer is built: build a new one per batch of
    decisions from the current inventory.
    """

    def __init__(
        self,
        nodes: Iterable[Node],
        *,
        headroom: float = DEFAULT_HEADROOM,
        policy: str = Policy.BINPACK.value,
    ) -> None:
        if not 0 <= headroom < 1:
            raise ValueError("headroom must be in [0, 1)")
        self.nodes = list(nodes)
        self.headroom = headroom
        self.cap = 100 - round(headroom * 100)
        self.policy = Policy(policy)
        self._states: list[_GpuState] = []
        self._by_node: dict[str, list[_GpuState]] = {}
        # size class (total bytes) -> free hundredths -> GPUs (a dict as an ordered set)
        self._buckets: dict[int, list[dict[_GpuState, None]]] = {}
        self._tenant_bytes: dict[Id, int] = {}
        # Per ready node: (node, its GPUs); and per node the most free hundredths on one GPU and
        # the count of empty GPUs, so node scans skip nodes that cannot fit at once.
        self._ready: list[tuple[Node, list[_GpuState]]] = []
        self._ready_names: set[str] = set()
        self._node_max_free: dict[str, int] = {}
        self._node_empty: dict[str, int] = {}
        self._sizes: set[int] = set()
        for node in self.nodes:
            states = [_GpuState(node, gpu) for gpu in node.gpus]
            self._by_node[node.name] = states
            self._states.extend(states)
            if node.ready and not node.lost:
                self._ready.append((node, states))
                self._ready_names.add(node.name)
                self._sizes.update(s.total for s in states)
            for state in states:
                for alloc in state.gpu.allocations:
                    self._add_tenant_bytes(alloc, state, +1)
                self._rebucket(state, update_node=False)
            self._update_node(node.name)
        self._max_ready_gpus = max((len(states) for _, states in self._ready), default=0)

    # ---------------------------------------------------------------- bookkeeping

    def _schedulable(self, node: Node) -> bool:
        return node.name in self._ready_names

    def _update_node(self, name: str) -> None:
        states = self._by_node[name]
        self._node_max_free[name] = max((s.free for s in states), default=0)
        self._node_empty[name] = sum(1 for s in states if s.empty)

    def _rebucket(self, state: _GpuState, *, update_node: bool = True) -> None:
        state.refresh(self.cap)
        if update_node:
            self._update_node(state.node.name)
        if state.bucket is not None:
            self._buckets[state.total][state.bucket].pop(state, None)
            state.bucket = None
        free = state.free
        if free <= 0 or state.node.name not in self._ready_names:
            return
        buckets = self._buckets.get(state.total)
        if buckets is None:
            buckets = self._buckets[state.total] = [{} for _ in range(101)]
        buckets[free][state] = None
        state.bucket = free

    def _reserved_bytes(self, alloc: Allocation, state: _GpuState) -> int:
        if alloc.mig_uuid is not None:
            for mig in state.gpu.mig_devices:
                if mig.uuid == alloc.mig_uuid:
                    return mig.memory_total_bytes
            return 0
        if alloc.exclusive:
            return state.total
        return state.total * fraction_pct(alloc.fraction) // 100

    def _add_tenant_bytes(self, alloc: Allocation, state: _GpuState, sign: int) -> None:
        for tenant, size in charged_bytes(alloc, self._reserved_bytes(alloc, state)).items():
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + sign * size

    def _apply(self, state: _GpuState, alloc: Allocation) -> None:
        state.gpu.allocations.append(alloc)
        state._account(alloc, +1)
        self._add_tenant_bytes(alloc, state, +1)
        self._rebucket(state)

    def _unapply(self, state: _GpuState, alloc: Allocation) -> None:
        state.gpu.allocations.remove(alloc)
        state._account(alloc, -1)
        self._add_tenant_bytes(alloc, state, -1)
        self._rebucket(state)

    def tenant_reserved_bytes(self, tenant_id: Id) -> int:
        """Memory the placer's allocations reserve for a tenant, across all GPUs."""
        return self._tenant_bytes.get(tenant_id, 0)

    # ---------------------------------------------------------------- public API

    def plan(self, request: PlacementRequest) -> PlacementResult:
        """Dry run: where the deployment would go, or why not. Nothing is kept."""
        return self.place(request, commit=False)

    def place(self, request: PlacementRequest, *, commit: bool = True) -> PlacementResult:
        """Place every replica or none; with ``commit`` the allocations stay on the GPUs."""
        try:
            self._check_request(request)
        except PlacementError as exc:
            return self._refuse(request, str(exc))
        applied: list[tuple[_GpuState, Allocation]] = []
        instances: list[InstancePlacement] = []
        try:
            for replica in range(request.replicas):
                try:
                    instance, allocs = self._place_one(request, replica)
                except PlacementError as exc:
                    prefix = (
                        f"replica {replica + 1} of {request.replicas}: "
                        if request.replicas > 1
                        else ""
                    )
                    raise PlacementError(prefix + str(exc)) from None
                for state, alloc in allocs:
                    self._apply(state, alloc)
                    applied.append((state, alloc))
                instances.append(instance)
            self._check_quota_after(request, applied)
        except PlacementError as exc:
            for state, alloc in reversed(applied):
                self._unapply(state, alloc)
            return self._refuse(request, str(exc))
        if not commit:
            for state, alloc in reversed(applied):
                self._unapply(state, alloc)
        return PlacementResult(
            ok=True,
            deployment_id=request.deployment_id,
            tenant_id=request.tenant_id,
            instances=tuple(instances),
        )

    def release(self, deployment_id: Id) -> int:
        """Remove every allocation of a deployment; returns how many were removed."""
        removed = 0
        for state in self._states:
            if deployment_id not in state.deployments:
                continue
            for alloc in [a for a in state.gpu.allocations if a.deployment_id == deployment_id]:
                self._unapply(state, alloc)
                removed += 1
        return removed

    def allocation_view(self) -> list[GpuAllocationView]:
        """What every GPU holds, for which deployment and tenant."""
        return allocation_view(self.nodes, headroom=self.headroom)

    # ---------------------------------------------------------------- filters

    @staticmethod
    def _refuse(request: PlacementRequest, reason: str) -> PlacementResult:
        return PlacementResult(
            ok=False,
            deployment_id=request.deployment_id,
            tenant_id=request.tenant_id,
            reason=reason,
        )

    def _check_request(self, request: PlacementRequest) -> None:
        request.check()
        tp, pp = request.tensor_parallel_size, request.pipeline_parallel_size
        world = request.world_size
        if not self._ready:
            raise PlacementError("no node is ready (all are not ready or lost)")
        most = self._max_ready_gpus
        if request.allow_multi_node:
            ready_gpus = sum(len(states) for _, states in self._ready)
            if world > ready_gpus:
                raise PlacementError(
                    f"needs {world} GPUs (TP {tp} x PP {pp}) across nodes; the ready nodes "
                    f"have {ready_gpus}"
                )
        elif world > most:
            what = "tensor parallelism" if pp == 1 else f"TP {tp} x PP {pp}"
            raise PlacementError(
                f"needs {world} GPUs on one node for {what}; the most on a ready node is "
                f"{most}" + (" (allow_multi_node lets an instance span nodes)"
                             if world <= sum(len(s) for _, s in self._ready) else "")
            )
        for tenant in request.charged():
            if tenant.quota_gib is None:
                continue
            used = self._tenant_used(request, tenant)
            need = int(request.memory_bytes_per_gpu * world * request.replicas * tenant.share)
            if used + need > tenant.quota_gib * GIB + 1:
                raise PlacementError(
                    f"{tenant.quota_owner} GPU memory quota is {tenant.quota_gib:.1f} GiB; it "
                    f"already uses {_gib(used)} and {tenant.part_of('deployment')} needs "
                    f"{_gib(need)} more"
                )

    def _tenant_used(self, request: PlacementRequest, tenant: TenantShare) -> int:
        if request.tenant_used_gib is not None and not request.tenants:
            return int(request.tenant_used_gib * GIB)
        return self.tenant_reserved_bytes(tenant.tenant_id)

    def _check_quota_after(
        self, request: PlacementRequest, applied: list[tuple[_GpuState, Allocation]]
    ) -> None:
        """Quota on what is really reserved (a dedicated GPU reserves all of its memory)."""
        for tenant in request.charged():
            if tenant.quota_gib is None:
                continue
            reserved = sum(
                charged_bytes(alloc, self._reserved_bytes(alloc, state)).get(tenant.tenant_id, 0)
                for state, alloc in applied
            )
            base = (
                int(request.tenant_used_gib * GIB)
                if request.tenant_used_gib is not None and not request.tenants
                else self.tenant_reserved_bytes(tenant.tenant_id) - reserved
            )
            if base + reserved > tenant.quota_gib * GIB + 1:
                raise PlacementError(
                    f"{tenant.quota_owner} GPU memory quota is {tenant.quota_gib:.1f} GiB; it "
                    f"already uses {_gib(base)} and {tenant.part_of('placement')} would "
                    f"reserve {_gib(reserved)} more"
                )

    # ---------------------------------------------------------------- one replica

    def _place_one(
        self, request: PlacementRequest, replica: int
    ) -> tuple[InstancePlacement, list[tuple[_GpuState, Allocation]]]:
        isolation = Isolation(request.isolation)
        if isolation is Isolation.MIG:
            return self._place_mig(request, replica)
        parts: list[list[_GpuState]]
        try:
            if isolation is Isolation.DEDICATED:
                states, util_pct = self._choose_dedicated(request)
            elif request.world_size == 1:
                state, util_pct = self._choose_shared_single(request)
                states = [state]
            else:
                states, util_pct = self._choose_shared_group(request)
            parts = [states]
        except PlacementError as exc:
            if not (request.allow_multi_node and request.world_size > 1):
                raise
            parts, util_pct = self._choose_across_nodes(request, str(exc))
            states = [s for part in parts for s in part]
        exclusive = isolation is Isolation.DEDICATED
        allocs = [
            (
                state,
                Allocation(
                    deployment_id=request.deployment_id,
                    tenant_id=request.tenant_id,
                    fraction=util_pct / 100,
                    isolation=isolation.value,
                    replica=replica,
                    exclusive=exclusive,
                    shares=request.allocation_shares(),
                ),
            )
            for state in states
        ]
        total = min(s.total for s in states)
        reserved = total if exclusive else total * util_pct // 100
        leader = parts[0]
        instance = InstancePlacement(
            replica=replica,
            node=leader[0].node.name,
            gpu_indexes=tuple(s.gpu.index for s in leader),
            gpu_uuids=tuple(s.gpu.uuid for s in leader),
            gpu_memory_utilization=util_pct / 100,
            reserved_bytes_per_gpu=reserved,
            isolation=isolation.value,
            env=self._env(request, leader, util_pct),
            workers=tuple(
                NodePart(node=part[0].node.name, gpu_indexes=tuple(s.gpu.index for s in part),
                         gpu_uuids=tuple(s.gpu.uuid for s in part),
                         env=self._env(request, part, util_pct))
                for part in parts[1:]
            ),
        )
        return instance, allocs

    def _env(
        self, request: PlacementRequest, states: list[_GpuState], util_pct: int
    ) -> dict[str, str]:
        env: dict[str, str] = {}
        if not all(s.gpu.declared for s in states):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(s.gpu.uuid for s in states)
        if request.isolation == Isolation.MPS.value:
            threads = request.mps_thread_percentage or max(1, min(100, util_pct))
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(threads)
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = mps_memory_limit(
                [s.total for s in states], util_pct / 100
            )
        return env

    def _better(self, leftover: int, best: int | None) -> bool:
        if best is None:
            return True
        return leftover < best if self.policy is Policy.BINPACK else leftover > best

    def _choose_shared_single(self, request: PlacementRequest) -> tuple[_GpuState, int]:
        need = request.memory_bytes_per_gpu
        cap = self.cap
        best: _GpuState | None = None
        best_pct = 0
        best_left: int | None = None
        for total, buckets in self._buckets.items():
            need_pct = _pct_up(need, total)
            if need_pct > cap:
                continue
            order = (
                range(need_pct, cap + 1)
                if self.policy is Policy.BINPACK
                else range(cap, need_pct - 1, -1)
            )
            for free in order:
                bucket = buckets[free]
                if not bucket:
                    continue
                found = next(
                    (s for s in bucket if request.deployment_id not in s.deployments), None
                )
                if found is None:
                    continue
                left = (free - need_pct) * total
                if self._better(left, best_left):
                    best, best_pct, best_left = found, need_pct, left
                break
        if best is None:
            raise PlacementError(self._no_fit_reason(request))
        return best, best_pct

    def _needs(self, request: PlacementRequest) -> dict[int, int]:
        """Hundredths of each GPU size in the cluster that the request needs."""
        return {total: _pct_up(request.memory_bytes_per_gpu, total) for total in self._sizes}

    def _candidates(
        self, states: list[_GpuState], request: PlacementRequest, needs: dict[int, int]
    ) -> list[_GpuState]:
        """GPUs (of one node) that can take a shared share of ``request``."""
        dep = request.deployment_id
        return [s for s in states if s.free >= needs[s.total] and dep not in s.deployments]

    def _choose_shared_group(self, request: PlacementRequest) -> tuple[list[_GpuState], int]:
        tp = request.world_size
        needs = self._needs(request)
        min_need = min(needs.values())
        best: list[_GpuState] | None = None
        best_pct = 0
        best_left: int | None = None
        binpack = self.policy is Policy.BINPACK
        for node, states in self._ready:
            if len(states) < tp or self._node_max_free[node.name] < min_need:
                continue
            candidates = self._candidates(states, request, needs)
            if len(candidates) < tp:
                continue
            # vLLM gives all ranks one gpu_memory_utilization: group GPUs of one size.
            first = candidates[0].total
            if all(s.total == first for s in candidates):
                groups: Iterable[tuple[int, list[_GpuState]]] = ((first, candidates),)
            else:
                by_size: dict[int, list[_GpuState]] = {}
                for state in candidates:
                    by_size.setdefault(state.total, []).append(state)
                groups = by_size.items()
            for total, group in groups:
                if len(group) < tp:
                    continue
                group.sort(key=_by_free, reverse=not binpack)
                chosen = group[:tp]
                need_pct = needs[total]
                left = (sum(s.free for s in chosen) - tp * need_pct) * total
                if self._better(left, best_left):
                    best, best_pct, best_left = chosen, need_pct, left
        if best is None:
            raise PlacementError(self._no_group_reason(request))
        return best, best_pct

    def _choose_dedicated(self, request: PlacementRequest) -> tuple[list[_GpuState], int]:
        tp = request.world_size
        best: list[_GpuState] | None = None
        best_score: int | None = None
        binpack = self.policy is Policy.BINPACK
        needs = self._needs(request)
        dep = request.deployment_id
        for node, states in self._ready:
            if self._node_empty[node.name] < tp:
                continue
            empty = [
                s
                for s in states
                if s.empty and dep not in s.deployments and needs[s.total] <= self.cap
            ]
            if len(empty) < tp:
                continue
            # binpack: the node with the fewest empty GPUs left over keeps whole nodes free.
            score = len(empty) - tp
            better = best_score is None or (score < best_score if binpack else score > best_score)
            if better:
                empty.sort(key=lambda s: (s.total, s.gpu.index))
                best, best_score = empty[:tp], score
        if best is None:
            raise PlacementError(self._no_dedicated_reason(request))
        return best, self.cap

    def _choose_across_nodes(
        self, request: PlacementRequest, one_node_reason: str
    ) -> tuple[list[list[_GpuState]], int]:
        """A group of ``world_size`` GPUs over the fewest nodes that hold it: ``nnodes`` nodes
        (a divisor of the world size) with ``world_size / nnodes`` GPUs of one size each, as
        vLLM's multi-node executor runs the same number of ranks on every node. Among the
        nodes that qualify, binpack takes those with the least room left, spread the most.
        Returns the GPUs per node, the leader's first, and the hundredths each gets."""
        world = request.world_size
        dedicated = request.isolation == Isolation.DEDICATED.value
        needs = self._needs(request)
        dep = request.deployment_id
        binpack = self.policy is Policy.BINPACK
        # Per node and GPU size: the GPUs that can take a rank.
        usable: list[tuple[Node, dict[int, list[_GpuState]]]] = []
        for node, states in self._ready:
            if dedicated:
                fit = [s for s in states if s.empty and dep not in s.deployments
                       and needs[s.total] <= self.cap]
            else:
                fit = self._candidates(states, request, needs)
            by_size: dict[int, list[_GpuState]] = {}
            for state in fit:
                by_size.setdefault(state.total, []).append(state)
            if by_size:
                usable.append((node, by_size))
        for nnodes in (n for n in range(2, world + 1) if world % n == 0):
            per = world // nnodes
            best: list[list[_GpuState]] | None = None
            best_left: int | None = None
            for total in sorted(self._sizes):
                holders = [(node, by_size[total]) for node, by_size in usable
                           if len(by_size.get(total, ())) >= per]
                if len(holders) < nnodes:
                    continue
                holders.sort(key=lambda h: (len(h[1]) - per, h[0].name), reverse=not binpack)
                parts = []
                for _, group in holders[:nnodes]:
                    if dedicated:
                        group.sort(key=lambda s: s.gpu.index)
                    else:
                        group.sort(key=_by_free, reverse=not binpack)
                    parts.append(group[:per])
                left = sum(s.free for part in parts for s in part) * total
                if best is None or self._better(left, best_left):
                    best, best_left = parts, left
            if best is not None:
                pct = self.cap if dedicated else needs[best[0][0].total]
                return best, pct
        gpus = sum(len(g) for _, by_size in usable for g in by_size.values())
        raise PlacementError(
            f"{one_node_reason}; across nodes, {gpus} GPU(s) on {len(usable)} node(s) could "
            f"take a rank, not {world} in equal numbers of one GPU size"
        )

    def _place_mig(
        self, request: PlacementRequest, replica: int
    ) -> tuple[InstancePlacement, list[tuple[_GpuState, Allocation]]]:
        need = request.memory_bytes_per_gpu
        best: tuple[_GpuState, MigSlot] | None = None
        largest: tuple[int, str] | None = None
        binpack = self.policy is Policy.BINPACK
        for node, states in self._ready:
            for state in states:
                if not state.gpu.mig_enabled or request.deployment_id in state.deployments:
                    continue
                for mig in state.free_migs.values():
                    size = mig.memory_total_bytes
                    if largest is None or size > largest[0]:
                        largest = (size, f"{node.name} GPU {state.gpu.index} MIG {mig.uuid}")
                    if _pct_up(need, size) > self.cap:
                        continue
                    if best is None or (
                        size < best[1].memory_total_bytes
                        if binpack
                        else size > best[1].memory_total_bytes
                    ):
                        best = (state, mig)
        if best is None:
            if largest is None:
                raise PlacementError(f"needs {_gib(need)} on a MIG device; no MIG device is free")
            raise PlacementError(
                f"needs {_gib(need)} on a MIG device (within {self.cap}% of it); the largest "
                f"free MIG device is {_gib(largest[0])} on {largest[1]}"
            )
        state, mig = best
        alloc = Allocation(
            deployment_id=request.deployment_id,
            tenant_id=request.tenant_id,
            fraction=self.cap / 100,
            isolation=Isolation.MIG.value,
            replica=replica,
            mig_uuid=mig.uuid,
            exclusive=True,
            shares=request.allocation_shares(),
        )
        instance = InstancePlacement(
            replica=replica,
            node=state.node.name,
            gpu_indexes=(state.gpu.index,),
            gpu_uuids=(state.gpu.uuid,),
            gpu_memory_utilization=self.cap / 100,
            reserved_bytes_per_gpu=mig.memory_total_bytes,
            isolation=Isolation.MIG.value,
            mig_uuid=mig.uuid,
            # A declared MIG device (a what-if plan, a CPU host) has no real UUID to select.
            env={} if state.gpu.declared else {"CUDA_VISIBLE_DEVICES": mig.uuid},
        )
        return instance, [(state, alloc)]

    # ---------------------------------------------------------------- refusal reasons

    def _largest_free_slot(self, request: PlacementRequest) -> tuple[int, _GpuState] | None:
        best: tuple[int, _GpuState] | None = None
        for state in self._states:
            if not self._schedulable(state.node) or request.deployment_id in state.deployments:
                continue
            free = state.free * state.total // 100
            if free and (best is None or free > best[0]):
                best = (free, state)
        return best

    def _no_fit_reason(self, request: PlacementRequest) -> str:
        need = _gib(request.memory_bytes_per_gpu)
        largest = self._largest_free_slot(request)
        if largest is None:
            return f"needs {need}; no GPU has free memory (headroom {100 - self.cap}% kept)"
        free, state = largest
        return (
            f"needs {need}; the largest free slot is {_gib(free)} on {state.node.name} "
            f"GPU {state.gpu.index}"
        )

    def _no_group_reason(self, request: PlacementRequest) -> str:
        tp = request.world_size
        need = _gib(request.memory_bytes_per_gpu)
        needs = self._needs(request)
        most, where = 0, ""
        for node, states in self._ready:
            count = len(self._candidates(states, request, needs))
            if count > most:
                most, where = count, node.name
        suffix = f" ({where})" if where else ""
        return (
            f"needs {tp} GPUs with {need} free each on one node; the most on one node is "
            f"{most}{suffix}"
        )

    def _no_dedicated_reason(self, request: PlacementRequest) -> str:
        tp = request.world_size
        need = _gib(request.memory_bytes_per_gpu)
        needs = self._needs(request)
        most, where = 0, ""
        for node, states in self._ready:
            count = sum(1 for s in states if s.empty and needs[s.total] <= self.cap)
            if count > most:
                most, where = count, node.name
        suffix = f" ({where})" if where else ""
        what = "an empty GPU" if tp == 1 else f"{tp} empty GPUs on one node"
        return f"needs {what} with room for {need}; the most empty on one node is {most}{suffix}"


__all__ = ["MPS_CONTEXT_HEADROOM_BYTES", "Placer", "mps_memory_limit"]
