"""The worker search's first segment with the guards' checked steps left out (the default,
`lightning_boost.instrumented`) against counted, on the time-to-quality autoencoder.

`SyncGuard` and `LossLoggingGuard` check a fit's first steps, slower than its others, and those
are the steps of the search's first segment, which times the setting the run starts at. Each fit
is `time_to_quality`'s boosted one from a cold cache (README set-up); `fits` of each kind,
alternating, with the count frozen for the counted ones (every step then looks unchecked). The
ratio is the median first-segment samples/s left out over counted; the detail adds what each fit
kept (a probe of the model on fewer threads wins against a slow first segment), a plain
Lightning fit's rate for scale, and the search's reported cost with its workers' starts and stops.
`accelerator` and `max_workers` pin the fits to a device and a worker budget: a GPU machine's 16
CPUs do not search these short fits at all, so the tests run the 2-CPU path there as
``run(..., accelerator="cpu", max_workers=2)``. Run: ``python -m benchmarks checked_steps``.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import time_to_quality
from benchmarks.common import Row
from lightning_boost import instrumented
from lightning_boost.workers.search import WorkerChoice

COMMAND = "python -m benchmarks checked_steps"


def run(
    fits: int = 6, workload: str = "autoencoder", accelerator: str = "auto", max_workers: int | None = None
) -> list[Row]:
    chosen = next(w for w in time_to_quality.WORKLOADS if w.name == workload)
    pin = {"accelerator": accelerator, "max_workers": max_workers}
    searches: dict[bool, list[WorkerChoice]] = {True: [], False: []}
    for fit in range(fits):
        for left_out in (True, False) if fit % 2 == 0 else (False, True):
            searches[left_out].append(_search(chosen, left_out, pin))
    with tempfile.TemporaryDirectory() as folder:
        plain, _, _ = time_to_quality._fit(chosen, Path(folder), 0, False, Path(folder) / "cache", **pin)
    first = {key: [choice.trials[0].samples_per_s for choice in value] for key, value in searches.items()}
    left, counted = statistics.median(first[True]), statistics.median(first[False])

    def kept(key: bool) -> str:
        runs = searches[key]
        return f"{sum(c.threads is None for c in runs)} of {len(runs)} kept the run's threads"

    cost = statistics.median(choice.seconds for choice in searches[True])
    overhead = statistics.median(sum(t.overhead_s for t in choice.trials) for choice in searches[True])
    detail = (
        f"{workload}, {fits} cold-cache fits each, alternating: first segment {left:,.0f} samples/s"
        f" ({', '.join(f'{r:,.0f}' for r in first[True])}; {kept(True)}) with the checked steps"
        f" left out, {counted:,.0f} ({', '.join(f'{r:,.0f}' for r in first[False])}; {kept(False)},"
        f" the others a probe's fewer threads) counted; for scale, plain Lightning's fit"
        f" {plain.samples_per_second:,.0f} from its first step to its last, validations included. Left out,"
        f" the search's reported cost {cost:.2f} s, {overhead:.3f} s of it starting and stopping its"
        " segments' workers (medians)"
    )
    return [Row("worker search's first segment: checked steps left out / counted, samples/s", left / counted,
                detail, COMMAND)]  # fmt: skip


def _search(workload: time_to_quality.Workload, left_out: bool, pin: dict[str, Any]) -> WorkerChoice:
    """One boosted fit's worker search.

    Raises:
        RuntimeError: when the fit's loader was not searched (nothing to compare).
    """
    count = instrumented.count
    if not left_out:
        instrumented.count = functools.partial(int, 0)  # every step looks unchecked to the segments
    datamodules: list[time_to_quality.Data] = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            root = Path(folder)
            cache = root / "cache"
            time_to_quality._fit(workload, root / "fit", 0, True, cache, datamodules=datamodules, **pin)
    finally:
        instrumented.count = count
    (choice,) = datamodules[0].worker_tuner.choices.values()
    if not choice.trials:
        raise RuntimeError(
            f"checked_steps: the {workload.name} fit's loader was not searched here ({choice.reason}), so"
            " it has no first segment: pin a smaller worker budget, e.g. checked_steps:max_workers=2"
        )
    return choice
