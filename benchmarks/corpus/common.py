"""What the corpus programs share: random images and labels, and a small CPU Trainer."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_boost.testing import cpu_only


def images(count: int = 64, size: int = 32, classes: int = 10, seed: int = 0) -> TensorDataset:
    """`count` random RGB images (3 x `size` x `size`) with labels in ``range(classes)``."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(count, 3, size, size, generator=generator)
    return TensorDataset(pixels, torch.randint(0, classes, (count,), generator=generator))


def loader(dataset: TensorDataset, batch_size: int = 16, shuffle: bool = False) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def trainer(root: str, callbacks: list[L.Callback], **options: Any) -> L.Trainer:
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
    )
    with cpu_only():
        return L.Trainer(**(settings | options))
