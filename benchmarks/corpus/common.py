"""What the corpus programs share: random images and labels, and a small CPU Trainer."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_boost.testing import tiny_trainer


def images(count: int = 64, size: int = 32, classes: int = 10, seed: int = 0) -> TensorDataset:
    """`count` random RGB images (3 x `size` x `size`) with labels in ``range(classes)``."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(count, 3, size, size, generator=generator)
    return TensorDataset(pixels, torch.randint(0, classes, (count,), generator=generator))


def loader(dataset: TensorDataset, batch_size: int = 16, shuffle: bool = False) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def trainer(root: str, callbacks: list[Any], **options: Any) -> Any:
    """A few CPU steps, no logger, no sanity check (`tiny_trainer`, whose options these override)."""
    settings: dict[str, Any] = dict(
        limit_train_batches=3, num_sanity_val_steps=0, logger=False, enable_checkpointing=False
    )
    return tiny_trainer(root, callbacks=callbacks, **(settings | options))
