"""Worker settings chosen on the run's own training steps: the segment plan and the search.

No Lightning and no clock here. The first epoch of a run starts at a prior setting and is cut
into segments of its own batches; each segment runs one setting and is timed end to end (the
wait for each batch plus the step that follows, host side), so what is measured is the real
training with the workers competing with the training process, not the loader alone. The
search (`search_online`) is a generator: it yields the next `Setting` to run, is sent the
segment's `WorkerTrial`, and returns the `WorkerChoice`. The driver that runs the segments is
`lightning_boost.workers.segments`.

On a CPU run that waits little for its data, the second segment trains the model alone at the
threads one worker would leave, step for step alternating with the threads loading in the main
process runs (a paired probe, `WorkerTrial.paired`); when that cannot beat loading in the main
process, no worker is started (`workers_cannot_win`). Otherwise the search assumes a throughput
curve that rises, flattens, and may fall again where workers take CPUs from the training process:
it bisects the unmeasured gaps beside the fastest count, and beside any count within twice the
tolerance of it (`_next_count`), until they close or the planned segments run out, and keeps the
fewest workers within `tolerance` of the fastest whose steps did not wait for their batches on a
CPU run, the fastest on a GPU run (`choose_online`). A GPU run's winner whose segments waited for
data then runs a segment at each larger prefetch factor of the tuning, kept when faster
(`_deeper_prefetch`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import NamedTuple

from lightning_boost.hardware import HardwareInfo
from lightning_boost.workers.search import (
    WorkerChoice,
    WorkerTrial,
    WorkerTuning,
    model_threads,
    worker_candidates,
    worker_limit,
)

#: Share of the first epoch (or of the run, when shorter) the search may take.
SEARCH_SHARE = 0.10
#: Batches per segment: the first is the setting's start-up (not timed), the others are timed, but
#: for the last ones at the batches its workers had queued when it started (`queue_depth`).
MIN_SEGMENT_BATCHES = 4
MAX_SEGMENT_BATCHES = 32
#: Steps a segment times at least besides its first batch, not counting the steps at the batches its
#: workers' queue held when it started (loaded while the segment before ran, they time no loading).
MIN_TIMED_STEPS = 2
#: A CPU run whose first segment waited for its data less than this share of its time probes the
#: model at fewer threads before starting any worker (workers can gain it little); above it, the
#: loader is the bottleneck and worker counts are measured at once.
PROBE_BELOW = 0.3
#: A segment loading in the main process ends once `MIN_SEGMENT_BATCHES` of its steps spent at
#: least this share of their time loading (its batches go to the next segment). Loading there
#: takes turns with the step (L + S a batch), workers overlap it (max(L, S c/(c-1)) on c CPUs,
#: contention aside), so from L >= S workers match it on 2 CPUs and beat it on more: its rate is
#: still compared, on fewer steps. `data_bound`'s first segment (17 batches at 0.6-0.7x the
#: winner's rate, loading 65-72 % of the time: the waits timed by hand, 2026-11-25) made most of
#: the search's 1.1-1.6 s cost (its tuning row); with this, 0.4-0.9 s.
LOADER_BOUND = 0.5
#: A CPU run's probe of the model on fewer threads wins (and its threads stay for the run) when it
#: leads every worker count by more than the tolerance, both measured twice; measured once, by
#: this many tolerances (on a busy 2-CPU host two segments of a few steps differed by up to 25 %,
#: timed by hand).
PROBE_LEAD_ONCE = 4


class Setting(NamedTuple):
    """What one segment runs: workers, their prefetch factor, and (a CPU run's probe) the model's
    threads when they are not the ones that worker count leaves."""

    num_workers: int
    prefetch_factor: int | None = None
    threads: int | None = None

    @property
    def probe(self) -> bool:
        """Whether this is a probe of the model's threads: no workers, the threads set apart."""
        return self.num_workers == 0 and self.threads is not None


@dataclass(frozen=True)
class SegmentPlan:
    """How the search cuts the first epoch: `segment_batches` each, at most `max_segments`.

    ``why_not`` is set (and the other fields are 0) when no search fits in the run. `unit` names
    what is cut: the training loader's ``"first epoch"``, or an evaluation stage's one pass
    (``"predict pass"``: `trainer.predict` searched on its own batches).
    """

    segment_batches: int = 0
    max_segments: int = 0
    why_not: str = ""
    unit: str = "first epoch"


def plan_segments(
    epoch_batches: int | None, run_batches: int | None, cpus: int, unit: str = "first epoch"
) -> SegmentPlan:
    """The segments a search may run: `SEARCH_SHARE` of the first epoch (`unit`: an evaluation
    stage's pass, for one), or of the whole run when that is shorter, split among the settings a
    search up to `cpus` workers measures (the CPU budget, or the user's ``max_workers`` when
    lower: a 16-CPU machine's count of settings would leave segments too short to time the one
    or two workers the user allowed).

    Example:
        >>> plan_segments(128, 256, cpus=2)  # the demo: 12 batches, three segments of 4
        SegmentPlan(segment_batches=4, max_segments=3, why_not='', unit='first epoch')
        >>> plan_segments(10_000, None, cpus=16)  # segments long enough to time 16 workers
        SegmentPlan(segment_batches=35, max_segments=28, why_not='', unit='first epoch')
        >>> plan_segments(20, 40, cpus=2).why_not
        'the first epoch has 20 batches: 10% of it cannot time two settings of 4 batches'
        >>> plan_segments(16, 16, cpus=2, unit="predict pass").why_not  # trainer.predict, 16 batches
        'the predict pass has 16 batches: 10% of it cannot time two settings of 4 batches'
    """
    if epoch_batches is None:
        why_not = f"the loader has no length, so {SEARCH_SHARE:.0%} of its {unit} is unknown"
        return SegmentPlan(why_not=why_not, unit=unit)
    batches = epoch_batches if run_batches is None else min(epoch_batches, run_batches)
    budget = int(batches * SEARCH_SHARE)
    if budget < 2 * MIN_SEGMENT_BATCHES:
        what = unit if batches == epoch_batches else "run"
        return SegmentPlan(
            why_not=f"the {what} has {batches} batches: {SEARCH_SHARE:.0%} of it cannot time two"
            f" settings of {MIN_SEGMENT_BATCHES} batches",
            unit=unit,
        )
    candidates = len(worker_candidates(max(cpus, 1)))
    expected = min(candidates, 2 + math.ceil(math.log2(candidates)))
    longest = max(MAX_SEGMENT_BATCHES, queue_depth(cpus, 2) + 1 + MIN_TIMED_STEPS)  # times `cpus` workers
    per = min(max(budget // expected, MIN_SEGMENT_BATCHES), longest)
    return SegmentPlan(per, budget // per, unit=unit)


def queue_depth(num_workers: int, prefetch_factor: int | None) -> int:
    """Batches a loader's workers hold in flight (PyTorch's default factor is 2): a segment's last
    this many steps run while its workers have nothing left to load.

    Example:
        >>> queue_depth(0, None), queue_depth(2, 2), queue_depth(3, None)
        (0, 4, 6)
    """
    return num_workers * (prefetch_factor or 2) if num_workers else 0


def timeable(num_workers: int, prefetch_factor: int | None, plan: SegmentPlan) -> bool:
    """Whether a segment of the plan can time this setting's workers loading while the model steps:
    `MIN_TIMED_STEPS` steps besides the first, before the steps at the batches they had queued.

    Example:
        >>> plan = SegmentPlan(4, 3)  # the demo's
        >>> timeable(0, None, plan), timeable(1, 2, plan), timeable(1, 2, SegmentPlan(8, 3))
        (True, False, True)
    """
    return queue_depth(num_workers, prefetch_factor) <= plan.segment_batches - 1 - MIN_TIMED_STEPS


def prior_setting(hardware: HardwareInfo, tuning: WorkerTuning) -> Setting:
    """Where the first epoch starts before anything is measured: a CPU run loads in the main
    process (PyTorch's default, every CPU for the model), a GPU run with the whole CPU budget
    (Lightning's hint), which the search then trims.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> [tuple(prior_setting(EXAMPLES[name], WorkerTuning())) for name in ("cpu", "h100")]
        [(0, None, None), (15, 2, None)]
    """
    if hardware.accelerator == "cpu":
        return Setting(0)
    factor = tuning.prefetch_factors[0]
    limit, _ = worker_limit(hardware, 0, factor, tuning)
    return Setting(limit, factor) if limit else Setting(0)


def search_start(hardware: HardwareInfo, tuning: WorkerTuning, plan: SegmentPlan) -> Setting | None:
    """The setting a search on `plan`'s segments starts at: the prior when a segment can time it,
    else the most workers one can time, or ``None`` (no search: the prior stays) when that is under
    half the prior's. A segment must see the workers' steady rate beyond their queue
    (`timeable`); a 16-CPU GPU run's 15 workers hold 30 batches in flight, and 4-batch segments
    read their start-up as up to twice the rate their whole epoch trained at (the H100's
    `data_bound`, 2026-11-24), so counts it cannot time are not compared, and without half the
    budget in range the search could not see where more workers stop paying.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> h100, tuning = EXAMPLES["h100"], WorkerTuning()
        >>> search_start(h100, tuning, SegmentPlan(4, 6)) is None  # a 256-batch first epoch
        True
        >>> tuple(search_start(h100, tuning, SegmentPlan(32, 31)))  # 10,000 batches
        (14, 2, None)
        >>> tuple(search_start(EXAMPLES["cpu"], tuning, SegmentPlan(4, 3)))
        (0, None, None)
    """
    prior = prior_setting(hardware, tuning)
    workers, factor = prior.num_workers, prior.prefetch_factor
    if timeable(workers, factor, plan):
        return prior
    most = max((count for count in range(workers) if timeable(count, factor, plan)), default=0)
    return Setting(most, factor if most else None) if most >= _half(workers) else None


def untimeable_reason(hardware: HardwareInfo, tuning: WorkerTuning, plan: SegmentPlan) -> str:
    """Why `search_start` found no search (the prior's workers stay).

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> print(untimeable_reason(EXAMPLES["h100"], WorkerTuning(), SegmentPlan(4, 6)))
        segments of 4 batches (10% of the first epoch) cannot time 8 workers (16 batches in flight)
    """
    workers, factor, _ = prior_setting(hardware, tuning)
    half = _half(workers)
    return (
        f"segments of {plan.segment_batches} batches ({SEARCH_SHARE:.0%} of the {plan.unit}) cannot"
        f" time {half} workers ({queue_depth(half, factor)} batches in flight)"
    )


def _half(workers: int) -> int:
    """The fewest workers a search must be able to time to search below a prior of `workers`."""
    return -(-workers // 2)


def search_online(
    hardware: HardwareInfo,
    tuning: WorkerTuning,
    plan: SegmentPlan,
    prior: Setting,
    threads: int | None = None,
) -> Generator[Setting, WorkerTrial | None, WorkerChoice]:
    """Yield settings to run as segments, be sent each one's trial, return the choice (sent
    ``None``, when the run ended the search early, at once, from what was measured). `threads`:
    the model's intra-op threads as the run found them (a CPU run's probe of fewer threads runs
    only where one worker would take some of them); ``None``: one per CPU.

    Example (a scripted run: 16 CPUs, the step takes 2000 samples/s, the loader 300 per worker):
        >>> from lightning_boost.hardware import EXAMPLES
        >>> rate = lambda n: min(300.0 * n, 2000.0) if n else 250.0
        >>> plan = SegmentPlan(32, 8)  # 10 % of a 10,000-batch epoch: segments time up to 14 workers
        >>> search = search_online(EXAMPLES["h100"], WorkerTuning(), plan, (14, 2))
        >>> setting, measured = next(search), []
        >>> try:
        ...     while True:
        ...         measured.append(setting[0])
        ...         setting = search.send(WorkerTrial(setting[0], setting[1], rate(setting[0])))
        ... except StopIteration as stop:
        ...     choice = stop.value
        >>> measured, choice.num_workers
        ([14, 7, 3, 10, 5, 12, 8, 6], 7)
    """
    factor = tuning.prefetch_factors[0]
    fewest = hardware.accelerator == "cpu"
    deeper = not fewest and len(tuning.prefetch_factors) > 1 and plan.max_segments > 2
    keep_one = dataclasses.replace(plan, max_segments=plan.max_segments - 1)
    order: list[WorkerTrial] = []
    skipped: list[str] = []
    candidates: list[int] = []
    setting: Setting | None = Setting(*prior)
    while setting is not None:
        trial = yield setting
        if trial is None:
            return choose_online(order, tuning, tuple(skipped), fewest)
        order.append(trial)
        if not candidates:  # the first batch's size bounds the workers memory allows
            limit, notes = worker_limit(hardware, trial.batch_bytes, factor, tuning)
            candidates = list(range(max(limit, prior[0]) + 1))  # every count: the peak may lie between rungs
            skipped.append(f"more than {limit} workers ({'; '.join(notes)})")
            # only a segment that times a count counts: one shorter than the workers' queue reads
            # their start-up (every worker's first batch at once), not their rate beside the step
            untimed = [count for count in candidates if not timeable(count, factor, plan)]
            candidates = [count for count in candidates if count not in untimed]
            if untimed:
                skipped.append(
                    f"{untimed[0]} or more workers: a segment of {plan.segment_batches} batches cannot"
                    f" time them (they hold {queue_depth(untimed[0], factor)} batches in flight, so its"
                    " steps would show their start-up, not their rate beside the training step)"
                )
        # an accelerator run whose fastest count waits for data keeps a segment for a deeper prefetch
        waits = deeper and _prefetch_could_gain(_waited(_runs_of(order, _fastest(order))), tuning)
        setting = _next_setting(
            hardware, candidates, order, tuning, keep_one if waits else plan, skipped, threads
        )
    choice = choose_online(order, tuning, tuple(skipped), fewest)
    if fewest or not choice.num_workers:
        return choice  # a CPU run's workers share the model's CPUs: deeper queues only hold memory
    budget = prior_setting(hardware, tuning)
    if max(candidates) < budget.num_workers and _still_rising(mean_rates(order), max(candidates), tuning):
        return _beyond_the_timed(choice, budget, max(candidates), plan)
    return (yield from _deeper_prefetch(hardware, tuning, plan, order, choice))


def _still_rising(ran: dict[int, float], top: int, tuning: WorkerTuning) -> bool:
    """Whether the rate still rose towards `top` workers (the most a segment times): within twice
    the tolerance (one segment's noise) of the fastest, and more than the tolerance above the
    fewest measured at half of `top` or more (a plateau is not rising).

    Example:
        >>> _still_rising({40: 8000.0, 60: 12000.0, 78: 15400.0, 81: 15100.0}, 81, WorkerTuning())
        True
        >>> _still_rising({7: 2000.0, 10: 2000.0, 14: 2000.0}, 14, WorkerTuning())
        False
    """
    lower = [count for count in ran if top // 2 <= count < top]
    if top not in ran or not lower:
        return False
    near_best = ran[top] >= (1 - 2 * tuning.tolerance) * max(ran.values())
    return near_best and ran[top] > (1 + tuning.tolerance) * ran[min(lower)]


def _beyond_the_timed(choice: WorkerChoice, budget: Setting, top: int, plan: SegmentPlan) -> WorkerChoice:
    """An accelerator run whose rate still rose at the most workers its segments can time keeps
    the CPU budget's workers (the prior, Lightning's hint)."""
    reason = (
        f"the CPU budget: the rate still rose at {top} workers, the most a segment of"
        f" {plan.segment_batches} batches can time ({choice.reason})"
    )
    return dataclasses.replace(
        choice, num_workers=budget.num_workers, prefetch_factor=budget.prefetch_factor, reason=reason
    )


def _deeper_prefetch(
    hardware: HardwareInfo,
    tuning: WorkerTuning,
    plan: SegmentPlan,
    order: list[WorkerTrial],
    choice: WorkerChoice,
) -> Generator[Setting, WorkerTrial | None, WorkerChoice]:
    """An accelerator run's winner at the larger prefetch factors of `tuning`, a segment each
    while the plan has segments left: kept when more than `tolerance` faster. Only tried when
    the winner's segments waited for data long enough for removing the wait to gain that much
    (its `load_share`); the count search's means leave these segments out."""
    count = choice.num_workers
    runs = _runs_of(order, count)
    rate = sum(t.samples_per_s for t in runs) / len(runs)
    waited = _waited(runs)
    best, skipped = choice.prefetch_factor, list(choice.skipped)
    deeper: list[WorkerTrial] = []
    factors = tuning.prefetch_factors[1:]
    if not _prefetch_could_gain(waited, tuning):
        factors = ()
        skipped.append(
            f"a deeper prefetch: {count} workers kept the step waiting {waited:.0%} of the time,"
            f" too little for more batches in flight to gain {tuning.tolerance:.0%}"
        )
    for factor in factors:
        if not timeable(count, factor, plan):
            skipped.append(
                f"prefetch {factor}: a segment of {plan.segment_batches} batches cannot time {count}"
                f" workers holding {queue_depth(count, factor)} batches in flight"
            )
            break
        limit, notes = worker_limit(hardware, runs[0].batch_bytes, factor, tuning)
        if limit < count or len(order) + len(deeper) >= plan.max_segments:
            why = "; ".join(notes[1:]) or f"the {plan.max_segments} segments the plan allows are run"
            skipped.append(f"prefetch {factor}: {why}")
            break
        trial = yield Setting(count, factor)
        if trial is None:
            break
        deeper.append(trial)
        if not trial.ok or trial.samples_per_s <= (1 + tuning.tolerance) * rate:
            break
        best, rate = factor, trial.samples_per_s
    trials = (*order, *deeper)
    reason = choice.reason
    if best != choice.prefetch_factor:
        reason = f"{reason}, with prefetch_factor={best} ({rate:.0f} samples/s)"
    return choice.replace(
        prefetch_factor=best,
        reason=reason,
        trials=trials,
        skipped=tuple(skipped),
        seconds=search_cost(list(trials), rate),
    )


def _runs_of(trials: list[WorkerTrial], count: int | None) -> list[WorkerTrial]:
    """The segments that ran `count` workers (a probe of the model's threads is no such setting)."""
    return [t for t in trials if t.num_workers == count and t.threads is None and t.ok]


def _fastest(trials: list[WorkerTrial]) -> int | None:
    """The worker count with the best mean rate so far (the fewer on a tie); ``None`` before any."""
    ran = mean_rates(trials)
    return max(sorted(ran), key=ran.__getitem__) if ran else None


def _waited(runs: list[WorkerTrial]) -> float:
    """The mean share of their time `runs` waited for data (0 without any)."""
    return sum(t.load_share for t in runs) / len(runs) if runs else 0.0


def _prefetch_could_gain(waited: float, tuning: WorkerTuning) -> bool:
    """Whether removing a wait for data of this share of the time would gain `tolerance`."""
    return 1 / max(1 - waited, 1e-9) > 1 + tuning.tolerance


def _next_setting(
    hardware: HardwareInfo,
    candidates: list[int],
    order: list[WorkerTrial],
    tuning: WorkerTuning,
    plan: SegmentPlan,
    skipped: list[str],
    threads: int | None = None,
) -> Setting | None:
    """The next segment: on a CPU run whose first segment waited for data less than `PROBE_BELOW`
    of its time, first the model alone at the threads one worker would leave, where that is fewer
    than the run's `threads` (no worker started: it trains the run at once; a run on no more
    threads than its CPUs less one loses none to a worker, as torch's default of one thread per
    physical core is on a machine of two logical CPUs a core), and no worker segment at all when that
    step alone cannot beat loading in the main process (a run that waits longer for its data goes
    to workers at once); then `_next_count`. The probe runs even where no worker count can be
    timed: its threads may win on their own (`choose_online`)."""
    if len(order) >= plan.max_segments:
        return None
    fewest = hardware.accelerator == "cpu"
    factor = tuning.prefetch_factors[0]
    if fewest and order[0].num_workers == 0 and order[0].threads is None:
        probe = next((trial for trial in order if trial.threads is not None), None)
        fewer = model_threads(hardware.cpus_per_process, 1)
        takes = fewer < (threads or hardware.cpus_per_process)  # a worker would take some of them
        if probe is None and takes and order[0].load_share < PROBE_BELOW:
            return Setting(0, None, fewer)
        why = workers_cannot_win(order[0], probe, tuning.tolerance)
        if why:
            if why not in skipped:
                skipped.append(why)
            return _confirm_probe(order, tuning.tolerance, factor)
    count = _next_count(candidates, order, tuning.tolerance, fewest) if len(candidates) > 1 else None
    if count is None:
        return _confirm_probe(order, tuning.tolerance, factor) if fewest else None
    return Setting(count, factor if count else None)


def _probe_lead(trials: list[WorkerTrial]) -> tuple[list[WorkerTrial], float, int | None, int]:
    """A CPU run's probes of the model on fewer threads, their mean rate over the fastest worker
    count's mean, that count, and the fewer of the two settings' segment counts. Where loading in
    the main process is the fastest and the probes were paired with its threads step for step
    (`WorkerTrial.paired`), the lead is their paired ratio, as good as two segments of each."""
    probes = [t for t in trials if t.ok and t.threads is not None and not t.num_workers]
    ran = mean_rates(trials)
    if not probes or not ran:
        return probes, 0.0, None, 0
    best = max(sorted(ran), key=ran.__getitem__)
    paired = [t.paired for t in probes if t.paired > 0]
    if best == 0 and paired:
        return probes, sum(paired) / len(paired), best, 2
    lead = sum(t.samples_per_s for t in probes) / len(probes) / max(ran[best], 1e-9)
    return probes, lead, best, min(len(probes), len(_runs_of(trials, best)))


def _confirm_probe(order: list[WorkerTrial], tolerance: float, factor: int) -> Setting | None:
    """When the probe leads every worker count by more than `tolerance` on one segment of
    either, the one measured once runs again (the fastest count first): one segment's noise must
    not set the model's threads for the whole run."""
    probes, lead, best, runs = _probe_lead(order)
    if best is None or lead <= 1 + tolerance or runs >= 2:
        return None
    if len(_runs_of(order, best)) < 2:
        return Setting(best, factor if best else None)
    return Setting(0, None, probes[0].threads)


#: How `workers_cannot_win`'s reason starts, in a choice's ``skipped`` (StepTimeMonitor reads it).
NO_WORKERS = "any workers: "


def workers_cannot_win(alone: WorkerTrial, probe: WorkerTrial | None, tolerance: float) -> str:
    """Why no worker count can beat loading in the main process on a CPU run, or ``""``.

    With workers the run goes at best at the model's own pace on the CPUs they leave (the probe's
    step time, its wait for data left out); with none, loading and the step take turns (the first
    segment's whole time). More workers leave the model fewer threads still.

    Example:
        >>> alone = WorkerTrial(0, None, 500.0, load_share=0.15)  # 64 samples: 0.128 s a batch
        >>> probe = WorkerTrial(0, None, 360.0, threads=1, load_share=0.1)
        >>> print(workers_cannot_win(alone, probe, 0.05))
        any workers: the model's step on the 1 thread(s) one worker leaves (400 samples/s without
        its data wait) cannot beat loading in the main process (500 samples/s)
    """
    if probe is None or not probe.ok or not alone.ok or probe.samples_per_s <= 0:
        return ""
    model_alone = probe.samples_per_s / max(1 - probe.load_share, 1e-9)
    if model_alone > (1 + tolerance) * alone.samples_per_s:
        return ""
    return (
        f"{NO_WORKERS}the model's step on the {probe.threads} thread(s) one worker leaves"
        f" ({model_alone:.0f} samples/s without its data wait) cannot beat loading in the main"
        f" process ({alone.samples_per_s:.0f} samples/s)"
    )


def mean_rates(trials: list[WorkerTrial]) -> dict[int, float]:
    """Samples/s per worker count, the mean of its segments; a count that failed once is out. A
    probe of the model's threads is no setting, but the other steps of a paired one ran loading in
    the main process at its threads: one more run of no workers (its rate over `paired`).

    Example:
        >>> mean_rates([WorkerTrial(2, 2, 100.0), WorkerTrial(0, None, 50.0), WorkerTrial(2, 2, 120.0)])
        {2: 110.0, 0: 50.0}
        >>> mean_rates([WorkerTrial(0, None, 50.0), WorkerTrial(0, None, 88.0, threads=1, paired=1.1)])
        {0: 65.0}
    """
    failed = {trial.num_workers for trial in trials if not trial.ok and trial.threads is None}
    runs: dict[int, list[float]] = {}
    for trial in trials:
        if trial.num_workers in failed:
            continue
        if trial.threads is None:
            runs.setdefault(trial.num_workers, []).append(trial.samples_per_s)
        elif trial.ok and trial.paired > 0 and not trial.num_workers:
            runs.setdefault(0, []).append(trial.samples_per_s / trial.paired)
    return {count: sum(rates) / len(rates) for count, rates in runs.items()}


def _next_count(
    candidates: list[int], trials: list[WorkerTrial], tolerance: float, fewest: bool
) -> int | None:
    """The next count to measure, or ``None`` when done: the middle of the widest unmeasured gap
    beside the fastest count or any count within twice `tolerance` of it (the peak lies there:
    the curve rises, flattens and may fall where workers take the training process's CPUs, and
    two segments' noise can put the fastest on the wrong side of it; on a flat top the extra
    segments train at the top's rate); when `fewest` workers are wanted (a CPU run, whose model
    needs the CPUs), the gap below the smallest count within `tolerance` of the fastest; then,
    when the two fastest are within `tolerance` of each other, each once more (one segment's noise
    must not pick the winner)."""
    ran = mean_rates(trials)
    if not ran:
        return None
    measured = sorted(
        i
        for i, count in enumerate(candidates)
        if count in ran or any(t.num_workers == count and not t.ok for t in trials)
    )
    best = max(ran.values())
    fastest = min(i for i, count in enumerate(candidates) if ran.get(count) == best)
    contenders = [
        i for i, count in enumerate(candidates) if ran.get(count, -1.0) >= (1 - 2 * tolerance) * best
    ]
    width, _, middle = max(_gap_beside(peak, measured, len(candidates), fastest) for peak in contenders)
    if width > 1 and middle not in measured:
        return candidates[middle]
    if fewest:
        good = min(i for i, count in enumerate(candidates) if ran.get(count, -1.0) >= (1 - tolerance) * best)
        under = max((i for i in measured if i < good), default=-1)
        if good - under > 1:
            return candidates[(under + good + 1) // 2 if under < 0 else (under + good) // 2]
    top = sorted(ran, key=ran.__getitem__, reverse=True)[:2]
    settings = [trial.num_workers for trial in trials if trial.threads is None]
    repeats = len(settings) - len(set(settings))
    if len(top) == 2 and repeats < 2 and ran[top[1]] >= (1 - tolerance) * ran[top[0]]:
        times = {count: sum(t.num_workers == count and t.threads is None for t in trials) for count in top}
        again = min(top, key=lambda count: (times[count], top.index(count)))
        return again if times[again] < 2 else None
    return None


def _gap_beside(peak: int, measured: list[int], size: int, fastest: int) -> tuple[int, int, int]:
    """The wider unmeasured gap beside candidate `peak`: its width, its nearness to the fastest
    (the tie-break) and its middle."""
    below = max((i for i in measured if i < peak), default=-1)
    above = min((i for i in measured if i > peak), default=size)
    lower = (
        peak - below,
        -abs(peak - fastest),
        (below + peak + 1) // 2 if below < 0 else (below + peak) // 2,
    )
    upper = (above - peak, -abs(peak - fastest), size - 1 if above == size else (peak + above) // 2)
    return max(lower, upper)


def choose_online(
    trials: list[WorkerTrial], tuning: WorkerTuning, skipped: tuple[str, ...] = (), fewest: bool = True
) -> WorkerChoice:
    """By each count's mean over its segments: the fewest workers within `tolerance` of the
    fastest on a CPU run (the model needs the CPUs), unless their steps waited for data
    (`_fewest_fed`), the fastest on a GPU run; no workers when
    nothing ran. A CPU run's probe of the model on fewer threads (no workers) wins when it beat
    every count by more than `tolerance` (`PROBE_LEAD_ONCE` tolerances when either was measured
    once, unless paired: `_probe_lead`): a small model's step can lose more to starting its
    threads than they add (`WorkerChoice.threads`).

    Example:
        >>> trials = [WorkerTrial(0, None, 400.0), WorkerTrial(2, 2, 430.0), WorkerTrial(1, 2, 420.0)]
        >>> choose_online(trials, WorkerTuning()).num_workers
        1
        >>> mlp = [WorkerTrial(0, None, 18000.0), WorkerTrial(0, None, 29000.0, threads=1)]
        >>> choice = choose_online(mlp, WorkerTuning())
        >>> choice.num_workers, choice.threads
        (0, 1)
    """
    ran = mean_rates(trials)
    if not ran:
        why = "; ".join(f"{trial.label}: {trial.error}" for trial in trials) or "nothing was measured"
        reason = f"fell back to loading in the main process ({why})"
        return WorkerChoice(0, None, reason, tuple(trials), skipped, 0.0, source="searched")
    best = max(sorted(ran), key=ran.__getitem__)  # an exact tie: the fewer workers
    near = [count for count, rate in ran.items() if rate >= (1 - tuning.tolerance) * ran[best]]
    winner = _fewest_fed(near, trials, tuning, best) if fewest else best
    label = next(trial.label for trial in trials if trial.num_workers == best and trial.threads is None)
    where = "on the run's own steps"
    probes, lead, _, runs = _probe_lead(trials)
    margin = tuning.tolerance * (1 if runs >= 2 else PROBE_LEAD_ONCE)
    if fewest and probes and lead > 1 + margin:
        threads, rate = probes[0].threads, lead * ran[best]
        reason = (
            f"fastest {where}: the model on {threads} thread(s), loading in the main process"
            f" ({rate:.0f} samples/s, against {ran[best]:.0f} at {label})"
        )
        cost = search_cost(trials, rate)
        return WorkerChoice(0, None, reason, tuple(trials), skipped, cost, "searched", threads=threads)
    if winner == best:
        reason = f"fastest {where} ({ran[best]:.0f} samples/s)"
    else:
        fed = " whose steps did not wait for data" if winner != min(near) else ""
        reason = (
            f"fewest workers{fed} within {tuning.tolerance:.0%} of the fastest {where}"
            f" ({label}: {ran[best]:.0f} samples/s)"
        )
    factor = next(t.prefetch_factor for t in trials if t.num_workers == winner and t.threads is None)
    return WorkerChoice(
        winner, factor, reason, tuple(trials), skipped, search_cost(trials, ran[winner]), source="searched"
    )


def _fewest_fed(near: list[int], trials: list[WorkerTrial], tuning: WorkerTuning, best: int) -> int:
    """A CPU run's pick among the counts within `tolerance` of the fastest (`near`): the fewest
    workers (the model needs the CPUs), passing over a count whose steps waited for its workers'
    batches long enough for ending the wait to gain the tolerance (`_prefetch_could_gain`): the
    loader, not the model, set its pace, and a segment's few steps cannot tell that count from
    the one above it. The fastest (`best`) when every near count waited so. Loading in the main
    process (no workers) is its own pace, not a wait for workers: kept on a tie as before.

    On `data_bound` (2 CPUs, 2026-11-25; the waits timed by hand in searches stopped after 70
    batches, no benchmark row prints them) 1 worker's segments waited 24-33 % of their time and
    read within 5 % of 2 workers', which waited 1-3 %, while whole epochs trained 12-16 % faster
    with 2 (its sweeps); on a busy spell 1 worker waited 1-11 % and read 4-10 % faster, and that
    spell's sweep had 1 worker ahead (580 against 533 samples/s).

    Example:
        >>> runs = [WorkerTrial(1, 2, 600.0, load_share=0.3), WorkerTrial(2, 2, 610.0, load_share=0.02)]
        >>> _fewest_fed([1, 2], runs, WorkerTuning(), best=2)
        2
        >>> _fewest_fed([0, 1, 2], [WorkerTrial(0, None, 605.0, load_share=0.6), *runs], WorkerTuning(), 2)
        0
    """
    fed = [
        count
        for count in sorted(near)
        if not count or not _prefetch_could_gain(_waited(_runs_of(trials, count)), tuning)
    ]
    return fed[0] if fed else best


def search_cost(trials: list[WorkerTrial], winner_rate: float) -> float:
    """Seconds the search's segments took beyond running them at the winner's rate (each segment
    trains the run anyway: only the slower settings cost time; a failed one costs all of its;
    a probe on a copy ran the run's own steps at the rate it was paired with), plus each
    segment's starting and stopping of its workers and a probe's steps of a copy (`overhead_s`:
    a run set by hand starts one loader and steps no copy).

    Example:
        >>> trials = [WorkerTrial(0, None, 100.0, seconds=2.0), WorkerTrial(2, 2, 200.0, 1.0)]
        >>> trials[1] = dataclasses.replace(trials[1], overhead_s=0.04)  # its workers' start and stop
        >>> search_cost(trials, 200.0)
        1.04
        >>> probe = WorkerTrial(0, None, 150.0, 1.2, threads=1, overhead_s=0.2, paired=0.75, on_copy=True)
        >>> search_cost([probe], 200.0)  # its own steps ran at 200 (150 / 0.75): the copy's 0.2 s
        0.2
    """
    if winner_rate <= 0:
        return 0.0
    return sum(_lost(trial, winner_rate) + trial.overhead_s for trial in trials)


def _lost(trial: WorkerTrial, winner_rate: float) -> float:
    """A segment's seconds beyond running it at `winner_rate` (`search_cost`)."""
    if not trial.ok:
        return trial.seconds if not trial.on_copy else 0.0  # a failed copy left the run's steps as they were
    rate = trial.samples_per_s / trial.paired if trial.on_copy and trial.paired else trial.samples_per_s
    seconds = trial.seconds - trial.overhead_s if trial.on_copy else trial.seconds
    return seconds * max(0.0, 1 - rate / winner_rate)
