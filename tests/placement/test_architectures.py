"""The planner per architecture family against what vLLM 0.26 sized on an H100 80GB.

Ground truth: the raw logs of six engine starts on an H100 80GB HBM3 on 2026-12-06
(docs/gpu-runs/2026-12-06-h100-planner/, made by ``scripts/gpu_arch_profiles.py``; the five of the
issue's table reproduced to the digit, and the pre-quantized layout): dummy weights, bf16,
``--max-model-len 8192``, ``--max-num-seqs 256``, 8,192 batched tokens,
``--gpu-memory-utilization 0.90``. CUDA sees 79.18 GiB (81,080 MiB) on that card, so the engine
was given ``0.90 x 81,080 MiB`` (each log: "Desired GPU memory utilization is (0.9, 71.26 GiB)").
Weights must agree within 2%, KV tokens within 3%. The configs are the public ``config.json``
files of the five models (tests/placement/fixtures/configs); a capacity-test model's weights are
its parameter count times its dtype's size, as ``modelfiles.read_model(dummy=True)`` registers it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving_app.layouts import Layout
from serving_app.modelfiles import config_parameters, read_model
from serving_app.placement.calibration import predict_kv_tokens
from serving_app.placement.inventory import GIB, MIB
from serving_app.placement.planner import (
    EngineSettings,
    ModelArchitecture,
    UnplannableArchitecture,
    plan_memory,
)

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
H100_CUDA_TOTAL = 81_080 * MIB  # ENGINE.md: what CUDA (and --gpu-memory-utilization) sees
REQUESTED = 0.90 * H100_CUDA_TOTAL


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def capacity_test_model(name: str) -> ModelArchitecture:
    """As a capacity-test folder registers it: parameters x the config's dtype size."""
    cfg = config(name)
    element = 4 if cfg["torch_dtype"] == "float32" else 2
    return ModelArchitecture.from_hf_config(cfg, config_parameters(cfg) * element)


def issue_engine(fp8: bool = False, tp: int = 1) -> EngineSettings:
    return EngineSettings(dtype="bfloat16", max_model_len=8192, max_num_seqs=256,
                          max_num_batched_tokens=8192, tensor_parallel_size=tp,
                          quantization="fp8" if fp8 else None,
                          kv_cache_dtype="fp8" if fp8 else "auto")


def check(name: str, vllm_weights_gib: float, vllm_kv_tokens: int, fp8: bool = False):
    plan = plan_memory(capacity_test_model(name), issue_engine(fp8))
    assert plan.weight_bytes / GIB == pytest.approx(vllm_weights_gib, rel=0.02)
    tokens = predict_kv_tokens(plan, REQUESTED)
    assert tokens == pytest.approx(vllm_kv_tokens, rel=0.03), (tokens, vllm_kv_tokens)
    return plan


# ----------------------------------------------------------------------------- dense, GQA


def test_qwen3_8b_dense_gqa():
    # Per layer: q 4096 x 32 x 128 = 16,777,216, k and v 4096 x 8 x 128 = 4,194,304 each, o
    # 16,777,216, q/k norms 2 x 128; MLP 3 x 4096 x 12288 = 150,994,944; two norms 8,192:
    # 192,946,432 x 36 = 6,946,071,552; + embedding and untied head 2 x 151936 x 4096 =
    # 1,244,659,712; + final norm 4,096 = 8,190,735,360 (the model card's 8.2 B).
    assert config_parameters(config("qwen3-8b")) == 8_190_735_360
    # x 2 B = 15.26 GiB; vLLM: 15.27 GiB. KV: 2 x 36 x 8 x 128 x 2 B = 147,456 B/token (vLLM's).
    plan = check("qwen3-8b", 15.27, 396_720)
    assert plan.kv_bytes_per_token == 147_456


def test_qwen3_8b_online_fp8_with_fp8_kv_cache():
    # Linear weights 1 B: 8,190,735,360 - embeddings 1,244,659,712 - norms 36 x 8,192 + 4,096
    # = 6,945,776,640 x 1 B; embeddings and norms 1,244,958,720 x 2 B: 9,435,694,080 B =
    # 8.79 GiB; vLLM 8.83 GiB. KV 2 x 36 x 8 x 128 x 1 B = 73,728 B/token.
    plan = check("qwen3-8b", 8.83, 886_752, fp8=True)
    assert plan.kv_bytes_per_token == 73_728
    assert "online fp8" in dict(plan.rules)["Weights"]


