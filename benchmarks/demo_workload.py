"""The demo's workload with plain DataLoader defaults vs the settings `HardwareInfo` implies.

Both variants train the same `SmallCNN` on the same FakeData task with the same CPU augmentation,
alternating in one process (plain first, then boosted first, ...) so drift hits both alike.
Run: ``python -m benchmarks demo_workload`` (or ``make bench``).
"""

from __future__ import annotations

import statistics
import tempfile

from benchmarks.common import Row, median_ratio
from lightning_boost.demo import fit_fake_cifar, loader_settings
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset

PLAIN = {"num_workers": 0}  # DataLoader's and Lightning's default


def run(samples: int = 1536, epochs: int = 2, repeats: int = 3, batch_size: int = 64) -> list[Row]:
    hw = HardwareInfo.detect()
    boosted = loader_settings(hw)
    timings: dict[str, list[float]] = {"plain": [], "boosted": []}
    with tempfile.TemporaryDirectory() as root:
        options = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False)
        fit_fake_cifar(PLAIN, "auto", batch_size * 2, 1, batch_size, root, **options)  # warm-up
        for repeat in range(repeats):
            order = ["plain", "boosted"] if repeat % 2 == 0 else ["boosted", "plain"]
            for variant in order:
                loader, strategy = (
                    (PLAIN, "auto") if variant == "plain" else (boosted, preset("auto", hardware=hw))
                )
                _, rate = fit_fake_cifar(loader, strategy, samples, epochs, batch_size, root, **options)
                timings[variant].append(rate)
    detail = (
        f"samples/s median of {repeats}: plain {statistics.median(timings['plain']):.0f}"
        f" (num_workers=0, Lightning's defaults) vs {statistics.median(timings['boosted']):.0f}"
        f" ({', '.join(f'{k}={v}' for k, v in boosted.items())}, preset('auto'));"
        f" {samples} images x {epochs} epochs, batch {batch_size}"
    )
    return [
        Row(
            "demo workload: loader settings + preset('auto') / plain defaults",
            median_ratio(timings["boosted"], timings["plain"]),
            detail,
            "python -m benchmarks demo_workload",
        )
    ]
