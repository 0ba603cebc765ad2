"""A loss summed over the batch (``reduction="sum"``) under `AutoBatchSize`, in real CPU fits.

A summed loss already takes steps as large as the batch: under SGD a larger batch trained at a
proportionally larger rate before any scaling (by hand: the time-to-quality MLP at 32 with SGD,
grown to 128 over 6 epochs, ended at 0.78 validation accuracy against plain's 0.83). The run now
keeps its size and says why; an averaged loss, batch norm or not, is tuned as before.

The trials' throughput is scripted (`fixed_cost_steps`); losses and gradients are the real step's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_boost import AutoBatchSize
from tests.test_goodput import MLP, Classes, quiet_trainer

pytestmark = pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps")


class Reduced(MLP):
    """`MLP` with SGD whose loss is reduced as `reduction` says, with batch norm or without."""

    def __init__(self, reduction: str, norm: bool = False) -> None:
        super().__init__()
        self.reduction = reduction
        if norm:
            self.net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1], reduction=self.reduction)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1 if self.reduction == "mean" else 0.1 / 32)


def fit(tmp_path: Path, model: Reduced) -> AutoBatchSize:
    tuner = AutoBatchSize(min_efficiency=0.5, grow=True)
    trainer = quiet_trainer(tmp_path, [tuner], max_epochs=1)
    trainer.fit(model, datamodule=Classes(batch_size=32))
    assert tuner.decision is not None and trainer.train_dataloader.batch_size == tuner.decision.batch_size
    return tuner


def test_a_loss_summed_over_the_batch_keeps_the_configured_size(tmp_path: Path) -> None:
    decision = fit(tmp_path, Reduced("sum")).decision
    assert decision is not None and decision.batch_size == 32 and decision.lr_factor == 1.0
    assert "loss sums over the batch" in decision.kept and "2.00x the mean" in decision.kept
    assert not decision.trials  # nothing timed


@pytest.mark.parametrize("norm", [False, True])
def test_a_loss_averaged_over_the_batch_is_tuned(tmp_path: Path, norm: bool) -> None:
    decision = fit(tmp_path, Reduced("mean", norm)).decision
    assert decision is not None and not decision.kept and decision.batch_size > 32
