"""A redis-server of a test's own (see `PrivateRedis`), for tests that stop, kill or fill Redis
without disturbing anyone else's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from benchmarks.gateway_bench import free_port, kill_group


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        with contextlib.suppress(redis.RedisError):
            if redis.Redis.from_url(url).ping():
                return
        time.sleep(0.1)
    raise RuntimeError(f"redis-server did not start within {timeout}s")


class PrivateRedis:
    """A redis-server of the test's own, on a free loopback port, so that killing it disturbs
    nothing else. With no `config` it runs as the machine's Redis does (no persistence: a restart
    loses everything); with `config` (e.g. deploy/redis.conf) it runs with those settings, its
    files in `folder`. `kill()` is SIGKILL, a crash: nothing gets a chance to be saved."""

    def __init__(self, folder: Path, config: Path | None = None, *extra: str) -> None:
        self.port = free_port()
        self.folder = folder
        self.config = config
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.config is None:
            argv = ["redis-server", "--save", "", "--appendonly", "no"]
        else:
            argv = ["redis-server", str(self.config)]
        argv += ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                 *self.extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        # PING answers LOADING while the AOF is replayed: wait until the data is back.
        _wait_ready(self.url, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL: Redis dies at once, as in a crash or an OOM kill."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)
