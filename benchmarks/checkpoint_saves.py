"""Checkpoint saves on a worker thread (``preset("auto")``'s default, `presets.saves`) against on
the training thread (Lightning's own), on the demo's model and schedule (issue 32): the demo's
ResNet-18 (`ValidatedResNet18`, 94 MB of checkpoint with its SGD momentum), four validations an
epoch (``val_check_interval=0.25``) and Lightning's default `ModelCheckpoint`, which saves after
each and removes the file it replaces. Everything else is the same preset.

Fits alternate which setting goes first. The ratio is the median fit's wall time with saves on
the training thread over in the background (above 1: faster); the detail gives the training
thread's seconds inside the saves and removals, what the worker takes off it. On a GPU the demo's
settings (16,384 images, batch 256, bf16, 8 pinned workers, cudnn.benchmark off in both: its
autotuning would land in whichever fit runs first); on a CPU 2,048 images at batch 64 in the main
process.
Run: ``python -m benchmarks checkpoint_saves``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.common import Row
from lightning_boost.demo import VAL_SAMPLES, ValidatedResNet18, demo_dataset
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset

COMMAND = "python -m benchmarks checkpoint_saves"


def run(samples: int | None = None, epochs: int = 2, pairs: int = 3, cpu: bool = False) -> list[Row]:
    """`pairs` fits of each setting over `samples` images (the demo's 16,384 on a GPU, 2,048 on a
    CPU; `cpu`: on the CPU where there is a GPU too, for tests); one row."""
    cuda = torch.cuda.is_available() and not cpu
    samples = samples or (16_384 if cuda else 2048)
    batch, workers = (256, 8) if cuda else (64, 0)
    train = DataLoader(
        demo_dataset(samples),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=workers > 0,
    )
    val = DataLoader(demo_dataset(VAL_SAMPLES, train=False), batch_size=batch, num_workers=min(workers, 4))
    fits: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for pair in range(pairs):
        for background in (False, True) if pair % 2 == 0 else (True, False):
            fits[background].append(_fit(background, train, val, epochs, cuda))
    wall = {key: statistics.median(f[0] for f in value) for key, value in fits.items()}
    held = {key: statistics.median(f[1] for f in value) for key, value in fits.items()}
    saves = fits[True][0][2]
    detail = (
        f"fit {wall[False]:.1f} s with saves on the training thread, {wall[True]:.1f} s in the"
        f" background (medians of {pairs}); the training thread spent {held[False]:.2f} s against"
        f" {held[True]:.2f} s in {saves} saves and their removals; demo ResNet-18, {samples} images x"
        f" {epochs} epochs, batch {batch}, val_check_interval=0.25, Lightning's default ModelCheckpoint"
    )
    return [
        Row(
            f"checkpoint saves{' on a GPU' if cuda else ''}: on the training thread / in the background,"
            " fit wall time",
            wall[False] / wall[True],
            detail,
            COMMAND,
        )
    ]


def _fit(
    background: bool, train: DataLoader[Any], val: DataLoader[Any], epochs: int, cuda: bool
) -> tuple[float, float, int]:
    """One fit: its wall seconds, the training thread's seconds in saves and removals, the saves."""
    L.seed_everything(0, verbose=False)
    hardware = HardwareInfo.detect() if cuda else HardwareInfo.detect().on_cpu()
    # cudnn.benchmark off: its autotuning would land in whichever fit runs a shape first
    strategy = preset("auto", hardware=hardware, background_saves=background, cudnn_benchmark=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="gpu" if cuda else "cpu",
            strategy=strategy,
            max_epochs=epochs,
            val_check_interval=0.25,
            num_sanity_val_steps=0,
            logger=False,
            default_root_dir=root,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        clock = _Clock()
        trainer.strategy.save_checkpoint = clock.timed(trainer.strategy.save_checkpoint)  # type: ignore[method-assign]
        trainer.strategy.remove_checkpoint = clock.timed(trainer.strategy.remove_checkpoint)  # type: ignore[method-assign]
        start = time.perf_counter()
        trainer.fit(ValidatedResNet18(), train_dataloaders=train, val_dataloaders=val)
        return time.perf_counter() - start, clock.seconds, clock.calls.get("save_checkpoint", 0)


class _Clock:
    """Seconds spent inside the wrapped calls, and how many of each."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls: dict[str, int] = {}

    def timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls[call.__name__] = self.calls.get(call.__name__, 0) + 1

        return wrapper
