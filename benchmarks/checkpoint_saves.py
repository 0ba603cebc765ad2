"""Checkpoint saves on a worker thread (``preset("auto")``'s default, `presets.saves`) against on
the training thread (Lightning's own), on the demo's model and schedule (issue 32): the demo's
ResNet-18 (`ValidatedResNet18`, 94 MB of checkpoint with its SGD momentum), four validations an
epoch (``val_check_interval=0.25``) and Lightning's default `ModelCheckpoint`, which saves after
each and removes the file it replaces. Everything else is the same preset.

Fits rotate which setting goes first. The ratio is the median fit's wall time with saves on
the training thread over in the background (above 1: faster); the detail gives the training
thread's seconds inside the saves and removals, what the worker takes off it. On a GPU a second
row compares the background saves' host copies: into pinned memory without waiting for the device
(the default) against one waiting copy per tensor into pageable memory. On a GPU the demo's
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

from benchmarks.common import Row, rotated
from lightning_boost.demo import VAL_SAMPLES, ValidatedResNet18, demo_dataset
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset
from lightning_boost.presets import saves as saves_module

COMMAND = "python -m benchmarks checkpoint_saves"
#: The settings compared: saves on the training thread, in the background (pinned host copies on a
#: GPU), in the background with pageable host copies (a GPU only).
THREAD, BACKGROUND, PAGEABLE = "on the training thread", "in the background", "pageable"


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
    settings = [THREAD, BACKGROUND, PAGEABLE] if cuda else [THREAD, BACKGROUND]
    fits: dict[str, list[tuple[float, float, int]]] = {setting: [] for setting in settings}
    for pair in range(pairs):
        for setting in rotated(settings, pair):
            fits[setting].append(_fit(setting, train, val, epochs, cuda))
    wall = {key: statistics.median(f[0] for f in value) for key, value in fits.items()}
    held = {key: statistics.median(f[1] for f in value) for key, value in fits.items()}
    saves = fits[BACKGROUND][0][2]
    workload = (
        f"demo ResNet-18, {samples} images x {epochs} epochs, batch {batch}, val_check_interval=0.25,"
        " Lightning's default ModelCheckpoint"
    )
    detail = (
        f"fit {wall[THREAD]:.1f} s with saves on the training thread, {wall[BACKGROUND]:.1f} s in the"
        f" background (medians of {pairs}); the training thread spent {held[THREAD]:.2f} s against"
        f" {held[BACKGROUND]:.2f} s in {saves} saves and their removals; {workload}"
    )
    where = " on a GPU" if cuda else ""
    rows = [
        Row(f"checkpoint saves{where}: on the training thread / in the background, fit wall time",
            wall[THREAD] / wall[BACKGROUND], detail, COMMAND)
    ]  # fmt: skip
    if cuda:
        detail = (
            f"the same fits: {wall[PAGEABLE]:.1f} s against {wall[BACKGROUND]:.1f} s; the training thread"
            f" spent {held[PAGEABLE]:.2f} s against {held[BACKGROUND]:.2f} s in the saves and removals"
        )
        rows.append(
            Row("checkpoint saves on a GPU, in the background: pageable host copies / pinned, fit wall time",
                wall[PAGEABLE] / wall[BACKGROUND], detail, COMMAND)
        )  # fmt: skip
    return rows


def _fit(
    setting: str, train: DataLoader[Any], val: DataLoader[Any], epochs: int, cuda: bool
) -> tuple[float, float, int]:
    """One fit: its wall seconds, the training thread's seconds in saves and removals, the saves."""
    L.seed_everything(0, verbose=False)
    hardware = HardwareInfo.detect() if cuda else HardwareInfo.detect().on_cpu()
    # cudnn.benchmark off: its autotuning would land in whichever fit runs a shape first
    strategy = preset("auto", hardware=hardware, background_saves=setting != THREAD, cudnn_benchmark=False)
    limit = saves_module.PINNED_LIMIT_BYTES
    saves_module.PINNED_LIMIT_BYTES = 0 if setting == PAGEABLE else limit
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
        try:
            trainer.fit(ValidatedResNet18(), train_dataloaders=train, val_dataloaders=val)
        finally:
            saves_module.PINNED_LIMIT_BYTES = limit
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
