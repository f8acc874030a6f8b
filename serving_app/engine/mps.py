"""The node's MPS control daemon, which `mps` deployments need (NVIDIA Multi-Process Service).

Under MPS the engines of several deployments share a GPU's compute through one MPS server, each
held to its share of the GPU's threads (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) and of its memory
(`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`), both set by the launch spec. The agent starts the control
daemon (`nvidia-cuda-mps-control -d`) before the first `mps` engine of its node, checks it
answers, and stops it (`quit`) once no `mps` engine of the node runs. Where no daemon can run
(the binary is missing, it does not start, the GPU refuses it), an `mps` deployment's instance
fails with that reason: it is never started unisolated.

The daemon's pipe and log folders are `MPS_PIPE_DIRECTORY` and `MPS_LOG_DIRECTORY` (defaults
under var/mps); every engine of an `mps` deployment gets the same two in its environment, so
its CUDA calls reach this daemon and no other.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from django.conf import settings
from django.utils import timezone

BINARY = "nvidia-cuda-mps-control"
# Where NVIDIA's container toolkit and driver packages put it, beside PATH.
SEARCH_PATH = "/usr/local/nvidia/bin:/usr/bin:/usr/local/bin:/usr/sbin"
TIMEOUT_SECONDS = 10.0
_START_LOCK = threading.Lock()


class MpsError(RuntimeError):
    """No MPS daemon can serve this node's engines; the message says why."""


def binary() -> str | None:
    """The control binary, on PATH or where NVIDIA's packages put it."""
    return shutil.which(BINARY, path=f"{os.environ.get('PATH', '')}:{SEARCH_PATH}")


def directories() -> dict[str, str]:
    """The environment that points a CUDA process (the daemon, an engine) at this daemon."""
    return {"CUDA_MPS_PIPE_DIRECTORY": str(settings.MPS_PIPE_DIRECTORY),
            "CUDA_MPS_LOG_DIRECTORY": str(settings.MPS_LOG_DIRECTORY)}


def _environment() -> dict[str, str]:
    """The daemon's environment: the agent's, pointed at the node's folders, with every GPU
    visible (a console process runs with CUDA_VISIBLE_DEVICES empty; the daemon then finds no
    device and exits with status 100, as seen on an H200)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, **directories()}


def _control(command: str, control: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([control], input=f"{command}\n", capture_output=True, text=True,
                          timeout=TIMEOUT_SECONDS, env=_environment(), check=False)


def _log_tail(lines: int = 5) -> str:
    path = Path(settings.MPS_LOG_DIRECTORY) / "control.log"
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def status() -> dict[str, object]:
    """What the node's page shows: whether the daemon answers, its MPS servers (one per GPU
    in use), its folders, or the error."""
    control = binary()
    result: dict[str, object] = {"checked_at": timezone.now().isoformat(), **directories()}
    if control is None:
        result.update(running=False, error=f"{BINARY} is not installed on this host.")
        return result
    try:
        done = _control("get_server_list", control)
    except (OSError, subprocess.TimeoutExpired) as exc:
        result.update(running=False, error=f"{BINARY} did not answer: {exc}")
        return result
    running = done.returncode == 0
    result["running"] = running
    if running:
        result["servers"] = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return result


def ensure_running() -> dict[str, object]:
    """Start the daemon unless it answers already; its status. `MpsError` when none can run.

    One start at a time in this agent; a daemon that another start brought up meanwhile
    ("An instance of this daemon is already running", seen on an H200 when two `mps` engines
    started together) is the daemon we want."""
    with _START_LOCK:
        return _ensure_running()


def _ensure_running() -> dict[str, object]:
    current = status()
    if current.get("running"):
        return current
    control = binary()
    if control is None:
        raise MpsError(f"MPS isolation needs NVIDIA's MPS control daemon, and {BINARY} is not "
                       f"installed on this host.")
    for folder in directories().values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        started = subprocess.run([control, "-d"], capture_output=True, text=True,
                                 timeout=TIMEOUT_SECONDS, env=_environment(), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MpsError(f"The MPS control daemon could not be started: {exc}") from exc
    said = (started.stderr or started.stdout).strip()
    if started.returncode != 0 and "already running" not in said:
        raise MpsError(f"The MPS control daemon did not start (exit {started.returncode}): "
                       f"{said[-300:] or _log_tail()}")
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        current = status()
        if current.get("running"):
            return current
        time.sleep(0.2)
    raise MpsError(f"The MPS control daemon started but does not answer: {_log_tail()}")


def stop() -> dict[str, object]:
    """Ask the daemon to quit (its servers end with it); its status afterwards."""
    control = binary()
    if control is not None and status().get("running"):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _control("quit", control)
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while time.monotonic() < deadline and status().get("running"):
            time.sleep(0.2)
    return status()
