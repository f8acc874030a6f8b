"""`manage.py gpu_check run mps`'s last check: each `mps` engine's GPU memory as NVML counts it,
against its pinned limit. NVML cannot run here (no GPU): a stand-in for the two process
queries answers for a real process tree (an engine's server and the child that holds its
GPU memory, as vLLM's EngineCore does), MPS clients listed apart as NVML lists them."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pynvml
import pytest

from serving_app.management.commands.gpu_check import Command

MIB = 1024 * 1024


@pytest.fixture
def engine_tree():
    """A server process with one child, like an engine's API server and its EngineCore."""
    server = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(60)']); print(c.pid, flush=True); c.wait()")],
        stdout=subprocess.PIPE, text=True)
    child = int(server.stdout.readline())
    yield server.pid, child
    subprocess.run(["kill", str(child)], check=False)
    server.wait(timeout=10)


def as_rows(procs):
    return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in procs]


def nvml(monkeypatch, compute, mps):
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: "gpu0")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: as_rows(compute))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses", lambda h: as_rows(mps))


def rows(pid: int, limit: str) -> list[dict]:
    return [{"pid": pid, "environment": {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": limit}}]


def test_the_engines_child_under_mps_is_counted_against_its_limit(monkeypatch, engine_tree):
    server, child = engine_tree
    # The MPS server is a compute process of its own; the engine's child is an MPS client.
    nvml(monkeypatch, compute=[(4242, 300 * MIB)], mps=[(child, 5000 * MIB)])
    seen = Command.engine_gpu_memory({"mps-a": rows(server, "0=5750M")})
    assert seen == {"mps-a": {"pids_on_gpu": [child], "used_mib": 5000, "limit_mib": 5750}}


def test_memory_nvml_cannot_tell_counts_as_none_used(monkeypatch, engine_tree):
    server, child = engine_tree
    nvml(monkeypatch, compute=[], mps=[(child, 2**64 - 1)])  # NVML_VALUE_NOT_AVAILABLE
    seen = Command.engine_gpu_memory({"mps-a": rows(server, "0=5750M")})
    assert seen["mps-a"]["used_mib"] == 0  # so the scenario's check fails rather than passes
