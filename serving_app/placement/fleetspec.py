"""GPUs, fleets and planned deployments written as data: the declared-inventory format (with its
MIG syntax) and what a what-if plan holds.

Plain Python with no Django, at the bottom of the serving layers: a node agent's ``NODE_GPUS``
(through ``placement.inventory.declared_inventory``), the ``FleetPlan`` model's validation and
the what-if placer (``placement.whatif``) all read text with these functions, so they accept and
refuse exactly the same input, with the same messages.

**GPUs** (``parse_gpus``), comma-separated entries, each one of

- ``COUNTxSIZE`` or ``COUNTxNAME:SIZE``: COUNT GPUs with the next free indexes
  (``2x24GiB``, ``4xNVIDIA A100-SXM4-80GB:80GiB``);
- ``INDEX:NAME:SIZE``: one GPU at that index (``0:NVIDIA L4:24GiB``);

each optionally followed by its MIG devices in brackets, which puts the GPU in MIG mode:
``2:NVIDIA A100-SXM4-80GB:80GiB[3g.40gb,2g.20gb,1g.10gb]``. A device is ``PROFILE``,
``COUNTxPROFILE`` or ``PROFILE:SIZE``. Its memory is the size given, else the profile's "40gb"
read as 40 GB (10^9 bytes, a little under the 39.25 GiB an A100's 3g.40gb really has, so a plan
never promises memory the device lacks). The devices of one GPU take at most 7 compute slices
(the "3" of 3g.40gb) and at most the GPU's memory.

**A fleet** (``parse_fleet``): one node per line, ``NAME: GPUS``; blank lines and lines starting
with ``#`` are ignored.

**Planned deployments** (``parse_plan_deployments``): a list of objects, each naming a ``model``
(a registered base model's name, or an object with its architecture) and the ``tenants`` it
serves, with the engine settings that change placement as a Deployment has them: those that
change memory, ``isolation`` and ``mps_thread_percentage``, each with its declared range or
choices (``serving_app.enginespec``; docs/placement.md, "What-if plans").
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from serving_app.enginespec import (
    ENGINE_FIELDS,
    FIELD,
    MAX_REPLICAS,
    MEMORY_FIELDS,
    EngineSpec,
    ModelDefaults,
    default_of,
    optional_default_of,
)

# Compute slices of a MIG-capable GPU (A100, H100, H200): the "7" of "7g.80gb".
GPU_COMPUTE_SLICES = 7

_PROFILE_RE = re.compile(r"^(\d+)g\.(\d+(?:\.\d+)?)gb(\+me)?$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*$", re.IGNORECASE)
_GIB = 1024**3

DEFAULT_DECLARED_NAME = "Declared GPU"
# Bounds that keep a declaration from asking for millions of rows.
MAX_GPUS_PER_ENTRY = 1024
MAX_FLEET_GPUS = 10_000
MAX_PLAN_DEPLOYMENTS = 1000


class FleetSpecError(ValueError):
    """Input that is not a valid declaration; ``messages`` lists every problem found."""

    def __init__(self, messages: Sequence[str]) -> None:
        self.messages = list(messages)
        super().__init__("; ".join(self.messages))


# -------------------------------------------------------------------------------- sizes, MIG


def parse_size(text: str) -> int:
    """``"24GiB"`` -> bytes. Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (1024)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(
            f"invalid memory size {text!r}: expected a number and a unit, such as 24GiB or 80GB"
        )
    number, unit = match.groups()
    size = int(float(number) * _UNITS[unit.lower()])
    if size <= 0:
        raise ValueError(f"invalid memory size {text!r}: must be greater than zero")
    return size


def mig_slices(profile: str | None) -> int | None:
    """Compute slices of a MIG profile ("3g.40gb" -> 3); None for a name that is not one."""
    match = _PROFILE_RE.match((profile or "").strip())
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class DeclaredMig:
    """A MIG device declared on a GPU."""

    profile: str
    memory_total_bytes: int
    slices: int


@dataclass(frozen=True)
class DeclaredGpu:
    """A GPU declared in configuration (``migs``: its MIG devices, empty when not in MIG mode)."""

    index: int
    name: str
    memory_total_bytes: int
    migs: tuple[DeclaredMig, ...] = ()


