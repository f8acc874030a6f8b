"""GPU inventory: what a host's GPUs are and hold, read through NVML or declared in configuration.

Reading is split in two so the parser can be tested on a recorded snapshot:

- ``read_nvml()`` queries NVML (``pynvml`` from the ``nvidia-ml-py`` package) and returns a raw,
  JSON-serializable dict. Only initialisation, the device count and the per-index handle are
  required; every other query may fail (``NVMLError_NotSupported`` under MIG or in a sandbox, no
  permission, an old driver) and is then recorded as ``None`` with the error under ``errors``.
- ``parse_snapshot(snapshot)`` turns that dict into ``GpuInfo`` dataclasses.

``declared_inventory(spec)`` builds the same dataclasses for a host without NVML (CPU engines in
development, tests and demos) from a string such as ``"2x24GiB"`` or
``"0:NVIDIA L4:24GiB,1:NVIDIA L4:24GiB[3g.40gb,3g.40gb]"`` (``serving_app.placement.fleetspec``
holds the format); those GPUs carry ``declared=True``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from serving_app.placement.fleetspec import DeclaredGpu, parse_gpus
from serving_app.placement.fleetspec import (
    parse_size as parse_size,
)  # the declared format's, re-exported

SNAPSHOT_SCHEMA = 1

# Bytes; the one definition of each, which placement and the dashboards import.
GIB = 1024**3
MIB = 1024**2
_MIG_PROFILE_RE = re.compile(r"\bMIG\s+(\S+)")


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised on this host (no driver, no library, no GPU)."""


@dataclass
class MigDeviceInfo:
    """One MIG device (a GPU instance + compute instance) carved out of a physical GPU."""

    index: int
    uuid: str | None
    profile: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    slice_count: int | None = None
    multiprocessor_count: int | None = None


@dataclass
class GpuProcessInfo:
    """A compute process holding memory on a GPU (``used_memory_bytes`` is None when hidden)."""

    pid: int
    used_memory_bytes: int | None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass
class GpuInfo:
    """One physical GPU as read through NVML, or as declared in configuration."""

    index: int
    uuid: str | None
    name: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    pci_bus_id: str | None = None
    compute_capability: str | None = None
    mig_mode_current: bool | None = None
    mig_mode_pending: bool | None = None
    mig_devices: list[MigDeviceInfo] = field(default_factory=list)
    processes: list[GpuProcessInfo] = field(default_factory=list)
    cpu_affinity: list[int] = field(default_factory=list)  # the cores nearest the GPU
    declared: bool = False
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def memory_total_gib(self) -> float | None:
        """Total memory in GiB, for display."""
        return None if self.memory_total_bytes is None else self.memory_total_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serializable) for the heartbeat payload or a model's JSON field."""
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Reading NVML
# --------------------------------------------------------------------------------------------


def _text(value: Any) -> str | None:
    """NVML strings come back as ``str`` in recent pynvml and as ``bytes`` in old releases."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _error_text(exc: BaseException) -> str:
    message = str(exc)
    name = type(exc).__name__
    return f"{name}: {message}" if message and message != name else name


def _query(errors: dict[str, str], key: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call one optional NVML query; on any failure record it under ``errors[key]``, return None.

    Any exception is tolerated, not only ``NVMLError``: an older pynvml may lack the function
    (``AttributeError``) or a sandboxed driver may return malformed structures.
    """
    try:
        return fn(*args)
    except Exception as exc:  # every optional query is allowed to fail
        errors[key] = _error_text(exc)
        return None


def _optional_int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _read_memory(
    nvml: ModuleType, handle: Any, errors: dict[str, str], key: str
) -> dict[str, Any] | None:
    info = _query(errors, key, nvml.nvmlDeviceGetMemoryInfo, handle)
    if info is None:
        return None
    return {
        "total": _optional_int(getattr(info, "total", None)),
        "used": _optional_int(getattr(info, "used", None)),
        "free": _optional_int(getattr(info, "free", None)),
    }


