"""Memory planner: how much GPU memory one vLLM instance of a deployment needs, before it starts.

Everything is per GPU of one instance: ``tensor_parallel_size`` (TP) x ``pipeline_parallel_size``
(PP) GPUs, each pipeline stage holding ``ceil(layers / PP)`` layers (vLLM gives the earlier
stages no more than that) split over its TP GPUs. The figures are those of the heaviest stage:
vLLM gives every rank one ``gpu_memory_utilization``, so the busiest GPU sizes them all.
The four parts, with the formulas used (``B(x)`` = bytes per element of dtype ``x``):

With a layout (``ModelArchitecture.layout``, from config.json) the parameters, the online-fp8
split and the activation width are the layout's (mixture of experts, latent attention); a layout
it does not model is refused (``UnplannableArchitecture``), and a measured profile
(``placement.profile``) replaces the terms its engine logged. Each plan names every term's rule
(``MemoryPlan.rules``).

1. **Weights.** ``weight_bytes`` is the size of the checkpoint's safetensors files. Parameters are
   ``weight_bytes / B(checkpoint dtype)`` (or the checkpoint's own quantization). Loaded bytes are
   the parameters times the bytes per parameter of the served format: ``B(dtype)`` unquantized;
   1 for ``fp8``; 0.5 + 2.5/128 for ``awq``/``gptq`` (4-bit, fp16 scale and packed zero per group
   of 128); 0.5 + 4/64 for ``bitsandbytes`` (NF4, fp32 absmax per block of 64). Embedding and
   LM head (``vocab_size x hidden_size``, once or twice) stay in ``dtype`` when quantizing. A
   checkpoint already in the requested quantization is taken at its file size. Per GPU: the
   stage's share of the decoder layers (``ceil(layers / PP) / layers``) plus, with PP > 1, one
   ``vocab x hidden`` matrix (the first stage holds the embedding, the last the LM head; with
   PP 1 both, or one when tied), / TP.
2. **KV cache.** Bytes per token per GPU = ``stage layers x values per layer x B(kv dtype)``,
   the values as the model's layout gives them (``serving_app.layouts``: ``2 x ceil(kv_heads /
   TP) x head_dim`` for dense attention, vLLM replicating KV heads when TP exceeds their count;
   ``kv_lora_rank + qk_rope_head_dim`` for latent attention; sliding windows at full length).
   Tokens needed = ``max_num_seqs x max_model_len`` (each sequence rounded up to whole
   ``block_size`` blocks), or the admin's ``target_kv_tokens``.
3. **LoRA.** vLLM preallocates ``max_loras`` slots of ``max_lora_rank``. Per layer and targeted
   module: ``rank x (in + out) x B(dtype)``; q: hidden -> heads x head_dim, k and v: hidden ->
   kv_heads x head_dim, o: heads x head_dim -> hidden; with MLP targets also gate and up:
   hidden -> intermediate, down: intermediate -> hidden. Per GPU: the stage's layers, / TP.
4. **Runtime reserve.** ``runtime_overhead_bytes`` (225 MiB: the non-torch memory vLLM 0.26
   logged on an H200) plus ``cuda_graph_bytes`` (315 MiB, 0 with ``enforce_eager``) plus, with
   TP x PP > 1, ``nccl_bytes`` (256 MiB); plus activations of one forward pass at the token budget,
   ``max_num_batched_tokens x B(dtype) x (hidden_size x activation_factor + intermediate_size x
   intermediate_factor)`` (0 and 3.125: the MLP's gate/up output dominates the peak), plus fp32
   logits for sampling, ``max_num_seqs x vocab_size x 4``. The constants were fitted to two
   engines on an H200 and predicted a third's KV capacity within 0.6%
   (``placement.calibration``, docs/gpu.md "Planner"); until 2026-12 they were 1 GiB, 0.5 GiB and
   ``hidden x 24`` at 2,048 batched tokens.

vLLM's ``gpu_memory_utilization`` is the share of the GPU's *total* memory the instance may use
for all of the above, so the fraction to give it is ``needed / total``, rounded up to 0.01.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from serving_app.enginespec import MEMORY_FIELDS, EngineSpec, vllm_default_of
from serving_app.layouts import Layout, text_config

from .inventory import GIB, MIB
from .profile import MeasuredProfile

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}

# Bytes per quantized parameter, scales and zero points included (see the module docstring).
QUANT_BYTES_PER_PARAM: dict[str, float] = {
    "fp8": 1.0,
    "awq": 0.5 + 2.5 / 128,
    "gptq": 0.5 + 2.5 / 128,
    "bitsandbytes": 0.5 + 4 / 64,
}

VLLM_DEFAULT_BLOCK_SIZE = 16  # GPU default; the CPU backend uses 128


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a torch dtype name (``"bfloat16"``, ``"torch.float16"``, ``"fp8"``)."""
    key = dtype.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def _normalise_dtype(dtype: str) -> str:
    key = dtype.lower().removeprefix("torch.")
    return {
        "fp32": "float32",
        "float": "float32",
        "fp16": "float16",
        "half": "float16",
        "bf16": "bfloat16",
    }.get(key, key)


