"""A node agent's configuration: who it is (`NODE_NAME`), where its engines listen, the engine
environment they run from and the GPUs it owns, read from the worker's environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

from django.conf import settings


@dataclass
class AgentConfig:
    name: str
    address: str
    engine_env: str
    gpus: str  # declared inventory ("" = none: a CPU host), or "nvml"
    engine_python: str = ""  # the engines' interpreter ("" = <engine_env>/bin/python)
    engine_pythonpath: str = ""  # folders put first on the engines' PYTHONPATH
    # With NVML: the GPUs this agent owns, by UUID (empty: every GPU of the host). NVML lists
    # every GPU whatever CUDA_VISIBLE_DEVICES says, so two agents on one host (a node each,
    # say, to run a multi-node group there) each name theirs.
    gpu_uuids: tuple[str, ...] = ()

    @property
    def queue(self) -> str:
        return f"node.{self.name}"

    @classmethod
    def from_environment(cls) -> AgentConfig | None:
        name = os.environ.get("NODE_NAME")
        if not name:
            return None
        return cls(
            name=name,
            address=os.environ.get("NODE_ADDRESS", "127.0.0.1"),
            engine_env=os.environ.get("NODE_ENGINE_ENV", settings.ENGINE_VENV),
            gpus=os.environ.get("NODE_GPUS", ""),
            engine_python=os.environ.get("NODE_ENGINE_PYTHON", ""),
            engine_pythonpath=os.environ.get("NODE_ENGINE_PYTHONPATH", ""),
            gpu_uuids=tuple(u.strip() for u in os.environ.get("NODE_GPU_UUIDS", "").split(",")
                            if u.strip()),
        )


def current_config() -> AgentConfig | None:
    return AgentConfig.from_environment()
