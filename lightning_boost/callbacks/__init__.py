"""The boost callbacks, gathered: each lives in its feature folder (`workers/`, `batch_size/`,
`guards/`, `step_time/`, `report/`, `micro_batch/`); `base` holds `BoostCallback`, `recommended` holds
`boost_callbacks()`.

The names load on first use (PEP 562): importing `lightning_boost.callbacks.base` from a feature
folder does not import every callback (which would import that folder back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_boost._lazy import lazy_exports

_EXPORTS = {
    "AutoBatchSize": "lightning_boost.batch_size.callback",
    "AutoMicroBatch": "lightning_boost.micro_batch.callback",
    "AutoNumWorkers": "lightning_boost.workers.callback",
    "BoostReport": "lightning_boost.report.callback",
    "LossLoggingGuard": "lightning_boost.guards.loss_logging_guard",
    "RetainedGraphError": "lightning_boost.guards.loss_logging_guard",
    "StepTimeMonitor": "lightning_boost.step_time.callback",
    "SyncError": "lightning_boost.guards.sync_guard",
    "SyncGuard": "lightning_boost.guards.sync_guard",
    "boost_callbacks": "lightning_boost.callbacks.recommended",
}
__all__ = [
    "AutoBatchSize",
    "AutoMicroBatch",
    "AutoNumWorkers",
    "BoostReport",
    "LossLoggingGuard",
    "RetainedGraphError",
    "StepTimeMonitor",
    "SyncError",
    "SyncGuard",
    "boost_callbacks",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)


if TYPE_CHECKING:
    from lightning_boost.batch_size.callback import AutoBatchSize
    from lightning_boost.callbacks.recommended import boost_callbacks
    from lightning_boost.guards.loss_logging_guard import LossLoggingGuard, RetainedGraphError
    from lightning_boost.guards.sync_guard import SyncError, SyncGuard
    from lightning_boost.micro_batch.callback import AutoMicroBatch
    from lightning_boost.report.callback import BoostReport
    from lightning_boost.step_time.callback import StepTimeMonitor
    from lightning_boost.workers.callback import AutoNumWorkers
