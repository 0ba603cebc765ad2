"""`boost_callbacks()`: the recommended set of boost callbacks, in one line."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L

from lightning_boost._validation import unknown_choice_error
from lightning_boost.callbacks.auto_num_workers import AutoNumWorkers
from lightning_boost.callbacks.boost_report import BoostReport
from lightning_boost.callbacks.loss_logging_guard import LossLoggingGuard
from lightning_boost.callbacks.step_time_monitor import StepTimeMonitor
from lightning_boost.callbacks.sync_guard import SyncGuard

#: Option name -> the callback it turns on, in the order they are returned.
RECOMMENDED: dict[str, Callable[..., L.Callback]] = {
    "auto_num_workers": AutoNumWorkers,
    "step_time_monitor": StepTimeMonitor,
    "loss_logging_guard": LossLoggingGuard,
    "sync_guard": SyncGuard,
    "boost_report": BoostReport,
}


def boost_callbacks(**options: bool | Mapping[str, Any]) -> list[L.Callback]:
    """The recommended callbacks: worker tuning, step-time monitoring, the two guards, the report.

    Each option is named after a callback and is ``True`` (on, with its defaults, the default),
    ``False`` (off) or a dict of its keyword arguments.

    ====================== ==================== ================================================
    option                 callback             what it does
    ====================== ==================== ================================================
    ``auto_num_workers``   `AutoNumWorkers`     measured ``num_workers`` for plain DataLoaders
    ``step_time_monitor``  `StepTimeMonitor`    data wait vs compute per step, input-bound check
    ``loss_logging_guard`` `LossLoggingGuard`   values kept between steps that hold a graph
    ``sync_guard``         `SyncGuard`          host-device syncs in the step, at their line
    ``boost_report``       `BoostReport`        console table, JSON/Markdown/plots, hparams
    ====================== ==================== ================================================

    Raises:
        ValueError: for an unknown option (with close matches).
        TypeError: for a value that is not a bool or a dict.

    Example:
        >>> [type(c).__name__ for c in boost_callbacks(step_time_monitor={"threshold": 0.2})]
        ['AutoNumWorkers', 'StepTimeMonitor', 'LossLoggingGuard', 'SyncGuard', 'BoostReport']
        >>> [type(c).__name__ for c in boost_callbacks(auto_num_workers=False)]
        ['StepTimeMonitor', 'LossLoggingGuard', 'SyncGuard', 'BoostReport']
    """
    for name, value in options.items():
        if name not in RECOMMENDED:
            raise unknown_choice_error("option", name, RECOMMENDED)
        if not isinstance(value, (bool, Mapping)):
            raise TypeError(
                f"`{name}` expected True, False or a dict of {RECOMMENDED[name].__name__}'s arguments,"
                f" got {type(value).__name__}."
            )
    callbacks = []
    for name, factory in RECOMMENDED.items():
        value = options.get(name, True)
        if value is False:
            continue
        callbacks.append(factory(**value) if isinstance(value, Mapping) else factory())
    return callbacks
