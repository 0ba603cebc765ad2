"""ImageNet-style training: torchvision's ResNet-18, SGD with momentum and a step schedule,
top-1/top-5 accuracy from torchmetrics, on random images (the ImageNet example's shape)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy
from torchvision.models import resnet18

from benchmarks.corpus.common import images, loader, trainer

CLASSES = 10


class ImageNetLightningModel(L.LightningModule):
    def __init__(self, planted: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.planted = planted
        self.model = resnet18(num_classes=CLASSES)
        self.top1 = MulticlassAccuracy(CLASSES, top_k=1, average="micro", validate_args=False)
        self.top5 = MulticlassAccuracy(CLASSES, top_k=5, average="micro", validate_args=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, target = batch
        loss = F.cross_entropy(self(images), target)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, target = batch
        output = self(images)
        self.log("val_loss", F.cross_entropy(output, target))
        self.top1.update(output, target)
        self.top5.update(output, target)
        self.log_dict({"val_acc1": self.top1, "val_acc5": self.top5})
        if self.planted:
            self.correct = (output.argmax(1) == target).sum().item()  # planted: scalar read

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9, weight_decay=1e-4)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)]


def run(planted: bool, root: str, callbacks: list[L.Callback]) -> None:
    trainer(root, callbacks).fit(
        ImageNetLightningModel(planted), loader(images(), shuffle=True), loader(images(32, seed=1))
    )
