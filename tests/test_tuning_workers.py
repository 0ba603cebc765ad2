"""Worker tuning as plain functions: candidates, budgets, the search and the choice, on made-up data."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import multiprocessing
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL, signal_handling

from lightning_boost import cache
from lightning_boost._lightning import preserved_rng
from lightning_boost.hardware import EXAMPLES, GIB, MIB, HardwareInfo
from lightning_boost.workers.search import (
    WorkerChoice,
    WorkerTrial,
    WorkerTuning,
    choose_worker_trial,
    compute_threads,
    describe_failure,
    measure_loader,
    not_worth_measuring,
    open_files_plan,
    search_workers,
    worker_candidates,
    worker_limit,
    workers_worth_measuring,
)
from tests.test_datamodule import CrashingInWorkers, HangingInWorkers

CPU16 = EXAMPLES["cpu"].replace(cpus_available=16, ram_available_bytes=64 * GIB, shm_bytes=32 * GIB)


class ScriptedLoader:
    """Stands in for measurement: throughput per worker count from a table, errors by count."""

    def __init__(self, rates: dict[int, float], errors: dict[int, str] | None = None) -> None:
        self.rates = rates
        self.errors = errors or {}
        self.calls: list[tuple[int, int | None]] = []

    def __call__(self, num_workers: int, prefetch_factor: int | None) -> WorkerTrial:
        self.calls.append((num_workers, prefetch_factor))
        if num_workers in self.errors:
            return WorkerTrial(num_workers, prefetch_factor, error=self.errors[num_workers])
        rate = self.rates[num_workers] * (1.2 if prefetch_factor == 4 else 1.0)
        return WorkerTrial(num_workers, prefetch_factor, rate, 1.0, batch_bytes=MIB)


def test_candidates_grow_geometrically_and_end_at_the_limit() -> None:
    assert worker_candidates(0) == [0]
    assert worker_candidates(2) == [0, 1, 2]
    assert worker_candidates(16) == [0, 1, 2, 3, 4, 6, 8, 12, 16]
    assert worker_candidates(40) == [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40]


@pytest.mark.parametrize(
    ("hardware", "batch_bytes", "expected"),
    [
        (EXAMPLES["a100x8"], MIB, 11),  # 96 CPUs over 8 processes, one left to each process
        (EXAMPLES["h100"].replace(cpus_available=1), MIB, 1),  # a GPU run on one CPU: Lightning's floor
        (CPU16.replace(local_world_size=4), MIB, 4),  # CPUs split among the node's processes
        (CPU16.replace(shm_bytes=64 * MIB), MIB, 16),  # 32 MiB of shm for 2 MiB per worker
        (CPU16.replace(shm_bytes=64 * MIB), 8 * MIB, 2),  # 32 MiB for 16 MiB per worker
        (CPU16.replace(ram_available_bytes=256 * MIB), 16 * MIB, 2),  # 64 MiB RAM for 32 MiB
    ],
)
def test_worker_limit_is_the_tightest_budget(hardware: HardwareInfo, batch_bytes: int, expected: int) -> None:
    limit, notes = worker_limit(hardware, batch_bytes, 2, WorkerTuning())
    assert limit == expected
    assert notes[0].startswith("CPU budget")


def test_worker_limit_respects_max_workers() -> None:
    limit, notes = worker_limit(CPU16, MIB, 2, WorkerTuning(max_workers=3))
    assert limit == 3
    assert "max_workers=3" in notes


@pytest.mark.parametrize(
    ("rates", "tuning", "expected", "reason"),
    [
        ({0: 100, 2: 300, 4: 305}, WorkerTuning(), 2, "within 5% of the fastest"),
        ({0: 100, 2: 250, 4: 305}, WorkerTuning(), 4, "fastest measured"),
        ({0: 100, 2: 250, 4: 305}, WorkerTuning(tolerance=0.2), 2, "within 20%"),
        ({0: 100, 2: 250, 4: 305}, WorkerTuning(target_samples_per_s=200), 2, "feeds the step"),
        ({0: 100, 2: 250, 4: 305}, WorkerTuning(target_samples_per_s=210), 4, "feeds the step"),  # margin
        ({0: 100, 2: 250, 4: 305}, WorkerTuning(target_samples_per_s=250), 4, "cannot feed the step"),
        ({0: 4000, 2: 250, 4: 305}, WorkerTuning(target_samples_per_s=150), 0, "under 5% of the step"),
        # the main process reads faster than a worker, but takes turns with the step: 104 against 180
        ({0: 197, 1: 180}, WorkerTuning(target_samples_per_s=220), 1, "takes turns with the step: 104"),
        ({0: 197, 1: 180}, WorkerTuning(), 0, "fastest measured"),  # the step's rate unknown
    ],
)
def test_choice_is_the_smallest_good_enough_setting(
    rates: dict[int, float], tuning: WorkerTuning, expected: int, reason: str
) -> None:
    trials = [WorkerTrial(n, 2 if n else None, rate) for n, rate in rates.items()]
    winner, why = choose_worker_trial(trials, tuning)
    assert winner is not None and winner.num_workers == expected
    assert reason in why


def test_a_cpu_run_measures_every_candidate_and_picks_the_smallest_near_the_best() -> None:
    measure = ScriptedLoader({0: 100, 1: 95, 2: 190, 3: 280, 4: 370, 6: 540, 8: 700, 12: 690, 16: 730})
    choice = search_workers(measure, CPU16, WorkerTuning(prefetch_factors=(2,)))
    # no stop at 12 (no faster than 8): on noisy timings a plateau is not a stop
    assert [n for n, _ in measure.calls] == [0, 1, 2, 3, 4, 6, 8, 12, 16]
    assert (choice.num_workers, choice.prefetch_factor) == (8, 2)  # 700 is within 5% of 730


H100 = EXAMPLES["h100"]  # 16 CPUs: a budget of 15 workers beside the training process


def test_a_data_bound_gpu_run_takes_the_whole_cpu_budget_in_two_measurements() -> None:
    measure = ScriptedLoader({n: 100.0 * (n + 1) for n in range(17)})
    choice = search_workers(measure, H100, WorkerTuning(prefetch_factors=(2,)))
    assert [n for n, _ in measure.calls] == [0, 15]
    assert choice.num_workers == 15 and "fastest measured" in choice.reason


def test_a_gpu_run_bisects_down_to_the_fewest_workers_that_feed_the_step() -> None:
    measure = ScriptedLoader({n: 100.0 * n or 50.0 for n in range(17)})
    tuning = WorkerTuning(prefetch_factors=(2,), target_samples_per_s=400)  # needs 500 with the margin
    choice = search_workers(measure, H100, tuning)
    assert [n for n, _ in measure.calls] == [0, 15, 7, 3, 5, 4]
    assert choice.num_workers == 5
    assert choice.consumer_samples_per_s == 400


def test_a_gpu_run_whose_budget_fails_halves_it_until_one_runs() -> None:
    measure = ScriptedLoader({0: 50, 3: 300}, errors={15: "shared memory exhausted: bus error", 7: "hung: x"})
    choice = search_workers(measure, H100, WorkerTuning(prefetch_factors=(2,)))
    assert [n for n, _ in measure.calls] == [0, 15, 7, 3]
    assert choice.num_workers == 3
    assert [trial.num_workers for trial in choice.failures] == [15, 7]


def test_a_gpu_run_loads_in_the_main_process_when_workers_are_slower() -> None:
    measure = ScriptedLoader({0: 5000, 15: 1200})  # a tensor dataset: workers only add copies
    assert search_workers(measure, H100, WorkerTuning(prefetch_factors=(2,))).num_workers == 0


def test_one_worker_no_faster_than_none_does_not_end_the_search() -> None:
    measure = ScriptedLoader({0: 100, 1: 90, 2: 180, 3: 185})
    choice = search_workers(measure, CPU16.replace(cpus_available=3), WorkerTuning(prefetch_factors=(2,)))
    assert choice.num_workers == 2


def test_a_larger_prefetch_factor_is_kept_only_when_faster() -> None:
    measure = ScriptedLoader({0: 100, 2: 195})
    choice = search_workers(measure, EXAMPLES["h100"].replace(cpus_available=3), WorkerTuning())
    assert measure.calls == [(0, None), (2, 2), (2, 4)]
    assert (choice.num_workers, choice.prefetch_factor) == (2, 4)  # scripted 20 % faster


def test_a_cpu_run_tries_no_deeper_prefetch() -> None:
    measure = ScriptedLoader({0: 100, 1: 190, 2: 195})
    choice = search_workers(measure, CPU16.replace(cpus_available=2), WorkerTuning())
    assert measure.calls == [(0, None), (1, 2), (2, 2)]  # the model weighs these; depth only costs RAM
    assert choice.prefetch_factor == 2


def test_target_rate_ends_a_cpu_scan_early() -> None:
    measure = ScriptedLoader({n: 100.0 * (n + 1) for n in range(17)})
    choice = search_workers(measure, CPU16, WorkerTuning(prefetch_factors=(2,), target_samples_per_s=350))
    assert [n for n, _ in measure.calls] == [0, 1, 2, 3, 4]  # 4 is the first with 25 % to spare
    assert choice.num_workers == 4


def test_a_crashing_count_is_dropped_and_ends_the_search() -> None:
    measure = ScriptedLoader({0: 100, 1: 120, 2: 240}, errors={3: "crashed: worker exited unexpectedly"})
    choice = search_workers(measure, CPU16, WorkerTuning(prefetch_factors=(2,)))
    assert [n for n, _ in measure.calls] == [0, 1, 2, 3]
    assert choice.num_workers == 2
    assert [trial.num_workers for trial in choice.failures] == [3]


def test_every_worker_count_failing_falls_back_to_the_main_process() -> None:
    measure = ScriptedLoader({0: 100}, errors={1: "hung: DataLoader timed out after 2 seconds"})
    choice = search_workers(measure, CPU16, WorkerTuning())
    assert (choice.num_workers, choice.prefetch_factor) == (0, None)
    assert choice.reason.startswith("fell back to loading in the main process")
    assert "hung" in choice.reason


def test_the_time_budget_bounds_the_search() -> None:
    ticks = itertools.count(step=10.0)  # every clock read is 10 s later
    measure = ScriptedLoader({n: 100.0 * (n + 1) for n in range(17)})
    choice = search_workers(
        measure, CPU16, WorkerTuning(budget_s=25, prefetch_factors=(2,)), lambda: next(ticks)
    )
    assert len(measure.calls) < len(worker_candidates(16))
    assert any("tuning budget would be passed" in note for note in choice.skipped)


def test_a_trial_that_would_end_past_the_budget_is_not_started() -> None:
    now = [0.0]

    def measure(num_workers: int, prefetch_factor: int | None) -> WorkerTrial:
        now[0] += 8.0  # each trial takes 8 s
        return WorkerTrial(num_workers, prefetch_factor, 100.0 * (num_workers + 1), 8.0, batch_bytes=MIB)

    choice = search_workers(measure, CPU16, WorkerTuning(budget_s=20, prefetch_factors=(2,)), lambda: now[0])
    assert [t.num_workers for t in choice.trials] == [0, 1]  # a third would end at 24 s
    assert now[0] <= 20


def test_a_run_too_short_to_pay_back_measuring_loads_in_the_main_process() -> None:
    measure = ScriptedLoader({n: 100.0 * (n + 1) for n in range(17)})
    choice = search_workers(measure, CPU16, WorkerTuning(prefetch_factors=(2,)), workload_samples=64)
    assert measure.calls == [(0, None)] and choice.num_workers == 0 and choice.source == "short run"
    assert "64 samples" in choice.reason  # 0.64 s of loading, less than one more 1 s trial
    long_run = search_workers(measure, CPU16, WorkerTuning(prefetch_factors=(2,)), workload_samples=10**6)
    assert long_run.num_workers > 0 and long_run.source == "measured"


def _batches(seconds_per_batch: float, clock: list[float], batch: Any) -> Iterator[Any]:
    while True:
        clock[0] += seconds_per_batch
        yield batch


def test_measure_loader_times_the_steady_state_after_one_batch_per_worker() -> None:
    now = [0.0]
    batch = (torch.zeros(8, 3), torch.zeros(8))
    trial = measure_loader(
        lambda n, pf: _batches(0.5, now, batch), 2, 2, batch_size=8, window_s=5.0, clock=lambda: now[0]
    )
    assert trial.ok
    assert trial.samples_per_s == pytest.approx(16.0)  # 8 samples per 0.5 s
    assert trial.batch_bytes == 8 * 3 * 4 + 8 * 4
    assert trial.startup_s == pytest.approx(1.0)  # one batch from each of the 2 workers first


def test_measure_loader_hands_each_timed_batch_to_the_consumer() -> None:
    now, seen = [0.0], []
    batch = torch.zeros(8, 3)

    def consume(item: Any) -> None:
        now[0] += 0.5  # the transfer takes as long as loading
        seen.append(item)

    trial = measure_loader(
        lambda n, pf: _batches(0.5, now, batch), 1, 2, batch_size=8, window_s=5.0, clock=lambda: now[0],
        consume=consume,
    )  # fmt: skip
    assert trial.samples_per_s == pytest.approx(8.0) and len(seen) == 5


def test_measure_loader_ends_once_the_runs_whole_load_is_projected_under_the_rest() -> None:
    now = [0.0]
    batch = torch.zeros(8, 3)
    make = lambda n, pf: _batches(1 / 64, now, batch)  # noqa: E731  512 samples/s, exact in binary
    timed = functools.partial(measure_loader, make, 0, None, batch_size=8, window_s=5.0, clock=lambda: now[0])
    quick = timed(workload_samples=512, rest_s=5.0)
    assert quick.samples_per_s == 512.0 and now[0] == 4 / 64  # one untimed batch and 3 timed
    assert not_worth_measuring(quick, 512, rest_s=5.0) is not None  # 1 s of loading, under 5 s
    tiny = timed(workload_samples=8, rest_s=5.0)
    assert tiny.seconds == 2 / 64  # its only batch timed: the run loads no more
    long = timed(workload_samples=10**5, rest_s=5.0)
    assert long.seconds == 1 / 64 + 5.0  # 195 s of loading: the whole window
    assert not_worth_measuring(long, 10**5, rest_s=5.0) is None


def test_a_cpu_run_counts_timing_the_models_step_in_the_rest_of_the_measurement() -> None:
    from lightning_boost.workers.decision import WorkerProbes, decide_workers

    timed_model = []

    def cpu_step(threads: Any) -> Any:
        timed_model.append(threads)
        return 1000.0, {2: 400.0, 1: 300.0}

    # 1,500 samples at 1,000 samples/s: 1.5 s of loading, more than one 1 s window, less than two
    first = lambda n, pf: WorkerTrial(n, pf, 1000.0, 1.0, MIB)  # noqa: E731
    tuning = WorkerTuning(window_s=1.0)
    cpu = decide_workers(
        WorkerProbes(first, cpu_step=cpu_step), EXAMPLES["cpu"], tuning, workload_samples=1500
    )
    assert cpu.source == "short run" and "(~2 s)" in cpu.reason and not timed_model
    gpu = decide_workers(WorkerProbes(first), EXAMPLES["cpu"], tuning, workload_samples=1500)
    assert gpu.source != "short run"  # no model to time: one more trial is the rest


def test_a_cpu_run_stops_before_timing_workers_that_cannot_repay_their_trials() -> None:
    from lightning_boost.workers.decision import WorkerProbes, decide_workers

    # ResNet-18's evaluation step on 2 CPUs: 409 samples/s at 2 threads, 218 at 1 (what a worker
    # leaves it), loading 336 samples/s; 1,024 samples could save at most 0.85 s, under two trials
    loader = lambda n, pf: WorkerTrial(n, pf, 336.0, 0.77, MIB)  # noqa: E731
    probes = WorkerProbes(loader, cpu_step=lambda threads: (336.0, {2: 409.0, 1: 218.0}))
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    small = decide_workers(probes, cpu, WorkerTuning(), workload_samples=1024)
    assert small.num_workers == 0 and [trial.num_workers for trial in small.trials] == [0]
    assert small.reason.startswith("no workers: workers could save at most 0.85 s of the 1024 samples'")
    longer = decide_workers(probes, cpu, WorkerTuning(), workload_samples=8 * 1024)  # 6.8 s to save
    assert [trial.num_workers for trial in longer.trials] == [0, 1, 2]
    kept = decide_workers(probes, cpu, WorkerTuning(skip_short_runs=False), workload_samples=1024)
    assert [trial.num_workers for trial in kept.trials] == [0, 1, 2]  # measured to cache the result


def test_a_cpu_run_weighs_what_workers_save_on_the_cpus_the_model_shares() -> None:
    from lightning_boost.workers.decision import WorkerProbes, decide_workers

    # a fit's small validation set on 2 CPUs (fit_val_set's 1,024 images): 2 s of loading at
    # 500 samples/s, ResNet-18's 0.04 s evaluation step at batch 64 (0.64 s of steps). The
    # loading alone would repay the rest of the measurement (1.6 s priced: the model's rates and
    # two worker trials), but both CPUs already work through it and the steps in turns, so
    # workers save at most 1.34 s: nothing more is timed, the model's rates neither
    timed_model: list[Any] = []

    def cpu_step(threads: Any) -> Any:
        timed_model.append(threads)
        return 500.0, {2: 1600.0, 1: 1000.0}

    def probes(share: float) -> WorkerProbes:
        loader = lambda n, pf: WorkerTrial(n, pf, 500.0, 0.6, MIB, cpu_share=share)  # noqa: E731
        return WorkerProbes(loader, cpu_step=cpu_step, step_s=lambda threads: 0.04, batch_size=64)

    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    small = decide_workers(probes(1.0), cpu, WorkerTuning(), workload_samples=1024)
    assert small.num_workers == 0 and [trial.num_workers for trial in small.trials] == [0]
    assert "on 2 CPUs, workers could save at most 1.3 s of it" in small.reason and not timed_model
    # a loader that waits on I/O (a fifth of its time on the CPU): workers overlap the waits
    waiting = decide_workers(probes(0.2), cpu, WorkerTuning(), workload_samples=1024)
    assert waiting.source != "short run" and timed_model
    # on an accelerator the whole loading can hide behind the steps: measured
    gpu = dataclasses.replace(probes(1.0), cpu_step=None, step_s=None)
    assert decide_workers(gpu, EXAMPLES["h100"], WorkerTuning(), workload_samples=1024).source != "short run"


def test_the_loaders_cpu_share_is_its_cpu_time_over_its_wall_time_in_the_main_process() -> None:
    now, cpu_now = [0.0], [0.0]
    batch = torch.zeros(8, 3)

    def batches(cpu_per_batch: float) -> Iterator[Tensor]:
        while True:
            now[0] += 0.01
            cpu_now[0] += cpu_per_batch
            yield batch

    def share(cpu_per_batch: float, num_workers: int = 0) -> float:
        make = lambda n, pf: batches(cpu_per_batch)  # noqa: E731
        factor = 2 if num_workers else None
        clocks = {"clock": lambda: now[0], "cpu_clock": lambda: cpu_now[0]}
        return measure_loader(make, num_workers, factor, batch_size=8, window_s=0.1, **clocks).cpu_share

    assert share(0.01) == pytest.approx(1.0) and share(0.002) == pytest.approx(0.2)
    assert share(0.03) == 1.0  # the transforms' threads: at most one CPU's worth counts
    assert share(0.002, num_workers=2) == 1.0  # the workers' loading is not in this process
    sleeping = lambda n, pf: (time.sleep(0.01) or batch for _ in itertools.count())  # noqa: E731
    assert measure_loader(sleeping, 0, None, batch_size=8, window_s=0.2).cpu_share < 0.5  # the real clocks


def test_measure_loader_turns_errors_into_failed_trials() -> None:
    def broken(num_workers: int, prefetch_factor: int | None) -> Iterator[Any]:
        raise RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly")

    trial = measure_loader(broken, 2, 2, batch_size=8, window_s=1.0)
    assert not trial.ok and trial.error.startswith("crashed")


def test_a_hung_candidates_workers_are_terminated_not_joined() -> None:
    """Real workers that hang: the candidate costs its timeout, not torch's 5 s join per worker
    on top (11.1 s here before), and no worker is left behind."""

    def make(num_workers: int, prefetch_factor: int | None) -> DataLoader[Any]:
        return DataLoader(HangingInWorkers(), batch_size=8, num_workers=num_workers, timeout=1.0)

    children = set(multiprocessing.active_children())  # an earlier test's, under pytest -n
    started = time.perf_counter()
    trial = measure_loader(make, 2, 2, batch_size=8, window_s=1.0)
    assert trial.error.startswith("hung")
    assert time.perf_counter() - started < 1.0 + MP_STATUS_CHECK_INTERVAL - 1  # no 5 s join, let alone two
    assert set(multiprocessing.active_children()) <= children


def test_a_crash_before_the_fit_is_found_as_it_happens_after_a_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """As after a fit (Lightning put the SIGCHLD handler back as it found it, torch's note that it
    is set kept): the measurement before the fit finds a crashed worker at once, not at its
    loader's timeout (10 s here, when only the online search set torch's handler again)."""
    before = signal.getsignal(signal.SIGCHLD)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", True)

    def make(num_workers: int, prefetch_factor: int | None) -> DataLoader[Any]:
        return DataLoader(CrashingInWorkers(), batch_size=8, num_workers=num_workers, timeout=10.0)

    started = time.perf_counter()
    try:
        trial = measure_loader(make, 1, 2, batch_size=8, window_s=1.0)
    finally:
        signal.signal(signal.SIGCHLD, before)
    assert "crashed" in trial.error or "exited" in trial.error, trial.error
    assert time.perf_counter() - started < 5.0  # half the loader's timeout


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RuntimeError("DataLoader timed out after 2 seconds"), "hung"),
        (RuntimeError("DataLoader worker (pid 9) is killed by signal: Killed."), "crashed"),
        (RuntimeError("unable to write to file </torch_1_2>: No space left on device (28)"), "shared memory"),
        (RuntimeError("DataLoader worker (pid 9) is killed by signal: Bus error."), "shared memory"),
        (ValueError("bad sample"), "ValueError"),
    ],
)
def test_failures_are_described_by_cause(error: Exception, kind: str) -> None:
    assert describe_failure(error).startswith(kind)


def test_cpu_runs_give_the_model_the_cpus_the_workers_leave() -> None:
    box = EXAMPLES["cpu"].replace(cpus_available=8)
    assert compute_threads(box, 3, current=8) == 5
    assert compute_threads(box, 8, current=8) == 1
    assert compute_threads(box, 3, current=2) is None  # already fewer threads: leave them
    assert compute_threads(box, 0, current=8) is None
    assert compute_threads(EXAMPLES["a100x8"], 4, current=64) is None  # the model runs on the GPU


def test_low_open_file_limits_are_raised_or_worked_around() -> None:
    box = EXAMPLES["cpu"]
    assert open_files_plan(box.replace(open_files_limit=1024, open_files_hard_limit=1 << 20), 4) == (
        "raise_limit",
        4096,
    )
    assert open_files_plan(box.replace(open_files_limit=1024, open_files_hard_limit=1024), 4) == (
        "file_system",
        4096,
    )
    assert open_files_plan(box.replace(open_files_limit=1024, open_files_hard_limit=1024), 0) is None
    assert open_files_plan(box.replace(open_files_limit=65536), 4) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window_s": 0}, "`window_s` expected a finite number of seconds > 0"),
        ({"tolerance": 1.5}, "`tolerance` expected a finite number > 0 and <= 1"),
        ({"max_workers": -1}, "`max_workers` expected an int >= 0 and <= 1024 or None"),
        ({"prefetch_factors": (0,)}, "`prefetch_factors` expected a non-empty tuple, each item an int >= 1"),
        ({"target_samples_per_s": -5.0}, "`target_samples_per_s` expected a finite number of samples/s > 0"),
        ({"feed_margin": 0}, "`feed_margin` expected a finite number > 0 and <= 1"),
    ],
)
def test_bad_tuning_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WorkerTuning(**kwargs)


def test_a_choice_round_trips_through_json() -> None:
    choice = search_workers(
        ScriptedLoader({0: 1.0, 1: 2.0, 2: 4.0}), CPU16.replace(cpus_available=2), WorkerTuning()
    )
    again = WorkerChoice.from_dict(json.loads(json.dumps(choice.to_dict())))
    assert again == choice


def test_cache_round_trip_and_a_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "workers.json"
    key = cache.fingerprint({"dataset": "x", "batch_size": 8})
    assert cache.load_entry(path, key) == (None, None)
    cache.store_entry(path, key, {"choice": {"num_workers": 2}})
    cache.store_entry(path, "other", {"choice": {"num_workers": 1}})
    entry, problem = cache.load_entry(path, key)
    assert problem is None and entry is not None and entry["choice"] == {"num_workers": 2}
    path.write_text("{not json")
    entry, problem = cache.load_entry(path, key)
    assert entry is None and problem is not None and "not readable JSON" in problem
    path.write_text(json.dumps({"schema_version": 99, "entries": {}}))
    assert "schema version 1" in str(cache.load_entry(path, key)[1])


def test_preserved_rng_restores_every_generator() -> None:
    def seed() -> None:
        random.seed(3)
        np.random.seed(3)
        torch.manual_seed(3)

    def draw() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), torch.rand(1).item()

    seed()
    expected = draw()
    seed()
    with preserved_rng():
        draw(), draw()
    assert draw() == expected
    seed()
    with pytest.raises(RuntimeError), preserved_rng():  # Lightning's isolate_rng would not restore here
        draw()
        raise RuntimeError("a failed trial")
    assert draw() == expected


LINEAR = {threads: 100.0 * threads for threads in range(1, 9)}  # the model: 100 samples/s per thread


@pytest.mark.parametrize(
    ("rates", "loading", "cap"),
    [
        (LINEAR, 100_000.0, 0),  # no workers ~794: even 1 worker's 7 threads (700) cannot beat it
        (LINEAR, 5000.0, 1),  # 690: 7 threads (700) can, 6 (600) cannot
        (LINEAR, 1000.0, 3),  # 444: up to 3 workers (5 threads, 500)
        (LINEAR, 300.0, 4),  # 218: up to 5 workers, so the candidate 4 (6 is the next)
        (LINEAR, 100.0, 8),  # 89: every count can
        ({8: 800.0}, 100_000.0, 8),  # the other rates are unknown: every count is worth timing
        ({}, 100.0, 8),
    ],
)
def test_only_worker_counts_that_can_beat_no_workers_are_timed_on_a_cpu_run(
    rates: dict[int, float], loading: float, cap: int
) -> None:
    counts = worker_candidates(8)
    found, why = workers_worth_measuring(counts, rates, loading, cpus=8, tolerance=0.05)
    assert found == cap
    assert (why == "") == (cap == 8)


def test_decide_workers_feeds_an_accelerator_run_at_the_step_rate_it_measured() -> None:
    """The pure decision over measurement callables: a GPU run (its properties simulated) asks for
    the step's rate once, and the fewest workers that feed it win; nothing else is measured."""
    from lightning_boost.workers.decision import WorkerProbes, decide_workers

    asked: list[str] = []

    def loader(workers: int, prefetch: int | None) -> WorkerTrial:
        asked.append(f"loader {workers}")
        return WorkerTrial(workers, prefetch, min(300.0 * workers, 3000.0) if workers else 250.0, 0.5, MIB)

    def step_rate() -> float:
        asked.append("step")
        return 1500.0

    probes = WorkerProbes(loader, consumer_rate=step_rate)
    choice = decide_workers(probes, EXAMPLES["h100"], WorkerTuning(), clock=itertools.count().__next__)
    assert asked[:2] == ["loader 0", "step"] and asked.count("step") == 1
    assert choice.num_workers == 7 and choice.consumer_samples_per_s == 1500.0  # 7 x 300 > 1500 x 1.25
    assert choice.seconds > 0


def test_decide_workers_stops_after_one_trial_for_a_run_too_short_to_repay_more() -> None:
    from lightning_boost.workers.decision import WorkerProbes, decide_workers

    def cpu_step(threads: Any) -> Any:
        raise AssertionError("a short run times no model step")

    probes = WorkerProbes(lambda n, pf: WorkerTrial(n, pf, 1000.0, 1.0, MIB), cpu_step=cpu_step)
    choice = decide_workers(probes, EXAMPLES["cpu"], WorkerTuning(), workload_samples=100)
    assert choice.num_workers == 0 and choice.source == "short run" and len(choice.trials) == 1