# ----------------------------------------------------------------------------- sliding window


def test_gemma2_9b_sliding_window_counted_at_full_length_and_tied_embeddings():
    layout = Layout.from_config(config("gemma-2-9b"))
    # No tie_word_embeddings in the config: Gemma2Config's default ties them.
    assert layout.tie_word_embeddings and layout.sliding_layers == 21
    # Per layer: q 3584 x 16 x 256 and o 14,680,064 each, k and v 3584 x 8 x 256 = 7,340,032
    # each, MLP 3 x 3584 x 14336 = 154,140,672, four norms 14,336: 198,195,200 x 42 =
    # 8,324,198,400; + one 256000 x 3584 matrix 917,504,000 + final norm 3,584 = 9,241,705,984.
    assert layout.parameters == 9_241_705_984
    # Served in bf16 (float32 config): 17.21 GiB; vLLM 17.22. KV: vLLM 0.26 allocates every
    # layer, sliding or not, at full length: 2 x 42 x 8 x 256 x 2 = 344,064 B/token (ENGINE.md).
    plan = check("gemma-2-9b", 17.22, 162_113)
    assert plan.kv_bytes_per_token == 344_064


# ----------------------------------------------------------------------------- mixture of experts


def test_qwen3_30b_a3b_counts_every_expert():
    layout = Layout.from_config(config("qwen3-30b-a3b"))
    # Per layer: attention 2 x 2048 x 4096 + 2 x 2048 x 512 + q/k norms 256 = 18,874,624;
    # 128 experts x 3 x 2048 x 768 = 603,979,776; router 2048 x 128 = 262,144; norms 4,096:
    # 623,120,640 x 48 = 29,909,790,720; + 2 x 151936 x 2048 = 622,329,856 + 2,048 =
    # 30,532,122,624 (the card's 30.5 B; the old count, one dense MLP per layer, was 3.3 B).
    assert layout.moe_layers == 48 and layout.dense_layers == 0
    assert layout.parameters == 30_532_122_624
    # 8 of 128 experts active: 30,532,122,624 - 48 x 120 x 4,718,592 = 3,353,032,704.
    assert layout.active_parameters == 3_353_032_704
    plan = plan_memory(capacity_test_model("qwen3-30b-a3b"), issue_engine())
    # 56.87 GiB; vLLM 56.88 (the old planner: 6.22). KV 2 x 48 x 4 x 128 x 2 = 98,304 B/token.
    assert plan.weight_bytes / GIB == pytest.approx(56.88, rel=0.02)
    assert plan.kv_bytes_per_token == 98_304


@pytest.mark.xfail(strict=True, reason=(
    "vLLM kept 1.88 GiB beside weights and KV for this shape (71.26 - 56.88 - 12.50), and its "
    "log's memory split says which terms: 1.15 GiB of peak activation, 0.24 non-torch and 0.49 "
    "of estimated CUDA graph memory, subtracted from the KV cache ('Estimated CUDA graph "
    "memory: 0.49 GiB total'; of the six shapes, only this one logged an estimate, and the "
    "dense ones' KV is requested - weights - activation - non-torch exactly). The planner has "
    "0.68 GiB of activations (the fused-MoE buffers and logits) and 0.53 of reserve: 0.67 GiB "
    "short (+5.5% KV tokens). Modelling the graph estimate needs vLLM's rule for when it is "
    "applied, not a constant fitted to this run"))
def test_qwen3_30b_a3b_kv_capacity_within_three_percent():
    check("qwen3-30b-a3b", 56.88, 136_544)


