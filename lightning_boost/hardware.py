"""What the machine is, as plain data: every tuning decision is a function of a `HardwareInfo`.

`HardwareInfo.detect()` reads the real machine once; decisions and tests take a `HardwareInfo`
built by hand (see `EXAMPLES` for a CPU box, a T4, a V100, an 8×A100 node and an H100).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from lightning_boost._validation import Count, PositiveInt, Range, unknown_choice_error, validated

#: The devices training can run on.
Accelerator = Literal["cuda", "mps", "cpu"]
_Bytes = Annotated[int, Range(ge=0)]
_Capability = tuple[Annotated[int, Range(ge=1)], Count]

GIB = 1024**3
MIB = 1024**2

# Environment variables that launchers set, in the order they are trusted.
_LOCAL_WORLD_SIZE_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")
_NODE_COUNT_VARS = ("GROUP_WORLD_SIZE", "SLURM_NNODES", "NUM_NODES", "PET_NNODES")


@validated
@dataclass(frozen=True)
class HardwareInfo:
    """Everything lightning-boost's decisions depend on, as immutable plain data.

    Args:
        accelerator: ``"cuda"``, ``"mps"`` or ``"cpu"``: the device training would run on.
        device_names: one name per visible accelerator device (empty on CPU).
        compute_capabilities: CUDA compute capability per device, e.g. ``(8, 0)`` for an A100.
        device_memory_bytes: total memory per device.
        supports_bf16: the device computes in bfloat16 at full speed (CUDA capability >= 8.0).
        supports_tf32: TensorFloat-32 matmuls are available (CUDA capability >= 8.0).
        cpu_supports_bf16: the CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX), so
            bf16 autocast can speed up a CPU run (for some models; see `auto_precision`).
        cpus_available: CPUs this process may run on (affinity and cgroup quota).
        cpu_count: CPUs in the machine (``os.cpu_count()``), for reference only.
        ram_total_bytes: physical memory, ``None`` where unknown.
        ram_available_bytes: memory available for new allocations, ``None`` where unknown.
        local_world_size: training processes on this node when launched distributed, else 1.
        node_count: nodes in the run when launched distributed, else 1.
        shm_bytes: size of ``/dev/shm`` (DataLoader workers share batches through it).
        open_files_limit: the soft ``RLIMIT_NOFILE`` of this process.
        open_files_hard_limit: the hard ``RLIMIT_NOFILE``, which the soft one may be raised to.
        torch_version: ``torch.__version__``.
        cuda_version: the CUDA version torch was built with, ``None`` for a CPU-only build.
        cudnn_version: cuDNN version as an int (e.g. ``90100``), ``None`` when unavailable.
        nccl_version: NCCL version string, ``None`` when unavailable.
        nccl_available: ``torch.distributed`` has the NCCL backend.
        cpu_only_build: torch was built without CUDA or ROCm.
        nvidia_driver_present: an NVIDIA driver is visible (``nvidia-smi`` or
            ``/proc/driver/nvidia``), whatever torch thinks.
        cuda_error: why CUDA is unusable when torch has CUDA and a driver is present but
            ``torch.cuda.is_available()`` is false.
        unused_gpus: CUDA devices this machine has that the run leaves idle (a Trainer pinned to
            the CPU: `on_cpu`).

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> EXAMPLES["a100x8"].supports_bf16, EXAMPLES["t4"].supports_bf16
        (True, False)
    """

    accelerator: Accelerator
    device_names: tuple[str, ...] = ()
    compute_capabilities: tuple[_Capability, ...] = ()
    device_memory_bytes: tuple[_Bytes, ...] = ()
    supports_bf16: bool = False
    supports_tf32: bool = False
    cpu_supports_bf16: bool = False
    cpus_available: PositiveInt = 1
    cpu_count: PositiveInt = 1
    ram_total_bytes: _Bytes | None = None
    ram_available_bytes: _Bytes | None = None
    local_world_size: PositiveInt = 1
    node_count: PositiveInt = 1
    shm_bytes: _Bytes | None = None
    open_files_limit: Count | None = None
    open_files_hard_limit: Count | None = None
    torch_version: str = ""
    cuda_version: str | None = None
    cudnn_version: Count | None = None
    nccl_version: str | None = None
    nccl_available: bool = False
    cpu_only_build: bool = True
    nvidia_driver_present: bool = False
    cuda_error: str | None = None
    unused_gpus: Count = 0

    def __post_init__(self) -> None:
        per_device = (len(self.compute_capabilities), len(self.device_memory_bytes))
        if self.accelerator == "cuda" and per_device != (self.device_count, self.device_count):
            raise ValueError(
                "`compute_capabilities` and `device_memory_bytes` expected one entry per device in"
                f" `device_names` ({self.device_count}), got {per_device[0]} and {per_device[1]}."
            )

    @property
    def device_count(self) -> int:
        """Number of accelerator devices visible to this process (0 on CPU)."""
        return len(self.device_names)

    @property
    def is_cuda(self) -> bool:
        return self.accelerator == "cuda"

    @property
    def min_compute_capability(self) -> tuple[int, int] | None:
        """The lowest capability over the devices: what every device can do."""
        return min(self.compute_capabilities) if self.compute_capabilities else None

    @property
    def min_device_memory_bytes(self) -> int | None:
        """The smallest device's memory: what a per-device decision must fit in."""
        return min(self.device_memory_bytes) if self.device_memory_bytes else None

    @property
    def processes_per_node(self) -> int:
        """Training processes sharing this node's CPUs: the launcher's count, else one per device."""
        if self.local_world_size > 1:
            return self.local_world_size
        return max(self.device_count, 1)

    @property
    def cpus_per_process(self) -> int:
        """CPUs each training process can count on: available CPUs // processes on this node."""
        return max(self.cpus_available // self.processes_per_node, 1)

    @property
    def max_workers_per_process(self) -> int:
        """DataLoader workers the CPU budget allows: one per CPU, less the training process's own."""
        return max(self.cpus_per_process - 1, 0)

    @property
    def is_multi_node(self) -> bool:
        return self.node_count > 1

    def replace(self, **changes: object) -> HardwareInfo:
        """A copy with some fields changed, e.g. ``hw.replace(local_world_size=2)``."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def on_cpu(self) -> HardwareInfo:
        """This machine as a run on its CPU sees it: no accelerator devices, the CPUs and limits
        as they are. For ``preset("auto", hardware=HardwareInfo.detect().on_cpu())`` beside a
        Trainer with ``accelerator="cpu"`` on a GPU machine.

        Example:
            >>> from lightning_boost.hardware import EXAMPLES
            >>> cpu = EXAMPLES["h100"].on_cpu()
            >>> cpu.accelerator, cpu.device_count, cpu.unused_gpus, cpu.supports_bf16, cpu.cpus_available
            ('cpu', 0, 1, False, 16)
        """
        return self.replace(
            accelerator="cpu",
            device_names=(),
            compute_capabilities=(),
            device_memory_bytes=(),
            supports_bf16=False,
            supports_tf32=False,
            unused_gpus=self.device_count if self.is_cuda else self.unused_gpus,
        )

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-ready dict (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def example(cls, name: str) -> HardwareInfo:
        """A named, made-up machine from `EXAMPLES`, for tests and for trying decisions.

        Raises:
            ValueError: for an unknown name, listing the close matches and every name.
        """
        if name not in EXAMPLES:
            raise unknown_choice_error("name", name, EXAMPLES)
        return EXAMPLES[name]

    @classmethod
    def detect(cls) -> HardwareInfo:
        """Read the real machine: devices, CPUs, memory, limits and library versions."""
        import torch

        devices = _cuda_devices() if torch.cuda.is_available() else []
        accelerator: Accelerator
        if devices:
            accelerator = "cuda"
        elif _mps_available():
            accelerator = "mps"
        else:
            accelerator = "cpu"
        capabilities = tuple(d[1] for d in devices)
        ampere = bool(capabilities) and min(capabilities) >= (8, 0)
        soft, hard = _open_files_limits()
        ram_total, ram_available = ram(_meminfo(), cgroup_memory(Path("/sys/fs/cgroup")))
        return cls(
            accelerator=accelerator,
            device_names=tuple(d[0] for d in devices),
            compute_capabilities=capabilities,
            device_memory_bytes=tuple(d[2] for d in devices),
            supports_bf16=ampere,
            supports_tf32=ampere,
            cpu_supports_bf16=_cpu_bf16(),
            cpus_available=available_cpus(),
            cpu_count=os.cpu_count() or 1,
            ram_total_bytes=ram_total,
            ram_available_bytes=ram_available,
            local_world_size=_first_int_env(_LOCAL_WORLD_SIZE_VARS),
            node_count=_first_int_env(_NODE_COUNT_VARS),
            shm_bytes=_disk_size("/dev/shm"),
            open_files_limit=soft,
            open_files_hard_limit=hard,
            torch_version=torch.__version__,
            cuda_version=torch.version.cuda,
            cudnn_version=_cudnn_version(),
            nccl_version=_nccl_version(),
            nccl_available=_nccl_available(),
            cpu_only_build=torch.version.cuda is None and torch.version.hip is None,
            nvidia_driver_present=nvidia_driver_present(),
            cuda_error=_cuda_error(),
        )


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (containers)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity mask
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(Path("/sys/fs/cgroup"))
    return max(min(count, quota) if quota else count, 1)


def cgroup_cpu_quota(root: Path) -> int | None:
    """CPUs granted by a cgroup v2 ``cpu.max`` (or v1 cfs quota) under `root`, rounded up."""
    try:
        v2 = root / "cpu.max"
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else math.ceil(int(quota) / int(period))
        v1 = root / "cpu" / "cpu.cfs_quota_us"
        if v1.exists():
            quota_us = int(v1.read_text())
            period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
            return None if quota_us <= 0 else math.ceil(quota_us / period_us)
    except (OSError, ValueError):
        return None
    return None


def cgroup_memory(root: Path) -> tuple[int | None, int | None]:
    """``(limit, usage)`` in bytes of a cgroup v2 ``memory.max`` (or v1 ``limit_in_bytes``)
    under `root`; ``(None, None)`` without a limit (v1 writes "no limit" as a huge number)."""
    try:
        if (root / "memory.max").exists():
            limit = (root / "memory.max").read_text().strip()
            usage = root / "memory.current"
        elif (root / "memory" / "memory.limit_in_bytes").exists():
            limit = (root / "memory" / "memory.limit_in_bytes").read_text().strip()
            usage = root / "memory" / "memory.usage_in_bytes"
        else:
            return None, None
        if limit == "max" or int(limit) >= 1 << 60:
            return None, None
        return int(limit), int(usage.read_text()) if usage.exists() else None
    except (OSError, ValueError):
        return None, None


def ram(
    meminfo: tuple[int | None, int | None], cgroup: tuple[int | None, int | None]
) -> tuple[int | None, int | None]:
    """``(total, available)`` RAM for this process: the machine's, within a container's limit
    (as `available_cpus` honours its CPU quota), so a budget never counts memory it cannot have.

    Example:
        >>> ram((64 * GIB, 60 * GIB), (8 * GIB, 3 * GIB))[1] // GIB  # 8 GiB limit, 3 GiB in use
        5
        >>> ram((64 * GIB, 60 * GIB), (None, None))[1] // GIB
        60
    """
    total, available = meminfo
    limit, usage = cgroup
    if limit is None:
        return total, available
    room = max(limit - (usage or 0), 0)
    return (
        min(total, limit) if total is not None else limit,
        min(available, room) if available is not None else room,
    )


def nvidia_driver_present() -> bool:
    """An NVIDIA driver is installed, whether or not torch can use it."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def _cuda_devices() -> list[tuple[str, tuple[int, int], int]]:
    import torch

    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append((props.name, (props.major, props.minor), props.total_memory))
    return devices


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _cuda_error() -> str | None:
    import torch

    if torch.version.cuda is None or not nvidia_driver_present():
        return None
    try:
        torch.cuda.init()
    except Exception as err:  # torch raises RuntimeError/AssertionError variants here
        return str(err).strip() or type(err).__name__
    return None


def _cudnn_version() -> int | None:
    import torch

    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError:
        return None


def _nccl_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


def _nccl_version() -> str | None:
    import torch

    if not _nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def _open_files_limits() -> tuple[int | None, int | None]:
    try:
        import resource
    except ImportError:  # Windows
        return None, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    return (None if soft == infinite else soft), (None if hard == infinite else hard)


def _cpu_bf16() -> bool:
    """The CPU has AVX512-BF16 or AMX tiles (torch's own checks, private: ``False`` without them)."""
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    except Exception:  # a private check that changed: no bf16 claimed
        return False


def _disk_size(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


def _meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int | None, int | None]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None, None
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * 1024  # /proc/meminfo reports kB
    return values.get("MemTotal"), values.get("MemAvailable")


def _first_int_env(names: tuple[str, ...], environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    for name in names:
        value = environ.get(name, "")
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return 1


def _cuda_box(
    name: str, capability: tuple[int, int], memory: int, count: int, cpus: int, **extra: object
) -> HardwareInfo:
    ampere = capability >= (8, 0)
    fields: dict[str, object] = dict(
        accelerator="cuda",
        device_names=(name,) * count,
        compute_capabilities=(capability,) * count,
        device_memory_bytes=(memory,) * count,
        supports_bf16=ampere,
        supports_tf32=ampere,
        cpus_available=cpus,
        cpu_count=cpus,
        ram_total_bytes=max(64, 16 * count) * GIB,
        ram_available_bytes=max(56, 14 * count) * GIB,
        shm_bytes=max(16, 8 * count) * GIB,
        open_files_limit=65536,
        open_files_hard_limit=65536,
        torch_version="2.14.1",
        cuda_version="13.0",
        cudnn_version=91300,
        nccl_version="2.27.7",
        nccl_available=True,
        cpu_only_build=False,
        nvidia_driver_present=True,
    )
    fields.update(extra)
    return HardwareInfo(**fields)  # type: ignore[arg-type]


def _cpu_box(cpus: int, ram_gib: int, **extra: object) -> HardwareInfo:
    fields: dict[str, object] = dict(
        accelerator="cpu",
        cpus_available=cpus,
        cpu_count=cpus,
        ram_total_bytes=ram_gib * GIB,
        ram_available_bytes=ram_gib * 7 // 8 * GIB,
        shm_bytes=ram_gib // 2 * GIB,
        open_files_limit=65536,
        open_files_hard_limit=65536,
        torch_version="2.14.1",
        nccl_available=False,
        cpu_only_build=True,
    )
    fields.update(extra)
    return HardwareInfo(**fields)  # type: ignore[arg-type]


#: Named made-up machines, for tests and for trying a decision without the hardware.
EXAMPLES: dict[str, HardwareInfo] = {
    "cpu": _cpu_box(8, 32),
    "cpu-bf16": _cpu_box(16, 64, cpu_supports_bf16=True),  # Sapphire Rapids or Zen 4: bf16 dot products
    "t4": _cuda_box("Tesla T4", (7, 5), 15_637_086_208, 1, 4),
    "v100": _cuda_box("Tesla V100-SXM2-16GB", (7, 0), 16_935_682_048, 1, 8),
    "a100x8": _cuda_box("NVIDIA A100-SXM4-80GB", (8, 0), 85_097_971_712, 8, 96),
    "h100": _cuda_box("NVIDIA H100 80GB HBM3", (9, 0), 85_045_379_072, 1, 16),
    "h100x8": _cuda_box("NVIDIA H100 80GB HBM3", (9, 0), 85_045_379_072, 8, 192),
    "h100x8-2nodes": _cuda_box(
        "NVIDIA H100 80GB HBM3", (9, 0), 85_045_379_072, 8, 192, local_world_size=8, node_count=2
    ),
}
