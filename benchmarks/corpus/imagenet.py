"""ImageNet-style training: torchvision's ResNet-18, SGD with momentum and a step schedule,
top-1/top-5 accuracy from torchmetrics, the ImageNet example's transforms, on torchvision's
``FakeData`` at 32 x 32 (the example's shape, sized for a CPU)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy
from torchvision import datasets
from torchvision import transforms as T
from torchvision.models import resnet18

from benchmarks.corpus.common import trainer

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


NORMALIZE = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])


def fake_imagenet(train: bool, size: int) -> datasets.FakeData:
    augment = (
        [T.RandomResizedCrop(32), T.RandomHorizontalFlip()] if train else [T.Resize(36), T.CenterCrop(32)]
    )
    transform = T.Compose([*augment, T.ToTensor(), NORMALIZE])
    return datasets.FakeData(size, (3, 40, 40), CLASSES, transform, random_offset=0 if train else size)


def run(planted: bool, root: str, callbacks: list[L.Callback]) -> None:
    train = DataLoader(fake_imagenet(True, 48), batch_size=16, shuffle=True)
    val = DataLoader(fake_imagenet(False, 32), batch_size=16)
    trainer(root, callbacks).fit(ImageNetLightningModel(planted), train, val)