@dataclass(frozen=True)
class DeclaredNode:
    """A node of a what-if fleet."""

    name: str
    gpus: tuple[DeclaredGpu, ...]


def _split_entries(spec: str) -> list[str]:
    """Split on commas outside brackets (a GPU's MIG list holds commas of its own)."""
    entries: list[str] = []
    current: list[str] = []
    depth = 0
    for char in spec:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            entries.append("".join(current))
            current = []
        else:
            current.append(char)
    entries.append("".join(current))
    return entries


def _size_in_entry(size_text: str, entry: str) -> int:
    try:
        return parse_size(size_text)
    except ValueError as exc:
        raise ValueError(f"{exc} (in GPU declaration entry {entry!r})") from None


def _parse_migs(text: str, entry: str) -> tuple[DeclaredMig, ...]:
    migs: list[DeclaredMig] = []
    for raw in text.split(","):
        item = raw.strip()
        count = 1
        counted = re.match(r"^(\d+)\s*[xX]\s*(.+)$", item)
        if counted:
            count, item = int(counted.group(1)), counted.group(2).strip()
            if count > GPU_COMPUTE_SLICES:
                raise ValueError(
                    f"at most {GPU_COMPUTE_SLICES} MIG devices fit on a GPU, not {count} (in GPU "
                    f"declaration entry {entry!r})"
                )
        profile, _, size_text = item.partition(":")
        profile = profile.strip()
        match = _PROFILE_RE.match(profile)
        if not match or count < 1:
            raise ValueError(
                f"invalid MIG device {raw.strip()!r} in GPU declaration entry {entry!r}: "
                "expected a profile such as 3g.40gb, 2x1g.10gb or 3g.40gb:39.25GiB"
            )
        size = (
            _size_in_entry(size_text.strip(), entry)
            if size_text.strip()
            else int(float(match.group(2)) * 1000**3)
        )
        migs.extend(DeclaredMig(profile.lower(), size, int(match.group(1))) for _ in range(count))
    return tuple(migs)


def _check_migs(gpu: DeclaredGpu, entry: str) -> None:
    slices = sum(m.slices for m in gpu.migs)
    if slices > GPU_COMPUTE_SLICES:
        raise ValueError(
            f"the MIG devices of GPU {gpu.index} take {slices} compute slices; a GPU has "
            f"{GPU_COMPUTE_SLICES} (in GPU declaration entry {entry!r})"
        )
    memory = sum(m.memory_total_bytes for m in gpu.migs)
    if memory > gpu.memory_total_bytes:
        raise ValueError(
            f"the MIG devices of GPU {gpu.index} take {memory / _GIB:.1f} GiB; the GPU has "
            f"{gpu.memory_total_bytes / _GIB:.1f} GiB (in GPU declaration entry {entry!r})"
        )


