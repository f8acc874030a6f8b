"""Read what a model or LoRA adapter folder holds, without loading any weights.

`config.json` gives the architecture; the safetensors headers (an 8-byte length and a JSON
header) give the weight bytes and tensor shapes. For an adapter the whole layout is checked too
(every tensor's byte range matches its dtype and shape, the ranges tile the data with no gap or
overlap, the file ends where the last one does), so truncated or padded tensor data is refused
before an engine reads it. Errors are `ModelFilesError`; `host_path` marks a problem with the
folder itself (not absolute, missing), which a tenant user is only ever shown as one generic
message (serving_app/storage.py). Content messages never repeat the folder's host path.

`~` is never expanded: a path is used exactly as written.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from serving_app.layouts import ArchitectureError, Layout, text_config


class ModelFilesError(ValueError):
    """The folder is not a usable model or adapter; the message says why.

    `host_path` is true when the problem is the path itself (not absolute, not a folder): the
    detail tells whether a host folder exists, so only platform admins see it.
    """

    def __init__(self, message: str, *, host_path: bool = False) -> None:
        super().__init__(message)
        self.host_path = host_path


DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


@dataclass
class TensorInfo:
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPE_BYTES.get(self.dtype, 0)


@dataclass
class ModelArchitecture:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    torch_dtype: str
    weight_bytes: int
    # The language model's config.json (a multimodal model's `text_config` over its top level):
    # the planner reads the layout from it (`layouts.Layout.from_config`).
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class AdapterInfo:
    rank: int
    alpha: float | None
    target_modules: list[str]
    base_model_name_or_path: str
    size_bytes: int
    # module kind (q_proj, down_proj, ...) -> {(in_features, out_features)} seen in the weights
    module_shapes: dict[str, set[tuple[int, int]]] = field(default_factory=dict)


def _safetensors_header(handle: IO[bytes], name: str) -> tuple[int, dict[str, Any]]:
    try:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length <= 0 or length > 100 * 1024 * 1024:
            raise ModelFilesError(f"{name} has an invalid safetensors header.")
        header = json.loads(handle.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFilesError(f"{name} is not a readable safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelFilesError(f"{name} has an invalid safetensors header.")
    return length, header


def _tensor(name: str, tensor: str, meta: object) -> TensorInfo:
    if not isinstance(meta, dict):
        raise ModelFilesError(f"{name}: tensor {tensor} has no dtype and shape.")
    dtype, shape = meta.get("dtype"), meta.get("shape")
    if dtype not in DTYPE_BYTES:
        raise ModelFilesError(f"{name}: tensor {tensor} has an unknown dtype {dtype!r}.")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ModelFilesError(f"{name}: tensor {tensor} has an invalid shape.")
    return TensorInfo(dtype=dtype, shape=list(shape))


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor dtypes and shapes from the header alone (a model's weights are large)."""
    try:
        with path.open("rb") as handle:
            _, header = _safetensors_header(handle, path.name)
    except OSError as exc:
        raise ModelFilesError(f"{path.name} is not a readable safetensors file: {exc}") from exc
    return {
        name: _tensor(path.name, name, meta) for name, meta in header.items()
        if name != "__metadata__"
    }


