"""Test helpers shipped with the package: a boring model and datamodule, and test markers.

Use them to test your own subclasses and callbacks the way lightning-boost tests its own::

    import lightning as L
    from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer

    def test_my_callback(tmp_path):
        trainer = tiny_trainer(tmp_path, callbacks=[MyCallback()])
        trainer.fit(BoringModel(), datamodule=BoringDataModule())

The pytest markers ``gpu`` (skipped without CUDA) and ``ddp`` (2 CPU processes over gloo) come
from the plugin: add ``pytest_plugins = ["lightning_boost.testing.pytest_plugin"]`` to your
``conftest.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar, overload

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = ["BoringDataModule", "BoringModel", "RandomDataset", "cpu_only", "marked_line", "tiny_trainer"]


def marked_line(file: str | Path, mark: str) -> str:
    """``file:line`` of the line in `file` that ends with the comment ``# <mark>``.

    Tests of the guards mark the line they expect a finding at (``loss.item()  # syncs: item``)
    and compare it with the finding's ``location``.
    """
    path = Path(file).resolve()
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {mark}"):
            return f"{path}:{number}"
    raise LookupError(f"no line of {path} ends with '# {mark}'")


class RandomDataset(Dataset[tuple[Tensor, Tensor]]):
    """`length` Gaussian inputs drawn with `seed`; targets from one fixed linear map, so every
    split (one seed each) poses the same regression."""

    def __init__(self, features: int = 32, length: int = 64, seed: int = 0) -> None:
        weight = torch.randn(features, 2, generator=torch.Generator().manual_seed(1234))
        self.inputs = torch.randn(length, features, generator=torch.Generator().manual_seed(seed))
        self.targets = self.inputs @ weight / features**0.5

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.inputs[index], self.targets[index]


class BoringModel(L.LightningModule):
    """A linear regression with SGD that logs ``train_loss``/``val_loss`` the recommended way."""

    def __init__(self, features: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(features, 2)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs), targets)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    @override
    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


class BoringDataModule(L.LightningDataModule):
    """Four loaders over `RandomDataset`; ``batch_size`` is a plain, writable attribute."""

    def __init__(self, features: int = 32, length: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        self.features = features
        self.length = length
        self.batch_size = batch_size

    def _loader(self, seed: int, shuffle: bool = False) -> DataLoader[tuple[Tensor, Tensor]]:
        dataset = RandomDataset(self.features, self.length, seed)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle)

    @override
    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(seed=0, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(seed=1)

    @override
    def test_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(seed=2)

    @override
    def predict_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(seed=3)


@contextlib.contextmanager
def cpu_only() -> Iterator[None]:
    """Build a Trainer that pins the CPU inside this block: on a machine with a GPU, Lightning's
    "GPU available but not used" warning is not raised here (any other warning is).

    A test that asks for the CPU means it; wrap where its Trainer is built (``tiny_trainer``
    does, a `LightningCLI` with ``accelerator: cpu`` in its config needs it around the CLI).
    """
    with warnings.catch_warnings():
        # by message: `pytorch_lightning` warns with `lightning_fabric`'s own PossibleUserWarning
        warnings.filterwarnings("ignore", "GPU available but not used")
        yield


_Trainer = TypeVar("_Trainer")


@overload
def tiny_trainer(root: str | Path, *, trainer_class: type[_Trainer], **overrides: Any) -> _Trainer: ...
@overload
def tiny_trainer(root: str | Path, **overrides: Any) -> L.Trainer: ...
def tiny_trainer(root: str | Path, *, trainer_class: type[Any] = L.Trainer, **overrides: Any) -> Any:
    """A CPU `Trainer` for tests: a few steps, a CSV logger, no progress bar or summary, under `root`.

    On a machine with a GPU, Lightning warns at construction that the GPU is not used; a test
    that pins the CPU means it, so that one warning is not raised here (`cpu_only`).
    ``trainer_class=pytorch_lightning.Trainer`` builds one for a ``pytorch_lightning`` module.
    """
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        logger=CSVLogger(str(root), name="tiny"),
    )
    options.update(overrides)
    if options["accelerator"] != "cpu":
        return trainer_class(**options)
    with cpu_only():
        return trainer_class(**options)
