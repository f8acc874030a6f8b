"""The planner's reserve constants, fitted to what real engines logged (docs/gpu.md, "Planner").

A CUDA vLLM logs how it split its share of the GPU when it sized its KV cache:

    Free memory on device (65.32/139.8 GiB) on startup. Desired GPU memory utilization is
    (0.23, 32.15 GiB). Actual usage is 13.1 GiB for weight, 0.93 GiB for peak activation,
    0.22 GiB for non-torch memory, and 0.24 GiB for CUDAGraph memory. ...
    GPU KV cache size: 146,624 tokens

`EngineMemory.parse()` reads those lines. Given the planner's own weights and LoRA figures for
the same engines, what is left of the requested memory once the KV cache is taken out is the
reserve: activations plus a constant (non-torch memory, CUDA graphs). `fit()` solves for the two
constants of the planner's reserve from two engines (activation bytes per batched token and
per unit of MLP width, and the constant); `predict_kv_tokens()` then predicts a third engine's
KV capacity from its plan alone, which `tests/gpu/test_calibration.py` checks against the
H200 run in docs/gpu-runs (within 2%).

Plain Python, no Django.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .inventory import GIB
from .planner import MemoryPlan, PlannerConstants, dtype_bytes

_NUMBER = r"([\d,]+(?:\.\d+)?)"
_MEMORY = re.compile(
    r"Desired GPU memory utilization is \(" + _NUMBER + r", " + _NUMBER + r" GiB\)\. Actual usage"
    r" is " + _NUMBER + r" GiB for weight, " + _NUMBER + r" GiB for peak activation, " + _NUMBER
    + r" GiB for non-torch memory, and " + _NUMBER + r" GiB for CUDAGraph memory")
_TOKENS = re.compile(r"KV cache size: " + _NUMBER + r" tokens")


def _float(text: str) -> float:
    return float(text.replace(",", ""))


@dataclass(frozen=True)
class EngineMemory:
    """How one engine split its requested GPU memory, as it logged it (GiB, rounded to 0.01)."""

    utilization: float
    requested_gib: float
    weights_gib: float
    activation_gib: float
    non_torch_gib: float
    cuda_graph_gib: float
    kv_cache_tokens: int

    @classmethod
    def parse(cls, log: str) -> EngineMemory:
        """From an engine's log (the last start in it); `ValueError` when the lines are missing."""
        memory = _MEMORY.findall(log)
        tokens = _TOKENS.findall(log)
        if not memory or not tokens:
            raise ValueError("the log holds no memory split or KV cache size (vLLM >= 0.26)")
        util, requested, weights, activation, non_torch, graphs = map(_float, memory[-1])
        return cls(util, requested, weights, activation, non_torch, graphs,
                   int(_float(tokens[-1])))

    def kv_cache_bytes(self, kv_bytes_per_token: int) -> int:
        return self.kv_cache_tokens * kv_bytes_per_token

    def reserve_bytes(self, plan: MemoryPlan) -> float:
        """What the engine kept beside the planned weights, LoRA slots and its KV cache."""
        requested = self.requested_gib * GIB
        logits = plan.engine.max_num_seqs * plan.model.vocab_size * 4  # the planner adds these
        return requested - self.kv_cache_bytes(plan.kv_bytes_per_token) - plan.weight_bytes \
            - plan.lora_bytes - logits


def _activation_unit(plan: MemoryPlan) -> float:
    """Batched tokens x MLP width x bytes per element: what the fitted factor multiplies."""
    model = plan.model
    return plan.max_num_batched_tokens * model.resolved_intermediate_size * dtype_bytes(plan.dtype)


def fit(samples: list[tuple[MemoryPlan, EngineMemory]]) -> PlannerConstants:
    """The reserve constants that make the planner agree with two engines exactly: activations
    proportional to batched tokens x MLP width (`intermediate_factor`), plus a constant
    (`runtime_overhead_bytes`: non-torch memory and CUDA graphs together)."""
    if len(samples) != 2:
        raise ValueError("fit() takes two engines; the others are for checking the fit")
    (plan_a, seen_a), (plan_b, seen_b) = samples
    unit_a, unit_b = _activation_unit(plan_a), _activation_unit(plan_b)
    if unit_a == unit_b:
        raise ValueError("the two engines need different MLP widths or batch sizes")
    reserve_a, reserve_b = seen_a.reserve_bytes(plan_a), seen_b.reserve_bytes(plan_b)
    factor = (reserve_a - reserve_b) / (unit_a - unit_b)
    constant = reserve_a - factor * unit_a
    return PlannerConstants(runtime_overhead_bytes=int(constant), cuda_graph_bytes=0,
                            activation_factor=0.0, intermediate_factor=round(factor, 3))


def predict_kv_tokens(plan: MemoryPlan, requested_bytes: float) -> int:
    """The KV capacity the plan predicts when the engine is given `requested_bytes`, in vLLM's
    whole blocks."""
    budget = requested_bytes - plan.non_kv_bytes
    blocks = math.floor(budget / (plan.engine.block_size * plan.kv_bytes_per_token))
    return max(0, blocks) * plan.engine.block_size