def check_safetensors(path: Path) -> dict[str, TensorInfo]:
    """The header's tensors, after checking that the file's data is laid out as it says.

    Each tensor's `data_offsets` must span exactly dtype size x shape product bytes; sorted by
    offset the ranges must start at 0 and follow one another with no gap and no overlap; the
    data must end exactly at the end of the file. vLLM would otherwise fail (or read garbage)
    when it loads the tensors, which the header alone cannot show.
    """
    try:
        with path.open("rb") as handle:
            length, header = _safetensors_header(handle, path.name)
            file_size = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise ModelFilesError(f"{path.name} is not a readable safetensors file: {exc}") from exc
    tensors: dict[str, TensorInfo] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        tensor = _tensor(path.name, name, meta)
        offsets = meta.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ModelFilesError(f"{path.name}: tensor {name} has invalid data offsets.")
        if offsets[1] - offsets[0] != tensor.nbytes:
            raise ModelFilesError(
                f"{path.name}: tensor {name} takes {offsets[1] - offsets[0]} bytes, but its "
                f"dtype and shape need {tensor.nbytes}."
            )
        tensors[name] = tensor
        ranges.append((offsets[0], offsets[1], name))
    position = 0
    for begin, end, name in sorted(ranges):
        if begin != position:
            what = "overlaps the one before it" if begin < position else "leaves a gap before it"
            raise ModelFilesError(f"{path.name}: tensor {name} {what}.")
        position = end
    data_size = file_size - 8 - length
    if data_size != position:
        raise ModelFilesError(
            f"{path.name} holds {data_size} bytes of tensor data; its header describes "
            f"{position}: the file is truncated or has trailing data."
        )
    return tensors


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFilesError(f"{path.name} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFilesError(f"{path.name} does not hold a JSON object.")
    return data


def _directory(path_text: str) -> Path:
    path = Path(path_text)  # never expanduser(): "~" is not a path a tenant may probe with
    if not path.is_absolute():
        raise ModelFilesError("Must be an absolute path on the node hosts.", host_path=True)
    if not path.is_dir():
        raise ModelFilesError(f"{path} is not a folder.", host_path=True)
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def config_parameters(config: dict[str, Any]) -> int:
    """The parameter count a decoder's `config.json` implies, as vLLM creates its layers
    (`layouts.Layout.parameters`: attention of its kind, dense MLPs, routed and shared experts,
    routers, norms, the embedding and the LM head unless tied). Llama-3-8B's config gives
    8,030,261,248, Qwen3-30B-A3B's 30,532,122,624. Used for capacity-test models, which have
    no weights to measure (`read_model(dummy=True)`)."""
    try:
        return Layout.from_config(config).parameters
    except ArchitectureError as exc:
        raise ModelFilesError(str(exc)) from exc


def read_model(path_text: str, *, dummy: bool = False) -> ModelArchitecture:
    """What the model folder holds. `dummy`: a capacity-test model, run with random weights: the
    folder needs its `config.json` and a tokenizer, no weights; the weight bytes are the
    configuration's parameter count times its dtype's size."""
    path = _directory(path_text)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelFilesError("The folder holds no config.json: it is not a model folder.")
    config = text_config(_read_json(config_path))
    if dummy:
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ModelFilesError("A capacity-test model needs a tokenizer beside its "
                                  f"config.json (one of {', '.join(TOKENIZER_FILES)}).")
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        element = DTYPE_BYTES.get({"bfloat16": "BF16", "float16": "F16"}.get(dtype, "F32"), 4)
        weight_bytes = config_parameters(config) * element
    else:
        weights = sorted(path.glob("*.safetensors"))
        if not weights:
            raise ModelFilesError("The folder holds no .safetensors weight files.")
        weight_bytes = sum(
            tensor.nbytes for file in weights for tensor in read_safetensors_header(file).values()
        )
    try:
        hidden = int(config["hidden_size"])
        # A model without attention heads (a state-space model) registers; the planner
        # refuses its layout with the reason (`layouts.Layout.refusal`).
        heads = int(config.get("num_attention_heads") or 0)
        layers = int(config["num_hidden_layers"])
        architectures = config.get("architectures") or [config.get("model_type", "unknown")]
        return ModelArchitecture(
            architecture=str(architectures[0]),
            num_layers=layers,
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or (hidden // heads if heads else 0)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            vocab_size=int(config.get("vocab_size") or 0),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            weight_bytes=weight_bytes,
            config=config,
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelFilesError(f"config.json lacks a usable architecture field: {exc}") from exc


def read_adapter(path_text: str) -> AdapterInfo:
    path = _directory(path_text)
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise ModelFilesError(
            "The folder holds no adapter_config.json: it is not a LoRA adapter."
        )
    config = _read_json(config_path)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ModelFilesError(f"adapter_config.json says peft_type {config.get('peft_type')}.")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelFilesError("The folder holds no adapter weights (adapter_model.safetensors).")
    tensors: dict[str, TensorInfo] = {}
    for file in weights:
        tensors.update(check_safetensors(file))
    try:
        rank = int(config["r"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFilesError("adapter_config.json has no rank 'r'.") from exc
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    # lora_A is [rank, in_features] and lora_B [out_features, rank]: they tell which base model
    # shapes the adapter was trained for.
    ins: dict[str, int] = {}
    outs: dict[str, int] = {}
    for name, tensor in tensors.items():
        if len(tensor.shape) != 2:
            continue
        stem, _, kind = name.partition(".lora_")
        if kind.startswith("A"):
            ins[stem] = tensor.shape[1]
        elif kind.startswith("B"):
            outs[stem] = tensor.shape[0]
    module_shapes: dict[str, set[tuple[int, int]]] = {}
    for stem, in_features in ins.items():
        module = stem.rsplit(".", 1)[-1]
        module_shapes.setdefault(module, set()).add((in_features, outs.get(stem, 0)))
    return AdapterInfo(
        rank=rank,
        alpha=config.get("lora_alpha"),
        target_modules=sorted(str(t) for t in targets),
        base_model_name_or_path=str(config.get("base_model_name_or_path") or ""),
        size_bytes=sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        module_shapes=module_shapes,
    )


class Shapes(Protocol):
    """What `expected_module_shapes` reads: a `ModelArchitecture` or a `BaseModel` row."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def expected_module_shapes(arch: Shapes) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-targetable Llama-style module of a base model."""
    hidden = arch.hidden_size
    q_out = arch.num_attention_heads * arch.head_dim
    kv_out = arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    return {
        "q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
