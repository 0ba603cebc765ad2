"""lightning-boost: fast PyTorch Lightning training without becoming a performance engineer."""

from lightning_boost.hardware import HardwareInfo
from lightning_boost.precision import auto_precision
from lightning_boost.presets import preset, presets
from lightning_boost.report import BoostReport, Finding, Severity

__version__ = "0.1.0.dev0"

__all__ = [
    "BoostReport",
    "Finding",
    "HardwareInfo",
    "Severity",
    "__version__",
    "auto_precision",
    "preset",
    "presets",
]
