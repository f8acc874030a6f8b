"""GPU inventory: the NVML snapshot parser on a real H200 read, error tolerance, declared GPUs.

The fixtures were recorded on the device tool's H200 by ``read_nvml()`` itself (see
docs/placement.md). The error-tolerance tests use a stand-in NVML module, because no host here has
a GPU that answers NotSupported; the stand-in raises the real ``pynvml`` error classes when the
package is installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving_app.placement.inventory import (
    GIB,
    NvmlUnavailable,
    declared_inventory,
    parse_size,
    parse_snapshot,
    read_nvml,
)

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_h200_snapshot_parses_to_one_gpu_with_its_memory_and_process():
    snapshot = load("h200_nvml.json")
    (gpu,) = parse_snapshot(snapshot)

    assert gpu.index == 0
    assert gpu.name == "NVIDIA H200"
    assert gpu.uuid == "GPU-4e1159e8-f3d6-41be-8b16-6125942d04c8"
    # nvidia-smi shows 143771MiB for the same GPU.
    assert gpu.memory_total_bytes == 143771 * 1024**2
    assert gpu.memory_used_bytes + gpu.memory_free_bytes == gpu.memory_total_bytes
    assert gpu.compute_capability == "9.0"
    assert gpu.pci_bus_id == "00000000:00:06.0"
    assert gpu.power_limit_w == 700.0
    assert 0 < gpu.power_w < 700
    assert 0 < gpu.temperature_c < 100
    assert gpu.utilization_gpu_pct == 0
    assert gpu.mig_mode_current is False and gpu.mig_mode_pending is False
    assert gpu.mig_devices == []
    assert gpu.declared is False
    assert gpu.errors == {}
    # The recording held a 4 GiB tensor in a PyTorch process while reading.
    (proc,) = gpu.processes
    assert proc.used_memory_bytes >= 4 * GIB
    assert proc.gpu_instance_id is None
    assert snapshot["driver_version"] == "580.159.04"


def test_idle_h200_snapshot_has_no_processes_and_little_memory_used():
    (gpu,) = parse_snapshot(load("h200_nvml_idle.json"))
    assert gpu.processes == []
    # NVML's v1 memory info counts the driver's reserved memory as used (~615 MiB on the H200).
    assert gpu.memory_used_bytes < 1 * GIB


def test_snapshot_survives_a_json_round_trip_and_to_dict():
    snapshot = load("h200_nvml.json")
    again = parse_snapshot(json.loads(json.dumps(snapshot)))
    assert again == parse_snapshot(snapshot)
    assert json.loads(json.dumps(again[0].to_dict()))["uuid"] == again[0].uuid


def test_unknown_snapshot_schema_is_rejected():
    with pytest.raises(ValueError, match="schema"):
        parse_snapshot({"schema": 99, "gpus": []})


def test_snapshot_with_missing_fields_parses_to_none():
    (gpu,) = parse_snapshot({"schema": 1, "gpus": [{"index": 3, "errors": {"handle": "Lost"}}]})
    assert gpu.index == 3
    assert gpu.uuid is None and gpu.memory_total_bytes is None and gpu.temperature_c is None
    assert gpu.errors == {"handle": "Lost"}


def _error_classes():
    try:
        import pynvml

        return pynvml.NVMLError_NotSupported, pynvml.NVMLError_NotFound
    except ImportError:  # pragma: no cover - nvidia-ml-py is a project dependency

        class NotSupported(Exception):
            pass

        class NotFound(Exception):
            pass

        return NotSupported, NotFound


def fake_nvml(*, mig: bool):
    """A stand-in NVML module: a MIG-enabled GPU where every optional query is unsupported."""
    not_supported, not_found = _error_classes()

    def unsupported(*_args):
        raise not_supported()

    migs = {
        0: ("MIG-aaaa", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40 * GIB, 1),
        1: ("MIG-bbbb", "NVIDIA A100-SXM4-80GB MIG 2g.20gb", 20 * GIB, 5),
    }

    def mig_handle(_gpu, index):
        if index not in migs:
            raise not_found()
        return ("mig", index)

    def memory(handle):
        if handle == "gpu0":
            return SimpleNamespace(total=80 * GIB, used=GIB, free=79 * GIB)
        return SimpleNamespace(total=migs[handle[1]][2], used=0, free=migs[handle[1]][2])

    return SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"550.54",  # old pynvml returned bytes
        nvmlSystemGetNVMLVersion=unsupported,
        nvmlSystemGetCudaDriverVersion=unsupported,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: "gpu0",
        nvmlDeviceGetUUID=lambda h: "GPU-fake" if h == "gpu0" else migs[h[1]][0],
        nvmlDeviceGetName=lambda h: "NVIDIA A100-SXM4-80GB" if h == "gpu0" else migs[h[1]][1],
        nvmlDeviceGetPciInfo=unsupported,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetUtilizationRates=unsupported,  # NotSupported under MIG
        nvmlDeviceGetTemperature=unsupported,
        nvmlDeviceGetPowerUsage=unsupported,
        nvmlDeviceGetEnforcedPowerLimit=unsupported,
        nvmlDeviceGetCudaComputeCapability=lambda h: (8, 0),
        nvmlDeviceGetMigMode=lambda h: (1, 1) if mig else (0, 0),
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
        nvmlDeviceGetAttributes=unsupported,
        nvmlDeviceGetGpuInstanceId=lambda h: migs[h[1]][3],
        nvmlDeviceGetComputeInstanceId=lambda h: 0,
        nvmlDeviceGetComputeRunningProcesses=unsupported,
        NVML_TEMPERATURE_GPU=0,
        NVML_DEVICE_MIG_ENABLE=1,
    )


def test_every_optional_query_failing_is_recorded_as_none():
    snapshot = read_nvml(fake_nvml(mig=False))
    json.dumps(snapshot)  # still serializable
    (gpu,) = parse_snapshot(snapshot)
    assert gpu.uuid == "GPU-fake"
    assert gpu.memory_total_bytes == 80 * GIB
    assert gpu.utilization_gpu_pct is None
    assert gpu.temperature_c is None
    assert gpu.power_w is None and gpu.power_limit_w is None
    assert gpu.processes == []
    assert "NVMLError_NotSupported" in gpu.errors["temperature"]
    assert snapshot["driver_version"] == "550.54"
    assert snapshot["nvml_version"] is None


def test_mig_devices_are_read_with_profile_memory_and_instance_id():
    (gpu,) = parse_snapshot(read_nvml(fake_nvml(mig=True)))
    assert gpu.mig_mode_current is True
    assert [
        (m.uuid, m.profile, m.memory_total_bytes, m.gpu_instance_id) for m in gpu.mig_devices
    ] == [
        ("MIG-aaaa", "3g.40gb", 40 * GIB, 1),
        ("MIG-bbbb", "2g.20gb", 20 * GIB, 5),
    ]


def test_nvml_that_cannot_initialise_raises_nvml_unavailable():
    def boom():
        raise OSError("NVML Shared Library Not Found")

    with pytest.raises(NvmlUnavailable, match="could not be initialised"):
        read_nvml(SimpleNamespace(nvmlInit=boom))


def test_declared_count_times_size():
    gpus = declared_inventory("2x24GiB", host="cpu-dev")
    assert [(g.index, g.uuid, g.memory_total_bytes) for g in gpus] == [
        (0, "declared-cpu-dev-0", 24 * GIB),
        (1, "declared-cpu-dev-1", 24 * GIB),
    ]
    assert all(g.declared and g.memory_free_bytes == 24 * GIB for g in gpus)


def test_declared_index_name_size_entries():
    gpus = declared_inventory("0:NVIDIA L4:24GiB,1:NVIDIA L4:24GiB")
    assert [(g.index, g.name, g.memory_total_bytes) for g in gpus] == [
        (0, "NVIDIA L4", 24 * GIB),
        (1, "NVIDIA L4", 24 * GIB),
    ]


def test_declared_count_with_name_and_mixed_entries():
    gpus = declared_inventory("2xNVIDIA A100 80GB:80GiB, 2:NVIDIA L4:24GB")
    assert [(g.index, g.name) for g in gpus] == [
        (0, "NVIDIA A100 80GB"),
        (1, "NVIDIA A100 80GB"),
        (2, "NVIDIA L4"),
    ]
    assert gpus[2].memory_total_bytes == 24 * 10**9


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty GPU declaration"),
        ("2x", "invalid GPU declaration entry"),
        ("2x24", "invalid memory size"),
        ("0x24GiB", "at least 1"),
        ("twoGPUs", "invalid GPU declaration entry"),
        ("0:L4:24GiB,0:L4:24GiB", "declared twice"),
        ("a:L4:24GiB", "GPU index must be"),
        ("1x24GiB,,", "empty entry"),
        ("1x0GiB", "greater than zero"),
    ],
)
def test_invalid_declarations_raise_value_error_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        declared_inventory(spec)


def test_parse_size_units():
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 GiB") == 3 * 2**29
    assert parse_size("512MiB") == 512 * 2**20
