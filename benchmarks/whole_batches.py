"""Loading a TensorDataset one gather a batch (`whole_batches`) against torch's per-sample loading.

For each in-memory dataset (a tabular one, 32 float features and a label, at batch 64 and 512;
CIFAR-sized uint8 images and a label at batch 256), a shuffled epoch is read from a plain
``DataLoader`` and from the same loader over `whole_batches`' dataset and collate function, with
0 and 2 workers (their start-up included), `repeats` times alternating: the ratio is the median
plain epoch's time over the median whole-batch epoch's (above 1 is faster). Each pair's batches
are compared element for element first; a row says "equal" only when every batch was.

What it is worth to a run depends on its step: the rows give the loading time a batch, and the
``time_to_quality`` MLP rows measure what it gives a whole fit.

Run: ``python -m benchmarks whole_batches``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import Row
from lightning_boost.workers.whole_batches import whole_batches

COMMAND = "python -m benchmarks whole_batches"


@dataclass(frozen=True)
class Case:
    name: str
    samples: int
    batch_size: int
    images: bool = False

    def dataset(self) -> TensorDataset:
        generator = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 10, (self.samples,), generator=generator)
        if self.images:
            pixels = torch.randint(0, 256, (self.samples, 3, 32, 32), dtype=torch.uint8, generator=generator)
            return TensorDataset(pixels, labels)
        return TensorDataset(torch.randn(self.samples, 32, generator=generator), labels)


CASES = (
    Case("tabular, batch 64", 16384, 64),
    Case("tabular, batch 512", 65536, 512),
    Case("uint8 images 3x32x32, batch 256", 16384, 256, images=True),
)


def _epoch(dataset: Any, collate_fn: Any, case: Case, workers: int) -> tuple[float, list[Any]]:
    torch.manual_seed(0)  # the same order for both loaders
    loader = DataLoader(
        dataset, batch_size=case.batch_size, shuffle=True, num_workers=workers, collate_fn=collate_fn
    )
    started = time.perf_counter()
    batches = list(loader)
    return time.perf_counter() - started, batches


def _equal(first: list[Any], second: list[Any]) -> bool:
    return len(first) == len(second) and all(
        torch.equal(a, b)
        for mine, theirs in zip(first, second, strict=True)
        for a, b in zip(mine, theirs, strict=True)
    )


def _row(case: Case, workers: int, repeats: int) -> Row:
    dataset = case.dataset()
    whole, collate = whole_batches(dataset, None)
    plain_s, whole_s, equal = [], [], True
    for repeat in range(repeats):
        order = [(dataset, None), (whole, collate)]
        timed = {}
        for data, collate_fn in order if repeat % 2 == 0 else order[::-1]:
            timed[collate_fn is None] = _epoch(data, collate_fn, case, workers)
        plain_s.append(timed[True][0])
        whole_s.append(timed[False][0])
        equal = equal and _equal(timed[True][1], timed[False][1])
    batches = -(-case.samples // case.batch_size)
    plain, gathered = statistics.median(plain_s), statistics.median(whole_s)
    return Row(
        f"whole batches: per-sample / whole-batch loading ({case.name}, {workers} workers)",
        plain / gathered,
        f"a shuffled epoch of {case.samples} samples, median of {repeats} alternating: {plain:.3f} s"
        f" against {gathered:.3f} s ({1e6 * plain / batches:.0f} against {1e6 * gathered / batches:.0f}"
        f" µs a batch); batches {'equal' if equal else 'DIFFERENT'}",
        COMMAND,
    )


def run(repeats: int = 5) -> list[Row]:
    """One row per dataset and worker count."""
    return [_row(case, workers, repeats) for case in CASES for workers in (0, 2)]
