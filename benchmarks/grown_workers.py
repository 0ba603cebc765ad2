"""A batch grown during a CPU run whose loading wants workers: does the grown loader keep them?

`BoostedDataModule` searches the training loader's workers on its first epoch's own batches. A
batch grown 4x later (a batch-size schedule, or `AutoBatchSize(grow=True)`) rebuilds the loader
with a quarter of the batches an epoch, often too few to search again. Before, such a loader
went back to the machine's prior: on a CPU, loading in the main process. Now it keeps the setting
found at the smaller batch (`carried_choice`): a loader's cost per sample does not depend on its
batch size.

The workload: 8,192 samples of a learnable task (labels from a fixed linear teacher) that each
take 0.4 ms of CPU to load (a decode and augmentation stand-in), a 64-256-10 MLP with SGD at
0.05, batch 32 on epoch 0 and 128 from epoch 1 on (Lightning rebuilds the loader each epoch),
`epochs` epochs. Three fits a round, in turn first: plain Lightning (its `DataLoader` at
PyTorch's default, 0 workers), the datamodule as it is, the datamodule with the carry off (the
pack before). The row gives the fit time without the carry over with it (above 1: faster), the
median over the rounds; the detail gives each run's final val accuracy and workers at 128.

Run: ``python -m benchmarks grown_workers``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any
from unittest import mock

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from benchmarks.common import Row, rotated
from lightning_boost import BoostedDataModule
from lightning_boost.workers import tuner

COMMAND = "python -m benchmarks grown_workers"
LOAD_S = 4e-4


class Loaded(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`samples` of a learnable task, each costing `LOAD_S` of CPU in `__getitem__`."""

    def __init__(self, samples: int, seed: int) -> None:
        self.x = torch.randn(samples, 64, generator=torch.Generator().manual_seed(seed))
        teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
        self.y = (self.x @ teacher).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        while time.perf_counter() - start < LOAD_S:  # busy: the CPU a decode would take
            pass
        return self.x[index], self.y[index]


class Tuned(BoostedDataModule):
    def __init__(self, samples: int) -> None:
        super().__init__(batch_size=32, shuffle=True)
        self.samples = samples

    @override
    def setup(self, stage: str) -> None:
        self.train_dataset, self.val_dataset = Loaded(self.samples, 0), Loaded(1024, 2)


class Plain(L.LightningDataModule):
    def __init__(self, samples: int) -> None:
        super().__init__()
        self.batch_size, self.samples = 32, samples

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Loaded(self.samples, 0), batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Loaded(1024, 2), batch_size=32)


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_acc", (self.net(batch[0]).argmax(1) == batch[1]).float().mean())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Grown(L.Callback):
    """The batch 4x after epoch 0: the loader Lightning rebuilds for epoch 1 is at 128."""

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.datamodule.batch_size *= 4  # type: ignore[attr-defined]


def run(rounds: int = 2, epochs: int = 4, samples: int = 8192) -> list[Row]:
    seconds: dict[str, list[float]] = {"plain": [], "carried": [], "prior": []}
    finals: dict[str, list[str]] = {name: [] for name in seconds}
    for turn in range(rounds):
        for name in rotated(list(seconds), turn):
            took, final = _fit(name, epochs, samples)
            seconds[name].append(took)
            finals[name].append(final)
    ratio = statistics.median(p / c for p, c in zip(seconds["prior"], seconds["carried"], strict=True))
    listed = {name: ", ".join(f"{s:.1f} s" for s in times) for name, times in seconds.items()}
    return [
        Row(
            "batch grown 4x on a CPU, loader too short to search again: fit time, prior workers / kept",
            ratio,
            f"{samples} samples at {LOAD_S * 1e3:.1f} ms of loading each, an MLP, batch 32 then 128 from"
            f" epoch 1, {epochs} epochs, {rounds} rounds; kept: {listed['carried']} (final val acc, workers"
            f" at 128: {'; '.join(finals['carried'])}); the prior (before): {listed['prior']}"
            f" ({'; '.join(finals['prior'])}); plain Lightning, 0 workers: {listed['plain']}"
            f" ({'; '.join(finals['plain'])})",
            COMMAND,
        )
    ]


def _fit(name: str, epochs: int, samples: int) -> tuple[float, str]:
    """The fit's seconds, and its final val accuracy with the training loader's workers at the end."""
    L.seed_everything(0, verbose=False)
    data: L.LightningDataModule = Plain(samples) if name == "plain" else Tuned(samples)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        reload_dataloaders_every_n_epochs=1,
        callbacks=[Grown()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    carry = tuner.carried_choice if name != "prior" else lambda *args: None
    start = time.perf_counter()
    with mock.patch.object(tuner, "carried_choice", carry):
        trainer.fit(MLP(), datamodule=data)
    took = time.perf_counter() - start
    loader = trainer.train_dataloader
    workers = loader.num_workers if isinstance(loader, DataLoader) else 0
    return took, f"{float(trainer.callback_metrics['val_acc']):.3f}, {workers}"
