"""A deployment's engine settings, declared once, and one resolved set of them (`EngineSpec`).

Each `EngineField` of `FIELDS` declares one setting that changes how a deployment's engines
run: its name, its label in vLLM's words, its vLLM command-line flag, its unit, its allowed range
or choices, its default and its help text. Every layer reads this declaration instead of naming
the settings again:

- the `Deployment` model's fields take their verbose name, help text, default, validators and
  choices from it, so the console form, the API serializer and the admin show them
  (`ENGINE_FIELDS` are the form's and the serializer's engine fields);
- a revision's `spec` holds the values of `ENGINE_FIELDS` (`serving_app.models.revisions`); a
  name it lacks (a revision recorded before the setting was declared) means the declared default;
- the memory planner takes the `memory` fields (`placement.planner.EngineSettings.of()`), and
  where it is given no value plans with vLLM's own default (`vllm_default`); what-if plans
  accept the fields with their declared defaults (`fleetspec.PlanDeployment`): both read them
  here (`default_of()`, `vllm_default_of()`);
- the engine's command line is `EngineSpec.arguments()` (`engine.launch`).

`MAX_REPLICAS`, the most instances one deployment runs, is declared here too, for the same
layers: the model's validators, the forms, the API, the autoscaler and what-if plans.

An `EngineSpec` is one set of values with what depends on the base model already resolved:
`dtype` "auto" becomes the model's own setting, an empty quantization the model's, an empty
`max_model_len` the model's context length. Build one with `EngineSpec.resolve(values, model)`,
or from the models: `Deployment.engine_spec(revision=None)`, `Instance.engine_spec()`,
`DeploymentRevision.engine_spec()`.

Plain Python with no Django, at the bottom of the serving layers, so that the models below the
engine and placement packages can read it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol, TypeVar

Unit = Literal["bytes", "GiB", "tokens", "fraction", "count", "percent"]
Kind = Literal["int", "float", "bool", "choice"]
Group = Literal["model", "capacity", "lora", "isolation", "scheduling"]

# The form's sections, in the order it shows them, with their titles.
GROUPS: tuple[tuple[Group, str], ...] = (
    ("model", "Model and data types"),
    ("capacity", "Capacity and memory"),
    ("lora", "LoRA adapters"),
    ("isolation", "GPU isolation and port"),
    ("scheduling", "Scheduling"),
)
Value = bool | int | float | str | None


@dataclass(frozen=True)
class EngineField:
    """One engine setting: how it is named, shown, bounded and passed to vLLM.

    `label` is the setting's name in vLLM's words; `flag` is vLLM's command-line option (None:
    the setting is not a flag; it changes where and how the engine runs: placement, its
    environment (`env`, the variable it sets), its port). `group`: the form's section.
    `shown_when`: (setting, value) where the setting applies only while another has that value
    (MPS's thread percentage only with MPS isolation). `vllm_default`: what vLLM runs with when
    the flag is not given, where the memory planner needs it (None: not declared, or vLLM's
    is None too). The flag is left out where the value is None, or `vllm_default` with
    `omit_vllm_default` (vLLM then does the same without it on every host); other flags are
    always passed. A "bool" setting is passed as `--flag` or `--no-flag`. `memory`: the memory
    planner reads it (it changes the GPU memory an instance needs). `allowed`: the only values
    vLLM accepts, beyond the range.
    """

    name: str
    label: str
    kind: Kind
    default: Value
    group: Group
    flag: str | None = None
    env: str | None = None
    unit: Unit | None = None
    minimum: int | float | None = None
    maximum: int | float | None = None
    choices: tuple[tuple[str, str], ...] = ()
    allowed: tuple[int, ...] = ()
    help_text: str = ""
    memory: bool = False
    vllm_default: Value = None
    omit_vllm_default: bool = False
    shown_when: tuple[str, str] | None = None

    @property
    def verbose_name(self) -> str:
        """The label with what it sets: "Max LoRA rank (--max-lora-rank)", the model field's
        verbose name (the admin and the API show it)."""
        setting = self.flag or self.env
        return f"{self.label} ({setting})" if setting else self.label

    @property
    def bounds(self) -> str:
        """The allowed values in words: "1 to 16", "at least 16", "8, 16, 32, ...", "" where
        any value of its kind goes."""
        if self.allowed:
            return "one of " + ", ".join(map(str, self.allowed))
        if self.minimum is not None and self.maximum is not None:
            return f"{self.minimum:g} to {self.maximum:g}"
        if self.minimum is not None:
            return f"at least {self.minimum:g}"
        if self.maximum is not None:
            return f"at most {self.maximum:g}"
        return ""

    @property
    def optional(self) -> bool:
        """Whether the setting may be empty (None: the model's or vLLM's default applies)."""
        return self.default is None

    @property
    def values(self) -> tuple[str, ...]:
        """The choices' values, for a "choice" setting."""
        return tuple(value for value, _ in self.choices)


class ModelDefaults(Protocol):
    """What an engine setting falls back on from its base model (a `BaseModel` row, or an
    inline model of a what-if plan)."""

    @property
    def dtype(self) -> str: ...

    @property
    def quantization(self) -> str: ...

    @property
    def max_position_embeddings(self) -> int: ...


@dataclass(frozen=True)
class InlineModel:
    """`ModelDefaults` of a model given by its figures (a what-if plan's inline model)."""

    max_position_embeddings: int
    dtype: str = "auto"
    quantization: str = ""


LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# The urgent batch cap a priority-scheduled deployment gets when the field is empty and a
# high-tier tenant of it carries a latency objective: the cap that met issue 45's go on an H100
# (docs/gpu.md, "The engine-side lever").
AUTO_URGENT_BATCH_CAP = 8

# In the order the console's form shows them: where the engine runs, its memory, the model's
# format, its LoRA slots, its scheduling and its port.
FIELDS: tuple[EngineField, ...] = (
    EngineField(
        "isolation_mode", "GPU isolation", "choice", "shared", group="isolation",
        choices=(("dedicated", "Dedicated GPUs"), ("shared", "Shared GPU"),
                 ("mig", "MIG slice"), ("mps", "MPS")),
        help_text="How an instance shares its GPUs: whole GPUs of its own, a share of a GPU's "
                  "memory, a MIG device, or an MPS share of a GPU's compute.",
    ),
    EngineField(
        "mps_thread_percentage", "MPS thread percentage", "int", None, group="isolation",
        env="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", unit="percent", minimum=1, maximum=100,
        help_text="MPS isolation only: the share of the GPU's compute the engine may use.",
        shown_when=("isolation_mode", "mps"),
    ),
    EngineField(
        "gpu_memory_utilization", "GPU memory utilization", "float", 0.9, group="capacity",
        flag="--gpu-memory-utilization", unit="fraction", minimum=0.01, maximum=1.0,
        help_text="The fraction of GPU memory the engine may use. On GPU nodes the placer sets "
                  "it from the memory plan.",
    ),
    EngineField(
        "tensor_parallel_size", "Tensor parallel size", "int", 1, group="capacity",
        flag="--tensor-parallel-size", unit="count", minimum=1, maximum=16, memory=True,
        vllm_default=1,
        help_text="GPUs each pipeline stage of one instance spans (tensor parallel groups).",
    ),
    EngineField(
        "pipeline_parallel_size", "Pipeline parallel size", "int", 1, group="capacity",
        flag="--pipeline-parallel-size", unit="count", minimum=1, maximum=16, memory=True,
        vllm_default=1,
        help_text="Pipeline stages one instance spans: its layers are split over this many "
                  "groups of tensor_parallel_size GPUs, so an instance takes TP x PP GPUs.",
    ),
    EngineField(
        "allow_multi_node", "Across nodes", "bool", False, group="capacity",
        help_text="Let one instance's TP x PP GPUs span several nodes: vLLM's multi-node "
                  "executor, a leader serving the API and a headless worker on each other "
                  "node, started and stopped as one group. Off: all on one node.",
    ),
    EngineField(
        "max_num_seqs", "Max sequences per batch", "int", 64, group="capacity",
        flag="--max-num-seqs", unit="count", minimum=1, maximum=4096, memory=True,
        # vLLM's API server below 70 GiB of GPU memory and on an A100; 1024 on an H100 or
        # H200, 128 per CPU rank (vLLM 0.32): the flag is always passed.
        vllm_default=256,
        help_text="Maximum number of sequences processed in one iteration.",
    ),
    EngineField(
        "max_model_len", "Context length", "int", None, group="capacity",
        flag="--max-model-len", unit="tokens", minimum=16, memory=True,
        help_text="Empty: the model's max positions.",
    ),
    EngineField(
        "max_num_batched_tokens", "Max batched tokens", "int", None, group="capacity",
        flag="--max-num-batched-tokens", unit="tokens", minimum=16, memory=True,
        # vLLM's API server on an H100 or H200 (0.26 on an H200: "Chunked prefill is enabled
        # with max_num_batched_tokens=8192"); 2048 below 70 GiB, on an A100 and per CPU rank.
        vllm_default=8192,
        help_text="Maximum number of tokens processed in one iteration. Empty: vLLM's default.",
    ),
    EngineField(
        "enable_prefix_caching", "Prefix caching", "bool", True, group="scheduling",
        flag="--enable-prefix-caching",
        help_text="Reuse the KV cache of a prompt prefix already computed.",
    ),
    EngineField(
        "enforce_eager", "Eager mode (no CUDA graphs)", "bool", False, group="capacity",
        flag="--enforce-eager", vllm_default=False, omit_vllm_default=True, memory=True,
        help_text="Run the model without torch.compile and CUDA graphs: a GPU engine starts "
                  "in a fraction of the time and keeps the graphs' memory for the KV cache, at "
                  "some cost in per-token latency; a CPU engine skips torch.compile's warm-up "
                  "(about 0.6 of the start time and CPU for the tiny model).",
    ),
    EngineField(
        "dtype", "Data type", "choice", "auto", group="model", flag="--dtype",
        choices=(("auto", "auto"), ("float32", "float32"), ("float16", "float16"),
                 ("bfloat16", "bfloat16")),
        memory=True, vllm_default="auto",
        help_text="Data type of the weights and activations. auto: the base model's setting.",
    ),
    EngineField(
        "quantization", "Quantization", "choice", "", group="model", flag="--quantization",
        choices=(("", "none"), ("awq", "AWQ"), ("gptq", "GPTQ"), ("fp8", "FP8"),
                 ("bitsandbytes", "bitsandbytes")),
        memory=True,
        help_text="Method used to quantize the weights. Empty: the base model's setting.",
    ),
    EngineField(
        "kv_cache_dtype", "KV cache data type", "choice", "auto", group="model",
        flag="--kv-cache-dtype", choices=tuple((v, v) for v in KV_CACHE_DTYPES), memory=True,
        vllm_default="auto", omit_vllm_default=True,
        help_text="Data type of the KV cache. auto: the model's data type; fp8 (= fp8_e4m3) "
                  "and fp8_e5m2 hold twice the tokens of a 16-bit cache.",
    ),
    EngineField(
        "max_loras", "Max LoRA adapters per batch", "int", 4, group="lora",
        flag="--max-loras", unit="count", minimum=1, maximum=64, memory=True, vllm_default=1,
        help_text="LoRA slots: adapters one batch may use at once (their memory is reserved).",
    ),
    EngineField(
        "max_lora_rank", "Max LoRA rank", "int", 16, group="lora", flag="--max-lora-rank",
        minimum=LORA_RANKS[0], maximum=LORA_RANKS[-1], allowed=LORA_RANKS, memory=True,
        vllm_default=16,
        help_text=f"The largest adapter rank a slot holds: {', '.join(map(str, LORA_RANKS))}.",
    ),
    EngineField(
        "scheduling_policy", "Scheduling policy", "choice", "fcfs", group="scheduling",
        flag="--scheduling-policy", vllm_default="fcfs", omit_vllm_default=True,
        choices=(("fcfs", "First come, first served"),
                 ("priority", "Priority (from the tenant's tier)")),
        help_text="Which waiting request the engine serves first.",
    ),
    EngineField(
        "urgent_batch_cap", "Requests running beside an urgent one", "int", None,
        group="scheduling", env="LLM_CONSOLE_URGENT_BATCH_CAP", unit="count", minimum=0,
        maximum=1024, shown_when=("scheduling_policy", "priority"),
        help_text="Priority scheduling only: while a request of a high-tier tenant is in the "
                  "engine, at most this many others run; the rest are preempted and resume "
                  "once it is done (the console's scheduler plugin, docs/gpu.md). Empty: "
                  f"automatic, {AUTO_URGENT_BATCH_CAP} on GPU engines while a high-tier "
                  "tenant of the deployment has a latency objective, else off. 0: off "
                  "(vLLM's own scheduling).",
    ),
    EngineField(
        "base_port", "Base port", "int", None, group="isolation", minimum=1024, maximum=65000,
        help_text="Fixed engine port for replica 0 (replica n: base_port + n). Empty: any free.",
    ),
)

FIELD: Mapping[str, EngineField] = {f.name: f for f in FIELDS}
ENGINE_FIELDS: tuple[str, ...] = tuple(FIELD)
MEMORY_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.memory)

