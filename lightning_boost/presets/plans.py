"""Preset decisions as pure functions: `HardwareInfo` (+ model size) in, a `PresetPlan` out.

No Lightning here: `lightning_boost.presets.strategies` turns a plan into a Strategy instance.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from torch.nn.parameter import is_lazy
from typing_extensions import TypedDict

from lightning_boost._validation import OneOf, PositiveInt, Range, unknown_choice_error
from lightning_boost.hardware import GIB, MIB, HardwareInfo
from lightning_boost.precision import auto_precision
from lightning_boost.report import Finding, Severity

#: Name -> one-line description, in the order `presets()` lists them.
PRESETS: dict[str, str] = {
    "auto": "single device, fast-ddp, fast-ddp-multinode or fsdp, picked from the hardware and model size",
    "fast-ddp": "DDP with the fast single-node flags and the precision that fits the GPUs",
    "fast-ddp-multinode": "fast-ddp plus gradient compression (bf16, fp16 before Ampere) across nodes",
    "fsdp": "fully sharded data parallel for models that do not fit per device",
}

#: The preset names (`PRESETS` describes each).
PresetName = Literal["auto", "fast-ddp", "fast-ddp-multinode", "fsdp"]
#: Precisions a preset can carry (Lightning's names).
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")
#: Lightning's short spellings and what they mean.
PRECISION_ALIASES: dict[object, str] = {
    "32": "32-true",
    32: "32-true",
    "16": "16-mixed",
    16: "16-mixed",
    "bf16": "bf16-mixed",
    "64": "64-true",
    64: "64-true",
}

# Mixed-precision Adam keeps 16 bytes per parameter: fp32 weights, grads and two moments plus
# the half-precision copy (ZeRO, Rajbhandari et al. 2020, section 3.1). Activations need room too.
TRAINING_BYTES_PER_PARAM = 16
FIT_FRACTION = 0.5

_COMMON_OVERRIDES = ("precision", "tf32", "cudnn_benchmark")
_DDP_OVERRIDES = (
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "bucket_cap_mb",
    "static_graph",
    "batched_grad_copy",
    "process_group_backend",
    "start_method",
    "comm_hook",
)
_FSDP_OVERRIDES = (
    "sharding_strategy",
    "min_num_params",
    "state_dict_type",
    "cpu_offload",
    "limit_all_gathers",
    "use_orig_params",
    "process_group_backend",
)
_OVERRIDES = {
    "single": (*_COMMON_OVERRIDES, "background_saves", "channels_last"),
    "ddp": (*_COMMON_OVERRIDES, "background_saves", "channels_last", *_DDP_OVERRIDES),
}
_OVERRIDES["fsdp"] = _COMMON_OVERRIDES + _FSDP_OVERRIDES


def distributed_backends() -> list[str]:
    """The process-group backends this torch has registered (``gloo``, ``nccl``, ``mpi``, ...)."""
    import torch.distributed

    return [name for name in torch.distributed.Backend.backend_list if name != "undefined"]


class _BackendSpec(OneOf):
    """A backend name, or a per-device list such as ``"cpu:gloo,cuda:nccl"``."""

    def holds(self, value: Any) -> bool:
        return all(super(_BackendSpec, self).holds(part.rpartition(":")[2]) for part in value.split(","))


class PresetOverrides(TypedDict, total=False):
    """What ``preset(name, **overrides)`` takes instead of its own choice (each kind takes some)."""

    precision: Literal[
        "32-true",
        "16-mixed",
        "bf16-mixed",
        "bf16-true",
        "16-true",
        "64-true",
        "32",
        "16",
        "bf16",
        "64",
        32,
        16,
        64,
    ]
    tf32: bool
    cudnn_benchmark: bool
    background_saves: bool
    channels_last: bool
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    bucket_cap_mb: Annotated[float, Range(gt=0, unit="MB")]
    static_graph: bool
    batched_grad_copy: bool
    process_group_backend: Annotated[str, _BackendSpec(distributed_backends)] | None
    start_method: Literal["popen", "spawn", "fork", "forkserver"]
    comm_hook: Literal["bf16_compress", "fp16_compress"] | None
    sharding_strategy: Literal[
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"
    ]
    min_num_params: PositiveInt
    state_dict_type: Literal["full", "sharded"]
    cpu_offload: bool
    limit_all_gathers: bool
    use_orig_params: bool


@dataclass(frozen=True)
class PresetPlan:
    """What a preset decided, as plain data.

    Args:
        name: the preset asked for; ``resolved`` is the one applied (``auto`` resolves).
        kind: ``"single"``, ``"ddp"`` or ``"fsdp"``: which Lightning strategy carries it.
        accelerator: the `HardwareInfo.accelerator` it was planned for.
        precision: the Lightning precision string the strategy carries.
        options: keyword arguments for the strategy (``comm_hook`` is a name, resolved later).
        tf32: allow TF32 matmuls while the strategy is set up.
        cudnn_benchmark: let cuDNN pick the fastest kernels while the strategy is set up.
        cudnn_benchmark_by_hand: the user passed `cudnn_benchmark`; otherwise it is the preset's
            default, which `AutoBatchSize` turns off for a run too short to repay its autotuning.
        findings: what was chosen and why.
        measure_autocast: a CPU's ``"bf16-mixed"`` chosen by the preset: a copy of the model times
            bf16 autocast against fp32 before training, and the faster is kept (`presets.autocast`).
        background_saves: checkpoint saves and removals run on a worker thread, in order
            (`presets.saves`), where the run's checkpoint IO is Lightning's default.
        channels_last: a convolutional model's weights in NHWC (`presets.memory_format`): ``True``
            or ``False`` as set by hand (one device, DDP); ``None``, the preset's choice: on one CPU
            device timed against NCHW before training and kept when faster, else left as built.
    """

    name: str
    resolved: str
    kind: str
    accelerator: str
    precision: str
    options: Mapping[str, Any] = field(default_factory=dict)
    tf32: bool = False
    cudnn_benchmark: bool = False
    cudnn_benchmark_by_hand: bool = False
    findings: tuple[Finding, ...] = ()
    measure_autocast: bool = False
    background_saves: bool = False
    channels_last: bool | None = None


def model_parameter_count(model: object) -> int | None:
    """Parameters in `model` (an int, or anything with ``.parameters()``), ``None`` if unknown."""
    if model is None:
        return None
    if isinstance(model, int) and not isinstance(model, bool):
        if model < 0:
            raise ValueError(f"`model` expected a parameter count >= 0 or an nn.Module, got {model}.")
        return model
    parameters = getattr(model, "parameters", None)
    if parameters is None:
        raise TypeError(
            f"`model` expected an nn.Module or a parameter count (int), got {type(model).__name__}."
        )
    params = list(parameters())
    if any(is_lazy(p) for p in params):  # a lazy module's, shaped at its first forward
        return None
    return sum(p.numel() for p in params)


def fits_per_device(hw: HardwareInfo, params: int) -> bool:
    """Whether training `params` with mixed-precision Adam fits one device with room for activations."""
    memory = hw.min_device_memory_bytes
    return memory is None or params * TRAINING_BYTES_PER_PARAM <= FIT_FRACTION * memory


def bucket_cap_mb(params: int | None) -> int:
    """DDP bucket size: PyTorch's 25 MB, grown for large models to ~10 buckets, at most 100 MB.

    Fewer, larger all-reduces cost less launch and latency overhead; ~10 buckets still overlap
    communication with the backward pass (Li et al., "PyTorch Distributed", VLDB 2020, sec. 5).
    """
    if params is None:
        return 25
    grad_mb = params * 4 / MIB
    return int(min(max(grad_mb / 10, 25), 100))


def resolve(name: str, hw: HardwareInfo, params: int | None) -> str:
    """The concrete preset `name` stands for on `hw` (only ``auto`` changes)."""
    if name != "auto":
        return name
    world = max(hw.processes_per_node, 1) * hw.node_count
    if not hw.is_cuda or world <= 1:
        return "single" if hw.local_world_size == 1 and hw.node_count == 1 else "fast-ddp"
    if params is not None and not fits_per_device(hw, params):
        return "fsdp"
    return "fast-ddp-multinode" if hw.is_multi_node else "fast-ddp"


def plan_preset(name: str, hw: HardwareInfo, model: object = None, **overrides: Any) -> PresetPlan:
    """Decide everything `preset(name)` sets for `hw`; see `PRESETS` for the names.

    Raises:
        ValueError: for an unknown name or override, a precision the hardware cannot run, or
            FSDP without CUDA.
    """
    if name not in PRESETS:
        raise unknown_choice_error("name", name, PRESETS)
    params = model_parameter_count(model)
    resolved = resolve(name, hw, params)
    kind = {"single": "single", "fsdp": "fsdp"}.get(resolved, "ddp")
    for key in overrides:
        if key not in _OVERRIDES[kind]:
            raise unknown_choice_error(f"preset({name!r}) override", key, _OVERRIDES[kind])
    by_hand = overrides.pop("precision", None)
    precision = _precision(hw, by_hand)
    measure = by_hand is None and hw.accelerator == "cpu" and precision == "bf16-mixed"
    why = [_precision_finding(hw, precision, chose_by_hand=precision != auto_precision(hw))]
    if kind == "fsdp" and precision == "64-true":
        raise ValueError(
            "`precision` '64-true' does not run under FSDP (Lightning's FSDPPrecision takes 32-true and"
            " 16/bf16, true or mixed). Use preset('fast-ddp', precision='64-true'), or '32-true'."
        )
    if kind == "fsdp" and not hw.is_cuda:
        raise ValueError(
            f"`name` 'fsdp' needs CUDA devices, but this machine's accelerator is {hw.accelerator!r}."
            " Use preset('fast-ddp') for CPU processes, or preset('auto')."
        )
    options = {"single": _single_options, "ddp": _ddp_options, "fsdp": _fsdp_options}[kind](
        resolved, hw, params
    )
    benchmark_by_hand = "cudnn_benchmark" in overrides
    speed = {"tf32": hw.supports_tf32, "cudnn_benchmark": hw.is_cuda}
    for key in ("tf32", "cudnn_benchmark"):
        speed[key] = bool(overrides.pop(key, speed[key]))
    background = bool(overrides.pop("background_saves", kind != "fsdp"))
    channels_last = overrides.pop("channels_last", None)
    options.update(overrides)
    why.append(_strategy_finding(name, resolved, kind, options, hw, params))
    if speed["tf32"] or speed["cudnn_benchmark"]:
        why.append(_speed_finding(speed["tf32"], speed["cudnn_benchmark"]))
    return PresetPlan(
        name,
        resolved,
        kind,
        hw.accelerator,
        precision,
        options,
        findings=tuple(why),
        measure_autocast=measure,
        cudnn_benchmark_by_hand=benchmark_by_hand,
        background_saves=background,
        channels_last=None if channels_last is None else bool(channels_last),
        **speed,
    )


def _precision(hw: HardwareInfo, chosen: object) -> str:
    if chosen is None:
        return auto_precision(hw)
    chosen = PRECISION_ALIASES.get(chosen, chosen)
    if chosen not in PRECISIONS:
        raise unknown_choice_error("precision", chosen, PRECISIONS)
    if chosen.startswith("16-") and not hw.is_cuda:
        raise ValueError(
            f"`precision` {chosen!r} needs CUDA (fp16 AMP does not run on {hw.accelerator!r})."
            " Use 'bf16-mixed' or '32-true'."
        )
    return chosen


def _single_options(resolved: str, hw: HardwareInfo, params: int | None) -> dict[str, Any]:
    return {"device": "cuda:0" if hw.is_cuda else "mps" if hw.accelerator == "mps" else "cpu"}


def _ddp_options(resolved: str, hw: HardwareInfo, params: int | None) -> dict[str, Any]:
    multinode = resolved == "fast-ddp-multinode"
    options: dict[str, Any] = {
        "find_unused_parameters": False,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": bucket_cap_mb(params),
        "static_graph": False,
        "process_group_backend": None,  # Lightning's from the trainer's device: nccl on CUDA, gloo on CPU
        # a notebook's CPU processes fork, as `ddp_notebook`; on CUDA the device query
        # (`HardwareInfo.detect`) has initialized CUDA in this process, which a fork cannot inherit
        "start_method": "fork" if interactive() and not hw.is_cuda else "popen",
        "comm_hook": None,
    }
    if ddp_accepts("batched_grad_copy"):  # torch >= 2.14
        options["batched_grad_copy"] = True
    if multinode and hw.is_cuda:
        options["comm_hook"] = "bf16_compress" if hw.supports_bf16 else "fp16_compress"
    return options


def interactive() -> bool:
    """Whether this is an interactive session (a notebook, a REPL), by Lightning's own test
    (``lightning.fabric.utilities.imports._IS_INTERACTIVE``): there it refuses a strategy that
    starts its processes as scripts."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