def _read_processes(
    nvml: ModuleType, handle: Any, errors: dict[str, str],
    query: Callable[..., Any] | None = None,
) -> list[dict[str, Any]] | None:
    """The processes `query` lists (default: the compute processes) with their memory."""
    query = query or nvml.nvmlDeviceGetComputeRunningProcesses
    procs = _query(errors, "processes", query, handle)
    if procs is None:
        return None
    not_available = getattr(nvml, "NVML_VALUE_NOT_AVAILABLE_ulonglong", None)
    sentinel = getattr(not_available, "value", None)
    out = []
    for proc in procs:
        used = getattr(proc, "usedGpuMemory", None)
        if used is not None and sentinel is not None and used == sentinel:
            used = None
        gi = getattr(proc, "gpuInstanceId", None)
        ci = getattr(proc, "computeInstanceId", None)
        out.append(
            {
                "pid": _optional_int(getattr(proc, "pid", None)),
                "used_memory": _optional_int(used),
                # 0xFFFFFFFF means "not on a MIG instance".
                "gpu_instance_id": None if gi in (None, 0xFFFFFFFF) else int(gi),
                "compute_instance_id": None if ci in (None, 0xFFFFFFFF) else int(ci),
            }
        )
    return out


def _read_mig_devices(
    nvml: ModuleType, handle: Any, errors: dict[str, str]
) -> list[dict[str, Any]]:
    count = _query(errors, "mig_device_count", nvml.nvmlDeviceGetMaxMigDeviceCount, handle)
    devices: list[dict[str, Any]] = []
    for mig_index in range(_optional_int(count) or 0):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
        except Exception:  # NotFound for an empty slot is the normal case
            continue
        mig_errors: dict[str, str] = {}
        attrs = _query(mig_errors, "attributes", nvml.nvmlDeviceGetAttributes, mig)
        devices.append(
            {
                "index": mig_index,
                "uuid": _text(_query(mig_errors, "uuid", nvml.nvmlDeviceGetUUID, mig)),
                "name": _text(_query(mig_errors, "name", nvml.nvmlDeviceGetName, mig)),
                "memory": _read_memory(nvml, mig, mig_errors, "memory"),
                "gpu_instance_id": _optional_int(
                    _query(mig_errors, "gpu_instance_id", nvml.nvmlDeviceGetGpuInstanceId, mig)
                ),
                "compute_instance_id": _optional_int(
                    _query(
                        mig_errors, "compute_instance_id", nvml.nvmlDeviceGetComputeInstanceId, mig
                    )
                ),
                "slice_count": _optional_int(getattr(attrs, "gpuInstanceSliceCount", None)),
                "multiprocessor_count": _optional_int(getattr(attrs, "multiprocessorCount", None)),
                "errors": mig_errors,
            }
        )
    return devices


