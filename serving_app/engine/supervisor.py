"""Engine processes on this host: launch detached, check, stop, read their logs.

Engines run in their own session (process group) with output to a log file, so they outlive a
node agent restart and can be adopted by the next one; stopping signals the whole group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Children this agent process launched, so their exit codes can be reaped (a zombie would look
# alive to kill(pid, 0)). Adopted engines are not our children; init reaps them.
_children: dict[int, subprocess.Popen[bytes]] = {}
_exit_codes: dict[int, int] = {}


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


def launch(argv: list[str], env: dict[str, str], log_path: Path) -> Launched:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    # The console's settings must not leak into the engine's Python.
    for name in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV"):
        full_env.pop(name, None)
    with log_path.open("ab") as log:
        log.write(f"\n=== launch at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
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
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = proc_stat(pid)
    return fields is None or fields[0] != "Z"  # a zombie is dead for our purposes


def pids() -> list[int]:
    """Every process id on this host (Linux's /proc)."""
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, session, ...;
    `man 5 proc` numbers them from 3), or None when the process is gone or unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with (`chrt` execs the engine, so it is the engine's).
    Only the process's owner and root may read it; anything else reads as empty."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Only zombies left? Reap ours and call the group dead.
    process = _children.get(pgid)
    if process is not None and process.poll() is not None:
        return any(_live_members(pgid))
    return True


def _live_members(pgid: int) -> list[int]:
    members = []
    for pid in pids():
        fields = proc_stat(pid)
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(pid)
    return members


def stop(pid: int, grace_seconds: float) -> str:
    """SIGTERM the engine's process group, SIGKILL what is left after the grace period.

    Returns how it ended: "terminated", "killed" or "gone" (nothing was running).
    """
    pgid = pid  # launched with start_new_session: the engine leads its own group
    if not _group_alive(pgid):
        _reap(pid)
        return "gone"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        _reap(pid)
        if not _group_alive(pgid):
            return "terminated"
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    for _ in range(50):
        _reap(pid)
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    return "killed"


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


def log_tail(path: str | os.PathLike[str], lines: int = 40, max_bytes: int = 16384) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])
