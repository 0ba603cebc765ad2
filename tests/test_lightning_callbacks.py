"""`AutoBatchSize` beside Lightning's callbacks that change the training during the fit, in real CPU
Trainer runs: fine-tuning (`BackboneFinetuning`, `BaseFinetuning`), which freezes a backbone before
the fit and unfreezes it during it, and `StochasticWeightAveraging`, which sets its own rate.

Peaks are the CPU estimate from the step's live tensors (`step_probe._Peak`), real here; the
trials' throughput is scripted (`tests/conftest.py`), so which size wins does not hang on timer noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning, StochasticWeightAveraging
from torch import Tensor, nn
from typing_extensions import override

from lightning_boost import AutoBatchSize
from lightning_boost.batch_size.finetuning import unfrozen_later
from lightning_boost.batch_size.held_rates import scale_held_rates
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer

pytestmark = pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps")


class Backboned(BoringModel):
    """A backbone and a head, the shape `BackboneFinetuning` fine-tunes; its optimizer holds the
    parameters that train when it is built, as Lightning's docs write it."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.backbone = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.layer = nn.Linear(256, 2)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.layer(self.backbone(x))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.hparams["lr"])


class FrozenByHand(Backboned):
    """The same model with its backbone frozen for the whole fit (a linear probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone.requires_grad_(False)


class UnfreezeAll(BaseFinetuning):
    """A user's own fine-tuning callback: which parameters it unfreezes is its own code."""

    @override
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    @override
    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer)


def tuned(
    tmp_path: Path, model: L.LightningModule, *callbacks: L.Callback, epochs: int = 2, retune: bool = True
) -> AutoBatchSize:
    tuner = AutoBatchSize(
        steps=1, tolerance=0.0, max_batch_size=16, lr_scaling="linear", min_efficiency=0.3, retune=retune
    )
    trainer = tiny_trainer(tmp_path, callbacks=[tuner, *callbacks], logger=False, max_epochs=epochs)
    trainer.fit(model, datamodule=BoringDataModule(length=256))
    return tuner


def peak_at_8(tuner: AutoBatchSize) -> int:
    (trial,) = [trial for trial in tuner.result["trials"] if trial["size"] == 8]
    return int(trial["peak_bytes"])


def test_a_backbone_unfrozen_during_the_fit_is_measured_as_it_trains_then(tmp_path: Path) -> None:
    """Frozen at the start, the backbone has no gradients or optimizer state and saves fewer
    activations: measured so, the batch fitted the epochs before `BackboneFinetuning` unfroze it
    and could run out of memory after (peak about a quarter of the trainable model's here). Measured with it
    trainable, the trial peaks as the fully trainable model does."""
    trainable = peak_at_8(tuned(tmp_path / "trainable", Backboned()))
    probe = peak_at_8(tuned(tmp_path / "probe", FrozenByHand()))
    finetuned = tuned(tmp_path / "finetuned", Backboned(), BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    assert probe < 0.5 * trainable  # the linear probe measures what it trains
    assert peak_at_8(finetuned) == pytest.approx(trainable, rel=0.1)
    (finding,) = [f for f in finetuned.findings if "fine-tuning callback" in f.title]
    backbone = sum(p.numel() for p in Backboned().backbone.parameters())
    assert f"{backbone:,} parameters" in finding.title and finding.data["unfrozen_tensors"] == 4
    own = tuned(tmp_path / "own", Backboned(), UnfreezeAll())  # a user's callback: every frozen one
    assert peak_at_8(own) == pytest.approx(trainable, rel=0.1)


def test_a_backbone_that_stays_frozen_for_the_run_is_measured_frozen(tmp_path: Path) -> None:
    later = tuned(tmp_path, Backboned(), BackboneFinetuning(unfreeze_backbone_at_epoch=2), epochs=2)
    probe = peak_at_8(tuned(tmp_path / "probe", FrozenByHand()))
    assert peak_at_8(later) == pytest.approx(probe, rel=0.1)
    assert not [f for f in later.findings if "fine-tuning callback" in f.title]


def test_a_cached_size_is_used_only_by_a_run_that_trains_the_same_parameters(tmp_path: Path) -> None:
    """The cache was keyed by the model's class and parameter count: a fit of the whole model reused
    the size a fit with its backbone frozen had measured, and the other way round."""
    trainable = peak_at_8(tuned(tmp_path / "trainable", Backboned(), retune=False))
    frozen = tuned(
        tmp_path / "frozen", Backboned(), BackboneFinetuning(unfreeze_backbone_at_epoch=5), retune=False
    )
    assert frozen.result["source"] != "cache" and peak_at_8(frozen) < 0.5 * trainable
    again = tuned(
        tmp_path / "again", Backboned(), BackboneFinetuning(unfreeze_backbone_at_epoch=1), retune=False
    )
    assert again.result["source"] == "cache" and peak_at_8(again) == trainable  # trains the same ones


class GroupRates(L.Callback):
    """The last param group's `key` at each epoch's first batch, once it has one (`groups` of them)."""

    def __init__(self, key: str = "lr", groups: int = 2) -> None:
        self.key, self.groups = key, groups
        self.rates: dict[int, float] = {}

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        groups = trainer.optimizers[0].param_groups
        if i == 0 and len(groups) >= self.groups and self.key in groups[-1]:
            self.rates[trainer.current_epoch] = groups[-1][self.key]


def test_the_backbones_own_learning_rate_follows_the_batch(tmp_path: Path) -> None:
    """`BackboneFinetuning(backbone_initial_lr=...)` sets the unfrozen backbone's rate from its own
    argument, then from its own state each epoch (x2 by default): the batch's scaling of the optimizer's
    rates did not reach them, and the backbone trained at the rate meant for the configured batch.
    The argument is the user's as written after the fit."""
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.01)
    rates = GroupRates()
    tuner = tuned(tmp_path, Backboned(), finetuning, rates, epochs=3)
    factor = tuner.result["lr_factor"]
    assert factor > 1.0  # a larger batch at scripted fixed-cost steps, under the linear rule
    assert rates.rates == pytest.approx({1: 0.01 * factor, 2: 0.02 * factor})
    assert finetuning.backbone_initial_lr == 0.01


def test_backbone_rates_are_scaled_with_the_optimizers() -> None:
    finetuning = BackboneFinetuning(backbone_initial_lr=0.01)
    finetuning.previous_backbone_lr = 0.02  # unfrozen already: the growth of the batch scales it
    trainer = L.Trainer(callbacks=[finetuning], accelerator="cpu", logger=False)
    scale_held_rates(trainer, 2.0)
    assert (finetuning.backbone_initial_lr, finetuning.previous_backbone_lr) == (0.02, 0.04)
    assert unfrozen_later(trainer, Backboned()) == []  # nothing frozen: nothing to unfreeze


def test_the_averaging_rate_follows_the_batch(tmp_path: Path) -> None:
    """`StochasticWeightAveraging(swa_lrs=...)` anneals to its own rate once averaging starts: the
    optimizer's rates were scaled for the tuned batch and then annealed to the configured batch's."""
    averaging = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1)
    rates = GroupRates("swa_lr", groups=1)
    tuner = tuned(tmp_path, Backboned(), averaging, rates, epochs=3)
    factor = tuner.result["lr_factor"]
    assert factor > 1.0
    assert rates.rates == pytest.approx({1: 0.05 * factor, 2: 0.05 * factor})
    assert averaging._swa_lrs == 0.05  # the argument as written, for another fit
