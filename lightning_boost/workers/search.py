"""DataLoader workers chosen by measurement: candidates, budgets, the search and the choice.

No Lightning here. The caller hands `search_workers` a ``measure(num_workers, prefetch_factor)``
function (`measure_loader` over a loader factory, in practice) and gets back a `WorkerChoice`:
the setting, every trial with its throughput, and why it won. Tests script the measurements.

The search is built for noisy timings (5-10 % between runs on one machine) and for machines
from 2 to 128 CPUs, where one more worker adds at most ``1 / N`` and a search that steps up one
count at a time stops on noise long before it reaches the answer:

- 0 workers is measured first (it also gives the batch size in bytes);
- a GPU (or MPS) run then measures the whole CPU budget, ``CPUs per process - 1`` (the training
  process keeps one, as Lightning's own hint does). When the consumer's rate is known (the
  model's training step at the run's batch size and precision, ``target_samples_per_s``) and the
  budget feeds it with `feed_margin` to spare, it bisects down to the smallest count that still
  does; otherwise the run is data-bound and the whole budget is used. Every comparison is against
  the consumer's rate with a margin larger than the noise, never between two noisy neighbours;
- a CPU run measures every candidate up to the budget (0-4, 6, 8, 12, ...), with no stop on a
  noisy plateau; the caller caps the budget at the counts whose model rate can still beat no
  workers (`workers_worth_measuring`) and weighs each against the model's step on the CPUs the
  workers leave (`split_cpus`).

A larger ``prefetch_factor`` is then tried on a data-bound winner of a GPU run and kept only
where it is faster by more than the tolerance (a CPU run's choice is the caller's, beside the
model, and deeper prefetching there only holds more memory).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from torch.utils.data._utils import signal_handling

from lightning_boost._validation import Fraction, NonEmpty, PositiveInt, Range, Seconds, validated
from lightning_boost.hardware import HardwareInfo

#: More worker processes than any machine runs: a cap above this is a mistake, not a cap.
MAX_WORKERS_CAP = 1024
#: Batches a main-process trial times before the run's projected load may end it early.
MIN_TIMED_BATCHES = 3

Clock = Callable[[], float]
#: ``measure(num_workers, prefetch_factor)``: one timed trial of a loader setting.
Measure = Callable[[int, "int | None"], "WorkerTrial"]


@validated
@dataclass(frozen=True)
class WorkerTuning:
    """How worker tuning measures and decides.

    Args:
        window_s: seconds each candidate is timed for, after one batch per worker has arrived.
        budget_s: seconds tuning may take in all; candidates it does not reach are left out.
        timeout_s: seconds a worker may take for one batch before the candidate counts as hung.
        tolerance: the smallest setting within this fraction of the best throughput wins.
        max_workers: an upper bound on the candidates (default: the CPU budget per process).
        prefetch_factors: prefetch factors to try, the first with every worker count, the others
            on the winner only.
        target_samples_per_s: samples per second the training step consumes, when known: the
            smallest setting that reaches it (with `feed_margin` to spare) is enough. Left
            ``None``, a GPU run measures it on a copy of the model.
        feed_margin: how much faster than the consumer a loader must measure to count as feeding
            it: covers timing noise and the workers' share of the training process's CPU.
        ram_fraction: share of available RAM that prefetched batches may hold.
        shm_fraction: share of ``/dev/shm`` that prefetched batches may hold.
        skip_short_runs: load in the main process, after one measurement, when the run is too
            short for worker tuning to pay back (`not_worth_measuring`); ``False`` measures anyway
            (to cache the result for a longer run).
        online: where a training loader's sampler allows it, search on the first epoch's own
            batches (`lightning_boost.workers.online`: no trial before the fit, every sample
            trained once); ``False`` times trials of the loader before the fit, as evaluation
            loaders and streams always are, and as a run told ``deterministic=True`` is (a search
            on its batches would load them at several worker counts, so a random augmentation's
            draws, and the shuffles after, would differ from its repeat's).

    Raises:
        TypeError, ValueError: for a value that does not fit its field (a time that is not a
            finite number > 0, a fraction outside (0, 1], a prefetch factor < 1, ...).

    Example:
        >>> WorkerTuning(window_s=1.0).prefetch_factors
        (2, 4)
    """

    window_s: Seconds = 0.5
    budget_s: Seconds = 60.0
    timeout_s: Seconds = 30.0
    tolerance: Fraction = 0.05
    max_workers: Annotated[int, Range(ge=0, le=MAX_WORKERS_CAP)] | None = None
    prefetch_factors: Annotated[tuple[PositiveInt, ...], NonEmpty()] = (2, 4)
    target_samples_per_s: Annotated[float, Range(gt=0, unit="samples/s")] | None = None
    feed_margin: Fraction = 0.25
    ram_fraction: Fraction = 0.25
    shm_fraction: Fraction = 0.5
    skip_short_runs: bool = True
    online: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefetch_factors", tuple(self.prefetch_factors))

    @property
    def need(self) -> float | None:
        """Samples/s a loader must measure to feed the consumer (its rate plus `feed_margin`).

        Example:
            >>> WorkerTuning(target_samples_per_s=1000.0).need
            1250.0
        """
        target = self.target_samples_per_s
        return None if target is None else target * (1 + self.feed_margin)


@dataclass(frozen=True)
class WorkerTrial:
    """One measured loader setting.

    Args:
        num_workers: worker processes.
        prefetch_factor: batches each worker loads ahead (``None`` with no workers).
        samples_per_s: steady-state throughput, after one batch per worker has arrived.
        seconds: time the trial took, worker start-up included.
        batch_bytes: bytes of tensor data in one batch.
        error: why the candidate was dropped (crashed, hung, shared memory); empty when it ran.
        startup_s: seconds until one batch per worker had arrived (start-up, a fixed cost per
            process start: every epoch without ``persistent_workers``).
        threads: the model's threads, when a segment of the run's own batches set them apart
            from its worker count (a CPU run's probe of the model at fewer threads).
        load_share: the share of a segment's time spent waiting for batches (host side).
        overhead_s: a segment's seconds on the training thread starting its workers and stopping
            them (forking and joining the processes), beyond `seconds`.
        paired: a probe of the model's threads timed step for step against the threads it would
            otherwise run (alternating in the same segment): its rate over theirs; 0 when not.
        on_copy: a probe timed on a copy of the model beside the run's own steps, which kept the
            run's threads (the copy's steps are in `overhead_s`).
        cpu_share: a trial in the main process (no workers): its CPU seconds per second while
            timed, at most 1; below 1 the loading waits on I/O, which workers overlap even
            without spare CPUs (`most_saved_s`).
    """

    num_workers: int
    prefetch_factor: int | None
    samples_per_s: float = 0.0
    seconds: float = 0.0
    batch_bytes: int = 0
    error: str = ""
    startup_s: float = 0.0
    threads: int | None = None
    load_share: float = 0.0
    overhead_s: float = 0.0
    paired: float = 0.0
    cpu_share: float = 1.0
    on_copy: bool = False

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def label(self) -> str:
        """``"2 workers, prefetch 4"``."""
        if self.threads is not None:
            copy = " (a copy of it)" if self.on_copy else ""
            return f"{self.num_workers} workers, the model on {self.threads} thread(s){copy}"
        if self.num_workers == 0:
            return "0 workers"
        noun = "worker" if self.num_workers == 1 else "workers"
        return f"{self.num_workers} {noun}, prefetch {self.prefetch_factor}"


@dataclass(frozen=True)
class WorkerChoice:
    """The loader setting to use and the evidence for it.

    Args:
        num_workers: the chosen worker count.
        prefetch_factor: the chosen prefetch factor (``None`` with no workers).
        reason: why it won, in one sentence.
        trials: every trial, in the order measured.
        skipped: candidates left out, each with why (budget, memory, time).
        seconds: time tuning took.
        source: ``"measured"`` (trials before the fit), ``"searched"`` (on the first epoch's own
            batches), ``"cache"``, ``"checkpoint"``, ``"short run"``, ...
        consumer_samples_per_s: the training step's own rate the loader was held to, when known.
        threads: a CPU run's model threads when the search measured the model faster on fewer
            than the workers leave it (a small step that thread start-up outweighs); ``None``: those.
    """

    num_workers: int
    prefetch_factor: int | None
    reason: str
    trials: tuple[WorkerTrial, ...] = ()
    skipped: tuple[str, ...] = ()
    seconds: float = 0.0
    source: str = "measured"
    consumer_samples_per_s: float | None = None
    threads: int | None = None

    @property
    def failures(self) -> tuple[WorkerTrial, ...]:
        return tuple(trial for trial in self.trials if not trial.ok)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain data (for the cache, a checkpoint and broadcasting to other ranks)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerChoice:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in fields}
        values["trials"] = tuple(WorkerTrial(**trial) for trial in data.get("trials", ()))
        values["skipped"] = tuple(data.get("skipped", ()))
        return cls(**values)

    def replace(self, **changes: Any) -> WorkerChoice:
        return dataclasses.replace(self, **changes)


def worker_candidates(max_workers: int) -> list[int]:
    """Worker counts to try, in increasing order: 0-4, then 6, 8, 12, 16, 24, ..., and `max_workers`.

    Example:
        >>> worker_candidates(10)
        [0, 1, 2, 3, 4, 6, 8, 10]
    """
    steps = {n for n in range(5)}
    power = 4
    while power <= max_workers:
        steps.update({power, power * 3 // 2})
        power *= 2
    return sorted(n for n in steps | {max_workers} if n <= max_workers)


def workers_allowed(cpus: int, tuning: WorkerTuning) -> int:
    """The most workers a search may try on `cpus` CPUs: all of them, or the user's `max_workers`."""
    return cpus if tuning.max_workers is None else min(cpus, tuning.max_workers)


def bounded(tuning: WorkerTuning, most: int | None) -> WorkerTuning:
    """`tuning` with no candidate past `most` workers (``None``: no bound), the user's lower
    ``max_workers`` kept.

    Example:
        >>> bounded(WorkerTuning(), 4).max_workers, bounded(WorkerTuning(max_workers=2), 4).max_workers
        (4, 2)
    """
    if most is None or (tuning.max_workers is not None and tuning.max_workers <= most):
        return tuning
    return dataclasses.replace(tuning, max_workers=most)


def worker_limit(
    hardware: HardwareInfo, batch_bytes: int, prefetch_factor: int, tuning: WorkerTuning
) -> tuple[int, list[str]]:
    """The most workers the CPU, RAM and shared-memory budgets allow, and what limits it.

    CPUs: the CPUs available to the process divided among the node's training processes; a GPU
    run leaves one of them to the training process (Lightning's hint, ``cpus // processes - 1``,
    at least 1), a CPU run lets `split_cpus` share them with the model. Memory:
    ``workers x prefetch_factor`` batches are in flight at once, in RAM and in ``/dev/shm``.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> worker_limit(EXAMPLES["a100x8"], batch_bytes=0, prefetch_factor=2, tuning=WorkerTuning())
        (11, ['CPU budget: 96 CPUs // 8 training processes per node - 1 for the training process = 11'])
    """
    cpus = hardware.cpus_per_process
    per_node = hardware.processes_per_node
    processes = "process" if per_node == 1 else "processes"
    note = f"CPU budget: {hardware.cpus_available} CPUs // {per_node} training {processes} per node"
    if hardware.accelerator != "cpu":
        cpus = max(cpus - 1, 1)
        note += " - 1 for the training process"
    limit = workers_allowed(cpus, tuning)
    notes = [f"{note} = {cpus}"]
    if tuning.max_workers is not None and tuning.max_workers < cpus:
        notes.append(f"max_workers={tuning.max_workers}")
    in_flight = batch_bytes * prefetch_factor
    budgets = {
        "RAM": (hardware.ram_available_bytes or 0) * tuning.ram_fraction / hardware.processes_per_node,
        "/dev/shm": (hardware.shm_bytes or 0) * tuning.shm_fraction / hardware.processes_per_node,
    }
    for name, allowed in budgets.items():
        if in_flight > 0 and allowed > 0 and allowed // in_flight < limit:
            limit = int(allowed // in_flight)
            notes.append(
                f"{name} budget: {allowed / 2**20:.0f} MiB holds {limit} workers x {prefetch_factor} "
                f"batches of {batch_bytes / 2**20:.1f} MiB"
            )
    return max(limit, 0), notes


def feeds(trial: WorkerTrial, tuning: WorkerTuning) -> bool:
    """`trial` keeps the consumer busy: a worker setting that measured at least `WorkerTuning.need`,
    or no workers when loading in the main process takes under `tolerance` of the step's time
    (without workers, loading and the step take turns).

    Example:
        >>> tuning = WorkerTuning(target_samples_per_s=100.0)
        >>> feeds(WorkerTrial(2, 2, 130.0), tuning), feeds(WorkerTrial(0, None, 130.0), tuning)
        (True, False)
    """
    need = tuning.need
    if need is None or not trial.ok:
        return False
    if trial.num_workers == 0:
        return trial.samples_per_s * tuning.tolerance >= need
    return trial.samples_per_s >= need


def choose_worker_trial(
    trials: Iterable[WorkerTrial], tuning: WorkerTuning, spare_cpus: bool = True
) -> tuple[WorkerTrial | None, str]:
    """The winning trial and why: the smallest that feeds the consumer, else the fastest setting
    (loading in the main process ranked by the pace it trains at, taking turns with the step: `_pace`).

    Among settings within `tolerance` of the fastest, `spare_cpus` (a CPU run, where the model
    needs the CPUs) takes the fewest workers; otherwise (a GPU run, where loading in the main
    process would stall the step) the most. Returns ``(None, why)`` when no trial ran.

    Example:
        >>> trials = [WorkerTrial(0, None, 100.0), WorkerTrial(2, 2, 290.0), WorkerTrial(4, 2, 300.0)]
        >>> choose_worker_trial(trials, WorkerTuning())[0].num_workers
        2
        >>> choose_worker_trial(trials, WorkerTuning(), spare_cpus=False)[0].num_workers
        4
    """
    ran = [trial for trial in trials if trial.ok]
    if not ran:
        return None, "no candidate ran"
    key = lambda trial: (trial.num_workers, trial.prefetch_factor or 0)  # noqa: E731
    fed = [trial for trial in ran if feeds(trial, tuning)]
    if fed:
        winner = min(fed, key=key)
        if winner.num_workers == 0:
            return winner, f"loading in the main process takes under {tuning.tolerance:.0%} of the step"
        return winner, (
            f"smallest setting that feeds the step's {tuning.target_samples_per_s:.0f} samples/s"
            f" with {tuning.feed_margin:.0%} to spare"
        )
    pace = lambda trial: _pace(trial, tuning)  # noqa: E731
    best = max(ran, key=pace)
    near = [trial for trial in ran if pace(trial) >= (1 - tuning.tolerance) * pace(best)]
    winner = min(near, key=key) if spare_cpus else max(near, key=key)
    target = tuning.target_samples_per_s
    bound = "" if target is None else f"; the loader cannot feed the step's {target:.0f}"
    alone = next((t for t in ran if not t.num_workers and t.samples_per_s > best.samples_per_s), None)
    if alone is not None:  # a faster loader alone, slower in the run: it takes turns with the step
        bound += (
            f"; loading in the main process read {alone.samples_per_s:.0f}, but it takes turns with the"
            f" step: {pace(alone):.0f}"
        )
    if winner is best:
        return winner, f"fastest measured ({best.samples_per_s:.0f} samples/s{bound})"
    which = "smallest" if spare_cpus else "largest"
    return winner, (
        f"{which} setting within {tuning.tolerance:.0%} of the fastest "
        f"({best.label}: {best.samples_per_s:.0f} samples/s{bound})"
    )


def taking_turns(loader: float, step: float) -> float:
    """Samples/s of a run whose loading and step take turns on the training thread (no workers):
    each batch costs the loader's time plus the step's.

    Example:
        >>> taking_turns(200.0, 200.0)
        100.0
    """
    return 1 / (1 / loader + 1 / step)


def _pace(trial: WorkerTrial, tuning: WorkerTuning) -> float:
    """What the choice ranks `trial` by: its loader's samples/s, but for loading in the main
    process when the step's rate is known, which takes turns with the step (as `feeds` and
    `split_cpus` have it): ``1 / (1 / loader + 1 / step)``. Ranked by the loader alone, a main
    process that read faster than one worker (within the noise: 197 against 180 samples/s beside
    a 220 samples/s step on a 2-CPU GPU machine, `worker_replay`) trained at half the worker's pace.

    Example:
        >>> tuning = WorkerTuning(target_samples_per_s=220.0)
        >>> round(_pace(WorkerTrial(0, None, 197.0), tuning)), round(_pace(WorkerTrial(1, 2, 180.0), tuning))
        (104, 180)
    """
    target = tuning.target_samples_per_s
    if trial.num_workers or target is None or trial.samples_per_s <= 0:
        return trial.samples_per_s
    return taking_turns(trial.samples_per_s, target)


def run_samples(
    split: str,
    samples_per_pass: int,
    batch_size: int,
    limit_batches: int | float,
    max_epochs: int | None,
    max_steps: int = -1,
    accumulate: int = 1,
    val_every_n_epochs: int | None = 1,
    val_checks_per_epoch: int = 1,
) -> int | None:
    """Samples a run loads from its ``"train"`` or ``"val"`` loader; ``None`` when unbounded.

    The arguments are the Trainer's (``limit_<split>_batches``, ``max_epochs``, ``max_steps``,
    ``accumulate_grad_batches``, ``check_val_every_n_epoch``, and the validations an epoch its
    ``val_check_interval`` asks for: `val_checks_per_epoch`).

    Example:
        >>> run_samples("val", 128, 32, 1.0, max_epochs=3)  # 4 batches, validated after each epoch
        384
        >>> run_samples("train", 50_000, 100, 10, max_epochs=2)  # limit_train_batches=10
        2000
        >>> run_samples("train", 50_000, 100, 1.0, max_epochs=-1, max_steps=300, accumulate=2)
        60000
        >>> run_samples("val", 128, 32, 1.0, max_epochs=3, val_checks_per_epoch=4)  # interval 0.25
        1536
        >>> run_samples("val", 128, 32, 1.0, max_epochs=-1, max_steps=100) is None  # by steps: unknown
        True
    """
    batches = -(-samples_per_pass // batch_size)
    batches = (
        int(batches * limit_batches) if isinstance(limit_batches, float) else min(batches, limit_batches)
    )
    epochs = max_epochs if max_epochs is not None and max_epochs >= 0 else None
    if split == "val":
        if epochs is None or not val_every_n_epochs:
            return None
        return batches * batch_size * max(epochs // val_every_n_epochs, 1) * val_checks_per_epoch
    bounds = []  # in batches: the epochs', the optimizer steps'
    if epochs is not None:
        bounds.append(epochs * batches)
    if max_steps >= 0:
        bounds.append(max_steps * accumulate)
    return min(bounds) * batch_size if bounds else None


def not_worth_measuring(
    first: WorkerTrial,
    workload_samples: int | None,
    rest_s: float = 0.0,
    cpus: int | None = None,
    step_s_per_sample: float = 0.0,
) -> str | None:
    """Why measuring worker settings cannot pay back, or ``None`` when it may.

    Workers can save at most what `most_saved_s` says (on a CPU run, with `cpus`: less than the
    loading, the CPUs being shared with the model's steps); when that is less than the rest of
    the measurement takes (at least as long as the first trial, without worker start-up, and at
    least `rest_s`: `rest_of_measuring`), the run is faster without measuring (a small
    validation set, a few-batch job).

    Example:
        >>> first = WorkerTrial(0, None, samples_per_s=1000.0, seconds=0.6)
        >>> print(not_worth_measuring(first, 128))
        the run loads 128 samples from it, about 0.13 s in the main process,
        less than the rest of the measurement takes (~0.6 s)
        >>> not_worth_measuring(first, 50_000) is None  # 50 s of loading: worth measuring
        True
        >>> print(not_worth_measuring(first, 1024, 0.6, cpus=2, step_s_per_sample=1e-4))
        the run loads 1024 samples from it, about 1 s in the main process; with the model's
        steps (about 0.1 s) on 2 CPUs, workers could save at most 0.56 s of it, less than the
        rest of the measurement takes (~0.6 s)
    """
    if workload_samples is None or not first.ok or first.samples_per_s <= 0:
        return None
    loading_s = workload_samples / first.samples_per_s
    saved_s = most_saved_s(first, workload_samples, cpus, step_s_per_sample)
    rest_s = max(first.seconds, rest_s)
    if saved_s > rest_s:
        return None
    words = f"the run loads {workload_samples} samples from it, about {loading_s:.2g} s in the main process"
    if saved_s < loading_s:
        steps_s = workload_samples * step_s_per_sample
        steps = f"with the model's steps (about {steps_s:.2g} s) " if steps_s else ""
        words += f"; {steps}on {cpus} CPUs, workers could save at most {saved_s:.2g} s of it"
    return f"{words}, less than the rest of the measurement takes (~{rest_s:.2g} s)"


def most_saved_s(
    first: WorkerTrial, workload_samples: int, cpus: int | None = None, step_s_per_sample: float = 0.0
) -> float:
    """The most seconds workers can save over the run's `workload_samples`, from the trial in the
    main process (`first`): on an accelerator run (`cpus` ``None``), the whole loading, which
    workers can hide behind the steps. On a CPU run the loading and the model's steps share the
    `cpus` CPUs: with workers the run takes at least their CPU work spread over every CPU (the
    loading's `WorkerTrial.cpu_share` of its time, and the steps' seconds at all threads,
    `step_s_per_sample`, as at least one CPU works through each), and no less than the steps
    alone, where without workers it takes both in turn.

    Example (1024 samples, 1 s of loading):
        >>> first = WorkerTrial(0, None, samples_per_s=1024.0)
        >>> most_saved_s(first, 1024)  # an accelerator run: all of it
        1.0
        >>> most_saved_s(first, 1024, cpus=2)  # 2 CPUs for loading: half of it
        0.5
        >>> most_saved_s(first, 1024, cpus=2, step_s_per_sample=1 / 512)  # a 2 s model: 1 s
        1.0
        >>> most_saved_s(WorkerTrial(0, None, 1024.0, cpu_share=0.2), 1024, cpus=1)  # waits on I/O
        0.8
    """
    loading_s = workload_samples / first.samples_per_s
    if cpus is None:
        return loading_s
    steps_s = workload_samples * step_s_per_sample
    fastest_s = max(steps_s, (first.cpu_share * loading_s + steps_s) / cpus)
    return max(loading_s + steps_s - fastest_s, 0.0)


#: The model-rate probe's timed steps per thread count a round, and its rounds (`model_step_rates`).
PROBE_REPEATS, PROBE_ROUNDS = 2, 2
#: A probe's trial error when the model's step cannot run on a copy of it (the model's failure).
COPY_FAILED = "the model's step cannot run on a copy"
#: Worker trials a CPU run's measurement is priced at, at least (fewer where fewer counts remain).
PRICED_TRIALS = 2


def priced_measuring(step_s: float, thread_counts: int, loader_trials: int, trial_s: float) -> float:
    """At least what a CPU run's measurement costs after its first trial, priced from one step of
    the model at all its threads (`step_s`; at fewer threads a step takes no less): the model's
    rates (a warm-up and `PROBE_REPEATS` timed steps a round, `PROBE_ROUNDS` rounds, at each of
    `thread_counts` counts) and `loader_trials` loader trials (`PRICED_TRIALS` where the CPUs
    allow that many) as long as the first (`trial_s`).

    Example:
        >>> priced_measuring(0.15, thread_counts=2, loader_trials=2, trial_s=0.75)  # 1.5 s + 1.5 s
        3.0
    """
    return thread_counts * (1 + PROBE_REPEATS * PROBE_ROUNDS) * step_s + loader_trials * trial_s


def rest_of_measuring(tuning: WorkerTuning, times_model: bool) -> float:
    """About what the measurement takes after its first trial: one worker trial (``window_s``),
    and on a CPU run first the model's step at each thread count the workers may leave, counted
    as one more window (an estimate: that timing runs a few of the model's steps per count).

    Example:
        >>> rest_of_measuring(WorkerTuning(window_s=0.5), times_model=True)
        1.0
    """
    return tuning.window_s * (2 if times_model else 1)


def search_workers(
    measure: Measure,
    hardware: HardwareInfo,
    tuning: WorkerTuning,
    clock: Clock = time.perf_counter,
    workload_samples: int | None = None,
    rest_s: float | None = None,
    step_s_per_sample: float = 0.0,
) -> WorkerChoice:
    """Measure the candidates the run needs (see the module's docstring) and return the choice.

    Falls back to ``num_workers=0`` and says why when every candidate with workers failed. With
    `workload_samples` (what the run will load from this loader) a run too short for workers to
    pay back their measurement stops after the first trial (`not_worth_measuring` against
    `rest_s`, by default `rest_of_measuring` without a model to time; on a CPU run the model's
    steps, `step_s_per_sample`, share the CPUs: `most_saved_s`). A trial that would end
    past ``budget_s`` (as long as the last one took) is not started.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> rate = lambda n: 300.0 * min(n, 10) if n else 250.0  # scales to 10 workers
        >>> measure = lambda n, pf: WorkerTrial(n, pf, rate(n), batch_bytes=1)
        >>> tuning = WorkerTuning(prefetch_factors=(2,), target_samples_per_s=1500.0)
        >>> choice = search_workers(measure, EXAMPLES["h100"], tuning)  # 16 CPUs: budget 15
        >>> choice.num_workers, [t.num_workers for t in choice.trials]
        (7, [0, 15, 7, 3, 5, 6])
    """
    start = clock()
    factor = tuning.prefetch_factors[0]
    trials = [measure(0, None)]
    rest_s = rest_of_measuring(tuning, times_model=False) if rest_s is None else rest_s
    cpus = hardware.cpus_per_process if hardware.accelerator == "cpu" else None
    short = (
        not_worth_measuring(trials[0], workload_samples, rest_s, cpus, step_s_per_sample)
        if tuning.skip_short_runs
        else None
    )
    if short is not None:
        return WorkerChoice(
            0, None, f"no workers: {short}", tuple(trials), (), clock() - start, source="short run"
        )
    limit, notes = worker_limit(hardware, trials[0].batch_bytes, factor, tuning)
    skipped = [f"more than {limit} workers ({'; '.join(notes)})"]

    def measured(count: int) -> WorkerTrial | None:
        """Measure `count` workers unless that would pass the time budget (then note it)."""
        if clock() - start + trials[-1].seconds > tuning.budget_s:
            skipped.append(f"{count} workers: the {tuning.budget_s:.0f} s tuning budget would be passed")
            return None
        trials.append(measure(count, factor))
        return trials[-1]

    spare_cpus = hardware.accelerator == "cpu"
    if not feeds(trials[0], tuning):
        (_scan if spare_cpus else _top_down)(measured, limit, tuning)
    winner, reason = choose_worker_trial(trials, tuning, spare_cpus)
    if winner is not None and winner.num_workers > 0 and not feeds(winner, tuning) and not spare_cpus:
        trials += _try_prefetch(measure, winner, hardware, tuning, skipped)
        winner, reason = choose_worker_trial(trials, tuning, spare_cpus)
    seconds = clock() - start
    with_workers = [trial for trial in trials if trial.num_workers > 0]
    if winner is None or (with_workers and not any(trial.ok for trial in with_workers)):
        return _fallback(trials, skipped, seconds, tuning)
    return WorkerChoice(
        winner.num_workers,
        winner.prefetch_factor,
        reason,
        tuple(trials),
        tuple(skipped),
        seconds,
        consumer_samples_per_s=tuning.target_samples_per_s,
    )


def _scan(measured: Callable[[int], WorkerTrial | None], limit: int, tuning: WorkerTuning) -> None:
    """A CPU run: every candidate up to `limit`, until one fails or feeds the consumer."""
    for count in worker_candidates(limit)[1:]:
        trial = measured(count)
        if trial is None or not trial.ok or feeds(trial, tuning):
            return  # more workers crash or hang the same way, or are not needed


def _top_down(measured: Callable[[int], WorkerTrial | None], limit: int, tuning: WorkerTuning) -> None:
    """A GPU run: the whole budget (halved while it fails), then, if it feeds the consumer, bisect
    down to the smallest count that still does, to within an eighth of the count."""
    high = limit
    top = measured(high) if high else None
    while top is not None and not top.ok and high > 1:
        high //= 2
        top = measured(high)
    if top is None or not feeds(top, tuning):
        return  # data-bound: every worker the budget allows, or nothing ran
    low = 0  # 0 workers did not feed the step (checked by the caller)
    while high - low > max(1, high // 8):
        middle = (low + high) // 2
        trial = measured(middle)
        if trial is None:
            return
        if feeds(trial, tuning):
            high = middle
        else:
            low = middle


def _try_prefetch(
    measure: Measure, winner: WorkerTrial, hardware: HardwareInfo, tuning: WorkerTuning, skipped: list[str]
) -> list[WorkerTrial]:
    trials = []
    for factor in tuning.prefetch_factors[1:]:
        limit, notes = worker_limit(hardware, winner.batch_bytes, factor, tuning)
        if limit < winner.num_workers:
            skipped.append(f"prefetch {factor}: {'; '.join(notes[1:])}")
            continue
        trial = measure(winner.num_workers, factor)
        trials.append(trial)
        if trial.ok and trial.samples_per_s <= (1 + tuning.tolerance) * winner.samples_per_s:
            break
    return trials


def _fallback(
    trials: list[WorkerTrial], skipped: list[str], seconds: float, tuning: WorkerTuning
) -> WorkerChoice:
    failed = "; ".join(f"{trial.label}: {trial.error}" for trial in trials if not trial.ok)
    return WorkerChoice(
        0,
        None,
        f"fell back to loading in the main process ({failed})",
        tuple(trials),
        tuple(skipped),
        seconds,
        consumer_samples_per_s=tuning.target_samples_per_s,
    )


def measure_loader(
    make_loader: Callable[[int, int | None], Iterable[Any]],
    num_workers: int,
    prefetch_factor: int | None,
    *,
    batch_size: int,
    window_s: float,
    clock: Clock = time.perf_counter,
    consume: Callable[[Any], object] | None = None,
    workload_samples: int | None = None,
    rest_s: float = 0.0,
    cpu_clock: Clock = time.process_time,
) -> WorkerTrial:
    """Time the loader `make_loader(num_workers, prefetch_factor)` builds, over `window_s` seconds.

    One batch per worker is fetched before the clock starts, so worker start-up and the first
    round (which arrives all at once) do not inflate the rate. With `workload_samples` (what the
    run itself will load) the timing ends early once loading them all at the rate so far would
    take less than `rest_s` (after `MIN_TIMED_BATCHES`, or once that many samples are timed): no
    worker setting can then save what the rest of the measurement costs (`rest_of_measuring`),
    and the trial says so (`not_worth_measuring`). `consume` takes each timed batch as training
    would before its step (a GPU run: the copy to the device, whose pinning and transfer share
    the main process's CPU with the workers). In the main process, `cpu_clock` (the process's CPU
    time) gives the loading's `WorkerTrial.cpu_share`. Any exception while loading makes the trial a
    failure that says what happened; the workers are shut down either way.
    """
    start = clock()
    iterator = None
    batch_bytes = 0
    try:
        if num_workers:
            watch_worker_deaths()
        iterator = iter(make_loader(num_workers, prefetch_factor))
        batch_bytes = tensor_bytes(next(iterator))
        for _ in range(num_workers - 1):
            next(iterator)
        started, cpu_started, batches = clock(), cpu_clock(), 0
        startup = started - start
        while clock() - started < window_s:
            batch = next(iterator)
            if consume is not None:
                consume(batch)
            batches += 1
            if workload_samples is not None and _run_loads_sooner(
                workload_samples, batches, batch_size, clock() - started, rest_s
            ):
                break
        elapsed = max(clock() - started, 1e-9)
        share = min(max((cpu_clock() - cpu_started) / elapsed, 0.0), 1.0) if num_workers == 0 else 1.0
        return WorkerTrial(
            num_workers,
            prefetch_factor,
            batches * batch_size / elapsed,
            clock() - start,
            batch_bytes,
            startup_s=startup,
            cpu_share=share,
        )
    except Exception as err:  # a failed candidate is data, whatever it raised
        error = describe_failure(err)
        end_workers(iterator)
        return WorkerTrial(num_workers, prefetch_factor, 0.0, clock() - start, batch_bytes, error)
    finally:
        del iterator  # shuts the workers down now


def _run_loads_sooner(
    workload_samples: int, batches: int, batch_size: int, elapsed: float, rest_s: float
) -> bool:
    """Whether the run's whole load, at the rate timed so far, takes less than `rest_s`."""
    timed = batches * batch_size
    if timed >= workload_samples:
        return True
    return batches >= MIN_TIMED_BATCHES and workload_samples * elapsed < rest_s * timed


def watch_worker_deaths() -> None:
    """Have the next worker loader set torch's SIGCHLD handler again where it is gone. torch sets
    it once a process and notes so; Lightning puts every signal's handler back as it found it
    when a fit ends, torch's among them, and the note stays. In a process's second fit a worker's
    death was then found only at the loader's `timeout` (the search's 30 s a candidate; 20 s twice
    in a test of 1.5 s run alone). Called before a candidate's workers start, online or not."""
    sigchld = getattr(signal, "SIGCHLD", None)  # none on Windows
    if sigchld is None:
        return
    if getattr(signal.getsignal(sigchld), "__qualname__", "") != "_set_SIGCHLD_handler.<locals>.handler":
        signal_handling._SIGCHLD_handler_set = False


def end_workers(iterator: object) -> None:
    """Terminate the live workers of a loader's `iterator` that failed (hung, crashed or raised)
    before it is released. torch's shutdown joins each live worker for 5 s before it terminates
    it, so every hung worker of a candidate cost 5 s beyond the candidate's `timeout_s` (by hand,
    2026-11-28: a search's hang test took 18.5 s with a 1 s timeout). Their pids leave torch's
    SIGCHLD watch first, as its shutdown does, so the terminations are not reported as crashes.
    Reads the iterator's private fields; one without workers is left as it is."""
    workers = getattr(iterator, "_workers", None)
    if not workers:
        return
    if getattr(iterator, "_worker_pids_set", False):
        signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False  # type: ignore[attr-defined]
    for worker in workers:
        if worker.is_alive():
            worker.terminate()


def describe_failure(err: BaseException) -> str:
    """A short cause for a failed candidate: hung, crashed, shared memory exhausted, or the error.

    Example:
        >>> describe_failure(RuntimeError("DataLoader timed out after 5 seconds"))
        'hung: DataLoader timed out after 5 seconds'
    """
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    lowered = str(err).lower()
    if isinstance(err, StopIteration):
        return "the loader ran out of batches before the measurement ended"
    if "shared memory" in lowered or "no space left on device" in lowered or "bus error" in lowered:
        return f"shared memory exhausted: {text}"
    if "timed out" in lowered:
        return f"hung: {text}"
    if "exited unexpectedly" in lowered or "killed by signal" in lowered:
        return f"crashed: {text}"
    return f"{type(err).__name__}: {text}"


def tensor_bytes(batch: Any) -> int:
    """Bytes of tensor data in a (nested) batch.

    Example:
        >>> tensor_bytes((torch.zeros(4, 3), {"y": torch.zeros(4, dtype=torch.int64)}))
        80
    """
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.numel()
    if isinstance(batch, Mapping):
        return sum(tensor_bytes(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(tensor_bytes(value) for value in batch)
    return 0


def compute_threads(hardware: HardwareInfo, num_workers: int, current: int) -> int | None:
    """Intra-op threads for CPU training beside `num_workers` workers, or ``None`` to leave `current`.

    On a CPU run the model and the workers share the CPU budget; torch's threads spinning on
    CPUs the workers use make both slower, so the model gets what the workers leave (at least 1).

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> compute_threads(EXAMPLES["cpu"].replace(cpus_available=8), num_workers=3, current=8)
        5
    """
    if hardware.accelerator != "cpu" or num_workers == 0:
        return None
    threads = model_threads(hardware.cpus_per_process, num_workers)
    return threads if threads < current else None


def model_threads(cpus: int, num_workers: int) -> int:
    """The model's intra-op threads on a CPU run beside `num_workers` workers (all CPUs without)."""
    return max(cpus - num_workers, 1) if num_workers else cpus


def split_cpus(
    trials: Sequence[WorkerTrial], step_rates: Mapping[int, float], cpus: int, tolerance: float = 0.05
) -> tuple[WorkerTrial, float] | None:
    """On a CPU run, the loader trial that trains fastest beside the model, and its predicted samples/s.

    With ``w`` workers the model gets `model_threads` (``cpus - w``), the loader and the model run
    side by side, and the slower sets the pace: ``min(loader(w), model(cpus - w))``. With no
    workers they take turns on all CPUs: ``1 / (1 / loader(0) + 1 / model(cpus))``. So a model
    whose step outweighs its data keeps its CPUs, and a data-bound one gets workers. Among
    trials within `tolerance` of the best prediction, no workers wins if it is one of them;
    otherwise the loader with the most headroom over the model, since workers contend with the
    model for the CPUs in a way measuring each alone leaves out. `step_rates` maps thread counts
    to the model's samples/s; ``None`` when no trial has the rate it needs.

    Example:
        >>> loader = [WorkerTrial(0, None, 3000.0), WorkerTrial(1, 2, 2900.0), WorkerTrial(2, 2, 3200.0)]
        >>> trial, rate = split_cpus(loader, {2: 780.0, 1: 420.0}, cpus=2)  # compute-bound
        >>> trial.num_workers, round(rate)
        (0, 619)
        >>> loader = [WorkerTrial(0, None, 500.0), WorkerTrial(1, 2, 900.0), WorkerTrial(2, 2, 1100.0)]
        >>> split_cpus(loader, {2: 3000.0, 1: 1700.0}, cpus=2)[0].num_workers  # data-bound
        2
    """
    predicted: list[tuple[float, WorkerTrial]] = []
    for trial in trials:
        model = step_rates.get(model_threads(cpus, trial.num_workers))
        if not trial.ok or not model or trial.samples_per_s <= 0:
            continue
        if trial.num_workers:
            rate = min(trial.samples_per_s, model)
        else:
            rate = taking_turns(trial.samples_per_s, model)
        predicted.append((rate, trial))
    if not predicted:
        return None
    best = max(rate for rate, _ in predicted)
    near = [(rate, trial) for rate, trial in predicted if rate >= (1 - tolerance) * best]

    def preference(pair: tuple[float, WorkerTrial]) -> tuple[bool, float, int]:
        _, trial = pair
        headroom = trial.samples_per_s / step_rates[model_threads(cpus, trial.num_workers)]
        return (trial.num_workers > 0, -headroom, trial.num_workers)

    rate, trial = min(near, key=preference)
    return trial, rate


def workers_worth_measuring(
    counts: Sequence[int], step_rates: Mapping[int, float], loading: float, cpus: int, tolerance: float
) -> tuple[int, str]:
    """On a CPU run, the most workers worth timing, and why fewer than `counts` allows.

    With ``w`` workers the run trains at most at the model's rate on the CPUs they leave
    (``step_rates[cpus - w]``); without workers at ``1 / (1 / loading + 1 / step_rates[cpus])``
    (`loading`: the loader's samples/s in the main process). A count whose bound is not within
    `tolerance` of that cannot win, and more workers leave the model less. Without the rates
    needed, every count is worth timing.

    Example:
        >>> workers_worth_measuring([0, 1, 2], {2: 743.0, 1: 393.0}, 1280.0, cpus=2, tolerance=0.05)[0]
        0
        >>> workers_worth_measuring([0, 1, 2], {2: 3000.0, 1: 1700.0}, 500.0, cpus=2, tolerance=0.05)[0]
        2
    """
    full = step_rates.get(cpus)
    if not full or loading <= 0:
        return max(counts), ""
    alone = taking_turns(loading, full)
    worth = [n for n in counts if step_rates.get(model_threads(cpus, n), math.inf) >= (1 - tolerance) * alone]
    cap = max(worth)
    if cap >= max(counts):
        return cap, ""
    first = min(n for n in counts if n > cap)
    threads = model_threads(cpus, first)
    return cap, (
        f"{first} worker(s) and up: the model's step on the {threads} CPU(s) they leave"
        f" ({step_rates[threads]:.0f} samples/s) cannot beat loading in the main process"
        f" ({alone:.0f} samples/s predicted)"
    )


def workers_cannot_repay(
    counts: Sequence[int],
    step_rates: Mapping[int, float],
    loading: float,
    cpus: int,
    workload_samples: int | None,
    trial_s: float,
    cpu_share: float = 1.0,
) -> str | None:
    """On a CPU run with the model's rates measured: why timing `counts` workers cannot pay back,
    or ``None`` when it may.

    With ``w`` workers the run trains at most at the model's rate on the CPUs they leave, and no
    faster than the CPUs get through the loading's work (its `cpu_share` of the main process's
    time) and the steps' (at least one CPU's through each): ``cpus / (cpu_share / loading + 1 /
    rate)``. So over the `workload_samples` the run loads they save at most ``W / alone - W /
    best`` seconds (``alone`` as in `workers_worth_measuring`), while timing them takes at least
    one trial as long as the first (`trial_s`) per count, up to `PRICED_TRIALS`. Timing the step
    (2 CPUs: 409 samples/s at 2 threads, 218 at 1) bounds what workers save far below the loading
    time (`not_worth_measuring`):

    Example:
        >>> rates = {2: 409.0, 1: 218.0}
        >>> print(workers_cannot_repay([0, 1, 2], rates, 336.0, 2, 1024, trial_s=0.77))
        workers could save at most 0.85 s of the 1024 samples' loading and steps (the model's step
        on the CPUs they leave: 218 samples/s; in turns with loading in the main process: 184),
        less than timing them takes (~1.5 s)
        >>> workers_cannot_repay([0, 1, 2], rates, 336.0, 2, 8 * 1024, trial_s=0.77) is None
        True
        >>> print(workers_cannot_repay([0, 1, 2], {2: 2100.0, 1: 1250.0}, 470.0, 2, 1024, 0.65))
        workers could save at most 1.2 s of the 1024 samples' loading and steps (the model's step
        on the CPUs they leave: 1250 samples/s, and the CPUs' work loading and stepping: 683;
        in turns with loading in the main process: 384), less than timing them takes (~1.3 s)
    """
    full = step_rates.get(cpus)
    rates = [step_rates.get(model_threads(cpus, n), 0.0) for n in counts if n]
    if workload_samples is None or not full or loading <= 0 or not rates or max(rates) <= 0:
        return None
    alone = taking_turns(loading, full)
    fastest = max(rates)
    best = max(min(rate, cpus / (cpu_share / loading + 1 / rate)) for rate in rates if rate > 0)
    saving_s = workload_samples / alone - workload_samples / best
    cost_s = min(PRICED_TRIALS, len(rates)) * trial_s
    if saving_s > cost_s:
        return None
    shared = f", and the CPUs' work loading and stepping: {best:.0f}" if best < fastest else ""
    return (
        f"workers could save at most {saving_s:.2g} s of the {workload_samples} samples' loading and"
        f" steps (the model's step on the CPUs they leave: {fastest:.0f} samples/s{shared}; in turns"
        f" with loading in the main process: {alone:.0f}), less than timing them takes (~{cost_s:.2g} s)"
    )


def open_files_plan(hardware: HardwareInfo, num_workers: int, minimum: int = 4096) -> tuple[str, int] | None:
    """What to do about a low open-file limit before starting workers, or ``None`` when it is fine.

    Workers hand each tensor to the main process as a file descriptor (torch's default
    ``file_descriptor`` sharing strategy), so a low ``ulimit -n`` ends in "Too many open files".
    Returns ``("raise_limit", n)`` when the hard limit allows raising the soft one to `n`, else
    ``("file_system", n)``: switch torch to the ``file_system`` sharing strategy.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> open_files_plan(EXAMPLES["cpu"].replace(open_files_limit=1024, open_files_hard_limit=4096), 2)
        ('raise_limit', 4096)
    """
    soft, hard = hardware.open_files_limit, hardware.open_files_hard_limit
    if num_workers == 0 or soft is None or soft >= minimum:
        return None
    if hard is not None and (hard < 0 or hard >= minimum):  # resource.RLIM_INFINITY is -1
        return "raise_limit", minimum
    return "file_system", minimum
