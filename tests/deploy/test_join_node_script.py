"""scripts/check_node.py says what a host lacks before it joins. The join itself, run by
scripts/join_node.sh in a network namespace of its own, up to a deployment served from the
joined node and its removal: tests/engine/test_node_join_e2e.py."""

from __future__ import annotations

import ctypes
import subprocess
import sys

from tests.deploy.known import ROOT


def test_the_check_says_what_is_missing_and_fails():
    result = subprocess.run(
        [sys.executable, "scripts/check_node.py", "--console", "http://127.0.0.1:9",
         "--gpus", "nvml", "--engine-venv", "/nonexistent", "--min-disk-gib", "1e9",
         "--address", "192.0.2.1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    report = {line.split()[1]: line.split()[0] for line in result.stdout.splitlines()
              if line.startswith("  ")}
    assert report["python"] == "OK"
    assert {report[name] for name in ("vllm", "disk", "address", "console")} == {"MISSING"}
    # NVML: missing exactly where the NVIDIA driver's library cannot be loaded.
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert report["nvml"] == "MISSING"
        assert "install the NVIDIA driver" in result.stdout
    assert "Not ready:" in result.stdout
