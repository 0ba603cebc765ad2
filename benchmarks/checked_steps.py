"""The worker search's first segment with the guards' checked steps left out (the default,
`lightning_boost.instrumented`) against counted, on the time-to-quality autoencoder.

`SyncGuard` and `LossLoggingGuard` check a fit's first steps, slower than its others, and those
are the steps of the search's first segment, which times the setting the run starts at. Each fit
is `time_to_quality`'s boosted one from a cold cache (README set-up); `fits` of each kind,
alternating, with the count frozen for the counted ones (every step then looks unchecked). The
ratio is the median first-segment samples/s left out over counted; the detail adds what each fit
kept (a probe of the model on fewer threads wins against a slow first segment) and a plain
Lightning fit's steady rate for scale.
Run: ``python -m benchmarks checked_steps``.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from pathlib import Path

from benchmarks import time_to_quality
from benchmarks.common import Row
from lightning_boost import instrumented

COMMAND = "python -m benchmarks checked_steps"


def run(fits: int = 6, workload: str = "autoencoder") -> list[Row]:
    chosen = next(w for w in time_to_quality.WORKLOADS if w.name == workload)
    readings: dict[bool, list[tuple[float, int | None]]] = {True: [], False: []}
    for fit in range(fits):
        for left_out in (True, False) if fit % 2 == 0 else (False, True):
            readings[left_out].append(_first_segment(chosen, left_out))
    with tempfile.TemporaryDirectory() as folder:
        plain, _, _ = time_to_quality._fit(chosen, Path(folder), 0, False, Path(folder) / "cache")
    left, counted = (statistics.median(rate for rate, _ in readings[key]) for key in (True, False))

    def kept(key: bool) -> str:
        threads = [t for _, t in readings[key]]
        return f"{sum(t is None for t in threads)} of {len(threads)} kept the run's threads"

    detail = (
        f"{workload}, {fits} cold-cache fits each, alternating: first segment {left:,.0f} samples/s"
        f" ({', '.join(f'{r:,.0f}' for r, _ in readings[True])}; {kept(True)}) with the checked steps"
        f" left out, {counted:,.0f} ({', '.join(f'{r:,.0f}' for r, _ in readings[False])}; {kept(False)},"
        f" the others a probe's fewer threads) counted; for scale, plain Lightning's fit"
        f" {plain.samples_per_second:,.0f} from its first step to its last, validations included"
    )
    return [Row("worker search's first segment: checked steps left out / counted, samples/s", left / counted,
                detail, COMMAND)]  # fmt: skip


def _first_segment(workload: time_to_quality.Workload, left_out: bool) -> tuple[float, int | None]:
    """One boosted fit: its first segment's samples/s and the model threads the search kept."""
    count = instrumented.count
    if not left_out:
        instrumented.count = functools.partial(int, 0)  # every step looks unchecked to the segments
    datamodules: list[time_to_quality.Data] = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            root = Path(folder)
            time_to_quality._fit(workload, root / "fit", 0, True, root / "cache", datamodules=datamodules)
    finally:
        instrumented.count = count
    (choice,) = datamodules[0].worker_tuner.choices.values()
    return choice.trials[0].samples_per_s, choice.threads
