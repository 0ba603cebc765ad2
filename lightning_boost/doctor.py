"""`lightning-boost doctor`: the environment checks fast-training guides start with, as a tool.

Each check is a plain function ``HardwareInfo -> list[Finding]``, so every branch is tested on
made-up hardware. `run_checks` runs them all; a finding of severity ``error`` is a FAIL.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

from lightning_boost.hardware import GIB, MIB, HardwareInfo
from lightning_boost.precision import auto_precision
from lightning_boost.report import Area, Finding, Report, Severity

#: DataLoader workers hand batches over in /dev/shm; below this, a few workers fill it.
MIN_SHM_BYTES = 1 * GIB
#: Each batch a worker shares holds file descriptors; Linux's common default (1024) runs out.
MIN_OPEN_FILES = 4096

_INSTALL_HINT = (
    "reinstall torch as a CUDA build matching your driver: `pip install --force-reinstall torch`"
    " with the CUDA index URL the PyTorch install selector gives for your CUDA version"
)

Check = Callable[[HardwareInfo], list[Finding]]


def _finding(
    area: Area,
    severity: str,
    title: str,
    detail: str = "",
    fix: str = "",
    data: dict[str, object] | None = None,
) -> Finding:
    return Finding("doctor", area, Severity(severity), title, detail, fix, data=data or {})


def check_gpu(hw: HardwareInfo) -> list[Finding]:
    """FAIL when an NVIDIA GPU is visible but this torch cannot use it."""
    if hw.is_cuda:
        return [
            _finding(
                "environment",
                "info",
                f"CUDA in use: {hw.device_count} GPU(s)",
                f"torch {hw.torch_version}, CUDA {hw.cuda_version}, cuDNN {hw.cudnn_version}",
            )
        ]
    if hw.unused_gpus:
        return [
            _finding(
                "environment",
                "warn",
                f"{hw.unused_gpus} GPU(s) here, but this run trains on the CPU",
                "The Trainer was told `accelerator='cpu'`: the GPUs stay idle.",
                "Leave out `accelerator='cpu'` (or pass `accelerator='gpu'`) to train on them.",
            )
        ]
    if hw.nvidia_driver_present and hw.cpu_only_build:
        return [
            _finding(
                "environment",
                "error",
                "An NVIDIA GPU is visible but torch is a CPU-only build",
                f"torch {hw.torch_version} was built without CUDA, so training runs on the CPU.",
                _INSTALL_HINT,
            )
        ]
    if hw.nvidia_driver_present:
        return [
            _finding(
                "environment",
                "error",
                "An NVIDIA GPU is visible but CUDA is unusable",
                hw.cuda_error or f"torch {hw.torch_version} (CUDA {hw.cuda_version}) sees no device.",
                "check `nvidia-smi` and CUDA_VISIBLE_DEVICES; a driver older than the CUDA"
                f" {hw.cuda_version} that torch was built with needs a driver update or "
                + _INSTALL_HINT.replace("matching your driver", "for an older CUDA"),
            )
        ]
    if hw.accelerator == "mps":
        return [_finding("environment", "info", "Apple GPU (MPS) in use", f"torch {hw.torch_version}")]
    build = "CPU-only build" if hw.cpu_only_build else f"CUDA {hw.cuda_version} build"
    return [
        _finding(
            "environment",
            "info",
            "No GPU visible: training runs on the CPU",
            f"torch {hw.torch_version} ({build}); no NVIDIA driver found.",
        )
    ]


def check_devices(hw: HardwareInfo) -> list[Finding]:
    """Each CUDA device's name, capability and memory; which precision fits; TF32."""
    precision = auto_precision(hw)
    if not hw.is_cuda:
        why = (
            "this CPU has bf16 dot products (AVX512-BF16 or AMX): preset('auto') times bf16 autocast"
            " against fp32 on a copy of the model before training and keeps the faster."
            if precision == "bf16-mixed"
            else "no CUDA device and no bf16 dot products on this CPU: mixed precision would slow training."
        )
        return [
            _finding(
                "precision and strategy",
                "info",
                "precision 'bf16-mixed' where it steps faster than fp32 on this CPU, timed on your model"
                if precision == "bf16-mixed"
                else f"precision {precision!r} fits this machine",
                why,
                data={"precision": precision},
            )
        ]
    findings = []
    for index, (name, cap, memory) in enumerate(
        zip(hw.device_names, hw.compute_capabilities, hw.device_memory_bytes, strict=True)
    ):
        findings.append(
            _finding(
                "environment",
                "info",
                f"cuda:{index} {name}",
                f"compute capability {cap[0]}.{cap[1]}, {memory / GIB:.1f} GiB",
            )
        )
    why = (
        "bf16 has fp32's range: no loss scaling, no overflow NaNs"
        if hw.supports_bf16
        else "no fast bf16 before compute capability 8.0: fp16 with Lightning's gradient scaler"
    )
    tf32 = "TF32 matmuls available" if hw.supports_tf32 else "no TF32 (capability < 8.0)"
    findings.append(
        _finding(
            "precision and strategy",
            "info",
            f"precision {precision!r} fits these GPUs",
            f"{why}; {tf32}.",
            f"Trainer(precision={precision!r})",
            data={"precision": precision, "tf32": hw.supports_tf32},
        )
    )
    return findings


