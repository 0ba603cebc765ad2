"""`preset(name)` and `presets()`, and the preset names registered with Lightning's strategies.

    Trainer(strategy=preset("fast-ddp"))

See `presets()` for the names and the README's preset table for what each sets and why.
"""

from __future__ import annotations

from typing import Any

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

__all__ = ["Preset", "preset", "presets"]


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
            ``cudnn_benchmark``, ``background_saves`` (not for ``"fsdp"``), ``channels_last`` (one
            device: NHWC convolutions, timed on a CPU when not given), and the strategy's own
            (e.g. ``static_graph=True``).

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


class Preset(Strategy):
    """`preset` as a class, for configuration files: LightningCLI (jsonargparse) builds a
    strategy from a ``class_path`` and its ``init_args``, and a preset's own class depends on the
    machine, so this one stands for it. Building it returns ``preset(name, **overrides)``, the
    preset's own strategy (`PresetDDPStrategy`, ...), not a `Preset`. Arguments left at ``None``
    are the preset's choice; see `preset` for each.

    In a LightningCLI config::

        trainer:
          strategy:
            class_path: lightning_boost.Preset
            init_args:
              name: fast-ddp
              static_graph: true

    and in code, ``LightningCLI(..., trainer_defaults={"strategy": lazy_instance(Preset)})`` (a
    strategy instance cannot be a CLI default: jsonargparse needs the class and its arguments).

    Example:
        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> isinstance(Preset("auto", precision="32-true"), SingleDeviceStrategy)
        True
    """

    def __new__(  # the signature jsonargparse reads
        cls,
        name: PresetName = "auto",
        precision: str | None = None,
        tf32: bool | None = None,
        cudnn_benchmark: bool | None = None,
        background_saves: bool | None = None,
        channels_last: bool | None = None,
        find_unused_parameters: bool | None = None,
        gradient_as_bucket_view: bool | None = None,
        bucket_cap_mb: float | None = None,
        static_graph: bool | None = None,
        batched_grad_copy: bool | None = None,
        process_group_backend: str | None = None,
        start_method: str | None = None,
        comm_hook: str | None = None,
        sharding_strategy: str | None = None,
        min_num_params: int | None = None,
        state_dict_type: str | None = None,
        cpu_offload: bool | None = None,
        limit_all_gathers: bool | None = None,
        use_orig_params: bool | None = None,
    ) -> Any:
        """The preset's own strategy (its class is not `Preset`, so no ``__init__`` runs)."""
        if "build_preset" not in cls.__dict__:  # jsonargparse's `lazy_instance` subclass: a placeholder
            return super().__new__(cls)
        given = {key: value for key, value in locals().items() if key not in ("cls", "name", "__class__")}
        return cls.build_preset(name, **{key: value for key, value in given.items() if value is not None})

    #: The namespace's `preset` function.
    build_preset = staticmethod(preset)


Preset.__abstractmethods__ = frozenset()  # never built itself; jsonargparse refuses abstract classes


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