def parse_gpus(spec: str) -> list[DeclaredGpu]:
    """The GPUs a declaration string describes, by index (the grammar is in the module's
    docstring). Raises ``ValueError`` naming the offending entry, a duplicate index or an empty
    declaration."""
    if not spec or not spec.strip():
        raise ValueError("empty GPU declaration: expected e.g. '2x24GiB' or '0:NVIDIA L4:24GiB'")
    gpus: list[DeclaredGpu] = []
    next_index = 0
    for raw_entry in _split_entries(spec):
        entry = raw_entry.strip()
        if not entry:
            raise ValueError(f"empty entry in GPU declaration {spec!r}")
        base = entry
        migs: tuple[DeclaredMig, ...] = ()
        bracket = re.match(r"^(.*?)\s*\[(.*)\]$", entry)
        if bracket:
            base = bracket.group(1)
            migs = _parse_migs(bracket.group(2), entry)
        elif "[" in entry or "]" in entry:
            raise ValueError(f"unbalanced brackets in GPU declaration entry {entry!r}")
        count_match = re.match(r"^(\d+)\s*[xX]\s*(.+)$", base)
        parts = base.split(":")
        if count_match and not (len(parts) == 3 and parts[0].strip().isdigit()):
            count = int(count_match.group(1))
            if count < 1:
                raise ValueError(f"GPU count must be at least 1 in {entry!r}")
            if count > MAX_GPUS_PER_ENTRY:
                raise ValueError(f"GPU count must be at most {MAX_GPUS_PER_ENTRY} in {entry!r}")
            name, _, size_text = count_match.group(2).rpartition(":")
            size = _size_in_entry(size_text, entry)
            for _ in range(count):
                gpus.append(DeclaredGpu(next_index, name.strip() or DEFAULT_DECLARED_NAME,
                                        size, migs))
                next_index += 1
        elif len(parts) == 3:
            index_text, name, size_text = (part.strip() for part in parts)
            if not index_text.isdigit():
                raise ValueError(f"GPU index must be a non-negative integer in {entry!r}")
            index = int(index_text)
            gpus.append(DeclaredGpu(index, name or DEFAULT_DECLARED_NAME,
                                    _size_in_entry(size_text, entry), migs))
            next_index = max(next_index, index + 1)
        else:
            raise ValueError(
                f"invalid GPU declaration entry {entry!r}: expected COUNTxSIZE (2x24GiB), "
                "COUNTxNAME:SIZE (2xNVIDIA L4:24GiB) or INDEX:NAME:SIZE (0:NVIDIA L4:24GiB), "
                "optionally followed by MIG devices ([3g.40gb,3g.40gb])"
            )
        if migs:
            _check_migs(gpus[-1], entry)
    seen: set[int] = set()
    for gpu in gpus:
        if gpu.index in seen:
            raise ValueError(f"GPU index {gpu.index} is declared twice in {spec!r}")
        seen.add(gpu.index)
    return sorted(gpus, key=lambda g: g.index)


# -------------------------------------------------------------------------------- fleets

_NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def parse_fleet(text: str) -> list[DeclaredNode]:
    """The nodes of a what-if fleet: one ``NAME: GPUS`` line each. Raises ``FleetSpecError``
    with one message per bad line."""
    if "\x00" in (text or ""):
        raise FleetSpecError(["text may not contain NUL characters"])
    nodes: list[DeclaredNode] = []
    errors: list[str] = []
    seen: set[str] = set()
    for number, raw in enumerate((text or "").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, spec = line.partition(":")
        name = name.strip()
        if not colon or not _NODE_NAME_RE.match(name):
            errors.append(
                f"line {number}: expected NODE: GPUS, such as "
                "'node-a: 4xNVIDIA A100-SXM4-80GB:80GiB'"
            )
            continue
        if name in seen:
            errors.append(f"line {number}: node {name} is declared twice")
            continue
        seen.add(name)
        try:
            nodes.append(DeclaredNode(name, tuple(parse_gpus(spec))))
        except ValueError as exc:
            errors.append(f"line {number} ({name}): {exc}")
    if not errors and sum(len(n.gpus) for n in nodes) > MAX_FLEET_GPUS:
        errors.append(f"a fleet holds at most {MAX_FLEET_GPUS} GPUs")
    if errors:
        raise FleetSpecError(errors)
    if not nodes:
        raise FleetSpecError(["declare at least one node, such as "
                              "'node-a: 4xNVIDIA A100-SXM4-80GB:80GiB'"])
    return nodes


# -------------------------------------------------------------------------------- deployments

DTYPES = FIELD["dtype"].values
# The engine settings a plan takes (a Deployment's, under the same names but "isolation").
PLAN_ENGINE_FIELDS = (*MEMORY_FIELDS, "mps_thread_percentage")
_DEPLOYMENT_NAME_RE = re.compile(r"^[-a-zA-Z0-9_]{1,100}$")

# Architecture fields of an inline model: name -> required (else optional).
ARCHITECTURE_FIELDS: dict[str, bool] = {
    "num_layers": True,
    "hidden_size": True,
    "num_attention_heads": True,
    "num_kv_heads": False,
    "head_dim": False,
    "intermediate_size": False,
    "vocab_size": True,
    "max_position_embeddings": True,
    "weight_bytes": True,
}


@dataclass(frozen=True)
class PlanDeployment:
    """One deployment of a what-if plan, checked but not yet planned (``placement.whatif``).

    ``model`` is a registered base model's name, or None with ``architecture`` holding an
    inline model's figures (the ``ARCHITECTURE_FIELDS`` plus ``name``, ``torch_dtype``,
    ``tie_word_embeddings`` and ``quantization``). The engine settings default as a
    Deployment's do, to their declarations (``serving_app.enginespec``)."""

    name: str
    tenants: tuple[str, ...]
    model: str | None = None
    architecture: Mapping[str, Any] = field(default_factory=dict)
    replicas: int = 1
    isolation: str = default_of("isolation_mode", str)
    tensor_parallel_size: int = default_of("tensor_parallel_size", int)
    pipeline_parallel_size: int = default_of("pipeline_parallel_size", int)
    allow_multi_node: bool = default_of("allow_multi_node", bool)
    max_num_seqs: int = default_of("max_num_seqs", int)
    max_model_len: int | None = optional_default_of("max_model_len", int)
    max_num_batched_tokens: int | None = optional_default_of("max_num_batched_tokens", int)
    dtype: str = default_of("dtype", str)
    quantization: str = default_of("quantization", str)
    kv_cache_dtype: str = default_of("kv_cache_dtype", str)
    max_loras: int = default_of("max_loras", int)
    max_lora_rank: int = default_of("max_lora_rank", int)
    lora_target_mlp: bool = False
    target_kv_tokens: int | None = None
    enforce_eager: bool = default_of("enforce_eager", bool)
    mps_thread_percentage: int | None = optional_default_of("mps_thread_percentage", int)

    @property
    def model_label(self) -> str:
        return self.model or str(self.architecture.get("name") or "inline model")

    def engine_spec(self, model: ModelDefaults) -> EngineSpec:
        """The engine settings of this deployment on `model`, resolved as a Deployment's are;
        those a plan does not take are at their defaults."""
        values = {name: getattr(self, name) for name in ENGINE_FIELDS if hasattr(self, name)}
        return EngineSpec.resolve({**values, "isolation_mode": self.isolation}, model)


# Integers above this are refused (the planner's float arithmetic stays exact and finite).
MAX_INTEGER = 2**53


def _integer(value: Any, low: int, high: int | None = None) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return low <= value <= (MAX_INTEGER if high is None else high)


def _has_nul(value: Any) -> bool:
    """Whether a NUL character hides anywhere in JSON data (PostgreSQL stores none)."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


_INTEGERS: dict[str, tuple[int, int | None, bool]] = {
    # name: (low, high, may be null)
    "replicas": (1, MAX_REPLICAS, False),
    "target_kv_tokens": (1, None, True),
    **{f.name: (int(f.minimum or 0), None if f.maximum is None else int(f.maximum), f.optional)
       for f in map(FIELD.__getitem__, PLAN_ENGINE_FIELDS) if f.kind == "int" and not f.allowed},
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "isolation": FIELD["isolation_mode"].values,
    **{f.name: f.values for f in map(FIELD.__getitem__, PLAN_ENGINE_FIELDS) if f.choices},
}
_ALLOWED: dict[str, tuple[int, ...]] = {
    f.name: f.allowed for f in map(FIELD.__getitem__, PLAN_ENGINE_FIELDS) if f.allowed
}
_BOOLEANS = ("lora_target_mlp", "enforce_eager", "allow_multi_node")


def _check_architecture(model: Mapping[str, Any], where: str, errors: list[str]) -> None:
    known = {*ARCHITECTURE_FIELDS, "name", "torch_dtype", "tie_word_embeddings", "quantization"}
    for key in sorted(set(model) - known):
        errors.append(f"{where}: model: unknown field {key!r}")
    for key, required in ARCHITECTURE_FIELDS.items():
        value = model.get(key)
        if value is None:
            if required:
                errors.append(f"{where}: model: {key} is required for an inline model")
        elif not _integer(value, 1):
            errors.append(f"{where}: model: {key} must be a positive integer")
    if model.get("torch_dtype", "bfloat16") not in DTYPES[1:]:
        errors.append(f"{where}: model: torch_dtype must be one of {', '.join(DTYPES[1:])}")
    if model.get("quantization", "") not in ("", "awq", "gptq"):
        errors.append(f"{where}: model: quantization of a checkpoint is awq, gptq or empty")
    if not isinstance(model.get("tie_word_embeddings", False), bool):
        errors.append(f"{where}: model: tie_word_embeddings must be true or false")
    if not isinstance(model.get("name", ""), str):
        errors.append(f"{where}: model: name must be text")


def _check_deployment(item: Any, number: int, names: set[str], errors: list[str]) -> None:
    if not isinstance(item, Mapping):
        errors.append(f"deployment {number}: must be an object")
        return
    name = item.get("name")
    where = f"deployment {number}" + (f" ({name})" if isinstance(name, str) and name else "")
    known = {"name", "model", "tenants", *_INTEGERS, *_CHOICES, *_ALLOWED, *_BOOLEANS}
    for key in sorted(set(item) - known):
        errors.append(f"{where}: unknown field {key!r}")
    if not isinstance(name, str) or not _DEPLOYMENT_NAME_RE.match(name):
        errors.append(f"{where}: name is required (letters, digits, - and _)")
    elif name in names:
        errors.append(f"{where}: another deployment of the plan is named {name}")
    else:
        names.add(name)
    model = item.get("model")
    if isinstance(model, Mapping):
        _check_architecture(model, where, errors)
    elif not (isinstance(model, str) and model.strip()):
        errors.append(f"{where}: model is required: a registered base model's name, or an "
                      "object with the model's architecture")
    tenants = item.get("tenants")
    if (not isinstance(tenants, list) or not tenants
            or not all(isinstance(t, str) and t for t in tenants)):
        errors.append(f"{where}: tenants must be a list of tenant slugs (at least one)")
    elif len(set(tenants)) != len(tenants):
        errors.append(f"{where}: a tenant is listed twice")
    for key, (low, high, nullable) in _INTEGERS.items():
        if key not in item or (item[key] is None and nullable):
            continue
        if not _integer(item[key], low, high):
            bound = f"from {low} to {high if high is not None else MAX_INTEGER}"
            errors.append(f"{where}: {key} must be an integer {bound}")
    for key, choices in _CHOICES.items():
        if key in item and item[key] not in choices:
            errors.append(f"{where}: {key} must be one of "
                          f"{', '.join(repr(c) for c in choices)}")
    for key in _BOOLEANS:
        if key in item and not isinstance(item[key], bool):
            errors.append(f"{where}: {key} must be true or false")
    for key, allowed in _ALLOWED.items():
        if key in item and (isinstance(item[key], bool) or item[key] not in allowed):
            errors.append(f"{where}: {key} must be one of {', '.join(map(str, allowed))}")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if item.get("isolation") == "mig" and item.get(key, 1) not in (1, None):
            errors.append(f"{where}: a MIG slice runs one GPU's worth: {key} 1")


def parse_plan_deployments(data: Any) -> list[PlanDeployment]:
    """Check a plan's deployments (a list of objects) and return them. Raises
    ``FleetSpecError`` with one message per problem, each naming its deployment."""
    if not isinstance(data, list):
        raise FleetSpecError(["must be a list of deployments"])
    if _has_nul(data):
        raise FleetSpecError(["text may not contain NUL characters"])
    if len(data) > MAX_PLAN_DEPLOYMENTS:
        raise FleetSpecError([f"a plan holds at most {MAX_PLAN_DEPLOYMENTS} deployments"])
    errors: list[str] = []
    names: set[str] = set()
    for number, item in enumerate(data, start=1):
        _check_deployment(item, number, names, errors)
    if errors:
        raise FleetSpecError(errors)
    out = []
    for item in data:
        settings = {k: v for k, v in item.items() if k not in ("name", "model", "tenants")}
        model = item["model"]
        out.append(PlanDeployment(
            name=item["name"],
            tenants=tuple(item["tenants"]),
            model=model.strip() if isinstance(model, str) else None,
            architecture=dict(model) if isinstance(model, Mapping) else {},
            **settings,
        ))
    return out


__all__ = [
    "ARCHITECTURE_FIELDS",
    "DEFAULT_DECLARED_NAME",
    "GPU_COMPUTE_SLICES",
    "DeclaredGpu",
    "DeclaredMig",
    "DeclaredNode",
    "FleetSpecError",
    "PlanDeployment",
    "mig_slices",
    "parse_fleet",
    "parse_gpus",
    "parse_plan_deployments",
    "parse_size",
]