@functools.cache
def ddp_accepts(argument: str) -> bool:
    """Whether this torch's `DistributedDataParallel` takes `argument`."""
    from torch.nn.parallel import DistributedDataParallel

    return argument in inspect.signature(DistributedDataParallel.__init__).parameters


def _fsdp_options(resolved: str, hw: HardwareInfo, params: int | None) -> dict[str, Any]:
    return {
        "sharding_strategy": "HYBRID_SHARD" if hw.is_multi_node else "FULL_SHARD",
        "min_num_params": max(int(params // 100), 1_000_000) if params else 10_000_000,
        "state_dict_type": "sharded",
        "cpu_offload": False,
        "limit_all_gathers": True,
        "use_orig_params": True,
        "process_group_backend": None,  # as for DDP: from the trainer's device
    }


def _finding(severity: Severity, title: str, detail: str, fix: str = "", **data: Any) -> Finding:
    return Finding("preset", "precision and strategy", severity, title, detail, fix, data=data)


_PRECISION_WHY = {
    "bf16-mixed": "bf16 autocast: fp32's range, so no loss scaling and no fp16 overflow NaNs",
    "16-mixed": "fp16 autocast with Lightning's gradient scaler: no fast bf16 before capability 8.0",
    "32-true": "no CUDA device and no bf16 dot products on this CPU: autocast would slow training",
}


def _precision_finding(hw: HardwareInfo, precision: str, chose_by_hand: bool) -> Finding:
    title = f"precision {precision!r}"
    if not chose_by_hand and hw.accelerator == "cpu" and precision == "bf16-mixed":
        detail = (
            "this CPU has bf16 dot products (AVX512-BF16 or AMX): before training, a copy of the model"
            " times bf16 autocast against fp32 on one of the run's batches, and the faster is kept (a"
            " convolutional network is often faster in bf16, a small MLP in fp32)"
        )
        title = "precision 'bf16-mixed' or '32-true', whichever this CPU steps faster"
        return _finding(Severity.INFO, title, detail, precision=precision)
    if not chose_by_hand:
        return _finding(Severity.INFO, title, _PRECISION_WHY[precision], precision=precision)
    if precision.startswith("bf16") and hw.is_cuda and not hw.supports_bf16:
        detail = "set by hand; this GPU has no native bf16 (capability < 8.0): emulated and slow"
        return _finding(Severity.WARN, title, detail, "precision='16-mixed'", precision=precision)
    return _finding(Severity.INFO, title, "set by hand", precision=precision)


def _strategy_finding(
    name: str, resolved: str, kind: str, options: Mapping[str, Any], hw: HardwareInfo, params: int | None
) -> Finding:
    size = f"{params / 1e6:.1f}M parameters" if params is not None else "model size unknown"
    chosen = ", ".join(f"{k}={v!r}" for k, v in options.items())
    detail = f"{hw.accelerator}, {hw.device_count} device(s) x {hw.node_count} node(s), {size}"
    if name == "auto":
        detail += f"; auto resolved to {resolved!r}"
    if options.get("start_method") == "fork" and interactive():
        detail += (
            "; an interactive session (a notebook): its processes start by fork, as Lightning's"
            " `ddp_notebook` does (a script's `popen` cannot start from one)"
        )
    if kind == "fsdp" and params is not None:
        need = params * TRAINING_BYTES_PER_PARAM / GIB
        detail += f"; training needs ~{need:.0f} GiB before activations"
    strategy = {"single": "SingleDeviceStrategy", "ddp": "DDPStrategy", "fsdp": "FSDPStrategy"}[kind]
    return _finding(
        Severity.INFO,
        f"{resolved}: {strategy}({chosen})",
        detail,
        preset=resolved,
        **{k: v for k, v in options.items() if k != "device"},
    )


def _speed_finding(tf32: bool, benchmark: bool) -> Finding:
    flags = [name for name, on in (("TF32 matmuls", tf32), ("cudnn.benchmark", benchmark)) if on]
    return _finding(
        Severity.INFO,
        " and ".join(flags) + " on while training",
        "set when the strategy sets up and put back at teardown; cudnn.benchmark stays off under"
        " Trainer(deterministic=True) and, with AutoBatchSize, for a run too short to repay its"
        " autotuning; pass cudnn_benchmark=False when input shapes vary",
        tf32=tf32,
        cudnn_benchmark=benchmark,
    )
