"""What a CPU engine's start costs, paired: wall seconds and CPU seconds to a healthy engine.

    .venv/bin/python benchmarks/engine_start_bench.py --pairs 3 --b-args=--enforce-eager
    .venv/bin/python benchmarks/engine_start_bench.py --pairs 2 --load \
        --a-args=--enforce-eager --b-args=--enforce-eager --b-env VLLM_ENABLE_V1_MULTIPROCESSING=0

Starts the tiny model as the benchmarks start it (`gateway_bench.start_engine`: under
`chrt --idle 0`, as node agents and the test suite start CPU engines), A then B, `--pairs`
times, each until `/health` answers 200, then stops it. CPU seconds are the user and system time
of every process of the engine's session (the API server, EngineCore and its worker), read every
0.2 s while it starts: on a 2-core machine running the suite in parallel workers, an engine's
start costs what it takes from the others, so CPU seconds are the figure that matters, wall
seconds the one that is felt. Prints each start and the ratios B / A of the medians (these
machines are noisy: compare only within one run).

`--load`: once healthy, each engine also serves `LOADS` (requests of 128 tokens, `ignore_eos`:
8 two at a time, then 24 at once), and the wall and CPU seconds of each load are paired the same
way: what a setting costs an engine's steps, beside its start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gateway_bench import ENGINE_SECRET, free_port, kill_group, start_engine  # noqa: E402
from serving_app.engine.supervisor import session_members  # noqa: E402

LOADS = ((2, 8), (24, 24))  # (requests at once, requests)
LOAD_TOKENS = 128


def session_cpu(proc: subprocess.Popen, seen: dict[int, float]) -> float:
    """CPU seconds of the engine's session so far (`seen` keeps those of exited members)."""
    for process in session_members(proc.pid):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            seen[process.pid] = times.user + times.system
    return sum(seen.values())


async def serve(port: int, at_once: int, requests: int) -> None:
    gate = asyncio.Semaphore(at_once)
    async with httpx.AsyncClient(timeout=600) as http:
        async def one() -> None:
            async with gate:
                r = await http.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    headers={"Authorization": f"Bearer {ENGINE_SECRET}"},
                    json={"model": "tiny-llama", "prompt": "Tell me a story about a lighthouse.",
                          "max_tokens": LOAD_TOKENS, "ignore_eos": True})
                r.raise_for_status()
        await asyncio.gather(*(one() for _ in range(requests)))


def start_once(extra: list[str], env_extra: dict[str, str], log: Path,
               load: bool) -> list[tuple[float, float]]:
    """One start: (wall seconds, CPU seconds) until /health answers 200, then with `load` the
    same for each of `LOADS`."""
    port = free_port()
    began = time.monotonic()
    with log.open("wb") as out:
        proc = start_engine(port, extra=tuple(extra), env=env_extra, log=out)
    seen: dict[int, float] = {}
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the engine exited with {proc.returncode}: see {log}")
            cpu = session_cpu(proc, seen)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        figures = [(time.monotonic() - began, cpu)]
        for at_once, requests in LOADS if load else ():
            began, cpu = time.monotonic(), session_cpu(proc, seen)
            asyncio.run(serve(port, at_once, requests))
            figures.append((time.monotonic() - began, session_cpu(proc, seen) - cpu))
        return figures
    finally:
        kill_group(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--a-args", default="", help="more engine flags for A (shell words)")
    parser.add_argument("--b-args", default="", help="more engine flags for B (shell words)")
    parser.add_argument("--a-env", default="", help="NAME=value ... for A's environment")
    parser.add_argument("--b-env", default="", help="NAME=value ... for B's environment")
    parser.add_argument("--load", action="store_true",
                        help="also time each engine serving LOADS once healthy")
    args = parser.parse_args()
    sides = {
        "A": (shlex.split(args.a_args), dict(w.split("=", 1) for w in shlex.split(args.a_env))),
        "B": (shlex.split(args.b_args), dict(w.split("=", 1) for w in shlex.split(args.b_env))),
    }
    names = ["start"] + [f"{requests} requests, {at_once} at once"
                         for at_once, requests in (LOADS if args.load else ())]
    results: dict[str, list[list[tuple[float, float]]]] = {"A": [], "B": []}
    folder = Path(tempfile.mkdtemp(prefix="engine-start-bench-"))
    for pair in range(args.pairs):
        for side, (extra, env) in sides.items():
            figures = start_once(extra, env, folder / f"{side}{pair}.log", args.load)
            results[side].append(figures)
            print(f"pair {pair + 1} {side}: " + "; ".join(
                f"{name} {wall:.1f} s wall, {cpu:.1f} s CPU"
                for name, (wall, cpu) in zip(names, figures, strict=True)), flush=True)
    for index, name in enumerate(names):
        medians = {}
        for side, (extra, env) in sides.items():
            walls = [run[index][0] for run in results[side]]
            cpus = [run[index][1] for run in results[side]]
            medians[side] = statistics.median(walls), statistics.median(cpus)
            print(f"{name}: {side} ({' '.join(extra) or 'no flags'}{' ' if env else ''}"
                  f"{' '.join(f'{k}={v}' for k, v in env.items())}): median "
                  f"{medians[side][0]:.1f} s wall, {medians[side][1]:.1f} s CPU")
        print(f"{name}: B / A: wall {medians['B'][0] / medians['A'][0]:.2f}, "
              f"CPU {medians['B'][1] / medians['A'][1]:.2f}")
    print(f"logs: {folder}")


if __name__ == "__main__":
    main()
