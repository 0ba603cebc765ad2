"""Steps that depend on the batch size: one that reads the batch-size attribute (a contrastive
loss's labels) runs at each trial's size, as it will in the tuned run; one written for its
configured size alone keeps it, instead of stopping the fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_boost import AutoBatchSize
from tests.test_goodput import MLP, Classes, quiet_trainer


class Viewed(MLP):
    """Steps that shape their batch by the `batch_size` hyperparameter, as many programs build a
    contrastive loss's labels (``torch.arange(self.hparams.batch_size)``) or a sequence's view."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x = batch[0].reshape(self.hparams["batch_size"], -1)
        return nn.functional.cross_entropy(self.net(x), batch[1])

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))


class Reshaped(MLP):
    """A step that reshapes by the size it was written for."""

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x = batch[0].reshape(32, 32)
        return nn.functional.cross_entropy(self.net(x), batch[1])


def fit(tmp_path: Path, model: L.LightningModule, tuner: AutoBatchSize, **data: Any) -> L.Trainer:
    trainer = quiet_trainer(tmp_path, [tuner], max_epochs=2, logger=False)
    trainer.fit(model, datamodule=Classes(samples=16384, batch_size=32, **data))
    return trainer


@pytest.mark.usefixtures("fixed_cost_steps")
def test_a_step_that_reads_the_batch_size_attribute_runs_at_each_trials_size(tmp_path: Path) -> None:
    """The trials ran on a copy whose `batch_size` was still the configured 32, so the step failed
    at 64, and the fit stopped before its first step ("mat1 and mat2 shapes cannot be multiplied
    (32x64 and 32x64)"; a contrastive loss's labels: "Expected input batch_size (64) to match
    target batch_size (32)"). The copy now holds each trial's size, as the module holds the tuned one in
    the run: the run tunes, trains and validates at it."""
    tuner = AutoBatchSize(retune=True, min_efficiency=0.5)
    model = Viewed()
    trainer = fit(tmp_path, model, tuner, drop_last=True)
    decision = tuner.decision
    assert decision is not None and decision.batch_size > 32
    assert trainer.global_step == 2 * (16384 // decision.batch_size)
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    assert model.hparams["batch_size"] == 32  # put back after the fit


@pytest.mark.usefixtures("fixed_cost_steps")
def test_a_step_written_for_its_configured_size_keeps_it(tmp_path: Path) -> None:
    """The step ran at 32 and failed at 64: the fit stopped before its first step. The size that
    ran is kept, and the report says where the search stopped and why."""
    tuner = AutoBatchSize(retune=True, min_efficiency=0.5)
    trainer = fit(tmp_path, Reshaped(), tuner, drop_last=True)
    decision = tuner.decision
    assert decision is not None and decision.batch_size == 32 and decision.lr_factor == 1.0
    assert decision.stopped.startswith("the step failed at batch size 64 (RuntimeError(")
    assert trainer.global_step == 2 * (16384 // 32)
