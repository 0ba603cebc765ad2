"""Fine-tuning with a frozen backbone, written against ``import pytorch_lightning as pl`` (as many
public modules are): torchvision's ResNet-18 features frozen in eval mode, a new head, AdamW on
the head only, class weights for an imbalanced set."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models import resnet18

from benchmarks.corpus.common import images, loader, trainer

CLASSES = 10
WEIGHTS = [1.0] * (CLASSES - 1) + [5.0]


class FineTuner(pl.LightningModule):
    def __init__(self, planted: bool = False) -> None:
        super().__init__()
        self.planted = planted
        backbone = resnet18()
        self.features = nn.Sequential(*list(backbone.children())[:-1])
        self.features.requires_grad_(False)
        self.head = nn.Linear(512, CLASSES)
        self.register_buffer("class_weights", torch.tensor(WEIGHTS))  # moved once, with the model
        self.losses: list[Tensor] = []

    def on_train_epoch_start(self) -> None:
        self.features.eval()  # frozen BatchNorm statistics stay as they are

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        with torch.no_grad():
            features = self.features(x).flatten(1)
        weights = self.class_weights
        if self.planted:
            weights = torch.tensor(WEIGHTS).to(self.device)  # planted: host-to-device copy
        loss = F.cross_entropy(self.head(features), y, weight=weights)
        self.log("train_loss", loss)
        if self.planted:
            self.losses.append(loss)  # planted: keeps each step's autograd graph
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.head.parameters(), lr=1e-3)


def run(planted: bool, root: str, callbacks: list[Any]) -> None:
    fit = trainer(root, callbacks, trainer_class=pl.Trainer, limit_val_batches=0)
    fit.fit(FineTuner(planted), loader(images(), shuffle=True))
