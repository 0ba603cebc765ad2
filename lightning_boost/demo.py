"""`lightning-boost demo`: the doctor, then a short fit on FakeData with the settings it implies.

A CIFAR-sized image task (torchvision ``FakeData`` with the usual CPU augmentation pipeline,
since nothing is downloaded) and a small CNN with torchmetrics accuracy, trained through a
`BoostedDataModule` (DataLoader workers measured, pinned memory on CUDA) and ``preset("auto")``.
It is the project's main job until the side-by-side demo (plain vs boosted) replaces it.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from typing_extensions import override

from lightning_boost.data import BoostedDataModule
from lightning_boost.doctor import run_checks
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset
from lightning_boost.report import BoostReport

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class SmallCNN(L.LightningModule):
    """Three conv blocks and a linear head for 32x32 RGB images; logs loss and accuracy."""

    def __init__(self, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            _block(3, 32),
            _block(32, 64),
            _block(64, 128),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, num_classes),
        )
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = nn.functional.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


def train_transform() -> transforms.Compose:
    """The usual CIFAR augmentation: random crop with padding, flip, tensor, normalize."""
    return transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
        ]
    )


def fake_cifar(samples: int) -> datasets.FakeData:
    """`samples` CIFAR-sized FakeData images (3x32x32, 10 classes) through `train_transform`."""
    return datasets.FakeData(
        size=samples, image_size=(3, 32, 32), num_classes=10, transform=train_transform()
    )


class FakeCIFAR(BoostedDataModule):
    """The demo's data: `fake_cifar` as a `BoostedDataModule`, whose loader settings are measured."""

    def __init__(self, samples: int = 2048, **kwargs: Any) -> None:
        super().__init__(drop_last=True, **kwargs)
        if samples < self.batch_size:
            raise ValueError(f"`samples` expected at least batch_size={self.batch_size}, got {samples}.")
        self.samples = samples

    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = fake_cifar(self.samples)


class Throughput(L.Callback):
    """Training samples per second from the start of training (worker start-up included)."""

    def __init__(self) -> None:
        self.samples = 0
        self.started = 0.0
        self.seconds = 0.0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.samples += len(batch[1])

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.started

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0


def fit_fake_cifar(
    data: DataLoader[Any] | L.LightningDataModule,
    strategy: Strategy | str,
    epochs: int,
    root: str,
    name: str = "demo",
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, float]:
    """Train `SmallCNN` on `data` (a loader or a datamodule) with `strategy`; return trainer, samples/s."""
    throughput = Throughput()
    L.seed_everything(0, verbose=False)
    options: dict[str, Any] = dict(
        max_epochs=epochs,
        strategy=strategy,
        logger=CSVLogger(root, name=name),
        default_root_dir=root,
        callbacks=[throughput],
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer = L.Trainer(**(options | trainer_kwargs))
    if isinstance(data, L.LightningDataModule):
        trainer.fit(SmallCNN(), datamodule=data)
    else:
        trainer.fit(SmallCNN(), train_dataloaders=data)
    return trainer, throughput.samples_per_second


def run_demo(
    samples: int = 2048, epochs: int = 2, root: str = "lightning_logs_demo", batch_size: int = 64
) -> tuple[BoostReport, dict[str, Any]]:
    """Check the machine, train `SmallCNN` on FakeData, return the report and a run summary.

    Raises:
        ValueError: when `samples` is smaller than one batch.
    """
    hardware = HardwareInfo.detect()
    report = run_checks(hardware)
    datamodule = FakeCIFAR(samples, batch_size=batch_size)
    strategy = preset("auto", hardware=hardware)
    report.add(strategy.findings)
    steps = min(10, samples // batch_size)
    trainer, samples_per_second = fit_fake_cifar(datamodule, strategy, epochs, root, log_every_n_steps=steps)
    report.add(datamodule.findings)
    loader = trainer.train_dataloader
    assert isinstance(loader, DataLoader)  # a BoostedDataModule builds one training DataLoader
    report.tuned.update(
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
        batch_size=batch_size,
        precision=trainer.precision,
        strategy=type(strategy).__name__,
    )
    paths = report.write(trainer.log_dir or root)
    summary = {
        "accelerator": hardware.accelerator,
        **report.tuned,
        "samples/s": round(samples_per_second, 1),
        "report": str(paths[0]),
    }
    return report, summary
