"""What a CPU engine's start costs, paired: wall seconds and CPU seconds to a healthy engine.

    .venv/bin/python benchmarks/engine_start_bench.py --pairs 3 --b-args=--enforce-eager

Starts the tiny model as the benchmarks start it (`gateway_bench.start_engine`: under
`chrt --idle 0`, as node agents and the test suite start CPU engines), A then B, `--pairs`
times, each until `/health` answers 200, then stops it. CPU seconds are the user and system time
of every process of the engine's session (the API server, EngineCore and its worker), read every
0.2 s while it starts: on a 2-core machine running the suite in parallel workers, an engine's
start costs what it takes from the others, so CPU seconds are the figure that matters, wall
seconds the one that is felt. Prints each start and the ratios B / A of the medians (these
machines are noisy: compare only within one run).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gateway_bench import free_port, kill_group, start_engine  # noqa: E402
from serving_app.engine.supervisor import session_members  # noqa: E402


def start_once(extra: list[str], env_extra: dict[str, str], log: Path) -> tuple[float, float]:
    """One start: (wall seconds, CPU seconds) until /health answers 200."""
    port = free_port()
    began = time.monotonic()
    with log.open("wb") as out:
        proc = start_engine(port, extra=tuple(extra), env=env_extra, log=out)
    seen: dict[int, float] = {}
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the engine exited with {proc.returncode}: see {log}")
            for process in session_members(proc.pid):
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    seen[process.pid] = times.user + times.system
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - began, sum(seen.values())
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    finally:
        kill_group(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--a-args", default="", help="more engine flags for A (shell words)")
    parser.add_argument("--b-args", default="", help="more engine flags for B (shell words)")
    parser.add_argument("--a-env", default="", help="NAME=value ... for A's environment")
    parser.add_argument("--b-env", default="", help="NAME=value ... for B's environment")
    args = parser.parse_args()
    sides = {
        "A": (shlex.split(args.a_args), dict(w.split("=", 1) for w in shlex.split(args.a_env))),
        "B": (shlex.split(args.b_args), dict(w.split("=", 1) for w in shlex.split(args.b_env))),
    }
    results: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    folder = Path(tempfile.mkdtemp(prefix="engine-start-bench-"))
    for pair in range(args.pairs):
        for side, (extra, env) in sides.items():
            wall, cpu = start_once(extra, env, folder / f"{side}{pair}.log")
            results[side].append((wall, cpu))
            print(f"pair {pair + 1} {side}: {wall:6.1f} s wall, {cpu:6.1f} s CPU", flush=True)
    for side, (extra, env) in sides.items():
        walls, cpus = zip(*results[side], strict=True)
        print(f"{side} ({' '.join(extra) or 'no flags'}{' ' if env else ''}"
              f"{' '.join(f'{k}={v}' for k, v in env.items())}): median "
              f"{statistics.median(walls):.1f} s wall, {statistics.median(cpus):.1f} s CPU")
    walls_a, cpus_a = zip(*results["A"], strict=True)
    walls_b, cpus_b = zip(*results["B"], strict=True)
    print(f"B / A: wall {statistics.median(walls_b) / statistics.median(walls_a):.2f}, "
          f"CPU {statistics.median(cpus_b) / statistics.median(cpus_a):.2f} (logs: {folder})")


if __name__ == "__main__":
    main()
