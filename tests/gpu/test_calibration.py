"""The planner against the engine on an H200 (docs/gpu.md, "Planner"): vLLM 0.26 logged how it
split its share of the GPU for three shapes started by the console (docs/gpu-runs, the
sequential planner run). The reserve's constants fitted to two shapes predict the third's KV
capacity within 2%, and the planner's defaults are that fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving_app.management.commands.gpu_check import PLANNER_SEQS, SHAPES
from serving_app.modelfiles import config_parameters
from serving_app.placement.calibration import EngineMemory, fit, predict_kv_tokens
from serving_app.placement.inventory import GIB
from serving_app.placement.planner import (
    DEFAULT_CONSTANTS,
    EngineSettings,
    ModelArchitecture,
    PlannerConstants,
    plan_memory,
)

RUN = Path(__file__).resolve().parents[2] / "docs" / "gpu-runs" / "2026-12-05-h200"


def plan(name: str, constants: PlannerConstants = DEFAULT_CONSTANTS):
    """The plan of the run's engine: the shape's config (the tiny tokenizer's 1,024-token
    vocabulary), 4,096-token context, its sequences, one LoRA slot of rank 16, vLLM's default
    batch (8,192 tokens, as the engine logged)."""
    config = {**SHAPES[name], "vocab_size": 1024, "torch_dtype": "bfloat16"}
    model = ModelArchitecture.from_hf_config(config, config_parameters(config) * 2)
    engine = EngineSettings(max_num_seqs=PLANNER_SEQS[name], max_model_len=4096,
                            enable_lora=True, max_loras=1, max_lora_rank=16)
    return plan_memory(model, engine, constants)


def logged(name: str) -> EngineMemory:
    return EngineMemory.parse((RUN / f"planner-sequential-{name}.log").read_text())


def test_the_engines_memory_split_is_read_from_its_log():
    seen = logged("llama3-8b-shape")
    assert seen == EngineMemory(utilization=0.23, requested_gib=32.15, weights_gib=13.1,
                                activation_gib=0.93, non_torch_gib=0.22, cuda_graph_gib=0.24,
                                kv_cache_tokens=146624)
    with pytest.raises(ValueError):
        EngineMemory.parse("INFO nothing about memory")


def test_planned_weights_and_kv_bytes_per_token_match_what_the_engine_used():
    for name in PLANNER_SEQS:
        p, seen = plan(name), logged(name)
        # Weights: the engine's figure includes its LoRA slots; within 0.2 GiB of the plan.
        assert abs(seen.weights_gib - (p.weight_bytes + p.lora_bytes) / GIB) < 0.2, name
        # KV bytes per token: vLLM's tokens x the plan's bytes per token is the GiB it logged.
        kv_gib = float(_kv_gib_logged(name))
        assert abs(seen.kv_cache_tokens * p.kv_bytes_per_token / GIB - kv_gib) < 0.01, name


def _kv_gib_logged(name: str) -> str:
    text = (RUN / f"planner-sequential-{name}.log").read_text()
    return text.split("Current kv cache memory in use is ")[-1].split(" GiB")[0]


@pytest.mark.parametrize("calibrated, predicted", [
    (("llama3-8b-shape", "llama2-7b-shape"), "qwen25-7b-shape"),
    (("llama3-8b-shape", "qwen25-7b-shape"), "llama2-7b-shape"),
    (("qwen25-7b-shape", "llama2-7b-shape"), "llama3-8b-shape"),
])
def test_constants_fitted_on_two_shapes_predict_the_third_within_two_percent(calibrated,
                                                                               predicted):
    constants = fit([(plan(name), logged(name)) for name in calibrated])
    seen = logged(predicted)
    tokens = predict_kv_tokens(plan(predicted, constants), seen.requested_gib * GIB)
    assert abs(tokens / seen.kv_cache_tokens - 1) < 0.02, (tokens, seen.kv_cache_tokens)


def test_the_planners_defaults_are_the_fit_on_llama3_and_llama2():
    constants = fit([(plan(name), logged(name)) for name in ("llama3-8b-shape",
                                                             "llama2-7b-shape")])
    # The defaults are the fit, rounded (3.123 -> 3.125; the constant to whole MiB).
    assert abs(constants.intermediate_factor - DEFAULT_CONSTANTS.intermediate_factor) < 0.005
    together = DEFAULT_CONSTANTS.runtime_overhead_bytes + DEFAULT_CONSTANTS.cuda_graph_bytes
    assert abs(constants.runtime_overhead_bytes - together) < 8 * 1024**2
    for name in PLANNER_SEQS:  # and so the defaults predict all three within 2%
        seen = logged(name)
        tokens = predict_kv_tokens(plan(name), seen.requested_gib * GIB)
        assert abs(tokens / seen.kv_cache_tokens - 1) < 0.02, name
