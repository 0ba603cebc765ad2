from pathlib import Path
from typing import Any

import lightning as L
import pytest

from lightning_boost import (
    AutoBatchSize,
    AutoMicroBatch,
    AutoNumWorkers,
    BoostReport,
    LossLoggingGuard,
    StepTimeMonitor,
    SyncGuard,
    WorkerTuning,
    boost_callbacks,
)
from lightning_boost._lightning import BATCH_HOOKS
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer


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


def test_lightning_calls_only_the_batch_hooks_each_callback_uses() -> None:
    """Lightning calls every callable hook of every callback at every batch; the pack's callbacks
    leave the ones they do not use as ``None`` (each no-op cost about 3 µs a call)."""
    for callback in [*boost_callbacks(), AutoBatchSize()]:
        for hook in BATCH_HOOKS:
            fn = getattr(callback, hook)
            assert fn is None or getattr(type(callback), hook) is not getattr(L.Callback, hook), hook
    assert SyncGuard().on_before_backward is None and callable(SyncGuard().on_train_batch_start)


class CountsBackward(SyncGuard):
    """A user's subclass: the hook SyncGuard leaves out, with ``super()`` as any callback calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.backward = 0

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self.backward += 1
        super().on_before_backward(trainer, pl_module, loss)


class Plain(StepTimeMonitor):
    """A user's subclass that changes no hook: Callback's no-ops back, as its own."""


def test_a_users_subclass_gets_every_hook_back(tmp_path: Path) -> None:
    counts = CountsBackward()
    trainer = tiny_trainer(tmp_path, callbacks=[counts, Plain()], logger=False, enable_checkpointing=False)
    trainer.fit(BoringModel(), BoringDataModule())
    assert counts.backward == 4  # tiny_trainer's four steps, super() included
    assert all(callable(getattr(Plain(), hook)) for hook in BATCH_HOOKS)
    assert all(callable(getattr(counts, hook)) for hook in BATCH_HOOKS)
