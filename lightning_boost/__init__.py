"""lightning-boost: fast PyTorch Lightning training without becoming a performance engineer."""

from lightning_boost.callbacks import (
    AutoBatchSize,
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
from lightning_boost.precision import auto_precision
from lightning_boost.presets import preset, presets
from lightning_boost.report import BoostWarning, Finding, Report, Severity
from lightning_boost.tuning.workers import WorkerTuning

__version__ = "0.1.0.dev0"

__all__ = [
    "AutoBatchSize",
    "AutoNumWorkers",
    "BoostReport",
    "BoostWarning",
    "BoostedDataModule",
    "Finding",
    "HardwareInfo",
    "LossLoggingGuard",
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
    "preset",
    "presets",
]
