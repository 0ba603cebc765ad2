import json
import math
from pathlib import Path

import pytest
import torch

from lightning_boost.hardware import (
    EXAMPLES,
    GIB,
    HardwareInfo,
    _first_int_env,
    _meminfo,
    cgroup_cpu_quota,
    cgroup_memory,
    ram,
)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_are_consistent(name: str) -> None:
    hw = HardwareInfo.example(name)
    assert hw is EXAMPLES[name]
    assert hw.cpus_per_process >= 1
    if hw.is_cuda:
        assert hw.device_count >= 1 and not hw.cpu_only_build
        assert hw.supports_bf16 == (hw.min_compute_capability >= (8, 0))
    else:
        assert hw.device_count == 0 and hw.min_device_memory_bytes is None


@pytest.mark.parametrize(
    ("name", "devices", "capability", "bf16", "per_process"),
    [
        ("cpu", 0, None, False, 8),
        ("t4", 1, (7, 5), False, 4),
        ("v100", 1, (7, 0), False, 8),
        ("a100x8", 8, (8, 0), True, 12),
        ("h100", 1, (9, 0), True, 16),
        ("h100x8", 8, (9, 0), True, 24),
        ("h100x8-2nodes", 8, (9, 0), True, 24),
    ],
)
def test_example_figures(
    name: str, devices: int, capability: tuple[int, int] | None, bf16: bool, per_process: int
) -> None:
    hw = HardwareInfo.example(name)
    assert (hw.device_count, hw.min_compute_capability, hw.supports_bf16) == (devices, capability, bf16)
    assert hw.cpus_per_process == per_process
    assert hw.max_workers_per_process == per_process - 1


def test_unknown_example_lists_close_matches() -> None:
    with pytest.raises(
        ValueError, match=r"`name` expected one of .*'a100x8'.*got 'a100'. Did you mean 'a100x8'"
    ):
        HardwareInfo.example("a100")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"accelerator": "tpu"}, r"`accelerator` expected one of 'cuda', 'mps', 'cpu', got 'tpu'"),
        ({"cpus_available": 0}, r"`cpus_available` expected an int >= 1, got 0"),
        ({"node_count": 0}, r"`node_count` expected an int >= 1"),
        ({"device_memory_bytes": (1,)}, r"one entry per device in `device_names` \(8\), got 8 and 1"),
    ],
)
def test_bad_fields_raise(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EXAMPLES["a100x8"].replace(**changes)


def test_is_immutable_and_json_ready() -> None:
    hw = EXAMPLES["h100"]
    with pytest.raises(AttributeError):
        hw.accelerator = "cpu"  # type: ignore[misc]
    data = json.loads(json.dumps(hw.to_dict()))
    assert data["compute_capabilities"] == [[9, 0]]
    assert data["device_memory_bytes"] == [85_045_379_072] and data["accelerator"] == "cuda"


def test_launcher_counts_override_devices() -> None:
    # Two processes launched on an 8-GPU, 96-CPU node each get 48 CPUs, not 12.
    hw = EXAMPLES["a100x8"].replace(local_world_size=2)
    assert (hw.processes_per_node, hw.cpus_per_process) == (2, 48)


def test_detect_reads_this_machine() -> None:
    hw = HardwareInfo.detect()
    assert hw.torch_version == torch.__version__
    assert hw.accelerator == ("cuda" if torch.cuda.is_available() else hw.accelerator)
    assert hw.device_count == (torch.cuda.device_count() if hw.is_cuda else 0)
    assert 1 <= hw.cpus_available <= hw.cpu_count
    assert hw.cpu_only_build == (torch.version.cuda is None and torch.version.hip is None)
    if Path("/dev/shm").exists():
        assert hw.shm_bytes and hw.shm_bytes > 0
    if Path("/proc/meminfo").exists():
        assert hw.ram_total_bytes and hw.ram_available_bytes and hw.ram_available_bytes <= hw.ram_total_bytes


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: a second worker still gets time
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu.max": "garbage\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_cpu_quota(tmp_path: Path, files: dict[str, str], expected: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == expected


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"memory.max": "8589934592\n", "memory.current": "3221225472\n"}, (8 * GIB, 3 * GIB)),
        ({"memory.max": "max\n", "memory.current": "1\n"}, (None, None)),
        (
            {"memory/memory.limit_in_bytes": "4294967296\n", "memory/memory.usage_in_bytes": "0\n"},
            (4 * GIB, 0),
        ),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, (None, None)),  # v1's "no limit"
        ({"memory.max": "garbage\n"}, (None, None)),
        ({}, (None, None)),
    ],
)
def test_cgroup_memory(
    tmp_path: Path, files: dict[str, str], expected: tuple[int | None, int | None]
) -> None:
    # Simulated container files: the machine's RAM budget must stay within a container's limit,
    # as the CPU count already stays within its quota.
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_memory(tmp_path) == expected
    total, available = ram((64 * GIB, 60 * GIB), cgroup_memory(tmp_path))
    limit, usage = expected
    assert total == (limit if limit is not None else 64 * GIB)
    assert available == (limit - (usage or 0) if limit is not None else 60 * GIB)


def test_meminfo_parses_kilobytes(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       24683116 kB\nMemFree:   1 kB\nMemAvailable:   23960800 kB\n")
    assert _meminfo(path) == (24683116 * 1024, 23960800 * 1024)
    assert _meminfo(tmp_path / "missing") == (None, None)
    assert math.isclose(24683116 * 1024 / GIB, 23.54, abs_tol=0.01)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, 1),
        ({"LOCAL_WORLD_SIZE": "4"}, 4),
        ({"SLURM_NTASKS_PER_NODE": "8"}, 8),
        ({"SLURM_NTASKS_PER_NODE": "8(x2)", "LOCAL_WORLD_SIZE": "0"}, 1),
        ({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}, 2),
    ],
)
def test_local_world_size_from_launcher_env(environ: dict[str, str], expected: int) -> None:
    assert _first_int_env(("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"), environ) == expected
