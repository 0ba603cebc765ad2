"""Worker settings chosen on the run's own training steps: the segment plan and the search.

No Lightning and no clock here. The first epoch of a run starts at a prior setting and is cut
into segments of its own batches; each segment runs one setting and is timed end to end (the
wait for each batch plus the step that follows, host side), so what is measured is the real
training with the workers competing with the training process, not the loader alone. The
search (`search_online`) is a generator: it yields the next ``(num_workers, prefetch_factor)``
to run, is sent the segment's `WorkerTrial`, and returns the `WorkerChoice`. The driver that
runs the segments is `lightning_boost.workers.segments`.

The search assumes a throughput curve that rises, flattens, and may fall again where workers
take CPUs from the training process. It keeps the smallest count within `tolerance` of the
fastest measured: it measures the far end of the candidates from the prior, then bisects the
gap below the smallest near-best count and the gap above the fastest, until both gaps are
closed or the segments planned run out.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping
from dataclasses import dataclass

from lightning_boost.hardware import HardwareInfo
from lightning_boost.workers.search import (
    WorkerChoice,
    WorkerTrial,
    WorkerTuning,
    worker_candidates,
    worker_limit,
)

#: Share of the first epoch (or of the run, when shorter) the search may take.
SEARCH_SHARE = 0.10
#: Batches per segment: the first is the setting's start-up (not timed), the others are timed.
MIN_SEGMENT_BATCHES = 4
MAX_SEGMENT_BATCHES = 32

Setting = tuple[int, "int | None"]


@dataclass(frozen=True)
class SegmentPlan:
    """How the search cuts the first epoch: `segment_batches` each, at most `max_segments`.

    ``why_not`` is set (and the other fields are 0) when no search fits in the run.
    """

    segment_batches: int = 0
    max_segments: int = 0
    why_not: str = ""


def plan_segments(epoch_batches: int | None, run_batches: int | None, cpus: int) -> SegmentPlan:
    """The segments a search may run: `SEARCH_SHARE` of the first epoch, or of the whole run
    when that is shorter, split among the settings a search of `cpus` candidates measures.

    Example:
        >>> plan_segments(128, 256, cpus=2)  # the demo: 12 batches for 0, 2 and 1 workers
        SegmentPlan(segment_batches=4, max_segments=3, why_not='')
        >>> plan_segments(20, 40, cpus=2).why_not
        'the first epoch has 20 batches: 10% of it cannot time two settings of 4 batches'
    """
    if epoch_batches is None:
        return SegmentPlan(why_not="the training loader has no length, so 10% of an epoch is unknown")
    batches = epoch_batches if run_batches is None else min(epoch_batches, run_batches)
    budget = int(batches * SEARCH_SHARE)
    if budget < 2 * MIN_SEGMENT_BATCHES:
        what = "first epoch" if batches == epoch_batches else "run"
        return SegmentPlan(
            why_not=f"the {what} has {batches} batches: {SEARCH_SHARE:.0%} of it cannot time two"
            f" settings of {MIN_SEGMENT_BATCHES} batches"
        )
    candidates = len(worker_candidates(max(cpus, 1)))
    expected = min(candidates, 2 + math.ceil(math.log2(candidates)))
    per = min(max(budget // expected, MIN_SEGMENT_BATCHES), MAX_SEGMENT_BATCHES)
    return SegmentPlan(per, budget // per)


def prior_setting(hardware: HardwareInfo, tuning: WorkerTuning) -> Setting:
    """Where the first epoch starts before anything is measured: a CPU run loads in the main
    process (PyTorch's default, every CPU for the model), a GPU run with the whole CPU budget
    (Lightning's hint), which the search then trims.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> prior_setting(EXAMPLES["cpu"], WorkerTuning()), prior_setting(EXAMPLES["h100"], WorkerTuning())
        ((0, None), (15, 2))
    """
    if hardware.accelerator == "cpu":
        return 0, None
    factor = tuning.prefetch_factors[0]
    limit, _ = worker_limit(hardware, 0, factor, tuning)
    return (limit, factor) if limit else (0, None)


def search_online(
    hardware: HardwareInfo, tuning: WorkerTuning, plan: SegmentPlan, prior: Setting
) -> Generator[Setting, WorkerTrial, WorkerChoice]:
    """Yield settings to run as segments, be sent each one's trial, return the choice.

    Example (a scripted run: 16 CPUs, the step takes 2000 samples/s, the loader 300 per worker):
        >>> from lightning_boost.hardware import EXAMPLES
        >>> rate = lambda n: min(300.0 * n, 2000.0) if n else 250.0
        >>> search = search_online(EXAMPLES["h100"], WorkerTuning(), SegmentPlan(8, 8), (15, 2))
        >>> setting, measured = next(search), []
        >>> try:
        ...     while True:
        ...         measured.append(setting[0])
        ...         setting = search.send(WorkerTrial(setting[0], setting[1], rate(setting[0])))
        ... except StopIteration as stop:
        ...     choice = stop.value
        >>> measured, choice.num_workers
        ([15, 4, 8, 6], 8)
    """
    factor = tuning.prefetch_factors[0]
    trials: dict[int, WorkerTrial] = {}
    order: list[WorkerTrial] = []
    skipped: list[str] = []
    candidates: list[int] = []
    setting: Setting | None = prior
    while setting is not None:
        trial = yield setting
        order.append(trial)
        trials[setting[0]] = trial
        if not candidates:  # the first batch's size bounds the workers memory allows
            limit, notes = worker_limit(hardware, trial.batch_bytes, factor, tuning)
            candidates = worker_candidates(max(limit, prior[0]))
            skipped.append(f"more than {limit} workers ({'; '.join(notes)})")
        count = _next_count(candidates, trials, tuning.tolerance) if len(order) < plan.max_segments else None
        setting = None if count is None else (count, factor if count else None)
    return choose_online(order, tuning, tuple(skipped))


def _next_count(candidates: list[int], trials: Mapping[int, WorkerTrial], tolerance: float) -> int | None:
    """The next count to measure, or ``None`` when the gaps around the best are closed: first
    the gap below the smallest count within `tolerance` of the fastest (fewer workers may do as
    well), then the gap above the fastest (the peak may lie between), then the top end."""
    ran = {count: trial.samples_per_s for count, trial in trials.items() if trial.ok}
    if not ran:
        return None
    measured = sorted(i for i, count in enumerate(candidates) if count in trials)
    best = max(ran.values())
    good = min(i for i, count in enumerate(candidates) if ran.get(count, -1.0) >= (1 - tolerance) * best)
    below = max((i for i in measured if i < good), default=-1)
    if good - below > 1:
        return candidates[(below + good + 1) // 2 if below < 0 else (below + good) // 2]
    fastest = max(i for i, count in enumerate(candidates) if ran.get(count) == best)
    above = min((i for i in measured if i > fastest), default=len(candidates))
    if above == len(candidates) and fastest < len(candidates) - 1:
        return candidates[-1]
    if above - fastest > 1:
        return candidates[(fastest + above) // 2]
    return None


def choose_online(
    trials: list[WorkerTrial], tuning: WorkerTuning, skipped: tuple[str, ...] = ()
) -> WorkerChoice:
    """The smallest measured setting within `tolerance` of the fastest; the first setting (the
    prior) when nothing ran.

    Example:
        >>> trials = [WorkerTrial(0, None, 400.0), WorkerTrial(2, 2, 430.0), WorkerTrial(1, 2, 420.0)]
        >>> choose_online(trials, WorkerTuning()).num_workers
        1
    """
    ran = [trial for trial in trials if trial.ok]
    if not ran:
        why = "; ".join(f"{trial.label}: {trial.error}" for trial in trials) or "nothing was measured"
        reason = f"fell back to loading in the main process ({why})"
        return WorkerChoice(0, None, reason, tuple(trials), skipped, 0.0, source="searched")
    best = max(ran, key=lambda trial: trial.samples_per_s)
    near = [trial for trial in ran if trial.samples_per_s >= (1 - tuning.tolerance) * best.samples_per_s]
    winner = min(near, key=lambda trial: trial.num_workers)
    where = "on the run's own training steps"
    if winner is best:
        reason = f"fastest {where} ({best.samples_per_s:.0f} samples/s)"
    else:
        reason = (
            f"fewest workers within {tuning.tolerance:.0%} of the fastest {where}"
            f" ({best.label}: {best.samples_per_s:.0f} samples/s)"
        )
    return WorkerChoice(
        winner.num_workers,
        winner.prefetch_factor,
        reason,
        tuple(trials),
        skipped,
        search_cost(trials, winner),
        source="searched",
    )


def search_cost(trials: list[WorkerTrial], winner: WorkerTrial) -> float:
    """Seconds the search's segments took beyond running them at the winner's rate (each segment
    trains the run anyway: only the slower settings cost time).

    Example:
        >>> search_cost([WorkerTrial(0, None, 100.0, seconds=2.0), WorkerTrial(2, 2, 200.0, seconds=1.0)],
        ...             WorkerTrial(2, 2, 200.0))
        1.0
    """
    if winner.samples_per_s <= 0:
        return 0.0
    return sum(
        trial.seconds * max(0.0, 1 - trial.samples_per_s / winner.samples_per_s)
        if trial.ok
        else trial.seconds
        for trial in trials
    )
