"""The demo's own job, ``lightning-boost demo``: plain Lightning vs lightning-boost, repeated.

Each repeat is one `run_demo` (the same ResNet-18, data and epochs; plain defaults, then
`BoostedDataModule` + ``preset("auto")`` + `AutoBatchSize` + `boost_callbacks()`), alternating
which goes first, in one process. The ratio is training samples/s, boosted / plain; the detail
also gives the wall-time ratio with tuning counted (worker measurements are cached on disk after
the first repeat, as on a user's second run). `compare` is the same comparison without
`AutoBatchSize` and the guards, which ``compute_bound`` uses. Run: ``python -m benchmarks demo_workload``.
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
from lightning_boost.demo import FakeCIFAR, demo_dataset, fit_fake_cifar, precision_text, run_demo
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset

COMMAND = "python -m benchmarks demo_workload"


def run(samples: int = 4096, epochs: int = 1, repeats: int = 3, batch_size: int = 64) -> list[Row]:
    rates: dict[str, list[float]] = {"plain": [], "boosted": []}
    walls: dict[str, list[float]] = {"plain": [], "boosted": []}
    settings = ""
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(repeats):
            plain, boosted = run_demo(
                samples,
                epochs,
                root,
                batch_size,
                say=lambda line: None,
                quiet=True,
                plain_first=repeat % 2 == 0,
            )
            for name, result in (("plain", plain), ("boosted", boosted)):
                rates[name].append(result.samples_per_s)
                walls[name].append(result.seconds)
            settings = ", ".join(f"{k} {v}" for k, v in boosted.settings.items() if k != "accelerator")
    detail = (
        f"training samples/s median of {repeats}: plain {statistics.median(rates['plain']):.0f} vs boosted"
        f" {statistics.median(rates['boosted']):.0f} ({settings}); wall time with tuning: boosted / plain"
        f" {median_ratio(walls['boosted'], walls['plain']):.2f}; ResNet-18, {samples} images x {epochs}"
        f" epoch(s), plain batch {batch_size}"
    )
    return [
        Row(
            "demo (ResNet-18): lightning-boost / plain Lightning, training samples/s",
            median_ratio(rates["boosted"], rates["plain"]),
            detail,
            COMMAND,
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
                        (f.data["threads"] for f in datamodule.findings if f.data.get("threads")),
                        torch.get_num_threads(),
                    )
                    tuned = (
                        f"num_workers={loader.num_workers}, prefetch_factor={loader.prefetch_factor},"
                        f" {threads} model thread(s), precision {precision_text(trainer)}"
                    )
                timings[variant].append(rate)
    return timings, tuned


def _plain(samples: int, batch_size: int) -> DataLoader[Any]:
    """What a Lightning user writes first: a shuffled loader with PyTorch's defaults, over the
    images `FakeCIFAR` loads (`demo_dataset`)."""
    return DataLoader(demo_dataset(samples), batch_size=batch_size, shuffle=True, drop_last=True)
