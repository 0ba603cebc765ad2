"""lightning-boost for programs written ``import pytorch_lightning as pl``.

``pytorch_lightning.Trainer`` takes only ``pytorch_lightning``'s own classes: its strategies and
datamodules are other classes than ``lightning.pytorch``'s, though the code is the same. The two
parts of lightning-boost that are such classes, the datamodule and the presets' strategies, are
here on ``pytorch_lightning``'s bases. The top-level ones work under a ``pl.Trainer`` too (a
preset given to it becomes this module's; a datamodule given as ``fit(datamodule=...)`` becomes a
``pytorch_lightning`` one); these are that from the start, which a datamodule passed
positionally (``trainer.fit(model, dm)``) needs. The callbacks work under both Trainers as they are, from
pytorch-lightning 2.6.0 on (older releases' Trainer rejects callbacks of the other namespace).

Example::

    import pytorch_lightning as pl
    from lightning_boost import boost_callbacks
    from lightning_boost.pytorch_lightning import BoostedDataModule, preset

    trainer = pl.Trainer(strategy=preset("fast-ddp"), callbacks=boost_callbacks())
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, Strategy
from typing_extensions import Unpack

from lightning_boost import data
from lightning_boost._validation import Count, validated
from lightning_boost.data.datamodule import BoostedDataMixin
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import api
from lightning_boost.presets.autocast import MeasuredAutocastMixin
from lightning_boost.presets.plans import PresetName, PresetOverrides, PresetPlan, plan_preset
from lightning_boost.presets.strategies import (
    PresetDDP,
    PresetFSDP,
    PresetSingleDevice,
    PresetStrategy,
    build,
)

__all__ = [
    "BoostedDataModule",
    "Preset",
    "PresetDDPStrategy",
    "PresetFSDPStrategy",
    "PresetSingleDeviceStrategy",
    "preset",
]


class BoostedDataModule(BoostedDataMixin, pl.LightningDataModule):  # type: ignore[misc]
    __doc__ = data.BoostedDataModule.__doc__


class MeasuredAutocast(MeasuredAutocastMixin, MixedPrecision):  # type: ignore[misc]
    """`MeasuredAutocastMixin` on ``pytorch_lightning``'s `MixedPrecision`."""


class PresetDDPStrategy(PresetDDP, DDPStrategy):  # type: ignore[misc]
    """`DDPStrategy` built by `preset("fast-ddp")`; ``.plan`` and ``.findings`` say what it chose."""

    namespace = "pytorch_lightning"
    measured_autocast = MeasuredAutocast


class PresetFSDPStrategy(PresetFSDP, FSDPStrategy):  # type: ignore[misc]
    """`FSDPStrategy` built by `preset("fsdp")`: sharding, size-based wrapping, mixed precision."""

    namespace = "pytorch_lightning"
    measured_autocast = MeasuredAutocast


class PresetSingleDeviceStrategy(PresetSingleDevice, SingleDeviceStrategy):  # type: ignore[misc]
    """`SingleDeviceStrategy` built by `preset("auto")` on one device, with its precision."""

    namespace = "pytorch_lightning"
    measured_autocast = MeasuredAutocast


KINDS: Mapping[str, Callable[[PresetPlan], PresetStrategy]] = {
    "single": PresetSingleDeviceStrategy,
    "ddp": PresetDDPStrategy,
    "fsdp": PresetFSDPStrategy,
}


@validated
def preset(
    name: PresetName,
    *,
    hardware: HardwareInfo | None = None,
    model: torch.nn.Module | Count | None = None,
    **overrides: Unpack[PresetOverrides],
) -> PresetStrategy:
    """`lightning_boost.preset` for ``pytorch_lightning.Trainer``: the same decisions and arguments.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> strategy = preset("fast-ddp", hardware=EXAMPLES["cpu"])
        >>> type(strategy).__module__, isinstance(strategy, DDPStrategy)
        ('lightning_boost.pytorch_lightning', True)
    """
    return build(plan_preset(name, hardware or HardwareInfo.detect(), model, **overrides), KINDS)


class Preset(Strategy):
    """`lightning_boost.Preset` for ``pytorch_lightning``'s LightningCLI: builds this module's
    ``preset(name, **overrides)`` from a config's ``class_path`` and ``init_args``."""

    __new__ = api.Preset.__new__  # type: ignore[assignment]
    build_preset = staticmethod(preset)


Preset.__abstractmethods__ = frozenset()  # never built itself; jsonargparse refuses abstract classes