# The most replicas (instances) one deployment runs, and so the most a rollout starts beside the
# old ones or lets be missing at once, an autoscaler asks for, or a what-if plan places.
MAX_REPLICAS = 64

_Kind = TypeVar("_Kind", bool, int, float, str)


def _declared(value: Value, kind: type[_Kind], what: str) -> _Kind:
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise TypeError(f"{what} is declared as {value!r}, not as a {kind.__name__}")


def default_of(name: str, kind: type[_Kind]) -> _Kind:
    """The declared default of setting `name`, as a `kind`, for a field that takes the setting
    under its own name (a what-if plan's: `fleetspec.PlanDeployment`)."""
    return _declared(FIELD[name].default, kind, f"{name}'s default")


def optional_default_of(name: str, kind: type[_Kind]) -> _Kind | None:
    """As `default_of()`, for a setting that may be empty (None: the model's or vLLM's)."""
    value = FIELD[name].default
    return None if value is None else _declared(value, kind, f"{name}'s default")


def vllm_default_of(name: str, kind: type[_Kind]) -> _Kind:
    """vLLM's own default for setting `name` (`EngineField.vllm_default`), as a `kind`: what the
    memory planner plans with where it is given no value (`placement.planner.EngineSettings`)."""
    return _declared(FIELD[name].vllm_default, kind, f"{name}'s vLLM default")


