"""`boost_callbacks()`: the recommended set of boost callbacks, in one line."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
from typing_extensions import TypedDict, Unpack

from lightning_boost._validation import validated
from lightning_boost.guards.loss_logging_guard import LossLoggingGuard
from lightning_boost.guards.sync_guard import SyncGuard
from lightning_boost.micro_batch.callback import AutoMicroBatch
from lightning_boost.report.callback import BoostReport
from lightning_boost.step_time.callback import StepTimeMonitor
from lightning_boost.workers.callback import AutoNumWorkers

#: Option name -> the callback it turns on, in the order they are returned.
RECOMMENDED: dict[str, Callable[..., L.Callback]] = {
    "auto_num_workers": AutoNumWorkers,
    "auto_micro_batch": AutoMicroBatch,
    "step_time_monitor": StepTimeMonitor,
    "loss_logging_guard": LossLoggingGuard,
    "sync_guard": SyncGuard,
    "boost_report": BoostReport,
}


class RecommendedOptions(TypedDict, total=False):
    """`boost_callbacks`' options: each on (``True``), off (``False``) or the callback's arguments."""

    auto_num_workers: bool | Mapping[str, Any]
    auto_micro_batch: bool | Mapping[str, Any]
    step_time_monitor: bool | Mapping[str, Any]
    loss_logging_guard: bool | Mapping[str, Any]
    sync_guard: bool | Mapping[str, Any]
    boost_report: bool | Mapping[str, Any]


@validated
def boost_callbacks(**options: Unpack[RecommendedOptions]) -> list[L.Callback]:
    """The recommended callbacks: worker tuning, out-of-memory retry, step-time monitoring, the two
    guards, the report.

    Each option is named after a callback and is ``True`` (on, with its defaults, the default),
    ``False`` (off) or a dict of its keyword arguments.

    ====================== ==================== ================================================
    option                 callback             what it does
    ====================== ==================== ================================================
    ``auto_num_workers``   `AutoNumWorkers`     measured ``num_workers`` for plain DataLoaders
    ``auto_micro_batch``   `AutoMicroBatch`     an out-of-memory step retried as micro-batches
    ``step_time_monitor``  `StepTimeMonitor`    data wait vs compute per step, input-bound check
    ``loss_logging_guard`` `LossLoggingGuard`   values kept between steps that hold a graph
    ``sync_guard``         `SyncGuard`          host-device syncs in the step, at their line
    ``boost_report``       `BoostReport`        console table, JSON/Markdown/plots, hparams
    ====================== ==================== ================================================

    Raises:
        TypeError: for an unknown option (with close matches), a value that is not a bool or a
            dict, or a dict key the callback does not take.
        ValueError: for a bad value in a callback's dict.

    Example:
        >>> [type(c).__name__ for c in boost_callbacks(step_time_monitor={"threshold": 0.2})][:3]
        ['AutoNumWorkers', 'AutoMicroBatch', 'StepTimeMonitor']
        >>> [type(c).__name__ for c in boost_callbacks(auto_num_workers=False)]
        ['AutoMicroBatch', 'StepTimeMonitor', 'LossLoggingGuard', 'SyncGuard', 'BoostReport']
    """
    callbacks = []
    for name, factory in RECOMMENDED.items():
        value: bool | Mapping[str, Any] = options.get(name, True)  # type: ignore[assignment]
        if value is False:
            continue
        callbacks.append(factory(**value) if isinstance(value, Mapping) else factory())
    return callbacks
