"""The evaluation batch size: the fastest measured evaluation step within the memory budget (pure).

An evaluation step keeps no gradients and no optimizer state, so it usually fits several times
the training batch, and on an accelerator a larger evaluation batch evaluates faster. Validation,
test and predict loaders get this size unless the user fixed one.
"""

from __future__ import annotations

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
) -> EvalSize:
    """Double from the training size `start` while the evaluation step fits in `budget_bytes` and
    gets at least `MIN_GAIN` faster per sample; stop at `MAX_FACTOR` times `start` or at the
    evaluation set's length `limit`.

    Example:
        >>> speed = {64: 1000.0, 128: 1800.0, 256: 2600.0, 512: 2700.0}
        >>> measure = lambda size: Trial(size, speed[size], peak_bytes=size)
        >>> result = eval_batch_size(measure, 64, budget_bytes=1000)
        >>> result.size, [t.size for t in result.trials], result.stopped
        (256, [64, 128, 256, 512], 'no faster at 512 (2700 vs 2600 samples/s)')
        >>> eval_batch_size(measure, 64, budget_bytes=200).stopped
        'over the memory budget at 256'
    """
    best = measure(start)
    trials = [best]
    if not best.fits(budget_bytes):
        return EvalSize(start, tuple(trials), "the training size's evaluation step does not fit")
    size = start
    while True:
        if size * 2 > start * MAX_FACTOR:
            return EvalSize(best.size, tuple(trials), f"{MAX_FACTOR}x the training size")
        if limit is not None and size >= limit:
            return EvalSize(best.size, tuple(trials), f"the evaluation set's {limit} samples")
        size = size * 2 if limit is None else min(size * 2, limit)
        trial = measure(size)
        trials.append(trial)
        if not trial.fits(budget_bytes):
            return EvalSize(best.size, tuple(trials), f"{why_failed(trial)} at {size}")
        if trial.samples_per_s < best.samples_per_s * (1 + MIN_GAIN):
            speeds = f"{trial.samples_per_s:.0f} vs {best.samples_per_s:.0f} samples/s"
            return EvalSize(best.size, tuple(trials), f"no faster at {size} ({speeds})")
        best = trial
