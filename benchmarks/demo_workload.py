"""The demo's workload with plain Lightning defaults vs `BoostedDataModule` and ``preset("auto")``.

Both variants train the same `SmallCNN` on the same FakeData task with the same CPU augmentation,
alternating in one process (plain first, then boosted first, ...) so drift hits both alike.
Run: ``python -m benchmarks demo_workload`` (or ``make bench``).
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.common import Row, median_ratio
from lightning_boost.demo import FakeCIFAR, SmallCNN, fake_cifar, fit_fake_cifar
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset


def run(samples: int = 1536, epochs: int = 2, repeats: int = 3, batch_size: int = 64) -> list[Row]:
    timings, tuned = compare(SmallCNN, samples, epochs, repeats, batch_size)
    detail = (
        f"samples/s median of {repeats}: plain {statistics.median(timings['plain']):.0f}"
        f" (num_workers=0, Lightning's defaults) vs {statistics.median(timings['boosted']):.0f}"
        f" (BoostedDataModule: {tuned}; preset('auto'));"
        f" {samples} images x {epochs} epochs, batch {batch_size}"
    )
    return [
        Row(
            "demo workload: BoostedDataModule + preset('auto') / plain defaults",
            median_ratio(timings["boosted"], timings["plain"]),
            detail,
            "python -m benchmarks demo_workload",
        )
    ]


def compare(
    model: Callable[[], L.LightningModule], samples: int, epochs: int, repeats: int, batch_size: int
) -> tuple[dict[str, list[float]], str]:
    """Samples/s of `model` trained plain and boosted, alternating; and the boosted loader's settings."""
    hw = HardwareInfo.detect()
    timings: dict[str, list[float]] = {"plain": [], "boosted": []}
    tuned = ""
    with tempfile.TemporaryDirectory() as root:
        options: dict[str, Any] = dict(
            enable_progress_bar=False, logger=False, enable_checkpointing=False, model=model
        )
        cache = Path(root) / "cache"  # the first boosted run measures, the others reuse the cache
        fit_fake_cifar(_plain(batch_size * 2, batch_size), "auto", 1, root, **options)  # warm-up
        for repeat in range(repeats):
            order = ["plain", "boosted"] if repeat % 2 == 0 else ["boosted", "plain"]
            for variant in order:
                if variant == "plain":
                    _, rate = fit_fake_cifar(_plain(samples, batch_size), "auto", epochs, root, **options)
                else:
                    datamodule = FakeCIFAR(samples, batch_size=batch_size, cache_dir=cache)
                    strategy = preset("auto", hardware=hw)
                    trainer, rate = fit_fake_cifar(datamodule, strategy, epochs, root, **options)
                    loader = trainer.train_dataloader
                    threads = next(  # set beside the workers for the fit, restored at teardown
                        (f.data["threads"] for f in datamodule.findings if "threads" in f.data),
                        torch.get_num_threads(),
                    )
                    tuned = (
                        f"num_workers={loader.num_workers}, prefetch_factor={loader.prefetch_factor},"
                        f" {threads} model thread(s)"
                    )
                timings[variant].append(rate)
    return timings, tuned


def _plain(samples: int, batch_size: int) -> DataLoader[Any]:
    """What a Lightning user writes first: a shuffled loader with PyTorch's defaults."""
    return DataLoader(fake_cifar(samples), batch_size=batch_size, shuffle=True, drop_last=True)
