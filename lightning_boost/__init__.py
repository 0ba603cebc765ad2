"""lightning-boost: fast PyTorch Lightning training without becoming a performance engineer.

The public names load on first use (PEP 562), so ``import lightning_boost`` and the
``lightning-boost`` command start without importing torch and Lightning.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from lightning_boost._lazy import lazy_exports

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "AutoBatchSize": "lightning_boost.callbacks",
    "AutoMicroBatch": "lightning_boost.callbacks",
    "AutoNumWorkers": "lightning_boost.callbacks",
    "BoostReport": "lightning_boost.callbacks",
    "LossLoggingGuard": "lightning_boost.callbacks",
    "RetainedGraphError": "lightning_boost.callbacks",
    "StepTimeMonitor": "lightning_boost.callbacks",
    "SyncError": "lightning_boost.callbacks",
    "SyncGuard": "lightning_boost.callbacks",
    "boost_callbacks": "lightning_boost.callbacks",
    "BoostedDataModule": "lightning_boost.data",
    "HardwareInfo": "lightning_boost.hardware",
    "auto_precision": "lightning_boost.precision",
    "Preset": "lightning_boost.presets",
    "preset": "lightning_boost.presets",
    "presets": "lightning_boost.presets",
    "BoostWarning": "lightning_boost.report",
    "Finding": "lightning_boost.report",
    "Report": "lightning_boost.report",
    "Severity": "lightning_boost.report",
    "WorkerTuning": "lightning_boost.workers.search",
    "micro_batches": "lightning_boost.micro_batch.callback",
}

__all__ = [
    "AutoBatchSize",
    "AutoMicroBatch",
    "AutoNumWorkers",
    "BoostReport",
    "BoostWarning",
    "BoostedDataModule",
    "Finding",
    "HardwareInfo",
    "LossLoggingGuard",
    "Preset",
    "Report",
    "RetainedGraphError",
    "Severity",
    "StepTimeMonitor",
    "SyncError",
    "SyncGuard",
    "WorkerTuning",
    "__version__",
    "auto_precision",
    "boost_callbacks",
    "micro_batches",
    "preset",
    "presets",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)


class _Package(types.ModuleType):
    """The package module: `presets` is both a subpackage and the function it exports.

    Importing ``lightning_boost.presets`` binds the subpackage to this attribute; the function of
    that name is what ``from lightning_boost import presets`` has always given, so the binding is
    skipped (the function then loads on first use, and importing the pure ``presets.plans``
    imports no Lightning).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "presets" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # the names as type checkers and IDEs see them
    from lightning_boost.callbacks import (
        AutoBatchSize,
        AutoMicroBatch,
        AutoNumWorkers,
        BoostReport,
        LossLoggingGuard,
        RetainedGraphError,
        StepTimeMonitor,
        SyncError,
        SyncGuard,
        boost_callbacks,
    )
    from lightning_boost.data import BoostedDataModule
    from lightning_boost.hardware import HardwareInfo
    from lightning_boost.micro_batch.callback import micro_batches
    from lightning_boost.precision import auto_precision
    from lightning_boost.presets import Preset, preset, presets
    from lightning_boost.report import BoostWarning, Finding, Report, Severity
    from lightning_boost.workers.search import WorkerTuning