def gib(n_bytes: float) -> str:
    """``40265318400`` -> ``"37.50 GiB"``."""
    return f"{n_bytes / GIB:.2f} GiB"


@dataclass(frozen=True)
class ModelArchitecture:
    """What the planner needs to know about a model (from its ``config.json`` and files)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    weight_bytes: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int | None = None
    torch_dtype: str = "bfloat16"
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    checkpoint_quantization: str | None = None
    # The layers as vLLM builds them, read from config.json (``serving_app.layouts``); without
    # one the model is planned as a dense decoder from the fields above.
    layout: Layout | None = None
    # What one start of its engine logged (``placement.profile``); used, marked "measured",
    # for engines with the settings it was measured with.
    measured: MeasuredProfile | None = None

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim`` when the config gives it, else ``hidden_size / num_attention_heads``."""
        if self.head_dim or not self.num_attention_heads:  # no heads: not an attention model
            return self.head_dim or 0
        return self.hidden_size // self.num_attention_heads

    @property
    def resolved_intermediate_size(self) -> int:
        """``intermediate_size`` when given, else 4 x hidden (the classic transformer ratio)."""
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus LM head (once when tied)."""
        if self.layout is not None:
            return self.layout.embedding_parameters
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], weight_bytes: int) -> ModelArchitecture:
        """Build from a Hugging Face ``config.json`` dict (a multimodal model's ``text_config``
        taken for the language model) and the weights' total size; the layout comes with it.
        Raises ``layouts.ArchitectureError`` (a ``ValueError``) when basic fields are missing."""
        layout = Layout.from_config(config)
        cfg = text_config(config)
        quant = cfg.get("quantization_config") or {}
        return cls(
            num_layers=layout.num_layers,
            hidden_size=layout.hidden_size,
            num_attention_heads=layout.num_attention_heads,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim or None,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            weight_bytes=int(weight_bytes),
            vocab_size=layout.vocab_size,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            intermediate_size=layout.intermediate_size,
            tie_word_embeddings=layout.tie_word_embeddings,
            checkpoint_quantization=quant.get("quant_method"),
            layout=layout,
        )


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM engine arguments that change memory (names follow vLLM's CLI flags). One not
    given is at vLLM's own default, declared with the setting (``enginespec.vllm_default_of()``);
    ``max_model_len`` and ``quantization`` default to the model's, ``max_num_batched_tokens`` to
    vLLM's on an H100 or H200 (where the reserve's constants were fitted)."""

    dtype: str = vllm_default_of("dtype", str)
    kv_cache_dtype: str = vllm_default_of("kv_cache_dtype", str)
    quantization: str | None = None
    max_num_seqs: int = vllm_default_of("max_num_seqs", int)
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = vllm_default_of("tensor_parallel_size", int)
    pipeline_parallel_size: int = vllm_default_of("pipeline_parallel_size", int)
    enable_lora: bool = False
    max_loras: int = vllm_default_of("max_loras", int)
    max_lora_rank: int = vllm_default_of("max_lora_rank", int)
    lora_target_mlp: bool = False
    target_kv_tokens: int | None = None
    block_size: int = VLLM_DEFAULT_BLOCK_SIZE
    enforce_eager: bool = vllm_default_of("enforce_eager", bool)

    @classmethod
    def of(
        cls,
        engine: EngineSpec,
        *,
        adapters: bool = False,
        lora_target_mlp: bool = False,
        target_kv_tokens: int | None = None,
        enforce_eager: bool = False,
    ) -> EngineSettings:
        """The planner's inputs for engines started with `engine`: every setting declared as
        changing memory (``EngineField.memory``), by its name, as launch passes it. LoRA slots
        are preallocated when ``adapters`` are attached or ``max_loras`` is set (launch then
        passes ``--enable-lora``)."""
        memory: dict[str, Any] = {name: getattr(engine, name) for name in MEMORY_FIELDS}
        memory["enforce_eager"] = memory.get("enforce_eager") or enforce_eager
        return cls(**memory, enable_lora=adapters or engine.max_loras > 0,
                   lora_target_mlp=lora_target_mlp, target_kv_tokens=target_kv_tokens)


