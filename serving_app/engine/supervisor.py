"""Engine processes on this host: launch detached, check, stop, read their logs.

Each engine runs in a session of its own (`start_new_session`) with output to a log file, so it
outlives a node agent restart and can be adopted by the next one. The session is the unit the
agent supervises: the API server leads it, and its EngineCore, workers and whatever they spawn
inherit it, also once the leader is gone (an engine killed with SIGKILL orphans its children,
which keep their session). Processes are read through psutil, never by parsing /proc here.
Linux keeps a pid from being reused while a session or process group it names still has members,
so the live members of session `pid` after the leader `pid` died are that engine's own orphans.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from django.conf import settings

from serving_app.engine.startup import LAUNCH_MARKER

# Children this agent process launched, so their exit codes can be reaped (a zombie would look
# alive to kill(pid, 0)). Adopted engines are not our children; init reaps them.
_children: dict[int, subprocess.Popen[bytes]] = {}
_exit_codes: dict[int, int] = {}
# After SIGKILL, how long to wait for the session to empty (the kernel tears down large
# processes in well under a second; this bounds a stuck one in uninterruptible sleep).
KILL_WAIT_SECONDS = 5.0
POLL_SECONDS = 0.1


@dataclass
class Launched:
    pid: int
    log_path: str


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# What an engine inherits from the node agent's environment: the host's basics and the
# variables its own stack reads (vLLM, CUDA, NCCL, PyTorch, OpenMP, Hugging Face). Nothing else:
# the agent's environment holds the console's secrets (DATABASE_URL, SECRET_KEY, REDIS_URL,
# broker URLs), which a tenant's adapter or prompt must never be one exploit away from.
# ENGINE_ENV_ALLOW adds names (or prefixes ending in "*") for a site that needs more.
ENGINE_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
    "TOKENIZERS_PARALLELISM", "PYTORCH_CUDA_ALLOC_CONF",
})
ENGINE_ENV_PREFIXES = ("LC_", "XDG_", "VLLM_", "CUDA_", "NCCL_", "NVIDIA_", "TORCH", "OMP_",
                       "KMP_", "MKL_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "TRITON_")


def engine_environment(inherited: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """The engine's environment: the allowed part of `inherited`, then `env` (the launch spec's,
    which always wins)."""
    extra = [name.strip() for name in settings.ENGINE_ENV_ALLOW if name.strip()]
    names = ENGINE_ENV_NAMES | {n for n in extra if not n.endswith("*")}
    prefixes = ENGINE_ENV_PREFIXES + tuple(n[:-1] for n in extra if n.endswith("*"))
    allowed = {k: v for k, v in inherited.items() if k in names or k.startswith(prefixes)}
    return {**allowed, **env}


def launch(argv: list[str], env: dict[str, str], log_path: Path) -> Launched:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = engine_environment(dict(os.environ), env)
    with log_path.open("ab") as log:
        log.write(b"\n" + LAUNCH_MARKER + f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
        log.flush()
        process = subprocess.Popen(
            argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, close_fds=True, cwd="/",
        )
    _children[process.pid] = process
    return Launched(pid=process.pid, log_path=str(log_path))


def exit_code(pid: int) -> int | None:
    """The exit code of a child that ended, None while it runs or if it is not our child."""
    process = _children.get(pid)
    if process is None:
        return _exit_codes.get(pid)
    return process.poll()


def is_alive(pid: int | None) -> bool:
    if not pid:
        return False
    process = _children.get(pid)
    if process is not None:
        return process.poll() is None
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie is dead to us
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with (`chrt` execs the engine, so it is the engine's).
    Only the process's owner and root may read it; anything else reads as empty."""
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def is_engine_of(pid: int | None, secret: str, port: int | None) -> bool:
    """Whether `pid` is the engine of the instance with this secret and port (for adoption and
    stop: a recycled pid must never be mistaken for our engine, nor signalled).

    The proof is the instance's secret as `VLLM_API_KEY` in the environment the process started
    with, which no other instance's engine has and other local users cannot read. An engine
    launched before the key moved off the command line carries it after `--api-key` there
    instead; it is still that instance's and is adopted too.
    """
    if not pid or not secret or not is_alive(pid):
        return False
    args = cmdline(pid)
    if port is not None and option_value(args, "--port") != str(port):
        return False
    return environ(pid).get("VLLM_API_KEY") == secret or option_value(args, "--api-key") == secret


def option_value(args: list[str], name: str) -> str | None:
    """The value given to option `name` (as `name value` or `name=value`), None without it."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def session_members(sid: int) -> list[psutil.Process]:
    """The live processes of session `sid` (the engine led by pid `sid` and all it spawned);
    zombies are left out, they are dead and only wait to be reaped."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (OSError, psutil.Error):
            continue  # ended while we looked
    return members


def _signal(processes: list[psutil.Process], sig: int) -> None:
    for process in processes:
        # psutil checks that the pid still names the process it listed (not a recycled one).
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(sig)


def stop(pid: int, grace_seconds: float) -> str:
    """Stop the engine led by `pid` and every process of its session.

    SIGTERM to every member (and to any that appears meanwhile), then SIGKILL to whatever is
    still there after `grace_seconds`: an engine that ignores SIGTERM, or hangs while shutting
    down, cannot outlive its stop. With the leader already gone (exited, or killed with SIGKILL)
    this clears its orphans. Returns how it ended: "terminated", "killed" or "gone" (nothing of
    the session was running); "killed" says how many processes were still exiting when it gave
    up waiting (a killed process of a few GB can take longer than `KILL_WAIT_SECONDS` to go on
    a loaded host: it is gone soon after, nothing more can be done to it).
    """
    members = session_members(pid)
    if not members:
        _reap(pid)
        return "gone"
    signalled: set[psutil.Process] = set()
    deadline = time.monotonic() + grace_seconds
    while members and time.monotonic() < deadline:
        newcomers = [m for m in members if m not in signalled]
        _signal(newcomers, signal.SIGTERM)
        signalled.update(newcomers)
        time.sleep(POLL_SECONDS)
        _reap(pid)
        members = session_members(pid)
    if not members:
        return "terminated"
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    while members and time.monotonic() < deadline:
        _signal(members, signal.SIGKILL)
        time.sleep(POLL_SECONDS)
        _reap(pid)
        members = session_members(pid)
    return f"killed, {len(members)} process(es) still exiting" if members else "killed"


def _reap(pid: int) -> None:
    process = _children.get(pid)
    if process is not None and process.poll() is not None:
        _exit_codes[pid] = process.returncode
        _children.pop(pid, None)


def wait_port_free(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_is_free(port, host):
            return True
        time.sleep(0.1)
    return port_is_free(port, host)


def log_tail(path: str | os.PathLike[str], lines: int = 40, max_bytes: int = 65536) -> str:
    """The last `lines` lines of an engine's log, with the node agent's own polling folded:
    each run of successful `GET /health` and `GET /metrics` access lines (every few seconds, so
    they would fill the tail) becomes one line saying how many there were. Failed polls stay."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return "\n".join(fold_polling(text.splitlines())[-lines:])


POLLING_LINE = re.compile(r'"GET /(?:health|metrics) HTTP/1\.[01]" 200\b')


def fold_polling(lines: list[str]) -> list[str]:
    folded: list[str] = []
    run = 0
    for line in [*lines, ""]:
        if line and POLLING_LINE.search(line):
            run += 1
            continue
        if run:
            folded.append(f"[{run} successful health and metrics poll{'s' if run > 1 else ''} "
                          "folded]")
            run = 0
        folded.append(line)
    return folded[:-1]
