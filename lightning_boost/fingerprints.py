"""What a measurement depends on, as plain data for cache keys: the machine, the model, the dataset
(pure). The measuring layer below the feature folders (DESIGN.md): worker settings, batch sizes
and the autocast trial are all cached under keys built from these.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from lightning_boost import __version__
from lightning_boost.hardware import HardwareInfo


def hardware_parts(hardware: HardwareInfo) -> dict[str, Any]:
    """What of the machine a measurement depends on (not what changes between runs, e.g. free RAM),
    and the lightning-boost that measured: a measurement an older release made (with its faults)
    is made again after an upgrade."""
    return {
        "lightning_boost": __version__,
        "accelerator": hardware.accelerator,
        "devices": list(hardware.device_names),
        "cpus_per_process": hardware.cpus_per_process,
        "ram_total_bytes": hardware.ram_total_bytes,
        "shm_bytes": hardware.shm_bytes,
        "torch": hardware.torch_version,
    }


def describe_model(module: torch.nn.Module | None) -> str | None:
    """``"pkg.Class: N parameters"``: enough to tell one model's step time from another's."""
    if module is None:
        return None
    kind = type(module)
    params = list(module.parameters())
    lazy = sum(is_lazy(p) for p in params)  # a lazy module's, shaped at its first forward
    count = sum(p.numel() for p in params if not is_lazy(p))
    return f"{kind.__module__}.{kind.__qualname__}: {count} parameters" + (
        f", {lazy} uninitialized" if lazy else ""
    )


def describe_dataset(dataset: object, depth: int = 3) -> dict[str, Any]:
    """Type, length and transforms of `dataset` and of the datasets it wraps (``Subset`` etc.)."""
    kind = type(dataset)
    described: dict[str, Any] = {"type": f"{kind.__module__}.{kind.__qualname__}"}
    if hasattr(dataset, "__len__"):
        described["length"] = len(dataset)
    for name in ("transform", "transforms", "target_transform"):
        if getattr(dataset, name, None) is not None:
            described[name] = stable_repr(getattr(dataset, name))
    inner = getattr(dataset, "dataset", None)
    if depth > 0 and inner is not None and inner is not dataset:
        described["wraps"] = describe_dataset(inner, depth - 1)
    return described


def stable_repr(value: object) -> str | None:
    """`repr` without memory addresses, so a lambda or a bound method keys the same across runs."""
    if value is None:
        return None
    while isinstance(value, functools.partial):  # e.g. the worker init bound to this process's rank
        value = value.func
    name = getattr(value, "__qualname__", None)
    text = f"{getattr(value, '__module__', '')}.{name}" if name else repr(value)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)[:2000]
