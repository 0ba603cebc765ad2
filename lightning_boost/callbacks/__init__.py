"""Lightning callbacks: thin hooks that gather data, call a decision from `tuning/`, apply it."""

from lightning_boost.callbacks.auto_batch_size import AutoBatchSize
from lightning_boost.callbacks.auto_num_workers import AutoNumWorkers
from lightning_boost.callbacks.boost_report import BoostReport
from lightning_boost.callbacks.loss_logging_guard import LossLoggingGuard, RetainedGraphError
from lightning_boost.callbacks.recommended import boost_callbacks
from lightning_boost.callbacks.step_time_monitor import StepTimeMonitor
from lightning_boost.callbacks.sync_guard import SyncError, SyncGuard

__all__ = [
    "AutoBatchSize",
    "AutoNumWorkers",
    "BoostReport",
    "LossLoggingGuard",
    "RetainedGraphError",
    "StepTimeMonitor",
    "SyncError",
    "SyncGuard",
    "boost_callbacks",
]
