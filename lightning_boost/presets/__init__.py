"""`preset(name)`: the Strategy and precision an expert would pick for this machine, in one word.

    Trainer(strategy=preset("fast-ddp"))

- `plans` (pure): `plan_preset`, the decision as plain data (`PresetPlan`);
- `strategies` (Lightning): the Strategy classes that carry a plan;
- `api` (Lightning): `preset()` and `presets()`.

The names load on first use (PEP 562), so importing the pure `plans` does not import Lightning.
See the README's preset table for what each preset sets and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_boost._lazy import lazy_exports

_EXPORTS = {
    "PresetDDPStrategy": "lightning_boost.presets.strategies",
    "PresetFSDPStrategy": "lightning_boost.presets.strategies",
    "PresetSingleDeviceStrategy": "lightning_boost.presets.strategies",
    "PresetStrategy": "lightning_boost.presets.strategies",
    "PresetName": "lightning_boost.presets.plans",
    "PresetOverrides": "lightning_boost.presets.plans",
    "PresetPlan": "lightning_boost.presets.plans",
    "plan_preset": "lightning_boost.presets.plans",
    "Preset": "lightning_boost.presets.api",
    "preset": "lightning_boost.presets.api",
    "presets": "lightning_boost.presets.api",
}
__all__ = [
    "Preset",
    "PresetDDPStrategy",
    "PresetFSDPStrategy",
    "PresetName",
    "PresetOverrides",
    "PresetPlan",
    "PresetSingleDeviceStrategy",
    "PresetStrategy",
    "plan_preset",
    "preset",
    "presets",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)


if TYPE_CHECKING:
    from lightning_boost.presets.api import Preset, preset, presets
    from lightning_boost.presets.plans import PresetName, PresetOverrides, PresetPlan, plan_preset
    from lightning_boost.presets.strategies import (
        PresetDDPStrategy,
        PresetFSDPStrategy,
        PresetSingleDeviceStrategy,
        PresetStrategy,
    )
