"""A pre-quantized (AWQ) checkpoint sized from its safetensors headers alone.

The folder is generated here: a small Llama-shaped ``config.json`` with AWQ's
``quantization_config`` and safetensors files holding only their headers (an 8-byte length and
the JSON header, no tensor data), with the tensors AWQ's GEMM layout stores for each linear
layer: ``qweight`` int32 [in, out / 8] (eight 4-bit weights per int32), ``qzeros`` int32
[in / group, out / 8] and ``scales`` fp16 [in / group, out]. Embeddings, the LM head and norms
stay fp16. vLLM's ``AWQLinearMethod`` creates exactly these parameters, so the weights it loads
are the headers' bytes; the parameter count comes from the config's layout.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from serving_app.layouts import Layout
from serving_app.modelfiles import read_model
from serving_app.placement.planner import EngineSettings, ModelArchitecture, plan_memory

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB, GROUP = 512, 2, 8, 2, 1536, 1000, 128
HEAD_DIM = HIDDEN // HEADS
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "intermediate_size": INTER, "vocab_size": VOCAB, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                            "zero_point": True, "version": "gemm"},
}
LINEARS = {  # name -> (in, out)
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTER),
    "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}


def header_only_file(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors header describing `tensors` (dtype, shape), without their data."""
    size = {"I32": 4, "F16": 2}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = size[dtype]
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def awq_folder(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    tensors: dict[str, tuple[str, list[int]]] = {
        "model.embed_tokens.weight": ("F16", [VOCAB, HIDDEN]),
        "lm_head.weight": ("F16", [VOCAB, HIDDEN]),
        "model.norm.weight": ("F16", [HIDDEN]),
    }
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = ("F16", [HIDDEN])
        tensors[prefix + "post_attention_layernorm.weight"] = ("F16", [HIDDEN])
        for name, (i, o) in LINEARS.items():
            tensors[prefix + name + ".qweight"] = ("I32", [i, o // 8])
            tensors[prefix + name + ".qzeros"] = ("I32", [i // GROUP, o // 8])
            tensors[prefix + name + ".scales"] = ("F16", [i // GROUP, o])
    header_only_file(root / "model-00001-of-00001.safetensors", tensors)
    return root


def test_an_awq_checkpoint_is_sized_from_its_headers(tmp_path):
    info = read_model(str(awq_folder(tmp_path / "awq")))
    # Per linear (in, out): qweight in x out / 8 x 4 B = in x out / 2, qzeros in / 128 x out / 8
    # x 4 B, scales in / 128 x out x 2 B. q and o: 512 x 512; k and v: 512 x 128; gate and up
    # 512 x 1536; down 1536 x 512.
    per_layer = sum(i * o // 2 + (i // GROUP) * (o // 8) * 4 + (i // GROUP) * o * 2
                    for i, o in LINEARS.values())
    # q, o: 131,072 + 1,024 + 4,096 = 136,192; k, v: 32,768 + 256 + 1,024 = 34,048; gate, up,
    # down: 393,216 + 3,072 + 12,288 = 408,576 each.
    assert per_layer == 2 * 136_192 + 2 * 34_048 + 3 * 408_576  # 1,566,208
    # Embedding and head 2 x 1000 x 512 x 2 B, norms (2 per layer + 1) x 512 x 2 B.
    expected = LAYERS * per_layer + 2 * VOCAB * HIDDEN * 2 + (2 * LAYERS + 1) * HIDDEN * 2
    assert info.weight_bytes == expected == 5_185_536  # the headers' sizes; no data read
    model = ModelArchitecture.from_hf_config(info.config, info.weight_bytes)
    assert model.checkpoint_quantization == "awq"
    plan = plan_memory(model, EngineSettings(max_num_seqs=4, max_model_len=1024))
    # Loaded as stored (AWQLinearMethod keeps qweight, qzeros and scales as they are).
    assert plan.weight_bytes_total == expected and plan.dtype == "float16"
    # The parameter count is the layout's: 2 x (4 attention + 3 MLP matrices) + embeddings.
    assert plan.parameters == Layout.from_config(CONFIG).parameters == LAYERS * (
        2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1536 + 2 * 512) + 2 * 1000 * 512 + 512
    assert "pre-quantized checkpoint (awq)" in dict(plan.rules)["Weights"]
