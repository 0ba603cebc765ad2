"""The guards mark the training steps they check (`lightning_boost.instrumented`), so that the
worker search's segments leave them out: real fits on the CPU."""

from pathlib import Path

from lightning_boost import LossLoggingGuard, SyncGuard, instrumented
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer


def test_every_step_a_guard_checks_is_marked_and_no_other(tmp_path: Path) -> None:
    sync, graphs = SyncGuard(mode="report"), LossLoggingGuard(mode="report")
    trainer = tiny_trainer(tmp_path, callbacks=[sync, graphs], limit_train_batches=40, limit_val_batches=0)
    before = instrumented.count()
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    (clean,) = [f for f in graphs.findings if "checks" in f.data]
    checked = sync.checked_steps["training"] + clean.data["checks"]
    assert 8 <= checked < 40 * 2  # the first steps of each, then what their budgets allow
    assert instrumented.count() - before == checked


def test_unguarded_steps_are_not_marked(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, limit_train_batches=8, limit_val_batches=0)
    before = instrumented.count()
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert instrumented.count() == before