@dataclass(frozen=True)
class PlannerConstants:
    """The reserve's fixed terms; override to calibrate against a measured engine."""

    # Fitted to two engines on an H200 (Llama-3-8B and Llama-2-7B shapes, vLLM 0.26), which
    # then predicted a Qwen2.5-7B shape's KV capacity within 0.6% (docs/gpu.md, "Planner";
    # `placement.calibration`): non-torch memory as logged (0.22 GiB), CUDA graphs the rest of
    # the fitted constant, activations 3.125 bytes per batched token per unit of MLP width per
    # byte of dtype (the gate/up projection's output dominates the peak).
    runtime_overhead_bytes: int = 225 * MIB
    cuda_graph_bytes: int = 315 * MIB
    nccl_bytes: int = 256 * MIB
    activation_factor: float = 0.0  # per unit of hidden size (the earlier form; 24 until 2026-12)
    intermediate_factor: float = 3.125


DEFAULT_CONSTANTS = PlannerConstants()


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's answer for one instance; byte figures are per GPU unless named ``_total``."""

    model: ModelArchitecture
    engine: EngineSettings
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    max_model_len: int
    max_num_batched_tokens: int
    parameters: int
    weight_bytes_total: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_token_total: int
    kv_tokens: int
    kv_cache_bytes: int
    lora_bytes: int
    activation_bytes: int
    runtime_overhead_bytes: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    pipeline_parallel_size: int = 1
    stage_layers: int = 0  # decoder layers on the heaviest pipeline stage (0: all)
    rules: tuple[tuple[str, str], ...] = ()  # (term, the rule that produced it)
    source: str = "formula"  # "measured": from the model's measured profile

    @property
    def gpus(self) -> int:
        """GPUs one instance spans (TP x PP); each needs ``needed_bytes``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def non_kv_bytes(self) -> int:
        """Everything but the KV cache: what is used before a single token is cached."""
        return (
            self.weight_bytes
            + self.lora_bytes
            + self.activation_bytes
            + (self.runtime_overhead_bytes)
        )

    @property
    def needed_bytes(self) -> int:
        """GPU memory needed on each GPU of the instance."""
        return self.non_kv_bytes + self.kv_cache_bytes

    @property
    def needed_gib(self) -> float:
        """``needed_bytes`` in GiB."""
        return self.needed_bytes / GIB

    @property
    def sequence_tokens(self) -> int:
        """KV tokens one full-length sequence occupies (whole blocks)."""
        return _round_up(self.max_model_len, self.engine.block_size)

    def gpu_memory_utilization(self, gpu_total_bytes: int) -> float:
        """The fraction to pass as ``--gpu-memory-utilization`` on a GPU of this total memory.

        ``needed / total`` rounded up to 0.01. It may exceed 1.0: then it does not fit (``fits``).
        """
        if gpu_total_bytes <= 0:
            raise ValueError("gpu_total_bytes must be positive")
        # The small epsilon keeps an exact 0.37 from becoming 0.38 through float error.
        return math.ceil(self.needed_bytes / gpu_total_bytes * 100 - 1e-9) / 100

    def fits(self, gpu_total_bytes: int, max_utilization: float = 1.0) -> bool:
        """Whether the instance fits on a GPU of this size within ``max_utilization``."""
        return self.gpu_memory_utilization(gpu_total_bytes) <= max_utilization + 1e-9

    def kv_budget_bytes(self, gpu_total_bytes: int, gpu_memory_utilization: float) -> int:
        """Bytes left for the KV cache given a utilization on a GPU (what vLLM would allocate)."""
        return max(0, int(gpu_total_bytes * gpu_memory_utilization) - self.non_kv_bytes)

    def concurrent_sequences(self, gpu_total_bytes: int, gpu_memory_utilization: float) -> int:
        """How many full-length (``max_model_len``) sequences the KV cache holds at once."""
        tokens = self.kv_capacity_tokens(
            self.kv_budget_bytes(gpu_total_bytes, gpu_memory_utilization)
        )
        return tokens // self.max_model_len

    def kv_capacity_tokens(self, kv_cache_bytes: int, block_size: int | None = None) -> int:
        """Tokens a KV cache of this many bytes (per GPU) holds, as vLLM counts them.

        vLLM splits the cache into blocks of ``block_size`` tokens and reports
        ``num_blocks / ceil(max_model_len / block_size) x max_model_len`` tokens, which is
        ``num_blocks x block_size`` when ``max_model_len`` is a multiple of the block size. The CPU
        engine sizes its cache as ``VLLM_CPU_KVCACHE_SPACE`` GiB with ``block_size`` 128.
        """
        block = block_size or self.engine.block_size
        num_blocks = kv_cache_bytes // (block * self.kv_bytes_per_token)
        blocks_per_request = math.ceil(self.max_model_len / block)
        return int(num_blocks / blocks_per_request * self.max_model_len)

    def explain(self, gpu_total_bytes: int | None = None) -> list[str]:
        """Human-readable lines, for the admin page and the dry-run plan endpoint."""
        m, e, tp = self.model, self.engine, self.tensor_parallel_size
        pp = self.pipeline_parallel_size
        layers = self.stage_layers or m.num_layers
        quant = e.quantization or "none"
        parallel = f"TP {tp}" + (f" x PP {pp} ({self.gpus} GPUs, {layers} layers on the "
                                 "heaviest stage)" if pp > 1 else "")
        lines = [
            f"Model: {m.num_layers} layers, hidden {m.hidden_size}, "
            f"{m.num_attention_heads} heads / {m.num_kv_heads} KV heads, head_dim "
            f"{m.resolved_head_dim}; served in {self.dtype}, quantization {quant}, {parallel}.",
            f"Weights: {self.parameters / 1e9:.2f} B parameters -> {gib(self.weight_bytes_total)}"
            f" in total, {gib(self.weight_bytes)} per GPU.",
            f"KV cache: {layers} layers x {self.kv_bytes_per_token // layers:,} B = "
            f"{self.kv_bytes_per_token:,} B per token per GPU.",
        ]
        if e.target_kv_tokens:
            lines.append(
                f"KV needed: target {self.kv_tokens:,} tokens -> {gib(self.kv_cache_bytes)}."
            )
        else:
            lines.append(
                f"KV needed: {e.max_num_seqs} seqs x {self.max_model_len:,} tokens "
                f"= {self.kv_tokens:,} tokens -> {gib(self.kv_cache_bytes)}."
            )
        if e.enable_lora:
            lines.append(
                f"LoRA: {e.max_loras} slots of rank {e.max_lora_rank} -> {gib(self.lora_bytes)}."
            )
        lines.append(
            f"Reserve: runtime {gib(self.runtime_overhead_bytes)} + activations for "
            f"{self.max_num_batched_tokens:,} batched tokens {gib(self.activation_bytes)}."
        )
        lines.append(f"Needed per GPU: {gib(self.needed_bytes)}.")
        if gpu_total_bytes:
            util = self.gpu_memory_utilization(gpu_total_bytes)
            if util <= 1.0:
                seqs = self.concurrent_sequences(gpu_total_bytes, util)
                lines.append(
                    f"On a GPU of {gib(gpu_total_bytes)}: gpu_memory_utilization {util:.2f}, "
                    f"{seqs} concurrent sequences of {self.max_model_len:,} tokens."
                )
            else:
                lines.append(f"Does not fit on a GPU of {gib(gpu_total_bytes)} (needs {util:.2f}).")
        lines.extend(f"{term} rule: {rule}." for term, rule in self.rules)
        lines.extend(self.notes)
        return lines


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def resolve_dtype(model: ModelArchitecture, engine: EngineSettings) -> str:
    """vLLM's ``--dtype auto``: the checkpoint's dtype, except float32 which is served in bf16."""
    if engine.dtype != "auto":
        return _normalise_dtype(engine.dtype)
    config_dtype = _normalise_dtype(model.torch_dtype)
    return "bfloat16" if config_dtype == "float32" else config_dtype


class UnplannableArchitecture(ValueError):
    """A model whose layout the planner does not model (``Layout.refusal`` says why)."""


def _weight_bytes(model: ModelArchitecture, engine: EngineSettings,
                  dtype: str) -> tuple[int, int, str]:
    """(parameters, loaded weight bytes for the whole model, the rule that gave them)."""
    layout, ckpt_quant, quant = model.layout, model.checkpoint_quantization, engine.quantization
    if ckpt_quant and quant in (None, ckpt_quant):
        params = layout.parameters if layout else _parameters(model)
        return params, model.weight_bytes, (
            f"pre-quantized checkpoint ({ckpt_quant}): the tensors as the safetensors headers "
            "size them, loaded as they are")
    if layout is None:
        params, loaded = _dense_weight_bytes(model, engine, dtype)
        return params, loaded, "dense decoder: parameters from the file size x bytes per " \
                               "parameter of the served format"
    if quant is None:
        # The files' tensors, as their headers size them (a capacity-test model's are the
        # layout's count x the config's dtype), converted to the served dtype.
        params = int(model.weight_bytes / dtype_bytes(model.torch_dtype))
        return params, int(params * dtype_bytes(dtype)), (
            f"{params:,} parameters (config.json's layers as vLLM creates them: "
            f"{layout.parameters:,}) x {dtype_bytes(dtype):g} B ({dtype})")
    if quant not in QUANT_BYTES_PER_PARAM:
        raise ValueError(
            f"unknown quantization {quant!r}; known: {', '.join(sorted(QUANT_BYTES_PER_PARAM))}"
        )
    linear, kept = layout.linear_parameters, layout.unquantized_parameters
    loaded = int(linear * QUANT_BYTES_PER_PARAM[quant] + kept * dtype_bytes(dtype))
    return layout.parameters, loaded, (
        f"online {quant} (vLLM's {quant} linear and MoE methods): {linear:,} linear and expert "
        f"parameters x {QUANT_BYTES_PER_PARAM[quant]:.3g} B + {kept:,} embedding, norm and "
        f"router parameters x {dtype_bytes(dtype):g} B ({dtype})")


def _parameters(model: ModelArchitecture) -> int:
    """Parameters from the file size alone (no layout)."""
    ckpt_quant = model.checkpoint_quantization
    if ckpt_quant and ckpt_quant in QUANT_BYTES_PER_PARAM:
        embed = model.embedding_params
        quantized = max(0, model.weight_bytes - embed * dtype_bytes(model.torch_dtype))
        return int(quantized / QUANT_BYTES_PER_PARAM[ckpt_quant] + embed)
    return int(model.weight_bytes / dtype_bytes(model.torch_dtype))


def _dense_weight_bytes(model: ModelArchitecture, engine: EngineSettings,
                        dtype: str) -> tuple[int, int]:
    """(parameters, loaded weight bytes) of a model without a layout."""
    ckpt_quant = model.checkpoint_quantization
    # Files hold quantized linears plus 16-bit embeddings: the count is recovered from both.
    params = _parameters(model)
    quant = engine.quantization
    if quant is None:
        if ckpt_quant:
            return params, model.weight_bytes
        return params, int(params * dtype_bytes(dtype))
    if quant not in QUANT_BYTES_PER_PARAM:
        raise ValueError(
            f"unknown quantization {quant!r}; known: {', '.join(sorted(QUANT_BYTES_PER_PARAM))}"
        )
    if ckpt_quant == quant:
        return params, model.weight_bytes
    embed = min(model.embedding_params, params)
    loaded = (params - embed) * QUANT_BYTES_PER_PARAM[quant] + embed * dtype_bytes(dtype)
    return params, int(loaded)


def _lora_bytes(model: ModelArchitecture, engine: EngineSettings, dtype: str,
                stage_layers: int) -> int:
    if not engine.enable_lora:
        return 0
    h = model.hidden_size
    q_out = model.num_attention_heads * model.resolved_head_dim
    kv_out = model.num_kv_heads * model.resolved_head_dim
    dims = [(h, q_out), (h, kv_out), (h, kv_out), (q_out, h)]
    if engine.lora_target_mlp:
        inter = model.resolved_intermediate_size
        dims += [(h, inter), (h, inter), (inter, h)]
    per_layer = sum(engine.max_lora_rank * (i + o) for i, o in dims) * dtype_bytes(dtype)
    total = per_layer * stage_layers * engine.max_loras
    return int(math.ceil(total / engine.tensor_parallel_size))


def stage_layers(num_layers: int, pipeline_parallel_size: int) -> int:
    """Decoder layers on the heaviest pipeline stage: vLLM splits them as evenly as it can."""
    return -(-num_layers // pipeline_parallel_size)


def _weight_bytes_per_gpu(model: ModelArchitecture, engine: EngineSettings, dtype: str,
                          params: int, weights_total: int, layers: int) -> int:
    """The heaviest stage's share of the loaded weights, on each of its TP GPUs: its decoder
    layers' part of what is not embedding, plus the embedding matrices it holds (embeddings stay
    in ``dtype`` when quantizing)."""
    tp, pp = engine.tensor_parallel_size, engine.pipeline_parallel_size
    if pp == 1:
        return int(math.ceil(weights_total / tp))
    embedding = int(min(model.embedding_params, params) * dtype_bytes(dtype))
    stage_embedding = int(min(model.vocab_size * model.hidden_size, params) * dtype_bytes(dtype))
    decoder = max(0, weights_total - embedding)
    stage = decoder * layers // model.num_layers + stage_embedding
    return int(math.ceil(stage / tp))


def plan_memory(
    model: ModelArchitecture,
    engine: EngineSettings,
    constants: PlannerConstants = DEFAULT_CONSTANTS,
) -> MemoryPlan:
    """Compute the memory plan for one instance (per GPU of its heaviest pipeline stage).

    With a measured profile that applies to these settings, each term the engine logged is
    taken from it (``source`` "measured"); otherwise a layout the planner does not model is
    refused (``UnplannableArchitecture``) with the reason."""
    measured = model.measured
    if measured is not None:
        mismatch = measured.mismatch(measured_settings(model, engine))
        if not mismatch:
            formula = _formula_plan(replace(model, measured=None), engine, constants,
                                    refuse=False)
            return _measured_plan(formula, measured)
        if model.layout is not None and model.layout.refusal:
            raise UnplannableArchitecture(
                f"Not planned automatically: {model.layout.refusal}; its measured profile was "
                f"{mismatch}.")
    return _formula_plan(model, engine, constants)


def measured_settings(model: ModelArchitecture, engine: EngineSettings) -> dict[str, Any]:
    """The settings a measured profile depends on, resolved as vLLM resolves them."""
    dtype = resolve_dtype(model, engine)
    return {
        "dtype": dtype,
        "quantization": engine.quantization,
        "kv_cache_dtype": dtype if engine.kv_cache_dtype == "auto"
        else _normalise_dtype(engine.kv_cache_dtype),
        "tensor_parallel_size": engine.tensor_parallel_size,
        "pipeline_parallel_size": engine.pipeline_parallel_size,
        "max_num_batched_tokens": engine.max_num_batched_tokens
        or vllm_default_of("max_num_batched_tokens", int),
        "max_num_seqs": engine.max_num_seqs,
    }


def _measured_plan(plan: MemoryPlan, measured: MeasuredProfile) -> MemoryPlan:
    """The formula's plan with every term the engine logged replaced by the logged figure."""
    rules = dict(plan.rules)
    where = f" ({measured.source})" if measured.source else ""

    def term(name: str, value: int | None, formula: int, logged: str) -> int:
        if value is None:
            rules[name] = f"not logged (absent): formula, {rules.get(name, '')}"
            return formula
        rules[name] = f"measured: {logged}{where}"
        return value

    kv_per_token = term("KV cache", measured.kv_bytes_per_token, plan.kv_bytes_per_token,
                        f"{measured.kv_cache_gib} GiB for {measured.kv_cache_tokens or 0:,} "
                        "tokens")
    weights = term("Weights", measured.weight_bytes, plan.weight_bytes,
                   f"{measured.weights_gib} GiB per GPU")
    activations = term("Activations", measured.activation_bytes, plan.activation_bytes,
                       f"{measured.activation_gib} GiB peak activation")
    runtime = term("Runtime", measured.runtime_bytes, plan.runtime_overhead_bytes,
                   f"{measured.non_torch_gib} GiB non-torch + {measured.cuda_graph_gib} GiB "
                   "CUDA graphs")
    layers = plan.stage_layers or plan.model.num_layers
    return replace(
        plan, weight_bytes=weights, weight_bytes_total=weights * plan.gpus,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_token_total=kv_per_token * plan.model.num_layers // layers
        * plan.tensor_parallel_size,
        kv_cache_bytes=plan.kv_tokens * kv_per_token, activation_bytes=activations,
        runtime_overhead_bytes=runtime, rules=tuple(rules.items()), source="measured")


