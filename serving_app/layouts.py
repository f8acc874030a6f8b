"""A model's layout as vLLM 0.26 builds and sizes it, read from its ``config.json``.

The planner's terms (parameters, loaded weights, KV bytes per token, the activation peak) come
from here. Each follows the rule vLLM applies when it creates the layer or allocates its cache;
the rule is named where the term is computed and repeated in the plan (``Layout.rules``):

- **Attention, dense / GQA / MQA.** vLLM's ``FullAttentionSpec`` (``vllm/v1/kv_cache_interface``)
  pages ``2 (K and V) x block_size x num_kv_heads x head_size x dtype`` bytes per layer; with
  TP > KV heads each rank keeps one replicated head (``num_kv_heads // tp``, at least 1).
- **Multi-head latent attention** (``kv_lora_rank``): ``MLAAttentionSpec`` caches one latent per
  token and layer, ``kv_lora_rank + qk_rope_head_dim`` values, no separate V, one "head" that every
  TP rank holds whole. Its parameters are the low-rank projections DeepSeek's
  ``DeepseekV2MLAAttention`` creates: ``q_proj`` (or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``
  with ``q_lora_rank``), ``kv_a_proj_with_mqa`` (hidden -> kv_lora_rank + rope),
  ``kv_a_layernorm``, ``kv_b_proj`` (kv_lora_rank -> heads x (nope + v)), ``o_proj``.
- **Sliding-window attention** is allocated at full length: vLLM 0.26's KV cache manager gives
  every attention layer, sliding or full, a page per block from one pool
  (``kv_cache_utils.get_kv_cache_config``: the pool is split into blocks of one page per layer),
  so a sliding layer costs as much memory per token of capacity as a full one (ENGINE.md, the
  H100 run: Gemma-2-9B at 344,064 B/token = all 42 layers).
- **Mixture of experts.** ``FusedMoE`` holds ``num_experts x (w13: 2 x I x hidden + w2: hidden x
  I)`` per MoE layer, the router (``gate``: hidden x experts, unquantized), shared experts as a
  dense gated MLP of ``n_shared_experts x moe_intermediate_size`` (DeepSeek) or
  ``shared_expert_intermediate_size`` with a 1-wide gate (Qwen2-MoE). Dense leading or
  interleaved layers follow the model's own rule: ``first_k_dense_replace`` and
  ``moe_layer_freq`` (DeepSeek), ``mlp_only_layers`` and ``decoder_sparse_step`` (Qwen-MoE).
  Activations of one MoE layer are the fused kernel's buffers (``TritonExperts.workspace_shapes``
  in ``fused_moe``, N = 2I the w13 output, K = hidden): ``M x topk x max(N/2, K)``, ``M x topk x
  max(N, K)`` and the output ``M x K``, live together, plus the router's fp32 logits
  ``M x experts``.
- **Tied embeddings**: one ``vocab x hidden`` matrix instead of two; a missing
  ``tie_word_embeddings`` is the model type's transformers default (True for Gemma).
- **Online FP8** (``--quantization fp8``): ``Fp8LinearMethod``/``Fp8MoEMethod`` store linear and
  expert weights in 1 byte; embeddings, the LM head, norms and routers keep the served dtype.

A layout the planner does not model (state-space and linear-attention layers, or an unknown model
type with fields it cannot place) is refused (``Layout.refusal``), never guessed. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

# Model types whose layers are not (only) softmax attention: state-space (Mamba) and
# linear-attention hybrids. vLLM sizes their recurrent state with other rules.
RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "jamba", "falcon_mamba", "falcon_h1", "zamba", "zamba2", "bamba",
    "nemotron_h", "granitemoehybrid", "qwen3_next", "lfm2", "minimax", "minimax_m1", "rwkv",
    "rwkv5", "rwkv6", "recurrent_gemma", "plamo2", "kimi_linear", "phi4flash",
})
# Model types the planner's layout covers (dense, GQA/MQA, MLA, MoE, sliding windows).
KNOWN_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3", "gemma3_text", "deepseek_v2", "deepseek_v3", "phi3", "granite", "granitemoe",
    "olmo", "olmo2", "olmoe", "internlm2", "cohere", "starcoder2", "gpt_bigcode", "falcon", "opt",
    "gpt_neox", "gptj", "phi", "bloom", "gpt2", "stablelm", "exaone", "glm", "glm4", "yi",
    "baichuan", "minicpm", "hunyuan_v1_dense", "ernie4_5",
})
# Config fields that name a layer kind the planner would have to model; an unknown model type
# holding one is refused rather than planned as a dense decoder.
LAYOUT_HINTS = ("ssm", "mamba", "conv_kernel", "state_size", "linear_attn", "time_step",
                "layers_block_type", "hybrid_override_pattern", "expert", "lora_rank",
                "attn_type_list", "full_attn_idxs")
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
UNGATED_MODEL_TYPES = frozenset({"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi",
                                 "starcoder2", "gpt_bigcode"})
QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe"})
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2"})
FOUR_NORM_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})
TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})


class ArchitectureError(ValueError):
    """The configuration describes a layout the planner cannot size (with the reason)."""


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: a multimodal model's ``text_config`` over the
    top level (whose ``torch_dtype`` and ``quantization_config`` it inherits)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return dict(config)
    outer = {k: v for k, v in config.items() if k != "text_config"}
    return {**outer, **text}


def _int(cfg: dict[str, Any], *names: str, default: int = 0) -> int:
    for name in names:
        value = cfg.get(name)
        if value is not None and not isinstance(value, bool):
            return int(value)
    return default


@dataclass(frozen=True)
class Layout:
    """The decoder's shapes, as vLLM creates its layers (one row per kind of layer)."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    gated: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    # multi-head latent attention (0: none)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # sliding window
    sliding_window: int = 0
    sliding_layers: int = 0
    # mixture of experts
    moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    refusal: str = ""

    # ------------------------------------------------------------------ reading a config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Layout:
        """The layout a ``config.json`` (dict) describes; ``refusal`` says why it cannot be
        planned. Raises `ArchitectureError` when the basic fields are missing."""
        cfg = text_config(config)
        model_type = str(cfg.get("model_type") or "")
        try:
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg.get("vocab_size") or 0)
            heads = int(cfg.get("num_attention_heads") or 0)
            kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", default=heads)
            head_dim = _int(cfg, "head_dim", default=hidden // heads if heads else 0)
            intermediate = _int(cfg, "intermediate_size", "ffn_dim", default=4 * hidden)
        except (KeyError, TypeError, ValueError) as exc:
            raise ArchitectureError(f"config.json lacks a usable architecture field: {exc}") \
                from exc
        tie = cfg.get("tie_word_embeddings")
        base = cls(
            model_type=model_type, num_layers=layers, hidden_size=hidden, vocab_size=vocab,
            num_attention_heads=heads, num_kv_heads=kv_heads or heads, head_dim=head_dim,
            intermediate_size=intermediate,
            tie_word_embeddings=bool(tie) if tie is not None else model_type in TIED_BY_DEFAULT,
            gated=model_type not in UNGATED_MODEL_TYPES,
            qkv_bias=model_type in QKV_BIAS_MODEL_TYPES or bool(cfg.get("attention_bias")),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            norms_per_layer=4 if model_type in FOUR_NORM_MODEL_TYPES else 2,
            refusal=_refusal(cfg, model_type, heads),
        )
        return _with_moe(_with_sliding(_with_mla(base, cfg), cfg), cfg)

    # ------------------------------------------------------------------ kinds

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): a compressed KV latent per token."""
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        """Some layers route tokens to experts."""
        return self.moe_layers > 0 and self.num_experts > 0

    @property
    def dense_layers(self) -> int:
        """Layers with a dense MLP of ``intermediate_size``."""
        return self.num_layers - self.moe_layers if self.is_moe else self.num_layers

    @property
    def attention_kind(self) -> str:
        """``mla``, ``mha``, ``mqa`` or ``gqa``."""
        if self.is_mla:
            return "mla"
        if self.num_kv_heads == self.num_attention_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    # ------------------------------------------------------------------ parameters

    @property
    def attention_parameters(self) -> int:
        """One layer's attention projections (and their biases and q/k norms)."""
        h, heads = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            # DeepseekV2MLAAttention: q (direct or through the q_lora_rank bottleneck), the
            # joint KV down-projection with the shared rope key, its norm, the up-projection to
            # per-head nope keys and values, and the output projection.
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk_head
            else:
                q = h * heads * qk_head
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + heads * self.v_head_dim * h
        q_out, kv_out = heads * self.head_dim, self.num_kv_heads * self.head_dim
        params = 2 * h * q_out + 2 * h * kv_out
        if self.qkv_bias:
            params += q_out + 2 * kv_out
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def mlp_parameters(self, width: int) -> int:
        """A dense MLP of this intermediate width: gate, up and down (up and down ungated)."""
        return (3 if self.gated else 2) * self.hidden_size * width

    @property
    def router_parameters(self) -> int:
        """One MoE layer's router (and the shared expert's 1-wide gate): kept unquantized."""
        return self.hidden_size * self.num_experts + (
            self.hidden_size if self.shared_expert_gate else 0)

    @property
    def expert_parameters(self) -> int:
        """One MoE layer's routed experts: ``FusedMoE``'s w13 and w2 for every expert."""
        return self.num_experts * self.mlp_parameters(self.moe_intermediate_size)

    @property
    def embedding_parameters(self) -> int:
        """Input embedding plus the LM head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def norm_parameters(self) -> int:
        """Every layer's norms and the final one."""
        return self.num_layers * self.norms_per_layer * self.hidden_size + self.hidden_size

    @property
    def linear_parameters(self) -> int:
        """What a quantized linear method stores: attention, dense MLPs, experts, shared
        experts (not embeddings, norms or routers)."""
        moe = self.moe_layers * (self.expert_parameters
                                 + self.mlp_parameters(self.shared_intermediate_size))
        return (self.num_layers * self.attention_parameters
                + self.dense_layers * self.mlp_parameters(self.intermediate_size)
                + (moe if self.is_moe else 0))

    @property
    def unquantized_parameters(self) -> int:
        """Embeddings, norms and routers: kept in the served dtype under online FP8."""
        routers = self.moe_layers * self.router_parameters if self.is_moe else 0
        return self.embedding_parameters + self.norm_parameters + routers

    @property
    def parameters(self) -> int:
        """Every parameter vLLM creates for the model."""
        return self.linear_parameters + self.unquantized_parameters

    @property
    def active_parameters(self) -> int:
        """Parameters one token passes through (top-k experts of each MoE layer)."""
        if not self.is_moe:
            return self.parameters
        idle = self.num_experts - self.experts_per_token
        return self.parameters - self.moe_layers * idle * self.mlp_parameters(
            self.moe_intermediate_size)

    # ------------------------------------------------------------------ KV cache

    def kv_values_per_layer(self, tp: int) -> int:
        """Cached values per token and attention layer on one TP rank.

        ``MLAAttentionSpec``: ``kv_lora_rank + qk_rope_head_dim`` (one latent, replicated on
        every rank). ``FullAttentionSpec``/``SlidingWindowSpec``: ``2 x kv_heads_per_rank x
        head_dim``, ``kv_heads_per_rank = max(1, kv_heads // tp)`` (vLLM replicates a head over
        ranks when TP exceeds the KV heads; ``ceil`` gives the same for the divisible splits
        vLLM accepts)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * -(-self.num_kv_heads // tp) * self.head_dim

    def kv_rule(self, tp: int) -> str:
        """The allocation rule behind ``kv_values_per_layer``, for the plan."""
        if self.is_mla:
            return (f"latent attention (MLAAttentionSpec): kv_lora_rank {self.kv_lora_rank} + "
                    f"qk_rope_head_dim {self.qk_rope_head_dim} = {self.kv_values_per_layer(tp)}"
                    " values per layer, whole on every TP rank")
        kind = self.attention_kind.upper()
        text = (f"{kind} attention (FullAttentionSpec): 2 x {-(-self.num_kv_heads // tp)} KV "
                f"heads per GPU x head_dim {self.head_dim}")
        if self.sliding_layers:
            text += (f"; {self.sliding_layers} sliding-window layers ({self.sliding_window:,} "
                     "tokens) allocated at full length, as vLLM 0.26's KV cache manager does")
        return text

    # ------------------------------------------------------------------ activations

    def activation_width(self, dense_factor: float) -> float:
        """Elements per batched token at the forward pass's peak, the widest layer's.

        A dense MLP holds ``dense_factor x intermediate`` (the fitted H200 factor: gate/up output
        and the activated half). An MoE layer holds the fused kernel's buffers
        (``TritonExperts.workspace_shapes``: ``topk x max(I, hidden)``, ``topk x max(2I,
        hidden)`` and the ``hidden``-wide output), plus its router's fp32 logits (``2 x
        experts`` in 16-bit units); its shared experts run as a dense MLP beside the routed ones
        and their buffers are freed in between."""
        dense = dense_factor * self.intermediate_size if self.dense_layers else 0.0
        if not self.is_moe:
            return dense
        i, k, h = self.moe_intermediate_size, self.experts_per_token, self.hidden_size
        routed = k * (max(i, h) + max(2 * i, h)) + h + 2 * self.num_experts
        shared = dense_factor * self.shared_intermediate_size
        return max(dense, routed, shared)

    def activation_rule(self) -> str:
        """The rule behind ``activation_width``, for the plan."""
        if not self.is_moe:
            return "dense MLP: fitted factor x intermediate_size (H200 fit)"
        i, h = self.moe_intermediate_size, self.hidden_size
        return (f"fused MoE workspaces (TritonExperts): top-{self.experts_per_token} x "
                f"(max({i}, {h}) + max(2 x {i}, {h})) + {h} per token and fp32 router "
                "logits, or the dense layers' MLP if wider")

    # ------------------------------------------------------------------ for the plan

    def describe(self) -> str:
        """One line: the attention and MLP kinds (or why the layout is not modelled)."""
        if self.refusal:
            return f"{self.model_type or 'unknown type'}: not modelled ({self.refusal})"
        attention = {"mla": "multi-head latent attention", "mha": "multi-head attention",
                     "mqa": "multi-query attention", "gqa": "grouped-query attention"}[
            self.attention_kind]
        if self.sliding_layers:
            attention += f", sliding window {self.sliding_window:,} on {self.sliding_layers} " \
                         "layers"
        mlp = "dense MLP"
        if self.is_moe:
            mlp = (f"{self.num_experts} experts (top {self.experts_per_token}, width "
                   f"{self.moe_intermediate_size}) on {self.moe_layers} layers")
            if self.shared_intermediate_size:
                mlp += f", shared experts of width {self.shared_intermediate_size}"
            if self.dense_layers:
                mlp += f", {self.dense_layers} dense layers"
        tied = ", tied embeddings" if self.tie_word_embeddings else ""
        return f"{self.model_type or 'unknown type'}: {attention}; {mlp}{tied}"


def _refusal(cfg: dict[str, Any], model_type: str, heads: int) -> str:
    if model_type in RECURRENT_MODEL_TYPES:
        return (f"model_type {model_type!r} has state-space or linear-attention layers, whose "
                "recurrent state vLLM sizes by other rules than the KV cache; the planner does "
                "not model them: run a capacity test to measure it")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        other = sorted({str(t) for t in layer_types} - ATTENTION_LAYER_TYPES)
        if other:
            return (f"layer types {', '.join(other)} are not attention layers; the planner does "
                    "not model them: run a capacity test to measure it")
    if not heads:
        return "config.json gives no num_attention_heads: not an attention decoder"
    if model_type not in KNOWN_MODEL_TYPES:
        hints = sorted(k for k in cfg if any(h in k for h in LAYOUT_HINTS))
        if hints:
            return (f"unknown model_type {model_type!r} with fields the planner cannot place "
                    f"({', '.join(hints)}): run a capacity test to measure it")
    return ""


def _with_mla(layout: Layout, cfg: dict[str, Any]) -> Layout:
    rank = _int(cfg, "kv_lora_rank")
    if not rank:
        return layout
    return replace(
        layout, kv_lora_rank=rank, q_lora_rank=_int(cfg, "q_lora_rank"),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim", default=layout.head_dim),
    )


def _with_sliding(layout: Layout, cfg: dict[str, Any]) -> Layout:
    window = _int(cfg, "sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return layout
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        sliding = sum(1 for t in layer_types if t == "sliding_attention")
    elif layout.model_type == "gemma2":
        sliding = (layout.num_layers + 1) // 2  # Gemma2: even layers slide
    elif cfg.get("sliding_window_pattern"):
        pattern = int(cfg["sliding_window_pattern"])  # Gemma3: 1 global layer in `pattern`
        sliding = layout.num_layers - layout.num_layers // pattern
    else:
        sliding = layout.num_layers
    return replace(layout, sliding_window=window, sliding_layers=sliding)


def _moe_layer_count(cfg: dict[str, Any], layers: int) -> int:
    """Layers whose MLP is routed, by the model's own rule."""
    first_dense = _int(cfg, "first_k_dense_replace")
    freq = _int(cfg, "moe_layer_freq", default=1) or 1
    step = _int(cfg, "decoder_sparse_step", default=1) or 1
    only_mlp = {int(i) for i in cfg.get("mlp_only_layers") or []}
    return sum(
        1 for i in range(layers)
        if i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in only_mlp
    )


def _with_moe(layout: Layout, cfg: dict[str, Any]) -> Layout:
    experts = _int(cfg, "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
    if experts <= 1:
        return layout
    width = _int(cfg, "moe_intermediate_size", default=layout.intermediate_size)
    shared = _int(cfg, "shared_expert_intermediate_size")
    if not shared and _int(cfg, "n_shared_experts"):
        shared = _int(cfg, "n_shared_experts") * width
    return replace(
        layout, num_experts=experts, moe_intermediate_size=width,
        experts_per_token=_int(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_topk",
                               default=1),
        moe_layers=_moe_layer_count(cfg, layout.num_layers),
        shared_intermediate_size=shared,
        shared_expert_gate=layout.model_type == "qwen2_moe" and bool(shared),
    )
