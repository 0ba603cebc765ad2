"""The worker decision made before the fit, and why the run got its worker settings, in words.

No Lightning here. `decide_workers` is the whole decision over measurement callables that the
Lightning side builds (`WorkerProbes`): it returns a frozen `WorkerChoice` (the setting, every
trial, the reason, the seconds, the source), using the search of `lightning_boost.workers.search`;
`choice_findings` says so. Together with the search they answer "why did this run get N
workers?". A search on the run's own batches decides in `lightning_boost.workers.online`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_boost.hardware import HardwareInfo
from lightning_boost.report import Finding, Severity, plot_data
from lightning_boost.workers.search import (
    COPY_FAILED,
    PRICED_TRIALS,
    Clock,
    Measure,
    WorkerChoice,
    WorkerTrial,
    WorkerTuning,
    model_threads,
    not_worth_measuring,
    priced_measuring,
    rest_of_measuring,
    search_workers,
    split_cpus,
    worker_candidates,
    workers_allowed,
    workers_cannot_repay,
    workers_worth_measuring,
)


@dataclass(frozen=True)
class WorkerProbes:
    """The measurements `decide_workers` may ask for; the Lightning side builds them.

    Args:
        loader: one timed trial of the loader at ``(num_workers, prefetch_factor)``.
        cpu_step: a CPU run: given thread counts, one batch of the real size fetched in the main
            process (its samples/s: a first, pessimistic loading rate) and the model's training
            step on it, samples/s per thread count (``{}`` when the step cannot run outside the
            fit). The workers and the model share the CPUs, so both decide.
        consumer_rate: an accelerator run: the training step's samples/s, the rate the loader must
            feed (``None`` when it cannot be measured).
        step_s: a CPU run: the seconds of one model step at the given thread count on a batch of
            the real size, after a warm-up step (``None`` when the step cannot run outside the
            fit), to price the rest of the measurement before timing it (`priced_measuring`).
        batch_size: the real batch size, the model probes' (0 where unknown).
    """

    loader: Measure
    cpu_step: Callable[[Sequence[int]], tuple[float, Mapping[int, float]]] | None = None
    consumer_rate: Callable[[], float | None] | None = None
    step_s: Callable[[int], float | None] | None = None
    batch_size: int = 0


def decide_workers(
    probes: WorkerProbes,
    hardware: HardwareInfo,
    tuning: WorkerTuning,
    workload_samples: int | None = None,
    clock: Clock = time.perf_counter,
) -> WorkerChoice:
    """The worker setting of a loader, measured before the fit: the loader in the main process
    first (a run too short to repay more stops there, `not_worth_measuring`); then a CPU run's
    model step per thread count, which caps the workers worth measuring
    (`workers_worth_measuring`), or an accelerator run's step rate, which the loader must feed;
    then the search (`search_workers`); a CPU run's winner is the loader setting that trains
    fastest beside the model on the CPUs it leaves (`split_cpus`).

    Example (2 CPUs): a model whose step outweighs its data keeps both CPUs, and no worker is
    timed; a data-bound one gets the workers:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> from lightning_boost.workers.search import WorkerTrial
        >>> cpu = EXAMPLES["cpu"].replace(cpus_available=2)
        >>> def decide(loader_rates, step_rates):
        ...     loader = lambda n, pf: WorkerTrial(n, pf, loader_rates[n], batch_bytes=1)
        ...     probes = WorkerProbes(loader, cpu_step=lambda threads: (loader_rates[0], step_rates))
        ...     choice = decide_workers(probes, cpu, WorkerTuning())
        ...     return choice.num_workers, [trial.num_workers for trial in choice.trials]
        >>> decide([3000.0, 2900.0, 3200.0], {2: 780.0, 1: 420.0})
        (0, [0])
        >>> decide([500.0, 900.0, 1100.0], {2: 3000.0, 1: 1700.0})
        (2, [0, 1, 2])
    """
    start = clock()
    first = probes.loader(0, None)
    rates: Mapping[int, float] = {}
    skipped: list[str] = []
    cpus = hardware.cpus_per_process if hardware.accelerator == "cpu" else None
    rest_s, per_sample_s = _rest_of_measuring(probes, first, cpus, tuning, workload_samples)
    short = not_worth_measuring(first, workload_samples, rest_s, cpus, per_sample_s)
    if not (tuning.skip_short_runs and short):
        if probes.cpu_step is not None:
            rates, tuning, skipped = _model_first(
                probes.cpu_step, hardware.cpus_per_process, tuning, first, workload_samples
            )
        elif probes.consumer_rate is not None and tuning.target_samples_per_s is None:
            tuning = dataclasses.replace(tuning, target_samples_per_s=probes.consumer_rate())

    def measure_once(num_workers: int, prefetch_factor: int | None) -> WorkerTrial:
        return first if num_workers == 0 else probes.loader(num_workers, prefetch_factor)

    choice = search_workers(measure_once, hardware, tuning, clock, workload_samples, rest_s, per_sample_s)
    choice = choice.replace(seconds=clock() - start, skipped=(*skipped, *choice.skipped))
    if not rates:
        return choice  # an accelerator run, or no model step to weigh
    if not any(trial.ok and trial.num_workers for trial in choice.trials):
        return choice.replace(reason=f"no workers: {skipped[0]}") if skipped else choice
    return _beside_model(choice, rates, hardware.cpus_per_process, tuning.tolerance)


def _rest_of_measuring(
    probes: WorkerProbes,
    first: WorkerTrial,
    cpus: int | None,
    tuning: WorkerTuning,
    workload_samples: int | None,
) -> tuple[float, float]:
    """What the measurement takes after its first trial, and a CPU run's model step in seconds a
    sample (0 where not timed): the estimate (`rest_of_measuring`), and on a CPU run (`cpus`)
    whose loading could repay that, at least its price from one step of the model at all its
    threads (`priced_measuring`: a slow step makes timing the model's rates and the workers dear;
    and the steps share the CPUs with the loading, `most_saved_s`)."""
    rest_s = rest_of_measuring(tuning, times_model=probes.cpu_step is not None)
    if (
        cpus is None
        or probes.cpu_step is None
        or probes.step_s is None
        or not tuning.skip_short_runs
        or workload_samples is None
        or not_worth_measuring(first, workload_samples, rest_s, cpus)
    ):
        return rest_s, 0.0
    step_s = probes.step_s(cpus)
    if step_s is None:
        return rest_s, 0.0
    counts, threads = _candidates(cpus, tuning)
    trials = min(PRICED_TRIALS, len(counts) - 1)
    priced = max(rest_s, priced_measuring(step_s, len(threads), trials, first.seconds))
    return priced, step_s / probes.batch_size if probes.batch_size else 0.0


def _candidates(cpus: int, tuning: WorkerTuning) -> tuple[list[int], list[int]]:
    """A CPU run's worker counts to time, and the model's thread counts they leave, most first."""
    counts = worker_candidates(workers_allowed(cpus, tuning))
    return counts, sorted({model_threads(cpus, count) for count in counts}, reverse=True)


def _model_first(
    cpu_step: Callable[[Sequence[int]], tuple[float, Mapping[int, float]]],
    cpus: int,
    tuning: WorkerTuning,
    first: WorkerTrial,
    workload_samples: int | None,
) -> tuple[Mapping[int, float], WorkerTuning, list[str]]:
    """A CPU run: the model's step rates at the thread counts the candidates leave, and the
    tuning capped at the most workers that can still win (`workers_worth_measuring`) and repay
    their trials (`workers_cannot_repay`: none when they cannot)."""
    counts, threads = _candidates(cpus, tuning)
    loading, rates = cpu_step(threads)
    cap, why = workers_worth_measuring(counts, rates, loading, cpus, tuning.tolerance)
    unpaid = None
    if cap and tuning.skip_short_runs:
        worth = [count for count in counts if count <= cap]
        unpaid = workers_cannot_repay(
            worth, rates, loading, cpus, workload_samples, first.seconds, first.cpu_share
        )
    if unpaid is not None:
        cap, why = 0, unpaid
    if cap >= counts[-1]:
        return rates, tuning, []
    return rates, dataclasses.replace(tuning, max_workers=cap), [why]


def _beside_model(
    choice: WorkerChoice, rates: Mapping[int, float], cpus: int, tolerance: float
) -> WorkerChoice:
    """A CPU run: the loader trial that trains fastest with the model on the CPUs it leaves."""
    pick = split_cpus(choice.trials, rates, cpus, tolerance)
    if pick is None:
        return choice
    trial, predicted = pick
    model = ", ".join(f"{rate:.0f} at {count} thread(s)" for count, rate in sorted(rates.items()))
    if trial.num_workers == choice.num_workers:
        return choice.replace(reason=f"{choice.reason}, and beside the model (its steps: {model} samples/s)")
    reason = (
        f"fastest beside the model: {predicted:.0f} samples/s predicted (the model's steps:"
        f" {model} samples/s; the loader's: {trial.samples_per_s:.0f})"
    )
    return choice.replace(num_workers=trial.num_workers, prefetch_factor=trial.prefetch_factor, reason=reason)


_FIXES = {
    "hung": "A worker waited longer than `timeout_s` for one sample batch: look for locks, network calls "
    "or per-worker initialisation in `__getitem__`, or raise `WorkerTuning(timeout_s=...)`.",
    "crashed": "A worker process died: run once with `num_workers=0` to see the dataset's own error, "
    "and check the kernel log (`dmesg`) for the out-of-memory killer.",
    "shared memory exhausted": "Workers hand batches over through /dev/shm: give the container more "
    "(`docker run --shm-size=8g` or `--ipc=host`) or lower the batch size or `prefetch_factor`.",
}


def _copy_steps(choice: WorkerChoice) -> str:
    """The search's steps of a copy of the model, for its cost's sentence."""
    seconds = sum(trial.overhead_s for trial in choice.trials if trial.on_copy)
    return f" and the steps of the model's copy ({seconds:.1f} s)" if seconds else ""


def choice_findings(source: str, choice: WorkerChoice, loader: str = "") -> list[Finding]:
    """The choice with its evidence, and one finding per candidate that failed; `loader` names
    the loader it is for (``"train loader at batch 256"``) in each title."""
    label = f"{loader}: " if loader else ""
    label += f"num_workers={choice.num_workers}"
    if choice.num_workers:
        label += f", prefetch_factor={choice.prefetch_factor}"
    if choice.threads is not None:
        label += f", the model on {choice.threads} thread(s)"
    measured = "; ".join(
        f"{trial.label}: {trial.samples_per_s:.0f} samples/s" if trial.ok else f"{trial.label}: failed"
        for trial in choice.trials
    )
    detail = {
        "measured": f"Measured {measured}. Tuning took {choice.seconds:.1f} s.",
        "searched": f"Searched on the run's own batches and steps, {len(choice.trials)} segment(s):"
        f" {measured}. Every segment was part of the run; the slower settings, and starting and stopping"
        f" each segment's workers{_copy_steps(choice)}, cost about {choice.seconds:.1f} s against the"
        " winner's rate.",
        "cache": "Reused the cached measurement (`retune=True` measures again).",
        "checkpoint": "Restored from the checkpoint; not measured again.",
        "carried": "The setting found for this dataset at another batch size in this process: a loader's"
        " cost per sample does not depend on its batch size, and the machine's prior has fewer workers.",
        "short run": f"Measured {measured}. Tuning took {choice.seconds:.1f} s; a longer run measures"
        " worker counts."
        if choice.trials
        else "Nothing measured: a run this short could not repay it.",
    }.get(choice.source, "")
    startups = [trial.startup_s for trial in choice.trials if trial.ok and trial.num_workers]
    measured_now = choice.source in ("measured", "searched")
    if startups and choice.source == "measured":
        detail += (
            f" Worker start-up (until one batch per worker arrived): {max(startups):.2f} s at most,"
            f" {sum(startups):.1f} s of the tuning in all."
        )
    if choice.consumer_samples_per_s and choice.source == "measured":
        detail += f" The training step alone: {choice.consumer_samples_per_s:.0f} samples/s."
    if choice.skipped and measured_now:
        detail += " Not tried: " + "; ".join(choice.skipped) + "."
    if choice.source == "unmeasurable":
        why = choice.reason.removeprefix("not measured: ")
        return [
            Finding(
                source, "data", Severity.INFO, f"{label}: not measured", why, "Set `num_workers` by hand."
            )
        ]
    fell_back = choice.reason.startswith("fell back") or choice.source == "error"
    data = {**choice.to_dict(), "cost_s": round(choice.seconds, 3)}
    plot = worker_plot(choice) if measured_now else None
    if plot is not None:
        data["plot"] = plot
    findings = [
        Finding(
            source,
            "data",
            Severity.WARN if fell_back else Severity.INFO,
            f"{label}: {choice.reason}",
            detail,
            "Fix the failures below, or set `num_workers` by hand." if fell_back else "",
            data=data,
            cost=f"{choice.seconds:.1f} s tuning" if measured_now else "",
        )
    ]
    for trial in choice.failures:
        kind = trial.error.split(":")[0]
        fix = _FIXES.get(kind, "Run with `num_workers=0` to see the dataset's error.")
        if trial.on_copy and trial.error.startswith(COPY_FAILED):  # the model's failure, not the data's
            fix = (
                "`copy.deepcopy(model)` after a training step shows the error; or set `num_workers`"
                " by hand, since the model's threads beside the workers went untimed."
            )
        findings.append(
            Finding(source, "data", Severity.WARN, f"{trial.label} dropped: {trial.error}", fix=fix)
        )
    return findings


def worker_plot(choice: WorkerChoice) -> dict[str, Any] | None:
    """Throughput vs ``num_workers`` at the first prefetch factor tried (``None`` under two points)."""
    with_workers = [trial for trial in choice.trials if trial.num_workers]
    base = with_workers[0].prefetch_factor if with_workers else None
    curve: dict[int, float] = {}
    for trial in choice.trials:
        if trial.ok and trial.prefetch_factor in (None, base):
            curve.setdefault(trial.num_workers, round(trial.samples_per_s, 1))
    if len(curve) < 2:
        return None
    return plot_data(
        "workers",
        "DataLoader throughput vs num_workers" + (f" (prefetch_factor={base})" if base else ""),
        "num_workers",
        list(curve),
        {"samples/s": list(curve.values())},
        chosen=choice.num_workers,
    )


def threads_finding(
    source: str, threads: int, num_workers: int, hardware: HardwareInfo, measured: bool = False
) -> Finding:
    """The model's threads set for a CPU run: those the workers leave, or (`measured`) the fewer
    the search timed the model faster on."""
    if measured:
        title = f"torch.set_num_threads({threads}): the model's step measured faster on fewer threads"
        why = (
            f"On the run's own steps the model trained faster on {threads} of the"
            f" {hardware.cpus_per_process} CPUs per process than on all of them: a small step loses more"
            " to starting its threads than they add. Restored at teardown."
        )
    else:
        title = f"torch.set_num_threads({threads}) beside {num_workers} DataLoader workers"
        why = (
            f"A CPU run has {hardware.cpus_per_process} CPUs per process; model threads spinning on the"
            " workers' CPUs slow both down, so the model gets the CPUs the workers leave."
            " Restored at teardown."
        )
    data = {"threads": threads, "num_workers": num_workers}
    return Finding(source, "data", Severity.INFO, title, why, data=data)


def capped_finding(source: str, split: str, cap: int, workers: int | None) -> Finding:
    """Why an evaluation loader of `split` got `cap` workers, not the `workers` decided for it
    (``None``: why its candidates stopped at `cap`)."""
    what = f"num_workers={cap}, not the {workers} decided"
    if workers is None:
        what = f"candidates up to {cap} worker(s)"
    return Finding(
        source,
        "data",
        Severity.INFO,
        f"{split} loader: {what}",
        f"a {split} pass has {cap} batch(es) per process, and each pass hands them to the workers in"
        " turn from the first: a worker past them would never get one, and would only cost a process"
        " start and its memory",
    )


def before_fit_finding(source: str, loader: str, unit: str) -> Finding:
    """Why `loader` was searched before the fit, not on its `unit`'s own batches: the run asks to
    be repeatable (`Trainer(deterministic=True)`)."""
    return Finding(
        source,
        "data",
        Severity.INFO,
        f"{loader}: searched before the fit, not on the {unit}'s own batches",
        f"`deterministic=True` asks for a run its repeat trains alike. A search on the {unit}'s"
        " batches loads them at several worker counts, so a random augmentation draws other numbers"
        " for them than a repeat at one count (from the cache or `config.tuned.yaml`) does, and"
        " loading in the main process moves its RNG for every later shuffle. Timed on trial loaders"
        " before the fit, the run's RNG put back, it trains at one setting from its first batch.",
    )


def open_files_finding(source: str, done: str, hardware: HardwareInfo) -> Finding:
    return Finding(
        source,
        "environment",
        Severity.WARN,
        f"Open-file limit {hardware.open_files_limit} is low for DataLoader workers: {done}",
        "Workers pass each tensor to the main process as a file descriptor; a low limit ends in "
        "'Too many open files'.",
        "Raise it where the job starts: `ulimit -n 65536` (or LimitNOFILE in systemd, --ulimit in docker).",
        data={"open_files_limit": hardware.open_files_limit, "action": done},
    )
