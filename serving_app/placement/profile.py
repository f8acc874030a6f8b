"""A model's measured profile: what one start of its engine logged, for the planner to use.

When the formula cannot know a model (a layout ``layouts.Layout`` refuses: state-space or
linear-attention layers, an unknown type), or the operator prefers what the engine itself said,
a one-off capacity test starts the engine once; its start-up figures (read from the log by
``serving_app.engine.startup.StartupProgress``: weights, peak activation, non-torch memory, CUDA
graphs, KV cache GiB and tokens) are stored on the base model with the settings it ran with.
The planner then takes each term from it, marked "measured"; a term the engine did not log
(the CPU engine logs no memory split) is ``None`` here and shown as absent, and the formula's
value is used for it where there is one.

Plain Python, no Django.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 1024**3

# figure in StartupProgress.figures -> field here
FIGURES = {
    "weights_gib": "weights_gib",
    "activation_gib": "activation_gib",
    "non_torch_gib": "non_torch_gib",
    "cuda_graph_gib": "cuda_graph_gib",
    "kv_cache_gib": "kv_cache_gib",
    "kv_cache_tokens": "kv_cache_tokens",
    "requested_gib": "requested_gib",
}
# The engine settings the figures depend on: a profile measured with others is not used.
SETTINGS = ("dtype", "quantization", "kv_cache_dtype", "tensor_parallel_size",
            "pipeline_parallel_size", "max_num_batched_tokens", "max_num_seqs")


@dataclass(frozen=True)
class MeasuredProfile:
    """Figures one engine start logged (GiB as vLLM rounds them; None: not logged)."""

    weights_gib: float | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    cuda_graph_gib: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    requested_gib: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # where it was measured: "instance 12 on node gpu-1, 2026-12-06 ..."

    @classmethod
    def from_figures(cls, figures: dict[str, Any], settings: dict[str, Any],
                     source: str = "") -> MeasuredProfile:
        """From a start's figures (``StartupProgress.figures``) and the engine's settings."""
        values: dict[str, Any] = {}
        for figure, name in FIGURES.items():
            value = figures.get(figure)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[name] = int(value) if name == "kv_cache_tokens" else float(value)
        if not values:
            raise ValueError("the engine logged none of the figures a profile needs (weights, "
                             "activation, KV cache)")
        return cls(**values, settings={k: settings.get(k) for k in SETTINGS},
                   source=source)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> MeasuredProfile | None:
        """From the base model's JSON field (None when empty)."""
        if not data:
            return None
        known = {k: data[k] for k in (*FIGURES.values(), "settings", "source") if k in data}
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _bytes(self, gib: float | None) -> int | None:
        return None if gib is None else int(gib * GIB)

    @property
    def weight_bytes(self) -> int | None:
        """Weights per GPU as loaded."""
        return self._bytes(self.weights_gib)

    @property
    def activation_bytes(self) -> int | None:
        """The profile run's peak activation."""
        return self._bytes(self.activation_gib)

    @property
    def runtime_bytes(self) -> int | None:
        """Non-torch memory plus CUDA graphs (None unless both were logged)."""
        if self.non_torch_gib is None or self.cuda_graph_gib is None:
            return None
        return int((self.non_torch_gib + self.cuda_graph_gib) * GIB)

    @property
    def kv_bytes_per_token(self) -> int | None:
        """KV cache bytes per token per GPU: the GiB it allocated over the tokens they hold."""
        if not self.kv_cache_gib or not self.kv_cache_tokens:
            return None
        return round(self.kv_cache_gib * GIB / self.kv_cache_tokens)

    def mismatch(self, settings: dict[str, Any]) -> str:
        """Why the profile does not apply to engines with these settings ("" when it does)."""
        different = [k for k in SETTINGS
                     if k in self.settings and settings.get(k) != self.settings[k]]
        if not different:
            return ""
        return "measured with other settings: " + ", ".join(
            f"{k} {self.settings[k]!r} (now {settings.get(k)!r})" for k in different)

    def absent(self) -> list[str]:
        """The terms the engine did not log."""
        names = {"weights_gib": "weights", "activation_gib": "peak activation",
                 "non_torch_gib": "non-torch memory", "cuda_graph_gib": "CUDA graphs",
                 "kv_cache_gib": "KV cache GiB", "kv_cache_tokens": "KV cache tokens"}
        return [label for name, label in names.items() if getattr(self, name) is None]
