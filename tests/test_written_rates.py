"""A program that writes its own learning rates during the fit (Lightning's documented warm-up in
`optimizer_step`) keeps its batch size: a tuned batch would train at the rates it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from typing_extensions import override

from lightning_boost import AutoBatchSize
from lightning_boost.batch_size.written_rates import rate_writers, source_writes_rate
from tests.test_goodput import MLP, Classes, quiet_trainer


class WarmedUp(MLP):
    """Lightning's docs' learning-rate warm-up by hand, over the first 100 optimizer steps."""

    @override
    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < 100:
            lr_scale = min(1.0, float(self.trainer.global_step + 1) / 100.0)
            for pg in optimizer.param_groups:
                pg["lr"] = lr_scale * self.hparams["lr"]


class Decayed(MLP):
    """Lowers the rate it finds each epoch: a write that follows whatever rate the group holds."""

    @override
    def on_train_epoch_end(self) -> None:
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = group["lr"] * 0.9


class WarmUpCallback(L.Callback):
    """A warm-up of the user's own as a callback, setting the rate before each step."""

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        scale = min(1.0, (trainer.global_step + 1) / 100)
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = scale * 1e-3


def fit(tmp_path: Path, model: MLP, tuner: AutoBatchSize | None, more: list[L.Callback]) -> float:
    """A 2-epoch fit from seed 0 (the model built after it); its final validation loss."""
    trainer = quiet_trainer(tmp_path, [*more, *([tuner] if tuner else [])], max_epochs=2, logger=False)
    datamodule = Classes(samples=16384, batch_size=32)
    trainer.fit(model, datamodule=datamodule)
    (metrics,) = trainer.validate(model, datamodule=datamodule, verbose=False)
    return float(metrics["val_loss"])


def seeded(build: type[MLP]) -> MLP:
    torch.manual_seed(0)
    return build()


@pytest.mark.usefixtures("fixed_cost_steps")
@pytest.mark.parametrize("where", ["optimizer_step", "callback"])
def test_a_program_that_writes_its_rates_keeps_its_batch_and_its_model(tmp_path: Path, where: str) -> None:
    """Tuned to 4x the batch, the run trained at the rate the warm-up writes for the configured
    batch (the scaled one overwritten), through a warm-up of 100 steps that took 100 of its 256:
    it ended at a validation loss of 0.93 against plain's 0.36. The size is kept, the report says
    which method writes the rate and the fix, and the run is plain's."""
    model, more = (seeded(WarmedUp), []) if where == "optimizer_step" else (seeded(MLP), [WarmUpCallback()])
    plain = fit(tmp_path / "plain", model, None, more)
    tuner = AutoBatchSize(retune=True, min_efficiency=0.5)
    model = seeded(WarmedUp) if where == "optimizer_step" else seeded(MLP)
    tuned = fit(tmp_path / "tuned", model, tuner, more)
    decision = tuner.decision
    assert decision is not None and decision.batch_size == 32 and decision.lr_factor == 1.0
    writer = "WarmedUp.optimizer_step" if where == "optimizer_step" else "WarmUpCallback.on_train_batch_start"
    assert decision.kept.startswith(f"`{writer}` writes the learning rate itself")
    assert "SequentialLR" in decision.kept and "lr_scaling=None" in decision.kept
    assert tuned == pytest.approx(plain, rel=1e-4)


@pytest.mark.usefixtures("fixed_cost_steps")
def test_a_rate_that_follows_the_groups_own_and_lr_scaling_none_still_tune(tmp_path: Path) -> None:
    """A write that scales the group's own rate follows the tuned one; with `lr_scaling=None` the
    user keeps the rates as written, so the size is tuned at them."""
    relative = AutoBatchSize(retune=True, min_efficiency=0.5)
    fit(tmp_path / "relative", seeded(Decayed), relative, [])
    unscaled = AutoBatchSize(retune=True, min_efficiency=0.5, lr_scaling=None)
    fit(tmp_path / "unscaled", seeded(WarmedUp), unscaled, [])
    for tuner in (relative, unscaled):
        assert tuner.decision is not None and not tuner.decision.kept and tuner.decision.batch_size > 32


def test_only_a_write_into_the_optimizers_groups_from_a_value_of_its_own_counts() -> None:
    assert rate_writers([seeded(WarmedUp), WarmUpCallback()]) == [
        "WarmedUp.optimizer_step",
        "WarmUpCallback.on_train_batch_start",
    ]
    assert rate_writers([seeded(Decayed), seeded(MLP)]) == []
    assert not source_writes_rate('self.hparams["lr"] = 0.05 * batch_size / 32  # param_groups built later')
    assert source_writes_rate("self.optimizers().param_groups[0]['lr'] = 0.1")
    assert source_writes_rate('for pg in opt.param_groups: pg["lr"] = scale * self.hparams["lr"]')