def test_a_compressed_tensors_w4a16_checkpoint_is_sized_from_its_headers(tmp_path):
    """The pre-quantized layout: Qwen3-8B with llm-compressor's W4A16 ``quantization_config``
    (compressed-tensors, pack-quantized, symmetric int4 in groups of 128, the LM head left in
    bf16). Its safetensors header is the one vLLM 0.26's ``CompressedTensorsWNA16`` layers
    created on the H100 (tests/placement/fixtures/headers/qwen3-8b-w4a16.json, dumped by
    ``scripts/gpu_arch_profiles.py qwen3-8b-w4a16``), written here over a sparse file as a
    registered folder holds it."""
    header = (Path(__file__).parent / "fixtures" / "headers" / "qwen3-8b-w4a16.json").read_bytes()
    cfg = {**config("qwen3-8b"), "quantization_config": W4A16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with (tmp_path / "model.safetensors").open("wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header)
        handle.truncate(8 + len(header) + 6_071_350_152)  # sparse: the data is never read
    registered = read_model(str(tmp_path))
    model = ModelArchitecture.from_hf_config(registered.config, registered.weight_bytes)
    # Per layer, e.g. qkv_proj: int4 weights 8 to an int32, 6144 x 4096 / 8 = 6144 x 512 x 4 B
    # = 12,582,912 B; bf16 scales per group, 6144 x 32 x 2 B = 393,216 B; the shape, 2 int64s.
    # 795 tensors: 6,071,350,152 B = 5.654 GiB (embeddings and LM head 2 x 1,244,659,712 B of
    # it). vLLM: "Model loading took 5.68 GiB" (-0.5%: its kernel's repacking workspace).
    assert registered.weight_bytes == 6_071_350_152
    assert model.checkpoint_quantization == "compressed-tensors"
    plan = plan_memory(model, issue_engine())
    assert plan.weight_bytes / GIB == pytest.approx(5.68, rel=0.02)
    # The KV cache is the dense model's, 147,456 B/token: vLLM "GPU KV cache size: 466,528
    # tokens".
    assert plan.kv_bytes_per_token == 147_456
    assert predict_kv_tokens(plan, REQUESTED) == pytest.approx(466_528, rel=0.03)


W4A16 = json.loads((Path(__file__).parent / "fixtures" / "quantization" / "w4a16.json")
                   .read_text())  # what llm-compressor's W4A16 scheme writes


def test_deepseek_v2_lite_latent_attention_and_shared_experts():
    layout = Layout.from_config(config("deepseek-v2-lite"))
    # first_k_dense_replace 1: layer 0 dense (intermediate 10944), 26 MoE layers of 64 routed
    # experts (width 1408) and 2 shared experts (one dense MLP of 2 x 1408 = 2816).
    assert (layout.dense_layers, layout.moe_layers, layout.shared_intermediate_size) == \
        (1, 26, 2816)
    # MLA per layer: q 2048 x 16 x (128 + 64) = 6,291,456; kv_a 2048 x (512 + 64) = 1,179,648
    # + its norm 512; kv_b 512 x 16 x (128 + 128) = 2,097,152; o 16 x 128 x 2048 = 4,194,304:
    # 13,763,072. Dense MLP 3 x 2048 x 10944 = 67,239,936; MoE layer 64 x 8,650,752 +
    # 17,301,504 shared + router 131,072 = 571,080,704. 27 x (13,763,072 + 4,096 norms) +
    # 67,239,936 + 26 x 571,080,704 + 2 x 102400 x 2048 + 2,048 = 15,706,484,224.
    assert layout.attention_parameters == 13_763_072
    assert layout.parameters == 15_706_484_224
    # 29.26 GiB; vLLM 29.34 (the old planner: 5.01). KV: one latent of 512 + 64 = 576 values
    # per layer: 27 x 576 x 2 = 31,104 B/token, vLLM's figure (the old 2 x 27 x 16 x 128 x 2 =
    # 221,184 reserved seven times too much).
    plan = check("deepseek-v2-lite", 29.34, 1_401_552)
    assert plan.kv_bytes_per_token == 31_104


def test_dense_leading_and_interleaved_layers_follow_each_models_rule():
    base = {"hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
            "vocab_size": 100, "intermediate_size": 256, "moe_intermediate_size": 32}
    deepseek = Layout.from_config({**base, "model_type": "deepseek_v3", "n_routed_experts": 8,
                                   "first_k_dense_replace": 3, "moe_layer_freq": 1})
    assert (deepseek.dense_layers, deepseek.moe_layers) == (3, 5)
    qwen = Layout.from_config({**base, "model_type": "qwen3_moe", "num_experts": 8,
                               "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    # (i + 1) % 2 == 0 -> layers 1, 3, 5, 7; layer 1 is MLP-only: 3 MoE layers.
    assert (qwen.dense_layers, qwen.moe_layers) == (5, 3)
    mixtral = Layout.from_config({**base, "model_type": "mixtral", "num_local_experts": 8,
                                  "num_experts_per_tok": 2, "moe_intermediate_size": None})
    # Mixtral's experts are intermediate_size wide; every layer routed.
    assert (mixtral.moe_layers, mixtral.moe_intermediate_size) == (8, 256)
    assert mixtral.parameters == 8 * (4 * 64 * 64 + 8 * 3 * 64 * 256 + 64 * 8 + 2 * 64) \
        + 2 * 100 * 64 + 64


# ----------------------------------------------------------------------------- across families


def test_a_multimodal_models_text_config_is_the_language_model():
    wrapped = {"model_type": "qwen3_vl", "architectures": ["X"], "torch_dtype": "bfloat16",
               "text_config": config("qwen3-8b"), "vision_config": {"hidden_size": 1152}}
    assert config_parameters(wrapped) == config_parameters(config("qwen3-8b"))
    model = ModelArchitecture.from_hf_config(wrapped, 1)
    assert (model.num_layers, model.hidden_size) == (36, 4096)


def test_tensor_parallel_splits_kv_heads_but_not_the_latent():
    # GQA over TP 2: 4 KV heads per GPU, half the bytes; MLA's latent is whole on each GPU.
    qwen = plan_memory(capacity_test_model("qwen3-8b"), issue_engine(tp=2))
    assert qwen.kv_bytes_per_token == 147_456 // 2
    deepseek = plan_memory(capacity_test_model("deepseek-v2-lite"), issue_engine(tp=2))
    assert deepseek.kv_bytes_per_token == 31_104


def test_the_plan_names_the_rule_behind_each_term():
    plan = plan_memory(capacity_test_model("deepseek-v2-lite"), issue_engine())
    rules = dict(plan.rules)
    assert set(rules) == {"Architecture", "Weights", "KV cache", "Activations", "Runtime"}
    assert "MLAAttentionSpec" in rules["KV cache"] and "576" in rules["KV cache"]
    assert "fused MoE workspaces" in rules["Activations"]
    assert "64 experts" in rules["Architecture"]
    explained = " ".join(plan.explain())
    assert "KV cache rule: latent attention" in explained
    gemma = dict(plan_memory(capacity_test_model("gemma-2-9b"), issue_engine()).rules)
    assert "21 sliding-window layers" in gemma["KV cache"]


# ----------------------------------------------------------------------------- refused


def test_a_state_space_model_is_refused_with_its_reason():
    model = capacity_test_model("mamba-2.8b")
    with pytest.raises(UnplannableArchitecture, match="state-space or linear-attention"):
        plan_memory(model, issue_engine())


@pytest.mark.parametrize("extra, reason", [
    ({"model_type": "newthing", "ssm_state_size": 16}, "unknown model_type 'newthing'"),
    ({"model_type": "newthing", "num_experts": 8}, "num_experts"),
    ({"model_type": "llama", "layer_types": ["full_attention", "linear_attention"]},
     "linear_attention"),
])
def test_unmodelled_layouts_are_refused(extra, reason):
    cfg = {**config("qwen3-8b"), **extra}
    with pytest.raises(UnplannableArchitecture, match=reason):
        plan_memory(ModelArchitecture.from_hf_config(cfg, 10**9), issue_engine())


def test_an_unknown_model_type_with_a_plain_layout_is_planned_as_dense():
    cfg = {**config("qwen3-8b"), "model_type": "newthing"}
    plan = plan_memory(ModelArchitecture.from_hf_config(cfg, 10**9), issue_engine())
    assert plan.kv_bytes_per_token == 147_456
