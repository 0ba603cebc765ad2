"""Models a copy cannot train as the run does, under the pack in real CPU fits: lazy modules
(``nn.LazyLinear``, ``nn.LazyConv2d``: their parameters are shaped by the first forward), whose
parameters nothing reads before they have a shape, and TorchScript modules, whose copies take no
gradients; and steps that return None at the trials' batch (Lightning skips it), which leave no
step to time. `AutoBatchSize` keeps the size with a finding that says why (and how to have it tuned).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_boost import AutoBatchSize, boost_callbacks, preset
from lightning_boost.fingerprints import describe_model
from lightning_boost.presets.plans import model_parameter_count
from lightning_boost.testing import BoringDataModule, BoringModel
from tests.conftest import spawned_ddp_trainer
from tests.test_goodput import MLP, Classes, classes, quiet_trainer

pytestmark = pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps")


class LazyMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 10))


def test_a_lazy_model_trains_at_its_size_with_the_dry_run_named(tmp_path: Path) -> None:
    """Counting the model's parameters for the trials' cache key raised ("Attempted to use an
    uninitialized parameter in numel") and the fit stopped before its first step."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    trainer = quiet_trainer(tmp_path, [*boost_callbacks(), tuner], strategy=preset("auto"))
    trainer.fit(model := LazyMLP(), datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.batch_size == 32
    assert "`net.0` (LazyLinear) is a lazy module" in tuner.decision.kept
    assert "dry run" in tuner.decision.kept
    assert model.net[0].weight.shape == (64, 32) and trainer.global_step == 7168 // 32


def test_after_a_dry_run_the_size_is_tuned(tmp_path: Path) -> None:
    tuner = AutoBatchSize(min_efficiency=0.5)
    model = LazyMLP()
    model.net(torch.zeros(1, 32))  # PyTorch's advice for lazy modules
    quiet_trainer(tmp_path, [tuner]).fit(model, datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.batch_size > 32


def test_a_lazy_models_size_is_unknown_and_its_description_counts_what_has_a_shape() -> None:
    model = LazyMLP()
    assert model_parameter_count(model) is None
    assert describe_model(model) == f"{LazyMLP.__module__}.LazyMLP: 650 parameters, 2 uninitialized"
    model.net(torch.zeros(1, 32))
    assert model_parameter_count(model) == 32 * 64 + 64 + 650


class ScriptedMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():  # deprecated (torch 2.14), still in models' code
            warnings.simplefilter("ignore", FutureWarning)
            self.net = torch.jit.script(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))


def test_a_torchscript_module_keeps_the_size_and_trains(tmp_path: Path) -> None:
    """A copy of a TorchScript module holds parameters that are not graph leaves: the trials'
    steps trained none of them (and read their gradients with a warning), so the noise scale and
    the step's cost were a copy's that trains nothing."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    trainer = quiet_trainer(tmp_path, [tuner])
    model = ScriptedMLP()
    before = [param.detach().clone() for param in model.parameters()]
    trainer.fit(model, datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.batch_size == 32
    assert "`net` is a TorchScript module" in tuner.decision.kept and tuner.decision.trials == ()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class SkipsFirstBatch(MLP):
    """Skips each epoch's first batch (`training_step` returns None: Lightning steps over it), as
    a step that waits for a warm-up batch does."""

    skipped = 0

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        if batch_idx == 0:
            self.skipped += 1
            return None
        return super().training_step(batch, batch_idx)


class PlainClasses(L.LightningDataModule):
    batch_size = 32

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(classes(7168), batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(classes(1024, seed=1), batch_size=self.batch_size)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`:UserWarning")  # Lightning's, at its skip
def test_a_step_that_skips_the_trials_batch_keeps_the_size_and_the_run_goes_on(tmp_path: Path) -> None:
    """The trials' step at batch_idx 0 returned None, which they read as a failed step
    ("`training_step` returned NoneType, expected a loss tensor") and the fit stopped there, where
    plain Lightning skips that batch and trains on. The probes that only time steps (the worker
    search's on a copy, the precision's) take a skipped step as the run does: before, the worker
    search dropped its probe of the model's threads, saying a copy of the model could not step."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    callbacks = [*boost_callbacks(), tuner]
    trainer = quiet_trainer(tmp_path, callbacks, strategy=preset("auto"))
    model = SkipsFirstBatch()
    trainer.fit(model, datamodule=PlainClasses())  # its loaders' workers tuned by AutoNumWorkers
    assert tuner.decision is not None and tuner.decision.batch_size == 32
    assert "`training_step` returned None" in tuner.decision.kept
    assert model.skipped == 1  # the run's own skip: the trials' copies counted theirs
    assert trainer.global_step == 7168 // 32  # Lightning counts the skipped batch's step too
    titles = [finding.title for callback in callbacks for finding in getattr(callback, "findings", [])]
    assert [title for title in titles if title.startswith("train loader at batch 32: num_workers=")]
    assert not [title for title in titles if "cannot run on a copy" in title], titles


class RankOneSkipsFirstBatch(BoringModel):
    """Rank 1 alone skips its first batch (`dist.get_rank()`: the same on a copy as in the run)."""

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        if dist.get_rank() == 1 and batch_idx == 0:
            return None
        return super().training_step(batch, batch_idx)


@pytest.mark.ddp
def test_a_skip_on_one_rank_ends_every_ranks_trials_and_lightning_says_why(tmp_path: Path) -> None:
    """The ranks' trials end together (rank 0's step ran, rank 1's skipped: both keep the size,
    neither waits at a trial the other left), and the run meets Lightning's own error, as it
    would without the pack: DDP cannot skip a step. Before, rank 1's skip was a failed step."""
    trainer = spawned_ddp_trainer(tmp_path, [AutoBatchSize(steps=1, min_efficiency=0.01)])
    with pytest.raises(
        ProcessRaisedException, match="returning None in distributed training is not supported"
    ):
        trainer.fit(RankOneSkipsFirstBatch(), datamodule=BoringDataModule(length=20480))