def check_shm(hw: HardwareInfo) -> list[Finding]:
    """WARN when /dev/shm is too small for DataLoader workers (Docker's default is 64 MB)."""
    if hw.shm_bytes is None:
        return [
            _finding("data", "info", "/dev/shm not found", "not Linux: workers share memory another way.")
        ]
    size = f"{hw.shm_bytes / MIB:.0f} MiB" if hw.shm_bytes < GIB else f"{hw.shm_bytes / GIB:.1f} GiB"
    if hw.shm_bytes >= MIN_SHM_BYTES:
        return [_finding("data", "info", f"/dev/shm is {size}", data={"shm_bytes": hw.shm_bytes})]
    return [
        _finding(
            "data",
            "warn",
            f"/dev/shm is only {size}",
            "DataLoader workers pass batches through shared memory; when it fills they die"
            " with 'bus error' or 'unable to write to file </torch_...>'.",
            "give the container more: `docker run --shm-size=8g` or `--ipc=host`"
            " (Kubernetes: an emptyDir with `medium: Memory` mounted at /dev/shm)",
            data={"shm_bytes": hw.shm_bytes},
        )
    ]


def check_open_files(hw: HardwareInfo) -> list[Finding]:
    """WARN when the open-file limit is low enough for workers to hit 'Too many open files'."""
    limit = hw.open_files_limit
    if limit is None or limit >= MIN_OPEN_FILES:
        shown = "unlimited" if limit is None else str(limit)
        return [_finding("data", "info", f"open-file limit {shown}", data={"open_files_limit": limit})]
    hard = hw.open_files_hard_limit
    if hard is None or hard > limit:
        how = f"`ulimit -n {hard or 65536}` before training (no root needed up to the hard limit)"
    else:
        how = (
            "raise the hard limit (/etc/security/limits.conf, or `docker run --ulimit"
            " nofile=65536:65536`), then `ulimit -n 65536`"
        )
    return [
        _finding(
            "data",
            "warn",
            f"open-file limit is only {limit}",
            "DataLoader workers share each batch through file descriptors; many workers or"
            " large batches fail with 'Too many open files'.",
            f"{how}, or `torch.multiprocessing.set_sharing_strategy('file_system')`",
            data={"open_files_limit": limit},
        )
    ]


def check_cpus(hw: HardwareInfo) -> list[Finding]:
    """CPUs per training process and the DataLoader worker count that implies."""
    per_process = hw.cpus_per_process
    workers = hw.max_workers_per_process
    detail = (
        f"{hw.cpus_available} CPUs available to this process ({hw.cpu_count} in the machine),"
        f" {hw.processes_per_node} training process(es) per node: {per_process} CPU(s) each."
        f" {workers} DataLoader worker(s) leave one CPU to the training process; worker tuning"
        f" measures up to {per_process}."
    )
    data: dict[str, object] = {"cpus_per_process": per_process, "max_workers": workers}
    if hw.is_cuda and per_process < 2:
        return [
            _finding(
                "data",
                "warn",
                f"only {per_process} CPU per GPU process",
                detail,
                "data loading will likely starve the GPU: give the job more CPUs, move"
                " augmentation to the GPU (torchvision transforms.v2 on the batch in"
                " on_after_batch_transfer), or run"
                " fewer processes per node",
                data,
            )
        ]
    return [
        _finding(
            "data",
            "info",
            f"{per_process} CPU(s) per process for the model and its workers",
            detail,
            "",
            data,
        )
    ]


def check_distributed(hw: HardwareInfo) -> list[Finding]:
    """Multi-GPU or multi-node: NCCL must be there for fast DDP on CUDA."""
    multi = hw.device_count > 1 or hw.local_world_size > 1 or hw.is_multi_node
    if not (hw.is_cuda and multi):
        return []
    layout = f"{hw.processes_per_node} process(es) per node x {hw.node_count} node(s)"
    if hw.nccl_available:
        return [_finding("precision and strategy", "info", f"NCCL {hw.nccl_version} available", layout)]
    return [
        _finding(
            "precision and strategy",
            "error",
            "multi-GPU but NCCL is not available",
            f"{layout}; DDP on CUDA tensors needs NCCL (gloo is many times slower).",
            "use a Linux CUDA build of torch (NCCL ships with it)",
        )
    ]


CHECKS: tuple[Check, ...] = (
    check_gpu,
    check_devices,
    check_cpus,
    check_shm,
    check_open_files,
    check_distributed,
)


def versions() -> dict[str, str]:
    """What a bug report needs: Python, the OS, and the versions of the packages that train.

    Example:
        >>> sorted(versions())
        ['lightning', 'lightning_boost', 'os', 'python', 'torch', 'torchmetrics']
    """
    import lightning
    import torch
    import torchmetrics

    from lightning_boost import __version__

    return {
        "python": platform.python_version(),
        "os": platform.platform(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchmetrics": torchmetrics.__version__,
        "lightning_boost": __version__,
    }


def run_checks(hw: HardwareInfo) -> Report:
    """Run every check on `hw` and collect the findings in a report."""
    report = Report()
    for check in CHECKS:
        report.add(check(hw))
    return report