def _formula_plan(
    model: ModelArchitecture,
    engine: EngineSettings,
    constants: PlannerConstants,
    refuse: bool = True,
) -> MemoryPlan:
    """The plan from the configuration's layout (or the dense fields) alone; a layout the
    planner does not model is refused unless ``refuse`` is off (its terms are then the
    fallbacks a measured profile replaces)."""
    tp, pp = engine.tensor_parallel_size, engine.pipeline_parallel_size
    if tp < 1:
        raise ValueError("tensor_parallel_size must be at least 1")
    if pp < 1:
        raise ValueError("pipeline_parallel_size must be at least 1")
    if pp > model.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {model.num_layers} "
                         "layers")
    if refuse and model.layout is not None and model.layout.refusal:
        raise UnplannableArchitecture(f"Not planned automatically: {model.layout.refusal}.")
    layers = stage_layers(model.num_layers, pp)
    if engine.max_num_seqs < 1:
        raise ValueError("max_num_seqs must be at least 1")
    dtype = resolve_dtype(model, engine)
    kv_dtype = dtype if engine.kv_cache_dtype == "auto" else _normalise_dtype(engine.kv_cache_dtype)
    max_model_len = engine.max_model_len or model.max_position_embeddings
    notes: list[str] = []
    if max_model_len > model.max_position_embeddings:
        notes.append(
            f"Note: max_model_len {max_model_len:,} exceeds the model's "
            f"max_position_embeddings {model.max_position_embeddings:,} (vLLM refuses this "
            "without rope scaling)."
        )
    batched = engine.max_num_batched_tokens or vllm_default_of("max_num_batched_tokens", int)

    params, weights_total, weight_rule = _weight_bytes(model, engine, dtype)
    weights = _weight_bytes_per_gpu(model, engine, dtype, params, weights_total, layers)

    values = kv_values_per_layer(model, tp)
    kv_per_token = int(layers * values * dtype_bytes(kv_dtype))
    kv_per_token_total = int(model.num_layers * values * dtype_bytes(kv_dtype)) * tp
    if engine.target_kv_tokens is not None:
        kv_tokens = _round_up(engine.target_kv_tokens, engine.block_size)
    else:
        kv_tokens = engine.max_num_seqs * _round_up(max_model_len, engine.block_size)
    kv_cache = kv_tokens * kv_per_token

    activations = int(batched * dtype_bytes(dtype) * activation_width(model, constants))
    activations += engine.max_num_seqs * model.vocab_size * 4
    runtime = constants.runtime_overhead_bytes
    if not engine.enforce_eager:
        runtime += constants.cuda_graph_bytes
    if tp * pp > 1:
        runtime += constants.nccl_bytes

    return MemoryPlan(
        model=model,
        engine=engine,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        tensor_parallel_size=tp,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        parameters=params,
        weight_bytes_total=weights_total,
        weight_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_token_total=kv_per_token_total,
        kv_tokens=kv_tokens,
        kv_cache_bytes=kv_cache,
        lora_bytes=_lora_bytes(model, engine, dtype, layers),
        activation_bytes=activations,
        runtime_overhead_bytes=runtime,
        notes=tuple(notes),
        pipeline_parallel_size=pp,
        stage_layers=layers,
        rules=_rules(model, weight_rule, tp, kv_dtype),
    )


