"""The recommended way: CIFAR-10 through a `BoostedDataModule`, torchmetrics accuracy, the boost
callbacks and a preset. Copy it and swap in your dataset and model.

    python examples/image_classifier.py --data ~/data/cifar10 --epochs 10
    python examples/image_classifier.py --data ~/data/cifar10 --download   # fetch it first
    python examples/image_classifier.py --fake-data --steps 20              # offline: same shapes

`BoostedDataModule` measures ``num_workers`` and ``prefetch_factor`` on this machine (cached),
pins memory on CUDA and seeds the workers; ``preset("auto")`` picks the strategy and precision
for the hardware (bf16 on GPUs that have it, DDP across several); `boost_callbacks()` adds the
step-time monitor, both guards and the report, which lands next to the logs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchvision
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from torchvision import transforms as T

from lightning_boost import BoostedDataModule, BoostReport, boost_callbacks, preset

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class CIFAR10Data(BoostedDataModule):
    """CIFAR-10 from `data_dir` (or FakeData of the same shape), with the usual CPU augmentation."""

    def __init__(
        self, data_dir: str | Path, download: bool = False, fake_data: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(drop_last=True, **kwargs)
        self.data_dir, self.download, self.fake_data = Path(data_dir), download, fake_data
        self.train_transform = T.Compose(
            [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
        )
        self.eval_transform = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])

    def prepare_data(self) -> None:
        if self.download and not self.fake_data:  # once, on one process per node
            torchvision.datasets.CIFAR10(self.data_dir, train=True, download=True)
            torchvision.datasets.CIFAR10(self.data_dir, train=False, download=True)

    def setup(self, stage: str) -> None:
        if self.fake_data:
            self.train_dataset = _fake(2048, self.train_transform, seed=0)
            self.val_dataset = _fake(512, self.eval_transform, seed=1)
            return
        try:
            self.train_dataset = torchvision.datasets.CIFAR10(self.data_dir, transform=self.train_transform)
            self.val_dataset = torchvision.datasets.CIFAR10(
                self.data_dir, train=False, transform=self.eval_transform
            )
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
            raise FileNotFoundError(
                f"`--data` expected a directory holding CIFAR-10 (cifar-10-batches-py), got"
                f" '{self.data_dir}'; add `--download` to fetch it, or run offline with `--fake-data`."
            ) from err


def _fake(size: int, transform: Any, seed: int) -> torchvision.datasets.FakeData:
    return torchvision.datasets.FakeData(
        size=size, image_size=(3, 32, 32), num_classes=10, transform=transform, random_offset=seed * size
    )


class Classifier(L.LightningModule):
    """torchvision's ResNet-18 for 10 classes; loss per step, accuracy per epoch, all on the device."""

    def __init__(self, lr: float = 0.05, epochs: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = torchvision.models.resnet18(num_classes=10)
        # micro: plain accuracy, no per-class bincount; validate_args=False: no input checks. Both
        # would sync with the GPU on every update (SyncGuard points at them otherwise).
        self.train_acc = MulticlassAccuracy(num_classes=10, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro", validate_args=False)

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = nn.functional.cross_entropy(logits, labels)
        self.train_acc.update(logits, labels)  # update, not forward: no per-step compute
        self.log("train_loss", loss)  # a tensor, read only when the loggers log (prog_bar: every step)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc.update(logits, labels)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)  # an epoch value: read once per epoch

    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9, weight_decay=5e-4)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams["epochs"])
        return [optimizer], [schedule]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="data/cifar10", help="directory holding CIFAR-10")
    parser.add_argument("--download", action="store_true", help="download CIFAR-10 into --data first")
    parser.add_argument("--fake-data", action="store_true", help="train on FakeData (no download)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=-1, help="stop after this many steps (-1: epochs)")
    parser.add_argument("--root", default="lightning_logs", help="where logs and the report go")
    args = parser.parse_args(argv)

    data = CIFAR10Data(args.data, args.download, args.fake_data, batch_size=args.batch_size)
    callbacks = boost_callbacks()
    trainer = L.Trainer(
        strategy=preset("auto"),  # DDP on several GPUs, bf16 where the GPU has it, one device here
        callbacks=callbacks,
        max_epochs=args.epochs,
        max_steps=args.steps,
        logger=CSVLogger(args.root, name="image_classifier"),
    )
    try:
        trainer.fit(Classifier(epochs=args.epochs), datamodule=data)
    except FileNotFoundError as err:
        parser.error(str(err))
    (report,) = [c for c in callbacks if isinstance(c, BoostReport)]
    print(f"report: {report.paths[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
