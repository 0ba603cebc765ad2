"""The demo's comparison with torchvision's ResNet-18: a model whose compute, not its data, bounds a CPU run.

The same FakeData task and CPU augmentation as ``demo_workload``, plain Lightning defaults vs
`BoostedDataModule` + ``preset("auto")``, alternating in one process. On a CPU the workers and
the model share the cores; `BoostedDataModule` measures the loader alone and gives the model the
cores the workers leave, which pays when the data is the bottleneck (``demo_workload``) and costs
when the model is. This row tracks that case. Run: ``python -m benchmarks compute_bound``.
"""

from __future__ import annotations

import statistics

from benchmarks.common import Row, median_ratio
from benchmarks.demo_workload import compare
from lightning_boost.demo import ResNet18Classifier

COMMAND = "python -m benchmarks compute_bound"


def run(samples: int = 1024, epochs: int = 1, repeats: int = 3, batch_size: int = 64) -> list[Row]:
    timings, tuned = compare(ResNet18Classifier, samples, epochs, repeats, batch_size)
    detail = (
        f"samples/s median of {repeats}: plain {statistics.median(timings['plain']):.0f}"
        f" (num_workers=0, all cores for the model) vs {statistics.median(timings['boosted']):.0f}"
        f" (BoostedDataModule: {tuned}; preset('auto')); torchvision resnet18, {samples} images x"
        f" {epochs} epoch(s), batch {batch_size}"
    )
    return [
        Row(
            "compute-bound (ResNet-18 on CPU): BoostedDataModule + preset('auto') / plain defaults",
            median_ratio(timings["boosted"], timings["plain"]),
            detail,
            COMMAND,
        )
    ]
