"""A classifier that reports a torchmetrics ``MetricCollection`` for training and validation
(``clone(prefix=...)``), updated in the steps and logged as metric objects."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision

from benchmarks.corpus.common import images, loader, trainer

CLASSES = 10


class WithMetrics(L.LightningModule):
    def __init__(self, planted: bool = False) -> None:
        super().__init__()
        self.planted = planted
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.head = nn.Linear(8, CLASSES)
        options: dict[str, Any] = {"average": "micro", "validate_args": False}
        metrics = MetricCollection(
            {
                "acc": MulticlassAccuracy(CLASSES, **options),
                "f1": MulticlassF1Score(CLASSES, **options),
                "precision": MulticlassPrecision(CLASSES, **options),
            }
        )
        self.train_metrics = metrics.clone(prefix="train_")
        self.val_metrics = metrics.clone(prefix="val_")
        self.macro_f1 = MulticlassF1Score(CLASSES, average="macro")  # per-class counts, checked inputs

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_metrics.update(logits, y)
        self.log_dict(self.train_metrics)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_metrics.update(logits, y)
        self.log_dict(self.val_metrics)
        if self.planted:
            self.macro_f1.update(logits, y)  # planted: input checks and per-class counts sync
            self.log("val_macro_f1", self.macro_f1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def run(planted: bool, root: str, callbacks: list[L.Callback]) -> None:
    trainer(root, callbacks).fit(
        WithMetrics(planted), loader(images(), shuffle=True), loader(images(32, seed=1))
    )