def with_defaults(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every engine setting of `values`, a missing one at its declared default (a revision
    recorded before that setting was declared ran at the default)."""
    return {f.name: values.get(f.name, f.default) for f in FIELDS}


@dataclass(frozen=True)
class EngineSpec:
    """The engine settings one instance runs with, resolved against its base model.

    Its attributes are the declared fields, in the same order (checked when this module is
    imported); `dtype`, `quantization` and `max_model_len` hold what the engine is given, never
    "auto" or empty where the model says more.
    """

    isolation_mode: str
    mps_thread_percentage: int | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    allow_multi_node: bool
    max_num_seqs: int
    max_model_len: int | None
    max_num_batched_tokens: int | None
    enable_prefix_caching: bool
    enforce_eager: bool
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    max_loras: int
    max_lora_rank: int
    scheduling_policy: str
    urgent_batch_cap: int | None
    base_port: int | None

    @classmethod
    def resolve(cls, values: Mapping[str, Any], model: ModelDefaults) -> EngineSpec:
        """The settings `values` (a revision's spec, a deployment's fields) on `model`: the
        deployment's dtype, else the model's; its quantization, else the model's (None: none);
        its context length, else the model's max positions (None: unknown)."""
        given = with_defaults(values)
        if given["dtype"] == "auto":
            given["dtype"] = model.dtype or "auto"
        given["quantization"] = given["quantization"] or model.quantization or None
        given["max_model_len"] = given["max_model_len"] or model.max_position_embeddings or None
        return cls(**given)

    def arguments(self, **overrides: Value) -> list[str]:
        """vLLM's flags for these settings, in declaration order. `overrides` replace values
        for this one engine (the fraction of memory the placer gave it, ...); a value of None
        leaves its flag out."""
        argv: list[str] = []
        for field in FIELDS:
            if field.flag is None:
                continue
            value = overrides[field.name] if field.name in overrides else getattr(self,
                                                                                  field.name)
            if value is None or (field.omit_vllm_default and value == field.vllm_default):
                continue
            if isinstance(value, bool):
                argv.append(field.flag if value else f"--no-{field.flag.removeprefix('--')}")
            elif isinstance(value, float):
                argv += [field.flag, f"{value:g}"]
            else:
                argv += [field.flag, str(value)]
        return argv

    @property
    def world_size(self) -> int:
        """GPUs (ranks) one instance spans: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def as_dict(self) -> dict[str, Value]:
        return {f.name: getattr(self, f.name) for f in FIELDS}


if tuple(f.name for f in fields(EngineSpec)) != ENGINE_FIELDS:
    raise TypeError("EngineSpec's attributes must be the declared FIELDS, in their order")


__all__ = ["ENGINE_FIELDS", "FIELD", "FIELDS", "GROUPS", "KV_CACHE_DTYPES", "LORA_RANKS",
           "MAX_REPLICAS", "MEMORY_FIELDS", "EngineField", "EngineSpec", "Group", "InlineModel",
           "ModelDefaults", "Unit", "default_of", "optional_default_of", "vllm_default_of",
           "with_defaults"]
