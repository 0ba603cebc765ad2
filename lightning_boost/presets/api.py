"""`preset(name)` and `presets()`, and the preset names registered with Lightning's strategies.

    Trainer(strategy=preset("fast-ddp"))

See `presets()` for the names and the README's preset table for what each sets and why.
"""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from typing_extensions import Unpack

from lightning_boost._validation import Count, validated
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets.plans import PRESETS, PresetName, PresetOverrides, plan_preset
from lightning_boost.presets.strategies import (
    PresetStrategy,
    build,
)

__all__ = ["preset", "presets"]


@validated
def preset(
    name: PresetName,
    *,
    hardware: HardwareInfo | None = None,
    model: torch.nn.Module | Count | None = None,
    **overrides: Unpack[PresetOverrides],
) -> PresetStrategy:
    """A configured Lightning Strategy instance for `name`, with the precision that fits.

    Args:
        name: one of `presets()`: ``"auto"``, ``"fast-ddp"``, ``"fast-ddp-multinode"``, ``"fsdp"``.
        hardware: the machine to decide for; ``HardwareInfo.detect()`` when not given.
        model: the LightningModule or its parameter count, when known: sizes DDP buckets and
            lets ``"auto"`` choose FSDP for a model that does not fit one device.
        **overrides: settings to take instead of the preset's: ``precision``, ``tf32``,
            ``cudnn_benchmark``, and the strategy's own (e.g. ``static_graph=True``).

    Raises:
        TypeError: for an unknown override (with close matches) or an argument of the wrong type.
        ValueError: for an unknown name (with close matches), an override the preset's strategy
            does not take, a bad override value, a precision the hardware cannot run, or FSDP
            without CUDA.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> strategy = preset("fast-ddp", hardware=EXAMPLES["cpu"])
        >>> type(strategy).__name__, strategy.plan.precision, strategy.plan.options["bucket_cap_mb"]
        ('PresetDDPStrategy', '32-true', 25)
    """
    plan = plan_preset(name, hardware or HardwareInfo.detect(), model, **overrides)
    return build(plan)


def presets() -> dict[str, str]:
    """Preset names with one-line descriptions."""
    return dict(PRESETS)


def _by_name_error(name: str) -> Strategy:
    raise ValueError(
        f"Trainer(strategy={name!r}) cannot carry the preset's precision: Lightning replaces the"
        " precision of strategies created from a registered name. Use"
        f" Trainer(strategy=preset({name!r})) from lightning_boost instead."
    )


for _name in PRESETS:
    if _name not in StrategyRegistry and _name != "auto":  # "auto" is Lightning's own default
        StrategyRegistry.register(
            _name,
            lambda _name=_name: _by_name_error(_name),
            description=f"lightning-boost preset: use lightning_boost.preset({_name!r})",
        )
