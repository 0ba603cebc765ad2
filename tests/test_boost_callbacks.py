from typing import Any

import pytest

from lightning_boost import (
    AutoMicroBatch,
    AutoNumWorkers,
    BoostReport,
    LossLoggingGuard,
    StepTimeMonitor,
    SyncGuard,
    WorkerTuning,
    boost_callbacks,
)


def test_default_set_is_tuning_monitoring_the_guards_and_the_report() -> None:
    assert [type(c) for c in boost_callbacks()] == [
        AutoNumWorkers,
        AutoMicroBatch,
        StepTimeMonitor,
        LossLoggingGuard,
        SyncGuard,
        BoostReport,
    ]


def test_options_configure_or_drop_each_callback() -> None:
    tuning = WorkerTuning(window_s=0.2)
    workers, micro, guard, syncs, report = boost_callbacks(
        auto_num_workers={"tuning": tuning},
        auto_micro_batch={"loss_reduction": "sum"},
        step_time_monitor=False,
        loss_logging_guard={"mode": "error"},
        sync_guard={"allow": ["model.py:12"]},
        boost_report={"console": False},
    )
    assert isinstance(workers, AutoNumWorkers) and workers.tuning is tuning
    assert isinstance(micro, AutoMicroBatch) and micro.loss_reduction == "sum"
    assert isinstance(guard, LossLoggingGuard) and guard.mode == "error"
    assert isinstance(syncs, SyncGuard) and syncs.allow == ("model.py:12",)
    assert isinstance(report, BoostReport) and not report.console
    names = ["auto_num_workers", "auto_micro_batch", "step_time_monitor", "loss_logging_guard", "sync_guard"]
    off = dict.fromkeys([*names, "boost_report"], False)
    assert boost_callbacks(**off) == []


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (
            {"step_time": True},
            TypeError,
            r"boost_callbacks\(\) got an unknown argument `step_time`.* Did you mean 'step_time_monitor'",
        ),
        (
            {"boost_report": "off"},
            TypeError,
            r"`boost_report` expected True or False or a mapping with string keys, got 'off' \(str\)",
        ),
        (
            {"step_time_monitor": {"threshold": 2}},
            ValueError,
            r"`threshold` expected a finite number > 0 and < 1, got 2",
        ),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        boost_callbacks(**options)
