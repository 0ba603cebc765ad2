"""A `BoostedDataModule` whose ``train_dataloader()`` the user overrides (the docs' way to train on
a loader of their own: several tasks' loaders at once, a collate of their own), in real CPU fits.

The datamodule's `train_dataset` is then not what training loads: `AutoBatchSize` takes its trial
batches from the user's loader, as for any datamodule, and `AutoNumWorkers` searches the workers
of the loaders the user built (the datamodule tunes the ones it builds itself).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, default_collate
from typing_extensions import override

from lightning_boost import AutoBatchSize, AutoNumWorkers, BoostReport
from lightning_boost.batch_size.measure import wants_eval_size
from lightning_boost.data.datamodule import builds_loader
from lightning_boost.workers.loaders import DeferredStartDataLoader
from tests.test_goodput import MLP, Classes, classes, quiet_trainer

pytestmark = pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps")


def as_dict(samples: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    x, y = default_collate(samples)
    return {"x": x, "y": y}


class DictMLP(MLP):
    """`MLP` whose steps read the batches a collate of the user's own makes."""

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:  # type: ignore[override]
        return super().training_step((batch["x"], batch["y"]), batch_idx)

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:  # type: ignore[override]
        super().validation_step((batch["x"], batch["y"]), batch_idx)


class OwnCollate(Classes):
    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True, collate_fn=as_dict)

    @override
    def val_dataloader(self) -> DataLoader[Any]:  # type: ignore[override]
        return DataLoader(self.val_dataset, batch_size=self.batch_size, collate_fn=as_dict)


class TwoTasks(L.LightningModule):
    """Two heads over one body, a batch from each task's loader at every step (a dict of loaders)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.heads = nn.ModuleDict({"a": nn.Linear(64, 10), "b": nn.Linear(64, 10)})

    @override
    def training_step(self, batch: dict[str, list[Tensor]], batch_idx: int) -> Tensor:
        losses = [nn.functional.cross_entropy(self.heads[k](self.body(x)), y) for k, (x, y) in batch.items()]
        loss = torch.stack(losses).sum()
        self.log("train_loss", loss)
        return loss

    @override
    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self.heads["a"](self.body(batch[0])), batch[1]))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class TwoLoaders(Classes):
    @override
    def train_dataloader(self) -> dict[str, DataLoader[Any]]:  # type: ignore[override]
        tasks = {"a": self.train_dataset, "b": classes(2048, seed=2)}
        return {k: DataLoader(data, batch_size=self.batch_size, shuffle=True) for k, data in tasks.items()}


def test_which_loaders_the_datamodule_builds_itself() -> None:
    assert builds_loader(Classes(), "train") and builds_loader(Classes(), "val")
    assert not builds_loader(OwnCollate(), "train") and not builds_loader(OwnCollate(), "val")
    assert not builds_loader(TwoLoaders(), "train") and builds_loader(TwoLoaders(), "val")
    assert not builds_loader(L.LightningDataModule(), "train")


def test_an_evaluation_size_is_measured_only_for_the_datamodules_own_validation_loader() -> None:
    """On a GPU `AutoBatchSize` measures the evaluation size for the loader the datamodule builds;
    a `val_dataloader()` of the user's own keeps its size, so none is measured for it."""
    assert wants_eval_size(SimpleNamespace(datamodule=TwoLoaders()))  # type: ignore[arg-type]
    assert not wants_eval_size(SimpleNamespace(datamodule=OwnCollate()))  # type: ignore[arg-type]
    assert not wants_eval_size(SimpleNamespace(datamodule=Classes(eval_batch_size=64)))  # type: ignore[arg-type]


def test_the_trials_load_the_users_own_loader(tmp_path: Path) -> None:
    """Its collate makes dicts the steps read: trials on `train_dataset` with the datamodule's
    collate (tuples) failed at the first size, and the fit stopped before its first step."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    trainer = quiet_trainer(tmp_path, [tuner], max_epochs=1)
    trainer.fit(DictMLP(), datamodule=OwnCollate(batch_size=32))
    decision = tuner.decision
    assert decision is not None and decision.batch_size > 32
    assert trainer.train_dataloader.batch_size == decision.batch_size
    assert trainer.global_step == math.ceil(7168 / decision.batch_size)


def test_several_training_loaders_keep_their_size_and_get_workers_searched(tmp_path: Path) -> None:
    """A dict of loaders: the batch size stays as written (the trials time one loader's batches),
    the fit trains, and `AutoNumWorkers` rebuilds the user's loaders with a searched count."""
    tuner, workers = AutoBatchSize(), AutoNumWorkers()
    trainer = quiet_trainer(tmp_path, [tuner, workers, BoostReport(console=False)], max_epochs=1)
    trainer.fit(TwoTasks(), datamodule=TwoLoaders(batch_size=32))
    assert tuner.decision is None and trainer.global_step == 7168 // 32
    assert any("several" in f.title for f in tuner.findings)
    loaders = trainer.train_dataloader
    assert set(loaders) == {"a", "b"}
    assert all(isinstance(loader, DeferredStartDataLoader) for loader in loaders.values())
    assert "train" in workers.worker_tuner.choices or workers.worker_tuner.findings
    titles = [f.title for f in workers.worker_tuner.findings if " loader at batch " in f.title]
    assert {title.split(" loader at batch ")[0] for title in titles} == {"train ['a']", "train ['b']"}
