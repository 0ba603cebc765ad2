"""`lightning-boost demo`: a short boosted fit on FakeData, with the report it produces.

A CIFAR-sized image task (torchvision ``FakeData`` with the usual CPU augmentation pipeline,
since nothing is downloaded) and a small CNN with torchmetrics accuracy, trained through a
`BoostedDataModule` (DataLoader workers measured, pinned memory on CUDA), ``preset("auto")`` and
`boost_callbacks()` (step-time monitor and the report, which also runs the doctor's checks).
It is the project's main job until the side-by-side demo (plain vs boosted) replaces it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
import torchmetrics
import torchvision
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from typing_extensions import override

from lightning_boost.callbacks import BoostReport, boost_callbacks
from lightning_boost.data import BoostedDataModule
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset
from lightning_boost.report import Report

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


class ResNet18Classifier(SmallCNN):
    """`SmallCNN`'s training with torchvision's ResNet-18 as the network: a compute-bound model on CPU."""

    def __init__(self, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__(num_classes, lr)
        self.net = torchvision.models.resnet18(num_classes=num_classes)


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
    callbacks: Sequence[L.Callback] = (),
    model: Callable[[], L.LightningModule] = SmallCNN,
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, float]:
    """Train `model()` (`SmallCNN`) on `data` (a loader or a datamodule) with `strategy`; return
    the trainer and samples/s."""
    throughput = Throughput()
    L.seed_everything(0, verbose=False)
    options: dict[str, Any] = dict(
        max_epochs=epochs,
        strategy=strategy,
        logger=CSVLogger(root, name=name),
        default_root_dir=root,
        callbacks=[throughput, *callbacks],
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer = L.Trainer(**(options | trainer_kwargs))
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model(), datamodule=data)
    else:
        trainer.fit(model(), train_dataloaders=data)
    return trainer, throughput.samples_per_second


def run_demo(
    samples: int = 2048, epochs: int = 2, root: str = "lightning_logs_demo", batch_size: int = 64
) -> tuple[Report, dict[str, Any]]:
    """Train `SmallCNN` on FakeData with `BoostedDataModule`, ``preset("auto")`` and `boost_callbacks`.

    The `BoostReport` prints its table at the end of the fit and writes its files; the report and
    a run summary (settings used, samples/s, where the report is) are returned.

    Raises:
        ValueError: when `samples` is smaller than one batch.
    """
    hardware = HardwareInfo.detect()
    datamodule = FakeCIFAR(samples, batch_size=batch_size)
    strategy = preset("auto", hardware=hardware)
    callbacks = boost_callbacks()
    steps = min(10, samples // batch_size)
    _, samples_per_second = fit_fake_cifar(
        datamodule, strategy, epochs, root, callbacks=callbacks, log_every_n_steps=steps
    )
    (boost_report,) = [c for c in callbacks if isinstance(c, BoostReport)]
    assert boost_report.report is not None  # written at the end of every fit
    summary = {
        "accelerator": hardware.accelerator,
        **boost_report.report.tuned,
        "samples/s": round(samples_per_second, 1),
        "report": str(boost_report.paths[0]),
    }
    return boost_report.report, summary