def _read_gpu(nvml: ModuleType, index: int) -> dict[str, Any]:
    errors: dict[str, str] = {}
    gpu: dict[str, Any] = {"index": index, "errors": errors}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # a lost GPU must not hide the others
        errors["handle"] = _error_text(exc)
        return gpu

    gpu["uuid"] = _text(_query(errors, "uuid", nvml.nvmlDeviceGetUUID, handle))
    gpu["name"] = _text(_query(errors, "name", nvml.nvmlDeviceGetName, handle))
    gpu["pci_bus_id"] = None
    pci = _query(errors, "pci_info", nvml.nvmlDeviceGetPciInfo, handle)
    if pci is not None:
        gpu["pci_bus_id"] = _text(getattr(pci, "busId", None))
    gpu["memory"] = _read_memory(nvml, handle, errors, "memory")

    util = _query(errors, "utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
    gpu["utilization"] = (
        None
        if util is None
        else {
            "gpu": _optional_int(getattr(util, "gpu", None)),
            "memory": _optional_int(getattr(util, "memory", None)),
        }
    )
    gpu["temperature_c"] = _optional_int(
        _query(
            errors,
            "temperature",
            nvml.nvmlDeviceGetTemperature,
            handle,
            getattr(nvml, "NVML_TEMPERATURE_GPU", 0),
        )
    )
    gpu["power_mw"] = _optional_int(_query(errors, "power", nvml.nvmlDeviceGetPowerUsage, handle))
    gpu["power_limit_mw"] = _optional_int(
        _query(errors, "power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    )
    cc = _query(errors, "compute_capability", nvml.nvmlDeviceGetCudaComputeCapability, handle)
    gpu["compute_capability"] = list(cc) if cc is not None else None

    mig_mode = _query(errors, "mig_mode", nvml.nvmlDeviceGetMigMode, handle)
    if mig_mode is None:
        gpu["mig_mode"] = None
    else:
        current, pending = (list(mig_mode) + [None, None])[:2]
        gpu["mig_mode"] = {"current": _optional_int(current), "pending": _optional_int(pending)}
    enabled = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
    if gpu["mig_mode"] and gpu["mig_mode"]["current"] == enabled:
        gpu["mig_devices"] = _read_mig_devices(nvml, handle, errors)
    else:
        gpu["mig_devices"] = []
    gpu["processes"] = _read_processes(nvml, handle, errors)
    words = max(1, -(-(os.cpu_count() or 1) // 64))  # NVML's mask: 64 cores per word
    affinity = getattr(nvml, "nvmlDeviceGetCpuAffinity", None)  # absent from old pynvml
    mask = None if affinity is None else _query(errors, "cpu_affinity", affinity, handle, words)
    if mask is not None:
        gpu["cpu_affinity"] = cpus_of_mask([int(word) for word in mask])
    return gpu


@contextlib.contextmanager
def _nvml_session(nvml: ModuleType | None) -> Iterator[ModuleType]:
    """NVML initialised for the block (``nvml`` defaults to the ``pynvml`` module), shut down
    after it. Raises ``NvmlUnavailable`` when NVML cannot be imported or initialised."""
    if nvml is None:
        try:
            import pynvml  # optional dependency, only on GPU hosts
        except ImportError as exc:
            raise NvmlUnavailable(f"pynvml is not installed: {exc}") from exc
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NvmlUnavailable(f"NVML could not be initialised: {_error_text(exc)}") from exc
    try:
        yield nvml
    finally:
        # Nothing useful can be done if shutdown fails.
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def read_process_memory(index: int = 0, nvml: ModuleType | None = None) -> dict[int, int | None]:
    """The processes on GPU ``index`` and the memory NVML counts for each (None where it cannot
    tell): its compute processes and the MPS clients, which NVML lists apart from them."""
    with _nvml_session(nvml) as nvml:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        errors: dict[str, str] = {}
        listed: dict[int, int | None] = {}
        for query in (nvml.nvmlDeviceGetComputeRunningProcesses,
                      getattr(nvml, "nvmlDeviceGetMPSComputeRunningProcesses", None)):
            if query is None:  # an old pynvml
                continue
            for proc in _read_processes(nvml, handle, errors, query) or []:
                if proc["pid"] is not None:
                    listed[proc["pid"]] = proc["used_memory"]
        return listed


def read_nvml(nvml: ModuleType | None = None) -> dict[str, Any]:
    """Read every GPU on this host through NVML; return a raw, JSON-serializable snapshot.

    ``nvml`` defaults to the ``pynvml`` module; tests pass a stand-in. Raises ``NvmlUnavailable``
    when NVML cannot be imported or initialised. Only reads: no setting is ever changed.
    """
    with _nvml_session(nvml) as nvml:
        errors: dict[str, str] = {}
        snapshot: dict[str, Any] = {
            "schema": SNAPSHOT_SCHEMA,
            "source": "nvml",
            "taken_at": time.time(),
            "hostname": socket.gethostname(),
            "driver_version": _text(
                _query(errors, "driver_version", nvml.nvmlSystemGetDriverVersion)
            ),
            "nvml_version": _text(_query(errors, "nvml_version", nvml.nvmlSystemGetNVMLVersion)),
            "cuda_driver_version": _optional_int(
                _query(errors, "cuda_driver_version", nvml.nvmlSystemGetCudaDriverVersion)
            ),
            "errors": errors,
        }
        count = int(nvml.nvmlDeviceGetCount())
        snapshot["device_count"] = count
        snapshot["gpus"] = [_read_gpu(nvml, index) for index in range(count)]
        return snapshot


# --------------------------------------------------------------------------------------------
# Parsing a snapshot
# --------------------------------------------------------------------------------------------


def _mig_profile(name: str | None) -> str | None:
    """``"NVIDIA H100 80GB HBM3 MIG 1g.10gb"`` -> ``"1g.10gb"``."""
    if not name:
        return None
    match = _MIG_PROFILE_RE.search(name)
    return match.group(1) if match else None


def _as_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def parse_snapshot(snapshot: dict[str, Any]) -> list[GpuInfo]:
    """Turn a ``read_nvml()`` snapshot (possibly loaded back from JSON) into ``GpuInfo`` objects.

    Missing or ``None`` fields stay ``None``; a GPU whose handle could not be obtained is kept
    (with ``uuid`` ``None`` and its error) so the console can show it as unreadable.
    """
    schema = snapshot.get("schema", SNAPSHOT_SCHEMA)
    if schema != SNAPSHOT_SCHEMA:
        raise ValueError(f"unsupported NVML snapshot schema {schema!r}; expected {SNAPSHOT_SCHEMA}")
    gpus: list[GpuInfo] = []
    for raw in snapshot.get("gpus") or []:
        memory = raw.get("memory") or {}
        util = raw.get("utilization") or {}
        mig_mode = raw.get("mig_mode") or {}
        power_mw = raw.get("power_mw")
        limit_mw = raw.get("power_limit_mw")
        cc = raw.get("compute_capability")
        migs = []
        for mig in raw.get("mig_devices") or []:
            mig_memory = mig.get("memory") or {}
            migs.append(
                MigDeviceInfo(
                    index=int(mig["index"]),
                    uuid=mig.get("uuid"),
                    profile=_mig_profile(mig.get("name")),
                    memory_total_bytes=mig_memory.get("total"),
                    memory_used_bytes=mig_memory.get("used"),
                    gpu_instance_id=mig.get("gpu_instance_id"),
                    compute_instance_id=mig.get("compute_instance_id"),
                    slice_count=mig.get("slice_count"),
                    multiprocessor_count=mig.get("multiprocessor_count"),
                )
            )
        procs = [
            GpuProcessInfo(
                pid=int(p["pid"]),
                used_memory_bytes=p.get("used_memory"),
                gpu_instance_id=p.get("gpu_instance_id"),
                compute_instance_id=p.get("compute_instance_id"),
            )
            for p in raw.get("processes") or []
            if p.get("pid") is not None
        ]
        gpus.append(
            GpuInfo(
                index=int(raw["index"]),
                uuid=raw.get("uuid"),
                name=raw.get("name"),
                memory_total_bytes=memory.get("total"),
                memory_used_bytes=memory.get("used"),
                memory_free_bytes=memory.get("free"),
                utilization_gpu_pct=util.get("gpu"),
                utilization_memory_pct=util.get("memory"),
                temperature_c=raw.get("temperature_c"),
                power_w=None if power_mw is None else power_mw / 1000.0,
                power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
                pci_bus_id=raw.get("pci_bus_id"),
                compute_capability=None if not cc else ".".join(str(part) for part in cc),
                mig_mode_current=_as_bool(mig_mode.get("current")),
                mig_mode_pending=_as_bool(mig_mode.get("pending")),
                mig_devices=migs,
                processes=procs,
                cpu_affinity=[int(c) for c in raw.get("cpu_affinity") or []],
                declared=False,
                errors=dict(raw.get("errors") or {}),
            )
        )
    return gpus


# --------------------------------------------------------------------------------------------
# Declared inventory
# --------------------------------------------------------------------------------------------


def declared_inventory(spec: str, host: str = "") -> list[GpuInfo]:
    """Build ``GpuInfo`` objects (``declared=True``) from a configuration string.

    The format is ``fleetspec.parse_gpus``'s: comma-separated entries, each one of

    - ``COUNTxSIZE`` or ``COUNTxNAME:SIZE``: COUNT GPUs with the next free indexes,
      e.g. ``"2x24GiB"`` or ``"4xNVIDIA A100 80GB:80GiB"``;
    - ``INDEX:NAME:SIZE``: one GPU at that index, e.g. ``"0:NVIDIA L4:24GiB"``;

    optionally followed by MIG devices in brackets (``"0:NVIDIA A100 80GB:80GiB[3g.40gb,
    3g.40gb]"``), which puts the GPU in MIG mode with those devices.

    UUIDs are synthetic (``declared-<host>-<index>``, a MIG device's ``...-<index>-mig-<n>``), so
    pass ``host`` to keep them unique across nodes. Raises ``ValueError`` with the offending
    entry for anything else, for duplicate indexes, and for an empty spec.
    """
    return declared_gpu_infos(parse_gpus(spec), host)


def declared_gpu_infos(gpus: list[DeclaredGpu], host: str = "") -> list[GpuInfo]:
    """``GpuInfo`` objects for GPUs already parsed by ``fleetspec``."""
    prefix = f"declared-{host}-" if host else "declared-"
    return [
        GpuInfo(
            index=gpu.index,
            uuid=f"{prefix}{gpu.index}",
            name=gpu.name,
            memory_total_bytes=gpu.memory_total_bytes,
            memory_used_bytes=0,
            memory_free_bytes=gpu.memory_total_bytes,
            mig_mode_current=bool(gpu.migs),
            mig_mode_pending=bool(gpu.migs),
            mig_devices=[
                MigDeviceInfo(
                    index=n,
                    uuid=f"{prefix}{gpu.index}-mig-{n}",
                    profile=mig.profile,
                    memory_total_bytes=mig.memory_total_bytes,
                    memory_used_bytes=0,
                    gpu_instance_id=n + 1,
                    slice_count=mig.slices,
                )
                for n, mig in enumerate(gpu.migs)
            ],
            declared=True,
        )
        for gpu in gpus
    ]


# --------------------------------------------------------------------------------------------
# CPU lists (the kernel's "0-7,16-23" form): engines are pinned to the cores nearest their GPU
# --------------------------------------------------------------------------------------------


def cpus_of_mask(words: list[int]) -> list[int]:
    """The cores set in NVML's CPU affinity mask (64 cores per word, lowest word first)."""
    return [index * 64 + bit for index, word in enumerate(words) for bit in range(64)
            if word >> bit & 1]


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``; a clear ``ValueError`` for anything else."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part!r} is not a core number or range (e.g. 0-7,16-23).")
        low, high = int(first), int(last or first)
        if high < low or high > 4095:
            raise ValueError(f"{part!r} is not a valid range of cores.")
        cores.update(range(low, high + 1))
    if not cores:
        raise ValueError("Give at least one core, e.g. 0-7.")
    return sorted(cores)


def cpulist_text(cores: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (what ``taskset -c`` and the kernel write)."""
    ranges: list[str] = []
    ordered = sorted(set(cores))
    start = previous = None
    for core in [*ordered, None]:
        if core is not None and previous is not None and core == previous + 1:
            previous = core
            continue
        if start is not None:
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = core
    return ",".join(ranges)
