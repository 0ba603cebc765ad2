"""A LightningCLI program: model and datamodule arguments from a config file, as such programs
are run (``python train.py fit --config config.yaml``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn

from benchmarks.corpus.common import images, loader
from lightning_boost.testing import cpu_only


class Classifier(L.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 0.01, planted: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        if self.hparams["planted"]:
            self.log("lr", self.hparams["lr"])  # planted: a Python number logged every step
            if loss > 10:  # planted: a branch on a tensor
                self.print("loss exploded")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


class RandomImages(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> Any:
        return loader(images(), self.batch_size, shuffle=True)

    def val_dataloader(self) -> Any:
        return loader(images(32, seed=1), self.batch_size)


def run(planted: bool, root: str, callbacks: list[L.Callback]) -> None:
    config = Path(root) / "config.yaml"
    settings = {
        "seed_everything": 0,
        "model": {"hidden": 32, "planted": planted},
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": 1,
            "limit_train_batches": 3,
            "limit_val_batches": 2,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": root,
        },
    }
    config.write_text(json.dumps(settings))  # JSON is YAML
    with cpu_only():
        LightningCLI(
            Classifier,
            RandomImages,
            args=["fit", "--config", str(config)],
            trainer_defaults={"callbacks": callbacks},
            save_config_callback=None,
        )
