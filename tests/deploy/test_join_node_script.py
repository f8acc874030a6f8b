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


def join(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/join_node.sh", "--console", "http://127.0.0.1:9",
                           "--name", "gpu-z", "--min-disk-gib", "1e9", "--no-systemd", *args],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60)


def test_a_token_on_the_command_line_is_refused_before_anything_runs():
    for args in (("--token", "nj_abc"), ("--token=nj_abc",)):
        result = join(*args)
        assert result.returncode == 2
        assert "not taken on the command line" in result.stderr
        assert "--token-file" in result.stderr
        assert "checking this host" not in result.stdout


def test_the_token_is_read_from_a_file_or_standard_input_and_never_empty(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    for result in (join("--token-file", str(empty)), join("--token-file", "-", stdin="  \n"),
                   join()):  # no terminal to ask on and no file: no token
        assert result.returncode == 2
        assert "no join token" in result.stderr
    # A token read from standard input goes on to the host check (which fails here: no
    # console listens on port 9), with the token spent on nothing.
    given = join("--token-file", "-", stdin="nj_abc\n")
    assert given.returncode == 1 and "checking this host" in given.stdout
    assert "nj_abc" not in given.stdout + given.stderr
