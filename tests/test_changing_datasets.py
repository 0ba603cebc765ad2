"""A training set the main process changes between epochs (a curriculum, progressive resizing):
the persistent workers the pack turns on load each epoch's samples as they are then."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_boost import BoostedDataModule
from lightning_boost.testing import tiny_trainer
from lightning_boost.workers.loaders import SameOrderDataLoader, rebuild_loader


class Scaled(Dataset[tuple[Tensor, Tensor]]):
    """Samples whose values are the curriculum's `scale` for the epoch."""

    def __init__(self) -> None:
        self.scale = 1.0

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return torch.full((8,), self.scale), torch.zeros(1)


class Curriculum(L.Callback):
    """Sets the training set's scale to the epoch's number, at its start, as a curriculum does."""

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.train_dataloader.dataset.scale = float(trainer.current_epoch + 1)  # type: ignore[union-attr]


class Seen(L.LightningModule):
    """The sample values each epoch trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.seen: dict[int, set[float]] = {}

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.seen.setdefault(self.current_epoch, set()).update(batch[0][:, 0].tolist())
        return self.layer(batch[0]).pow(2).mean()

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ScaledData(BoostedDataModule):
    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = Scaled()


class RebuiltLoader(L.LightningDataModule):
    """The user's loader as `AutoNumWorkers` rebuilds it once it chose 2 workers."""

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        own = DataLoader(Scaled(), batch_size=32)
        return rebuild_loader(own, SameOrderDataLoader, num_workers=2, persistent_workers=True)


@pytest.mark.parametrize("loaders", ["BoostedDataModule", "AutoNumWorkers"])
def test_persistent_workers_load_each_epochs_samples_as_the_main_process_set_them(
    tmp_path: Path, loaders: str
) -> None:
    """With 2 persistent workers, epochs 2 and 3 loaded epoch 1's samples (scale 2): the workers
    held the dataset as it was when they started. Now each epoch loads its own, as without workers."""
    datamodule = (
        ScaledData(batch_size=32, num_workers=2) if loaders == "BoostedDataModule" else RebuiltLoader()
    )
    model = Seen()
    trainer = tiny_trainer(
        tmp_path, callbacks=[Curriculum()], max_epochs=4, limit_train_batches=1.0, limit_val_batches=0
    )
    trainer.fit(model, datamodule=datamodule)
    loader = trainer.train_dataloader
    assert isinstance(loader, DataLoader) and loader.num_workers == 2 and loader.persistent_workers
    assert model.seen == {epoch: {float(epoch + 1)} for epoch in range(4)}