def kv_values_per_layer(model: ModelArchitecture, tp: int) -> int:
    """Values cached per token and layer on one GPU: the layout's rule (latent attention, KV
    heads replicated past TP), or ``2 x ceil(kv_heads / TP) x head_dim`` without one."""
    if model.layout is not None:
        return model.layout.kv_values_per_layer(tp)
    return 2 * math.ceil(model.num_kv_heads / tp) * model.resolved_head_dim


def activation_width(model: ModelArchitecture, constants: PlannerConstants) -> float:
    """Elements per batched token at the forward pass's peak (see ``Layout.activation_width``):
    the widest MLP, dense or routed, plus the hidden-size term."""
    hidden = model.hidden_size * constants.activation_factor
    if model.layout is not None:
        return hidden + model.layout.activation_width(constants.intermediate_factor)
    return hidden + model.resolved_intermediate_size * constants.intermediate_factor


def _rules(model: ModelArchitecture, weight_rule: str, tp: int,
           kv_dtype: str) -> tuple[tuple[str, str], ...]:
    """Which rule produced each term, for the plan (API and deployment page)."""
    layout = model.layout
    kv = (layout.kv_rule(tp) if layout else
          f"dense attention: 2 x {math.ceil(model.num_kv_heads / tp)} KV heads per GPU x "
          f"head_dim {model.resolved_head_dim}")
    activation = (layout.activation_rule() if layout else
                  "dense MLP: fitted factor x intermediate_size (H200 fit)")
    return (
        ("Architecture", layout.describe() if layout else "dense decoder (no config.json read)"),
        ("Weights", weight_rule),
        ("KV cache", f"{kv} x {dtype_bytes(kv_dtype):g} B ({kv_dtype})"),
        ("Activations", f"{activation}; + fp32 logits max_num_seqs x vocab_size"),
        ("Runtime", "non-torch memory and CUDA graphs as logged on an H200 (fitted constants)"),
    )
