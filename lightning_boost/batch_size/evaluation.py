"""The evaluation batch size: the fastest measured evaluation step within the memory budget (pure).

An evaluation step keeps no gradients and no optimizer state, so it usually fits several times
the training batch, and on an accelerator a larger evaluation batch evaluates faster. Validation,
test and predict loaders get this size unless the user fixed one. A run that evaluates little
(a small validation set checked a few times) stops measuring once another trial would cost more
than it could save: a doubled batch at best halves the time its evaluation takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from lightning_boost.trials import Trial, why_failed

#: The most an evaluation batch grows over the training batch.
MAX_FACTOR = 8
#: A doubling is kept only when its evaluation step is this much faster per sample.
MIN_GAIN = 0.10


@dataclass(frozen=True)
class EvalSize:
    """The evaluation batch size, the evaluation steps measured, and why the doubling stopped."""

    size: int
    trials: tuple[Trial, ...]
    stopped: str


def eval_batch_size(
    measure: Callable[[int], Trial],
    start: int,
    budget_bytes: int,
    limit: int | None = None,
    planned: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    spread: tuple[int, int] | None = None,
) -> EvalSize:
    """Double from the training size `start` while the evaluation step fits in `budget_bytes` and
    gets at least `MIN_GAIN` faster per sample; stop at `MAX_FACTOR` times `start`, at the
    evaluation set's length `limit`, or, given the samples the run will evaluate (`planned`),
    when half the time they take at the best size so far is less than the last trial took (by
    `clock`): the next, at twice the size, cannot repay itself. With `spread`, the samples each
    evaluation pass loads on a rank and the loader's workers, stop where the next size would leave
    a worker without a batch in a pass: past ``samples / workers`` each pass waits for fewer
    workers, each loading a whole batch alone (the trials time the step, not the loading).

    Example:
        >>> speed = {64: 1000.0, 128: 1800.0, 256: 2600.0, 512: 2700.0}
        >>> measure = lambda size: Trial(size, speed[size], peak_bytes=size)
        >>> result = eval_batch_size(measure, 64, budget_bytes=1000)
        >>> result.size, [t.size for t in result.trials], result.stopped
        (256, [64, 128, 256, 512], 'no faster at 512 (2700 vs 2600 samples/s)')
        >>> eval_batch_size(measure, 64, budget_bytes=200).stopped
        'over the memory budget at 256'
        >>> now = iter(range(100))  # each trial takes 1 s by this clock
        >>> small = eval_batch_size(measure, 64, 1000, planned=3000, clock=lambda: float(next(now)))
        >>> small.size, small.stopped
        (128, 'the run evaluates 3000 samples, 1.7 s at 128: another trial (1.0 s) cannot repay itself')
        >>> spread = eval_batch_size(measure, 64, 1000, spread=(1024, 6))  # 171 samples a worker
        >>> spread.size, spread.stopped
        (128, "past 171 a pass of 1024 samples would leave some of the loader's 6 workers no batch")
    """
    started = clock()
    best = measure(start)
    cost, started = clock() - started, clock()
    trials = [best]
    if not best.fits(budget_bytes):
        return EvalSize(start, tuple(trials), "the training size's evaluation step does not fit")
    samples, workers = spread or (0, 0)
    per_worker = -(-samples // workers) if workers > 0 else None  # samples a worker loads per pass
    size = start
    while True:
        if size * 2 > start * MAX_FACTOR:
            return EvalSize(best.size, tuple(trials), f"{MAX_FACTOR}x the training size")
        if limit is not None and size >= limit:
            return EvalSize(best.size, tuple(trials), f"the evaluation set's {limit} samples")
        if per_worker is not None and size * 2 > per_worker:
            why = f"a pass of {samples} samples would leave some of the loader's {workers} workers no batch"
            return EvalSize(best.size, tuple(trials), f"past {per_worker} {why}")
        left_s = None if planned is None else planned / best.samples_per_s
        if left_s is not None and left_s / 2 < cost:
            spent = f"the run evaluates {planned:.0f} samples, {left_s:.1f} s at {best.size}"
            why = f"{spent}: another trial ({cost:.1f} s) cannot repay itself"
            return EvalSize(best.size, tuple(trials), why)
        size = size * 2 if limit is None else min(size * 2, limit)
        trial = measure(size)
        cost, started = clock() - started, clock()
        trials.append(trial)
        if not trial.fits(budget_bytes):
            return EvalSize(best.size, tuple(trials), f"{why_failed(trial)} at {size}")
        if trial.samples_per_s < best.samples_per_s * (1 + MIN_GAIN):
            speeds = f"{trial.samples_per_s:.0f} vs {best.samples_per_s:.0f} samples/s"
            return EvalSize(best.size, tuple(trials), f"no faster at {size} ({speeds})")
        best = trial
