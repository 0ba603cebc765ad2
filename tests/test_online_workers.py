"""Workers searched on the first epoch's own batches (issue 30): the pure search, and real fits that
check every sample is trained exactly once, in the sampler's order, whatever the search switches."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL, signal_handling
from typing_extensions import override

from lightning_boost import AutoNumWorkers, BoostedDataModule, WorkerTuning
from lightning_boost.hardware import EXAMPLES
from lightning_boost.testing import BoringModel, tiny_trainer
from lightning_boost.workers import tuner
from lightning_boost.workers.decision import choice_findings
from lightning_boost.workers.loaders import SameOrderDataLoader
from lightning_boost.workers.online import (
    SegmentPlan,
    Setting,
    _next_count,
    choose_online,
    plan_segments,
    prior_setting,
    search_online,
    search_start,
)
from lightning_boost.workers.search import WorkerChoice, WorkerTrial
from lightning_boost.workers.segments import OnlineSearch, SegmentedDataLoader, _Timing, probe_first
from tests.conftest import minor_version

#: At most 2 workers whatever the machine, so the candidates (0, 1, 2) are the same on every CI box.
TUNING = WorkerTuning(max_workers=2, timeout_s=20.0)
SAMPLES = 960  # batch 4: 240 batches an epoch, so 10 % of it holds three segments of 8 (each times 2 workers)


def _run(
    rate: Any, hardware: Any = None, plan: SegmentPlan | None = None, prior: Any = None, threads: Any = None
) -> Any:
    plan = plan or SegmentPlan(32, 8)  # an ImageNet-sized first epoch: times up to 14 workers at factor 2
    hardware = hardware or EXAMPLES["h100"]
    search = search_online(
        hardware, WorkerTuning(), plan, prior or search_start(hardware, WorkerTuning(), plan), threads
    )
    setting, measured = next(search), []
    try:
        while True:
            measured.append(setting[0])
            workers, factor, threads = setting
            value = rate(workers) if threads is None else rate(("threads", threads))
            value, share = value if isinstance(value, tuple) else (value, 0.0)  # samples/s, data wait
            trial = WorkerTrial(workers, factor, value, seconds=1.0, threads=threads, load_share=share)
            setting = search.send(trial)
    except StopIteration as stop:
        return measured, stop.value


def test_the_search_finds_the_smallest_count_that_feeds_the_step() -> None:
    measured, choice = _run(lambda n: min(300.0 * n, 2000.0) if n else 250.0)
    assert choice.num_workers == 7 and choice.source == "searched"  # 7 x 300 feeds the 2000
    assert measured[0] == 14 and len(measured) <= 8  # from the most workers a segment times down


def test_the_search_sees_workers_slow_the_training_process() -> None:
    """The contention a loader timed alone cannot show: past 6 workers the training process loses
    CPU to them (the H100 demo: the loader alone 17.5k samples/s, training with 15 workers 8.3k)."""
    rate = lambda n: min(1500.0 * n, 9000.0) * (1 - 0.05 * max(n - 6, 0)) if n else 900.0  # noqa: E731
    measured, choice = _run(rate)
    assert choice.num_workers == 6, measured
    assert rate(choice.num_workers) >= 0.95 * max(rate(n) for n in range(16))


def test_a_cpu_run_probes_the_model_before_starting_any_worker() -> None:
    """ResNet-18 on 2 CPUs as measured in the demo: the model alone on 1 thread (the probe, no
    worker started) cannot beat loading in the main process, so no worker segment runs."""
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    resnet = {0: 430.0, 1: 340.0, 2: 330.0, ("threads", 1): 300.0}
    measured, choice = _run(resnet.__getitem__, cpu, prior=(0, None))
    assert measured == [0, 0] and choice.num_workers == 0
    assert any("cannot beat loading in the main process" in why for why in choice.skipped)
    # loading in the main process beside the model on 1 thread: 250 samples/s, 70 % of it waiting
    data_bound = {0: 280.0, 1: 480.0, 2: 470.0, ("threads", 1): (250.0, 0.7)}
    measured, choice = _run(data_bound.__getitem__, cpu, prior=(0, None))
    assert measured == [0, 0, 2, 1, 1, 2] and choice.num_workers == 1  # a near tie: each once more
    assert choice.threads is None


def test_a_cpu_tie_goes_past_a_count_whose_steps_waited_for_its_workers() -> None:
    """`data_bound` on 2 CPUs as its three segments read it: 1 worker within 5 % of 2, but its
    steps waited 30 % of the time for data (whole epochs trained 12-16 % faster with 2); on a busy
    spell the 1-worker steps were fed and it stays, as does a clear lead whatever the wait."""
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    starved = {0: (430.0, 0.7), 1: (650.0, 0.3), 2: (630.0, 0.02)}
    measured, choice = _run(starved.__getitem__, cpu, SegmentPlan(17, 3), prior=(0, None))
    assert measured == [0, 2, 1] and choice.num_workers == 2
    assert "whose steps did not wait for data" in choice.reason
    fed = {**starved, 1: (650.0, 0.01)}
    assert _run(fed.__getitem__, cpu, SegmentPlan(17, 3), prior=(0, None))[1].num_workers == 1
    ahead = {**starved, 1: (720.0, 0.3)}
    assert _run(ahead.__getitem__, cpu, SegmentPlan(17, 3), prior=(0, None))[1].num_workers == 1


@pytest.mark.parametrize("plan", [SegmentPlan(8, 8), SegmentPlan(4, 3)], ids=["workers timed", "too short"])
def test_a_small_model_faster_on_fewer_threads_keeps_them(plan: SegmentPlan) -> None:
    """The time-to-quality MLP on 2 CPUs as its segments measured it: 18k samples/s on both
    threads, 29k on one (a 1 ms step loses more to starting a second thread than it gains). The
    probe's thread count wins, also where segments too short to time a worker measure no count."""
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    mlp = {0: (18000.0, 0.15), 1: (14000.0, 0.2), 2: (13000.0, 0.2), ("threads", 1): (29000.0, 0.1)}
    measured, choice = _run(mlp.__getitem__, cpu, plan, prior=(0, None))
    assert measured[:2] == [0, 0] and len(measured) <= plan.max_segments
    assert (choice.num_workers, choice.threads) == (0, 1)
    assert "the model on 1 thread(s)" in choice.reason
    assert measured.count(0) >= 3  # each of the two measured again before the threads are kept
    even = {**mlp, ("threads", 1): (18500.0, 0.1)}  # within the tolerance: all threads kept
    assert _run(even.__getitem__, cpu, plan, prior=(0, None))[1].threads is None


def test_one_segments_lead_of_the_probe_does_not_set_the_threads() -> None:
    """ResNet-18 in the demo's plan: its segments read the probe on 1 thread 4 % and, another time,
    24 % behind both threads. A 10 % lead on one segment runs both threads again, and that mean
    (the probe measured once) needs a lead of `PROBE_LEAD_ONCE` tolerances."""
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    reads = iter([350.0, 385.0, 350.0])  # both threads, the probe, both threads again
    measured, choice = _run(lambda key: (next(reads), 0.05), cpu, SegmentPlan(4, 3), prior=(0, None))
    assert measured == [0, 0, 0] and (choice.num_workers, choice.threads) == (0, None)
    close = {0: (350.0, 0.05), ("threads", 1): (365.0, 0.05)}
    measured, choice = _run(close.__getitem__, cpu, SegmentPlan(4, 3), prior=(0, None))
    assert measured == [0, 0] and choice.threads is None  # within the tolerance: nothing to confirm


def test_a_probe_of_the_threads_alternates_them_step_by_step_and_compares_the_pairs() -> None:
    """ABBA over a segment of 8 (a scripted clock): the probe's steps take 2 ms, those at the
    threads of loading in the main process 3 ms. A segment that probes no threads alternates none."""
    now = [0.0]
    chunk = [[4 * i + j for j in range(4)] for i in range(8)]

    def stream(probe_ms: float, other_ms: float) -> Any:
        for k in range(8):
            if k:  # the step of batch k - 1 ran while it was yielded
                now[0] += (probe_ms if probe_first(k - 1) else other_ms) / 1e3
            yield k

    turns: list[int | None] = []
    timing = _Timing(Setting(0, None, 1), chunk, lambda: now[0], alternate=turns.append)
    assert len(list(timing.run(stream(2.0, 3.0), lambda done: iter(())))) == 8
    assert turns == [1, None, None, 1, 1, None, None, 1]
    trial = timing.trial()  # steps 0-6: the probe's 0, 3 and 4 against 1, 2, 5 and 6
    assert trial.samples_per_s == pytest.approx(12 / 0.006) and trial.paired == pytest.approx(1.5)
    turns.clear()
    plain = _Timing(Setting(0), chunk, lambda: now[0], alternate=turns.append)
    list(plain.run(stream(2.0, 2.0), lambda done: iter(())))
    assert turns == [] and plain.trial().paired == 0.0


def test_a_probe_on_a_copy_moves_the_runs_steps_by_the_copys_difference() -> None:
    """A segment of 4 (a scripted clock): the run's steps take 3 ms on its threads (2 ms of it the
    model's), the wait for each batch 1 ms. A copy takes a warm-up step, then pairs: 4 ms on the
    probe's 1 thread, 2 ms on the run's, in swapped order the second time. The probe's step is the
    run's 4 ms with the copy's 2 ms difference added; the run's own steps keep their threads and
    their time leaves the copy's out."""
    now = [0.0]
    chunk = [[4 * i + j for j in range(4)] for i in range(4)]
    calls: list[tuple[int, int | None]] = []

    def copy_step(batch: int, threads: int | None) -> float:
        calls.append((batch, threads))
        seconds = (9.0 if len(calls) == 1 else 4.0 if threads == 1 else 2.0) / 1e3
        now[0] += seconds
        return seconds

    def stream() -> Any:
        for k in range(4):
            if k:
                now[0] += 1.0 / 1e3  # the wait for batch k
            yield k

    turns: list[int | None] = []
    timing = _Timing(Setting(0, None, 1), chunk, lambda: now[0], alternate=turns.append, copy_step=copy_step)
    for _ in timing.run(stream(), lambda done: iter(())):
        now[0] += 3.0 / 1e3  # the run's step of the batch
    assert calls == [(0, 1), (0, 1), (0, None), (1, None), (1, 1)] and turns == []
    trial = timing.trial()
    assert trial.ok and trial.threads == 1
    assert trial.samples_per_s == pytest.approx(8 / 0.012)  # batches 0 and 1 at 6 ms each
    assert trial.paired == pytest.approx(4 / 6) and trial.load_share == pytest.approx(1 / 6)

    def fails(batch: int, threads: int | None) -> float:
        raise RuntimeError("the step reads self.trainer")

    broken = _Timing(Setting(0, None, 1), chunk, lambda: now[0], copy_step=fails)
    assert len(list(broken.run(stream(), lambda done: iter(())))) == 4  # the run goes on
    assert not broken.trial().ok and "cannot run on a copy" in broken.trial().error
    choice = WorkerChoice(0, None, "searching on the first epoch's own batches", (broken.trial(),))
    (dropped,) = choice_findings("BoostedDataModule", choice)[1:]
    assert "copy.deepcopy(model)" in dropped.fix and "dataset" not in dropped.fix  # the model's failure


def test_a_copys_step_slower_than_the_runs_whole_step_moves_it_by_the_copys_ratio() -> None:
    """The run's steps take 3 ms and wait 1 ms for each batch (a scripted clock), but the copy's
    step on the run's threads reads 12 ms, on the probe's 1 ms (a loaded host's noise). Taking the
    11 ms difference off the 4 ms step left only the 1 ms wait (4,000 samples/s, 4x the run's);
    the copy stands for the run's 3 ms of step at most, scaled by its 1:12: 1.25 ms a step."""
    now = [0.0]
    chunk = [[4 * i + j for j in range(4)] for i in range(4)]

    def copy_step(batch: int, threads: int | None) -> float:
        seconds = (1.0 if threads == 1 else 12.0) / 1e3
        now[0] += seconds
        return seconds

    def stream() -> Any:
        for k in range(4):
            if k:
                now[0] += 1.0 / 1e3
            yield k

    timing = _Timing(Setting(0, None, 1), chunk, lambda: now[0], copy_step=copy_step)
    for _ in timing.run(stream(), lambda done: iter(())):
        now[0] += 3.0 / 1e3
    trial = timing.trial()
    assert trial.samples_per_s == pytest.approx(8 / 0.0025) and trial.paired == pytest.approx(4 / 1.25)
    assert trial.load_share == pytest.approx(1 / 1.25)


def test_a_paired_probes_lead_sets_the_threads_without_a_segment_to_confirm_it() -> None:
    """The lead of `test_one_segments_lead_of_the_probe_does_not_set_the_threads`, timed step for
    step against the other threads: no segment is spent measuring both threads again."""
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    for paired, measured in ((1.08, 2), (0.0, 3)):
        search = search_online(cpu, WorkerTuning(), SegmentPlan(4, 3), Setting(0))
        settings = [next(search)]
        trials = iter([
            WorkerTrial(0, None, 350.0, seconds=1.0, load_share=0.05),
            WorkerTrial(0, None, 385.0, seconds=1.0, threads=1, load_share=0.05, paired=paired),
            WorkerTrial(0, None, 350.0, seconds=1.0, load_share=0.05),
        ])  # fmt: skip
        with pytest.raises(StopIteration) as stop:
            while True:
                settings.append(search.send(next(trials)))
        assert settings[:2] == [Setting(0), Setting(0, None, 1)] and len(settings) == measured
        expected = (0, 1) if paired else (0, None)  # unpaired, measured once: 4 tolerances needed
        assert (stop.value.value.num_workers, stop.value.value.threads) == expected


def test_a_paired_probes_other_steps_count_as_a_run_of_no_workers() -> None:
    """The time-to-quality autoencoder on 2 CPUs, as one cold run's segments read it: a first
    segment twice as slow as the run's steps, the probe on 1 thread 11 % behind the other threads
    step for step, 2 workers slow. Without the probe's other steps, 2 workers read fastest and the
    probe beat them by 31 %: the run trained on 1 thread."""
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    search = search_online(cpu, WorkerTuning(), SegmentPlan(8, 3), Setting(0))
    next(search)
    probe = search.send(WorkerTrial(0, None, 11000.0, seconds=1.0, load_share=0.08))
    assert probe == Setting(0, None, 1)
    workers = search.send(WorkerTrial(0, None, 19138.0, seconds=1.0, threads=1, load_share=0.1, paired=0.89))
    assert workers.num_workers == 2
    with pytest.raises(StopIteration) as stop:
        search.send(WorkerTrial(2, 2, 14649.0, seconds=1.0, load_share=0.24))
    assert (stop.value.value.num_workers, stop.value.value.threads) == (0, None)


def test_a_cpu_run_that_waits_for_its_data_goes_to_workers_at_once() -> None:
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    search = search_online(cpu, WorkerTuning(), SegmentPlan(8, 8), Setting(0))
    assert next(search) == Setting(0)
    following = search.send(WorkerTrial(0, None, 300.0, seconds=1.0, load_share=0.6))
    assert following.num_workers == 2 and following.threads is None  # no probe of the model first


def test_a_cpu_run_whose_segments_cannot_time_a_worker_keeps_loading_in_the_main_process() -> None:
    """The demo's plan: segments of 4 batches. One worker's queue (2 batches) is loaded before its
    segment starts, leaving one step that loads anything: no worker count is measured (a run that
    waits this long for its data runs no probe of the model's threads either)."""
    cpu = EXAMPLES["cpu"].replace(cpus_available=2)
    search = search_online(cpu, WorkerTuning(), SegmentPlan(4, 3), Setting(0))
    assert next(search) == Setting(0)
    with pytest.raises(StopIteration) as stop:
        search.send(WorkerTrial(0, None, 500.0, seconds=0.5, load_share=0.6))
    choice = stop.value.value
    assert choice.num_workers == 0 and len(choice.trials) == 1
    assert any("1 or more workers: a segment of 4 batches cannot time them" in why for why in choice.skipped)


def test_a_segment_leaves_out_the_steps_at_the_batches_its_workers_had_queued() -> None:
    """Two workers at prefetch 2 hold 4 batches when their segment of 8 starts: the last 4 steps
    load nothing (here each takes 0.1 s against 0.3 s while loading), so only the first 3 count."""
    ticks = iter([0.0, 0.0, 0.1, 0.4, 0.4, 0.7, 0.7, 1.0, 1.0, 1.1, 1.1, 1.2, 1.2, 1.3, 1.3, 1.4, 1.4, 9.0])
    chunk = [[4 * i + j for j in range(4)] for i in range(8)]
    timing = _Timing(Setting(2, 2), chunk, lambda: next(ticks))
    assert len(list(timing.run(iter(range(8)), lambda done: iter(())))) == 8
    trial = timing.trial()
    assert trial.samples_per_s == pytest.approx(12 / 0.9) and trial.load_share == 0.0
    alone = _Timing(Setting(0), chunk[:4], iter([0.0, 0.0, 0.1, 0.4, 0.4, 0.7, 0.7, 1.0, 1.0, 9.0]).__next__)
    list(alone.run(iter(range(4)), lambda done: iter(())))
    assert alone.trial().samples_per_s == pytest.approx(12 / 0.9)  # no queue: every step counts


def test_the_runs_first_segment_leaves_out_its_first_step() -> None:
    """The fit's first step builds the optimizer's state (12 ms against 2 ms on the time-to-quality
    MLP): in the run's first segment it would count against the setting the run starts at."""
    ticks = [0.0, 0.0, 0.0, 0.012, 0.012, 0.014, 0.014, 0.016, 0.016, 0.018, 0.018, 9.0]  # started, then
    # (asked, arrived) per batch
    chunk = [[4 * i + j for j in range(4)] for i in range(5)]
    first = _Timing(Setting(0), chunk, iter(ticks).__next__, warmup=1)
    list(first.run(iter(range(5)), lambda done: iter(())))
    assert first.trial().samples_per_s == pytest.approx(12 / 0.006)  # steps 1-3: 2 ms each
    later = _Timing(Setting(0), chunk, iter(ticks).__next__)
    list(later.run(iter(range(5)), lambda done: iter(())))
    assert later.trial().samples_per_s == pytest.approx(16 / 0.018)
    short = _Timing(Setting(0), chunk[:3], iter([*ticks[:7], 9.0]).__next__, warmup=1)
    list(short.run(iter(range(3)), lambda done: iter(())))
    assert short.trial().samples_per_s == pytest.approx(8 / 0.014)  # two steps: both needed


def test_a_segment_leaves_out_the_steps_a_guard_checked() -> None:
    """The guards check a fit's first steps, slower than the run's (`instrumented`): on the
    time-to-quality autoencoder the run's first segment read 22,400 samples/s with them, 30,100
    without (`python -m benchmarks checked_steps`). Here steps 1 and 2 were checked, 0.3 s
    against 0.1 s."""
    ticks = [0.0, 0.0, 0.0, 0.1, 0.1, 0.4, 0.4, 0.7, 0.7, 0.8, 0.8, 0.9, 0.9, 9.0]  # started, then
    # (asked, arrived) per batch, then the trial's clock
    chunk = [[4 * i + j for j in range(4)] for i in range(6)]
    marks = [0, 0, 1, 2, 2, 2]  # `instrumented.count()` at each arrival
    timing = _Timing(Setting(0), chunk, iter(ticks).__next__, marks=iter(marks).__next__)
    list(timing.run(iter(range(6)), lambda done: iter(())))
    assert timing.trial().samples_per_s == pytest.approx(12 / 0.3)  # steps 0, 3 and 4
    every = _Timing(Setting(0), chunk, iter(ticks).__next__, marks=iter([0, 1, 2, 3, 4, 4]).__next__)
    list(every.run(iter(range(6)), lambda done: iter(())))
    assert every.trial().samples_per_s == pytest.approx(20 / 0.9)  # one unchecked step: all of them count


def _run_prefetch(rate: Any, waited: float, hardware: Any = None) -> tuple[list[Setting], WorkerChoice]:
    """A GPU run's search where `rate(workers, prefetch_factor)` is the training rate and every
    segment waited `waited` of its time for data."""
    hardware = hardware or EXAMPLES["h100"]
    plan = SegmentPlan(32, 12)
    search = search_online(hardware, WorkerTuning(), plan, search_start(hardware, WorkerTuning(), plan))
    setting, measured = next(search), []
    try:
        while True:
            measured.append(setting)
            trial = WorkerTrial(
                setting[0], setting[1], rate(*setting[:2]), seconds=1.0, batch_bytes=2**20, load_share=waited
            )
            setting = search.send(trial)
    except StopIteration as stop:
        return measured, stop.value


def test_a_gpu_run_waiting_for_data_tries_a_deeper_prefetch_on_the_winner() -> None:
    """prefetch_factor searched online too: one segment at the winner's count with 4 batches in
    flight per worker, kept when more than 5 % faster; the count's mean leaves it out."""
    faster = lambda n, factor: min(300.0 * n, 2000.0) * (1.1 if factor == 4 else 1.0) if n else 250.0  # noqa: E731
    measured, choice = _run_prefetch(faster, waited=0.3)
    assert measured[-1] == Setting(7, 4) and all(s.prefetch_factor == 2 for s in measured[1:-1])
    assert (choice.num_workers, choice.prefetch_factor) == (7, 4)
    assert "with prefetch_factor=4" in choice.reason and choice.trials[-1].prefetch_factor == 4
    same = lambda n, factor: min(300.0 * n, 2000.0) if n else 250.0  # noqa: E731
    measured, choice = _run_prefetch(same, waited=0.3)
    assert measured[-1] == Setting(7, 4) and (choice.num_workers, choice.prefetch_factor) == (7, 2)


def test_a_deeper_prefetch_is_not_tried_where_it_cannot_gain() -> None:
    rate = lambda n, factor: min(300.0 * n, 2000.0) if n else 250.0  # noqa: E731
    measured, choice = _run_prefetch(rate, waited=0.01)  # removing a 1 % wait gains 1 %
    assert all(s.prefetch_factor != 4 for s in measured) and choice.prefetch_factor == 2
    assert any("too little for more batches in flight" in why for why in choice.skipped)
    tight = EXAMPLES["h100"].replace(ram_available_bytes=60 * 2**20, shm_bytes=2**40)  # 15 MiB for batches
    measured, choice = _run_prefetch(rate, waited=0.3, hardware=tight)
    assert all(s.prefetch_factor != 4 for s in measured)
    assert any(why.startswith("prefetch 4: RAM budget") for why in choice.skipped)


def test_the_search_bisects_beside_any_count_the_noise_may_hide_the_peak_behind() -> None:
    """14 measured fastest by one segment's noise, its neighbours measured: the gaps beside the
    counts within twice the tolerance of it are searched too (the widest, between 7 and 11),
    where a search around the fastest alone would stop."""
    rates = {7: 7000.0, 11: 9000.0, 13: 9300.0, 14: 9486.0, 15: 9082.0}
    trials = [WorkerTrial(count, 2, rate, seconds=1.0) for count, rate in rates.items()]
    assert _next_count(list(range(17)), trials, 0.05, fewest=False) == 9


def test_the_search_stops_at_the_planned_segments() -> None:
    measured, choice = _run(lambda n: 100.0 * (20 - n), plan=SegmentPlan(32, 2))
    assert len(measured) == 2 and choice.num_workers in measured


@pytest.mark.parametrize(
    ("epoch", "run", "expected"),
    [(1000, None, (32, 3)), (128, 256, (4, 3)), (128, 40, None), (None, None, None), (60, None, None)],
)
def test_the_plan_takes_a_tenth_of_the_first_epoch(epoch: Any, run: Any, expected: Any) -> None:
    plan = plan_segments(epoch, run, cpus=2)
    if expected is None:
        assert plan.why_not and plan.max_segments == 0
    else:
        assert (plan.segment_batches, plan.max_segments) == expected
        assert plan.segment_batches * plan.max_segments <= 0.1 * min(epoch, run or epoch)


def test_a_failed_candidate_is_dropped_and_nothing_ran_falls_back() -> None:
    trials = [WorkerTrial(0, None, 400.0), WorkerTrial(2, 2, 0.0, error="crashed: killed")]
    assert choose_online(trials, WorkerTuning()).num_workers == 0
    choice = choose_online([WorkerTrial(2, 2, 0.0, error="hung: timed out")], WorkerTuning())
    assert choice.num_workers == 0 and "fell back" in choice.reason


class IndexedData(Dataset[tuple[Tensor, int]]):
    """Sample ``i`` is ``(features, i)``; with `crash_in_workers`, loading in a worker process
    kills it (a dataset that cannot be loaded in workers), loading in the main process works.
    `load_s` per sample makes the run wait for its data most of the time, so the search goes to
    workers at once (`PROBE_BELOW`) instead of on the timing of a probe of the model's threads."""

    def __init__(
        self,
        length: int = SAMPLES,
        crash_in_workers: bool = False,
        hang_in_workers: bool = False,
        load_s: float = 0.0,
    ) -> None:
        self.length = length
        self.crash_in_workers = crash_in_workers
        self.hang_in_workers = hang_in_workers
        self.load_s = load_s
        self.main_pid = os.getpid()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if self.crash_in_workers and os.getpid() != self.main_pid:
            os._exit(1)
        if self.hang_in_workers and os.getpid() != self.main_pid:
            time.sleep(3600)
        if self.load_s:
            time.sleep(self.load_s)
        return torch.full((8,), float(index % 7)), index


class Recorder(BoringModel):
    """Records the sample indices of each training batch, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)
        self.seen: dict[int, list[int]] = {}

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.seen.setdefault(self.current_epoch, []).extend(batch[1].tolist())
        return self.layer(batch[0]).square().mean()

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.layer(batch[0]).square().mean())


class Data(BoostedDataModule):
    def __init__(self, dataset: Dataset[Any] | None = None, val: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("worker_tuning", TUNING)
        kwargs.setdefault("batch_size", 4)
        super().__init__(**kwargs)
        self.dataset = dataset if dataset is not None else IndexedData()
        self.val = val

    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = self.dataset
        if self.val:
            self.val_dataset = IndexedData(16)


def _fit(tmp_path: Path, data: BoostedDataModule, seed: int = 0, **options: Any) -> Recorder:
    defaults = {
        "limit_train_batches": 1.0,
        "limit_val_batches": 1.0,
        "logger": False,
        "enable_checkpointing": False,
    }
    L.seed_everything(seed, verbose=False)
    model = Recorder()
    tiny_trainer(tmp_path, **(defaults | options)).fit(model, datamodule=data)
    return model


def _by_hand(tmp_path: Path, length: int = SAMPLES, **options: Any) -> dict[int, list[int]]:
    """The order a run told its loader settings by hand (no tuning) trains in, per epoch."""
    data = {key: options.pop(key) for key in ("shuffle", "drop_last", "val") if key in options}
    return _fit(tmp_path / "by_hand", Data(IndexedData(length), num_workers=0, **data), **options).seen


def _searched(data: BoostedDataModule) -> WorkerChoice:
    (choice,) = data.worker_tuner.choices.values()
    assert choice.source == "searched", choice
    return choice


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_each_epoch_trains_the_samplers_batches_in_its_order(
    tmp_path: Path, shuffle: bool, drop_last: bool
) -> None:
    data = Data(IndexedData(SAMPLES + 2, load_s=0.001), shuffle=shuffle, drop_last=drop_last)
    model = _fit(tmp_path, data, max_epochs=2)
    choice = _searched(data)
    assert len(choice.trials) == 3 and any(t.num_workers for t in choice.trials)  # settings switched
    expected = _by_hand(tmp_path, SAMPLES + 2, max_epochs=2, shuffle=shuffle, drop_last=drop_last)
    assert model.seen == expected  # the same samples, once each, in the order of a run not tuned


def test_limits_and_max_steps_end_the_search_cleanly(tmp_path: Path) -> None:
    model = _fit(tmp_path, Data(IndexedData(4000)), limit_train_batches=0.2, max_epochs=2)
    assert [len(model.seen[e]) for e in (0, 1)] == [800, 800]
    data = Data(IndexedData(4000))
    model = _fit(tmp_path, data, max_steps=30, max_epochs=-1)  # ends during the search's segments
    assert model.seen[0] == _by_hand(tmp_path, 4000, max_steps=30, max_epochs=-1)[0]
    assert not data.worker_tuner.findings or data.worker_tuner.choices  # settled on what it measured


def test_len_and_persistent_workers_after_the_search(tmp_path: Path) -> None:
    class Loaders(L.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int, bool]] = []

        @override
        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            loader = trainer.train_dataloader
            self.seen.append((len(loader), loader.num_workers, loader.persistent_workers))  # type: ignore[arg-type, union-attr]

    data = Data(IndexedData(SAMPLES, crash_in_workers=False), shuffle=True)
    callback = Loaders()
    _fit(tmp_path, data, max_epochs=2, callbacks=[callback])
    choice = _searched(data)
    assert [length for length, _, _ in callback.seen] == [SAMPLES // 4] * 2
    assert all(workers == choice.num_workers for _, workers, _ in callback.seen)
    assert all(persistent == bool(choice.num_workers) for _, _, persistent in callback.seen)


def test_a_crashing_worker_drops_its_candidate_and_loses_no_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a plain fit whose loader had workers, as in a notebook's second fit: Lightning put
    the process's SIGCHLD handler back as it found it, torch's gone, and the search still finds a
    worker's death as it happens, not at its loader's `timeout` (20 s a candidate here before).
    The process starts as a fresh one does, torch's handler not yet set: one set outside a fit
    (by an earlier test of the process) would be what Lightning puts back."""
    before = signal.getsignal(signal.SIGCHLD)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)
    try:
        loader = DataLoader(IndexedData(16), batch_size=4, num_workers=1)
        plain = tiny_trainer(tmp_path / "plain", logger=False, enable_checkpointing=False)
        plain.fit(Recorder(), loader, loader)
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL and signal_handling._SIGCHLD_handler_set
        data = Data(IndexedData(SAMPLES, crash_in_workers=True, load_s=0.001), shuffle=False)
        model = _fit(tmp_path, data, max_epochs=1)
    finally:
        signal.signal(signal.SIGCHLD, before)
    choice = _searched(data)
    assert choice.num_workers == 0
    crashed = [trial for trial in choice.trials if "crashed" in trial.error or "exited" in trial.error]
    assert crashed and all(trial.seconds < TUNING.timeout_s / 2 for trial in crashed), choice.trials
    assert model.seen[0] == list(range(SAMPLES))


def test_a_hanging_worker_drops_its_candidate_and_loses_no_sample(tmp_path: Path) -> None:
    """A hung candidate costs its timeout: its workers are terminated, not joined for torch's 5 s
    each first (before: 6.1 s for 1 worker, 11.1 s for 2, with this 1 s timeout)."""
    tuning = WorkerTuning(max_workers=2, timeout_s=1.0)
    data = Data(IndexedData(SAMPLES, hang_in_workers=True, load_s=0.001), shuffle=False, worker_tuning=tuning)
    children = set(multiprocessing.active_children())  # an earlier test's, under pytest -n
    model = _fit(tmp_path, data, max_epochs=1)
    choice = _searched(data)
    hung = [trial for trial in choice.trials if "hung" in trial.error]
    assert choice.num_workers == 0 and hung, choice.trials
    assert all(trial.seconds < tuning.timeout_s + MP_STATUS_CHECK_INTERVAL - 1 for trial in hung), hung
    assert set(multiprocessing.active_children()) <= children  # terminated, none left hanging
    assert model.seen[0] == list(range(SAMPLES))


class _Interrupt(L.Callback):
    """Ctrl-C while a segment with workers runs."""

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        if multiprocessing.active_children():
            raise KeyboardInterrupt


def test_ctrl_c_during_the_search_leaves_no_worker_process(tmp_path: Path) -> None:
    data = Data(IndexedData(SAMPLES, load_s=0.001))
    with pytest.raises(SystemExit):  # Lightning's answer to a KeyboardInterrupt: it exits the process
        _fit(tmp_path, data, max_epochs=1, callbacks=[_Interrupt()])
    import gc

    gc.collect()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


def test_the_evaluation_loader_follows_and_reloading_reuses_the_choice(tmp_path: Path) -> None:
    data = Data(val=True)
    model = _fit(tmp_path, data, max_epochs=2, reload_dataloaders_every_n_epochs=1)
    choice = _searched(data)
    assert model.seen == _by_hand(tmp_path, max_epochs=2, reload_dataloaders_every_n_epochs=1, val=True)
    trainer = data.trainer
    assert trainer is not None
    assert trainer.val_dataloaders.num_workers == choice.num_workers  # type: ignore[union-attr]


class _Grown(L.Callback):
    """Grows the datamodule's batch 4x after the first epoch, as a batch-size schedule (or
    `AutoBatchSize(grow=True)`) does; the loader rebuilt at it has 60 batches an epoch."""

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        data = trainer.datamodule  # type: ignore[attr-defined]
        if trainer.current_epoch == 0:
            data.batch_size *= 4


def test_a_grown_batch_too_short_to_search_keeps_the_workers_found_at_the_smaller_one(tmp_path: Path) -> None:
    """A loader whose samples take 1 ms to load, searched at batch 4 on 240 batches (the workers
    win), then rebuilt at 16: 60 batches an epoch, too few to search. Before, that loader went back
    to the CPU's prior, loading in the main process (`grown_workers` in RESULTS: a 4x grown batch
    fitted 1.41x as long to the same final accuracy)."""
    data = Data(IndexedData(SAMPLES, load_s=0.001), shuffle=False)
    model = _fit(tmp_path, data, max_epochs=2, reload_dataloaders_every_n_epochs=1, callbacks=[_Grown()])
    found, grown = data.worker_tuner.choices.values()
    assert found.source == "searched" and found.num_workers > 0
    assert grown.source == "carried" and (grown.num_workers, grown.prefetch_factor) == (
        found.num_workers,
        found.prefetch_factor,
    )
    assert "as searched at batch 4, not searched: the first epoch has 60 batches" in grown.reason
    trainer = data.trainer
    assert trainer is not None and trainer.train_dataloader.num_workers == found.num_workers  # type: ignore[union-attr]
    assert model.seen[1] == list(range(SAMPLES))  # every sample once, in order


def test_a_warm_cache_starts_at_the_cached_setting(tmp_path: Path) -> None:
    first = Data()
    _fit(tmp_path, first, max_epochs=1)
    second = Data()
    model = _fit(tmp_path, second, max_epochs=1)
    (choice,) = second.worker_tuner.choices.values()
    assert choice.source == "cache" and choice.num_workers == _searched(first).num_workers
    assert model.seen[0] == _by_hand(tmp_path, max_epochs=1)[0]


class _Augmented(IndexedData):
    """`IndexedData` with a random augmentation: each sample draws from the RNG of the process that
    loads it (a worker's, or the main process's at 0 workers)."""

    @override
    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        features, index = super().__getitem__(index)
        return features + torch.rand(8), index


class _Features(L.Callback):
    """The features of every training batch, as the step got them."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        self.batches.append(batch[0].sum(dim=1).tolist())


def test_a_deterministic_run_trains_the_same_batches_when_repeated_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `Trainer(deterministic=True)`, with workers seeded (`seed_everything(workers=True)`)
    and a random augmentation: the run that tunes and its repeat from the cache train the same
    batches, every epoch. A search on the first epoch's own batches loads them at several worker
    counts, so their augmentation drew other numbers than a run at one count, and loading in the
    main process moved its RNG: the repeat's first epoch and every later shuffle differed. The
    search is made before the fit instead, with the run's RNG put back after it."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # Lightning sets it: put back after
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    runs = []
    for name in ("tuning", "repeat"):
        data, features = Data(_Augmented(load_s=0.001), shuffle=True), _Features()
        L.seed_everything(0, workers=True, verbose=False)
        trainer = tiny_trainer(
            tmp_path / name, max_epochs=2, limit_train_batches=1.0, logger=False,
            enable_checkpointing=False, deterministic=True, callbacks=[features],
        )  # fmt: skip
        trainer.fit(Recorder(), datamodule=data)
        (choice,) = data.worker_tuner.choices.values()
        runs.append((features.batches, choice, data.findings))
    (tuned, tuning, said), (repeated, cached, _) = runs
    assert tuning.source == "measured" and cached.source == "cache"  # before the fit, then reused
    assert cached.num_workers == tuning.num_workers
    assert len(tuned) == 2 * SAMPLES // 4
    assert tuned == repeated
    assert any("before the fit" in f.title and "deterministic" in f.detail for f in said)


class _Threads(L.Callback):
    """torch's intra-op thread count at each training step."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    @override
    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        self.seen.add(torch.get_num_threads())


def test_a_cached_thread_count_trains_every_step_and_is_put_back(
    tmp_path: Path, _private_tuning_cache: Path
) -> None:
    """Which thread count wins is timing (the pure decision is tested above); here the choice a
    search stores when the model was faster on 1 thread, read from the cache, trains every step
    on 1 thread, says so in a finding, and torch's own count is put back after the fit."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _fit(tmp_path, Data(), max_epochs=1)  # a cold run stores its searched choice
        path = _private_tuning_cache / "workers.json"
        document = json.loads(path.read_text())
        (entry,) = document["entries"].values()
        entry["choice"].update(num_workers=0, prefetch_factor=None, threads=1)
        path.write_text(json.dumps(document))
        data, threads = Data(), _Threads()
        _fit(tmp_path, data, max_epochs=1, callbacks=[threads])
        (choice,) = data.worker_tuner.choices.values()
        assert (choice.source, choice.threads, threads.seen) == ("cache", 1, {1})
        assert any("set_num_threads(1): the model's step measured faster" in f.title for f in data.findings)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


class _StepThreads(L.Callback):
    """torch's intra-op thread count at each training step, in order, and whether worker
    processes were alive beside it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool]] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        self.seen.append((torch.get_num_threads(), bool(multiprocessing.active_children())))


class _Images(Dataset[tuple[Tensor, int]]):
    """Sample ``i``: a 3 x 16 x 16 image drawn from seed ``i``, its class ``i % 2``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(index)), index % 2


class _ConvNet(L.LightningModule):
    """A convolution, whose gradients round differently on 1 thread than on 2 (checked by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 14 * 14, 2)
        )

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the run's 2 threads need 2 CPUs")
@pytest.mark.parametrize("cpus", [2, 16])
def test_the_probe_of_fewer_threads_trains_none_of_the_runs_steps_on_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    """A CPU run's search probes the model on the 1 thread a worker would leave on a copy: every
    step of the run trains on the run's 2 threads and it ends on the weights of the run told its
    settings by hand, bit for bit (a step on 1 thread rounds differently). The tolerance keeps
    the choice the run's own. On 16 CPUs (simulated: the tuner is told so, as a GPU machine
    has them, where this test failed on 2026-11-27) a worker leaves 15, no fewer than the run's
    2: no probe runs, where one used to time the run's own 2 threads as "15". On a loaded host
    (six busy processes on 2 CPUs) 1 thread can lead 2 by over 2x: then a worker segment may run,
    its steps on the 1 thread its workers leave, and the probe may win, the run's steps on 1
    thread from the choice on; no other step leaves the run's 2."""
    real = tuner.hardware_for
    monkeypatch.setattr(tuner, "hardware_for", lambda trainer: real(trainer).replace(cpus_available=cpus))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = {}
        for name, tuning in (("tuned", WorkerTuning(max_workers=2, tolerance=0.99)), ("by hand", None)):
            data = Data(_Images(), worker_tuning=tuning) if tuning else Data(_Images(), num_workers=0)
            threads = _StepThreads()
            L.seed_everything(0, verbose=False)
            model = _ConvNet()
            trainer = tiny_trainer(
                tmp_path / name, max_epochs=1, limit_train_batches=1.0, logger=False, callbacks=[threads]
            )
            trainer.fit(model, datamodule=data)
            runs[name] = (data, threads.seen, torch.cat([p.detach().flatten() for p in model.parameters()]))
        data, seen, weights = runs["tuned"]
        choice = _searched(data)
        probes = [trial for trial in choice.trials if trial.threads is not None]
        if cpus == 2:
            assert probes and all(t.ok and t.threads == 1 and t.on_copy for t in probes), choice.trials
            assert choice.num_workers == 0, choice.trials
        else:
            assert not probes and choice.threads is None, choice.trials
        # beside a worker segment's workers the model has the 1 thread they leave (a loaded host
        # runs one: the probe's lead says workers may win); every other step has the run's 2
        alone = [count for count, workers in seen if not workers]
        if choice.threads is None:
            assert alone == [2] * len(alone), (seen, choice.trials)
            if len(alone) == len(seen):  # no worker segment: the by-hand run's steps, bit for bit
                assert seen == [(2, False)] * (SAMPLES // 4) == runs["by hand"][1]
                assert torch.equal(weights, runs["by hand"][2])
        else:  # on a loaded host 1 thread can lead 2 by over 2x: it won, and trains from the choice on
            searched = alone.index(1)
            assert searched >= 2 and alone == [2] * searched + [1] * (len(alone) - searched), seen
    finally:
        torch.set_num_threads(before)


def _old_weight_norm(layer: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():  # deprecated for the parametrization, still in models' code
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.utils.weight_norm(layer)


@pytest.mark.parametrize("norm", [torch.nn.utils.spectral_norm, _old_weight_norm])
def test_the_probe_copies_a_model_whose_norm_computes_its_weight_at_each_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, norm: Any
) -> None:
    """``spectral_norm`` (and the older ``weight_norm``, both common in GANs and audio models) set
    the layer's ``weight`` at each forward to a tensor computed with gradients, which
    ``copy.deepcopy`` refuses. The probe of the model's threads on a copy failed, loading in the
    main process went untimed, and a search on 2 CPUs could take workers a TensorDataset does not
    need. The copy now clones that tensor, detached."""
    real = tuner.hardware_for
    monkeypatch.setattr(tuner, "hardware_for", lambda trainer: real(trainer).replace(cpus_available=2))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        data = Data(_Images(), worker_tuning=WorkerTuning(max_workers=2, tolerance=0.99))
        model = _ConvNet()
        model.net[0] = norm(model.net[0])
        trainer = tiny_trainer(tmp_path, max_epochs=1, limit_train_batches=1.0, logger=False)
        trainer.fit(model, datamodule=data)
        choice = _searched(data)
        probes = [trial for trial in choice.trials if trial.threads is not None]
        assert probes and all(trial.ok and trial.on_copy for trial in probes), choice.trials
        assert model.net[0].weight.grad_fn is not None  # the run's own, computed at its last forward
    finally:
        torch.set_num_threads(before)


def test_a_run_on_fewer_threads_than_a_worker_leaves_probes_no_threads() -> None:
    """16 CPUs and the run's model on 8 threads (torch's default of one a physical core, two
    logical CPUs a core): one worker leaves 15, so it takes none of the 8 and the search goes
    from no workers to worker counts without a probe; a run on all 16 probes 15 first."""
    cpu = EXAMPLES["cpu"].replace(cpus_available=16)
    rate = {n: (300.0 + 40 * n, 0.1) for n in range(16)}
    rate["threads", 15] = (320.0, 0.1)
    measured, choice = _run(rate.__getitem__, cpu, SegmentPlan(8, 4), prior=(0, None), threads=8)
    assert all(trial.threads is None for trial in choice.trials) and measured[1] > 0, choice.trials
    measured, choice = _run(rate.__getitem__, cpu, SegmentPlan(8, 4), prior=(0, None), threads=16)
    assert [trial.threads for trial in choice.trials][:2] == [None, 15], choice.trials


class _Draws(L.Callback):
    """A draw from the global RNG at each training step: what dropout or a random augmentation in
    the step gets."""

    def __init__(self) -> None:
        self.draws: list[float] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        self.draws.append(float(torch.rand(())))


def test_persistent_workers_leave_the_runs_random_draws_as_without_them(
    tmp_path: Path, _private_tuning_cache: Path
) -> None:
    """PyTorch's persistent workers draw no base seed after their first epoch, where a loader
    without them draws one per iteration (each epoch, each validation run): tuned to 2 persistent
    workers (from the cache, so the setting is sure), three epochs validating twice each shuffle
    the same batches and draw the same random numbers as the run told 0 workers by hand."""
    _fit(tmp_path, Data(val=True), max_epochs=1)  # stores a searched choice
    path = _private_tuning_cache / "workers.json"
    document = json.loads(path.read_text())
    (entry,) = document["entries"].values()
    entry["choice"].update(num_workers=2, prefetch_factor=2, threads=None)
    path.write_text(json.dumps(document))
    runs = {}
    for name, workers in (("tuned", None), ("by hand", 0)):
        data, draws = Data(val=True, shuffle=True, num_workers=workers), _Draws()
        model = _fit(tmp_path / name, data, max_epochs=3, val_check_interval=0.5, callbacks=[draws])
        runs[name] = (model.seen, draws.draws, data)
    tuned = runs["tuned"][2].trainer
    assert tuned is not None and tuned.train_dataloader.num_workers == 2  # type: ignore[union-attr]
    assert tuned.train_dataloader.persistent_workers  # type: ignore[union-attr]
    assert runs["tuned"][:2] == runs["by hand"][:2]


def test_a_same_order_loader_shuffles_as_a_loader_without_persistent_workers() -> None:
    def orders(loader_class: type[DataLoader[Any]], **options: Any) -> list[list[int]]:
        torch.manual_seed(0)
        loader = loader_class(TensorDataset(torch.arange(32)), batch_size=8, shuffle=True, **options)
        return [torch.cat([batch[0] for batch in loader]).tolist() for _ in range(3)]

    plain = orders(DataLoader)
    assert orders(SameOrderDataLoader, num_workers=1, persistent_workers=True) == plain
    assert orders(DataLoader, num_workers=1, persistent_workers=True) != plain  # PyTorch's own


def test_resuming_reuses_the_checkpointed_choice(tmp_path: Path) -> None:
    data = Data()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _fit(tmp_path, data, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint])
    trainer_dir = tmp_path / "resumed"
    L.seed_everything(0, verbose=False)
    resumed_data = Data(retune=True)  # no cache read: the setting comes from the checkpoint
    model = Recorder()
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = tiny_trainer(
        trainer_dir, max_epochs=2, limit_train_batches=1.0, logger=False, callbacks=[again]
    )
    with warnings.catch_warnings():  # the run it resumes wrote there: Lightning says so
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
        trainer.fit(model, datamodule=resumed_data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    (choice,) = resumed_data.worker_tuner.choices.values()
    assert choice.num_workers == _searched(data).num_workers
    assert sorted(model.seen[1]) == list(range(SAMPLES))


class Stream(IterableDataset[tuple[Tensor, int]]):
    def __iter__(self) -> Any:
        return iter([(torch.zeros(8), i) for i in range(SAMPLES)])


def test_a_stream_is_not_split(tmp_path: Path) -> None:
    """An IterableDataset has no sampler to split: it loads as the user set it, unsearched."""
    data = Data(Stream(), shuffle=False)
    model = _fit(tmp_path, data, max_epochs=1)
    assert model.seen[0] == list(range(SAMPLES))
    assert not data.worker_tuner.searches
    assert any("not measured" in f.title for f in data.findings)


def test_a_short_first_epoch_is_not_searched(tmp_path: Path) -> None:
    data = Data(IndexedData(64))
    _fit(tmp_path, data, max_epochs=3)
    (choice,) = data.worker_tuner.choices.values()
    assert choice.source == "short run" and "cannot time two settings" in choice.reason


def test_an_epoch_is_the_samplers_draws_not_the_datasets_length(tmp_path: Path) -> None:
    """64 samples drawn 960 times an epoch by a `WeightedRandomSampler` (an imbalanced set
    oversampled): 240 batches, long enough to search. Counted by the dataset's length (16 batches)
    it was kept unsearched as a short run, in `AutoNumWorkers` as in `BoostedDataModule`."""
    weights = torch.linspace(0.1, 1.0, 64)
    sampler = torch.utils.data.WeightedRandomSampler(
        weights, SAMPLES, generator=torch.Generator().manual_seed(3)
    )
    loader = DataLoader(IndexedData(64, load_s=0.001), batch_size=4, sampler=sampler)
    tuner = AutoNumWorkers(TUNING)
    options = {"logger": False, "enable_checkpointing": False, "callbacks": [tuner]}
    trainer = tiny_trainer(tmp_path, max_epochs=1, limit_train_batches=1.0, limit_val_batches=0, **options)
    model = Recorder()
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=DataLoader(IndexedData(16), batch_size=4))
    (choice,) = [c for c in tuner.worker_tuner.choices.values() if c.source != "short run"]
    assert choice.source == "searched", choice.reason
    assert len(model.seen[0]) == SAMPLES


@pytest.mark.skipif(
    minor_version(L.__version__) < (2, 6),
    reason="Lightning 2.4's lr_find leaves its own training loader in the fit loop: the fit trains on it",
)
def test_lightnings_lr_finder_leaves_the_fits_own_loader_to_be_searched(tmp_path: Path) -> None:
    """`LearningRateFinder` runs the fit's loop for 30 steps before the fit: the loader asked for
    that short run was kept unsearched ("the run has 30 batches"), and the fit reused the choice
    for its whole run, which was never searched."""
    from lightning.pytorch.callbacks import LearningRateFinder

    data = Data()
    finder = LearningRateFinder(num_training_steps=30, early_stop_threshold=None)
    _fit(tmp_path, data, max_epochs=1, callbacks=[finder])
    assert _searched(data).trials
    assert not any("the run has 30 batches" in f.title for f in data.findings)


def _driver(
    shuffle: bool, **options: Any
) -> tuple[Dataset[Any], SegmentedDataLoader, OnlineSearch, list[WorkerChoice]]:
    """A `SegmentedDataLoader` over 200 indices, batch 3, with a pending search of three segments
    of 8 batches on a 2-CPU machine (`options`: more `OnlineSearch` arguments), and the list its
    settled choice lands in."""
    dataset = TensorDataset(torch.arange(200))
    hardware = EXAMPLES["cpu"].replace(cpus_available=2)
    plan = SegmentPlan(8, 3)
    settled: list[WorkerChoice] = []
    start = functools.partial(search_online, hardware, TUNING, plan, Setting(0))
    search = OnlineSearch(start, plan, TUNING, Setting(0), settled=settled.append, **options)
    return (
        dataset,
        SegmentedDataLoader(dataset, batch_size=3, shuffle=shuffle, online=search),
        search,
        settled,
    )


def test_the_segment_driver_alone_yields_each_batch_once() -> None:
    """`OnlineSearch` over a plain loader, no Lightning: the driver's own contract."""
    dataset, loader, _, settled = _driver(shuffle=True)
    torch.manual_seed(0)
    seen = [int(i) for (batch,) in loader for i in batch]
    torch.manual_seed(0)
    assert seen == [int(i) for (batch,) in DataLoader(dataset, batch_size=3, shuffle=True) for i in batch]
    assert len(settled) == 1 and len(settled[0].trials) == 3
    assert loader.num_workers == settled[0].num_workers


def test_each_loader_starts_with_its_threads_while_the_batch_before_it_steps() -> None:
    """Every segment's loader, the winner's too, starts while the batch before it still has its
    step to run; the setting's process side (the model's threads) comes first, so that step does
    not keep the threads of a setting with fewer workers beside the starting ones (on 2 CPUs, 2
    model threads beside 2 starting workers made it 330-560 ms against 45). Ranks sharing trials
    (`share`) switch at the planned batches: segments of exactly 8."""
    dataset = TensorDataset(torch.arange(200))
    hardware = EXAMPLES["cpu"].replace(cpus_available=2)
    plan = SegmentPlan(8, 3)
    handed: list[int] = []
    configured: list[tuple[int, int]] = []  # (batches handed to the step so far, workers)
    settled: list[tuple[int, WorkerChoice]] = []
    start = functools.partial(search_online, hardware, TUNING, plan, Setting(0))
    search = OnlineSearch(
        start,
        plan,
        TUNING,
        Setting(0),
        share=lambda trial: trial,
        configure=lambda workers, threads: configured.append((len(handed), workers)),
        settled=lambda choice: settled.append((len(handed), choice)),
    )
    for (batch,) in SegmentedDataLoader(dataset, batch_size=3, online=search):
        handed.append(len(batch))
    (at, choice), trials = settled[0], settled[0][1].trials
    assert len(settled) == 1 and len(trials) == 3
    assert configured[:3] == [(at, trial.num_workers) for at, trial in zip((0, 7, 15), trials, strict=True)]
    assert at == 23 and configured[3:] == [(23, choice.num_workers)]
    assert sum(handed) == len(dataset)


def test_a_segments_workers_stop_as_its_last_batch_arrives_and_count_in_the_search_cost() -> None:
    """Forking a segment's workers and joining them run on the training thread: they are the
    search's cost (a run set by hand starts one loader), and the workers of a finished segment
    must not linger beside the next one's (its last batch came: they have nothing left to do)."""
    lingering: list[int] = []  # worker processes alive as each loader's setting is applied

    def configure(workers: int, threads: int | None) -> None:
        lingering.append(len(multiprocessing.active_children()))

    _, loader, _, settled = _driver(shuffle=False, configure=configure)
    assert sum(len(batch) for (batch,) in loader) == 200
    (choice,) = settled
    assert any(trial.num_workers for trial in choice.trials)
    assert lingering == [0] * len(lingering) and len(lingering) == len(choice.trials) + 1
    started = [trial.overhead_s for trial in choice.trials if trial.num_workers]
    assert all(seconds > 0 for seconds in started)
    assert choice.seconds >= sum(trial.overhead_s for trial in choice.trials) > 0


class _Slow(Dataset[int]):
    """Sample ``i`` is ``i``, after 10 ms of loading (a sleep: workers overlap it whatever the load;
    at 2 ms a worker's wake-ups on a host loaded 4x over cost more than 2 workers saved)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        time.sleep(0.01)
        return index


def test_a_deeper_prefetch_segment_loads_each_batch_once_in_order() -> None:
    """The driver under a GPU machine's search (its properties simulated: this machine has no
    GPU): nothing but loading runs between batches, so the step always waits for data and the
    winner gets a real segment of workers at prefetch_factor=4; the epoch is still the sampler's.
    Each sample takes 10 ms to load, so workers win over the main process."""
    dataset = _Slow(200)
    hardware = EXAMPLES["h100"]
    plan = SegmentPlan(12, 5)  # times 2 workers at prefetch_factor=4 (8 batches in flight)
    settled: list[WorkerChoice] = []
    prior = search_start(hardware, TUNING, plan)
    assert prior is not None
    start = functools.partial(search_online, hardware, TUNING, plan, prior)
    search = OnlineSearch(start, plan, TUNING, prior, settled=settled.append)
    loader = SegmentedDataLoader(dataset, batch_size=3, shuffle=True, online=search)
    torch.manual_seed(0)
    seen = [int(i) for batch in loader for i in batch]
    torch.manual_seed(0)
    assert seen == [int(i) for batch in DataLoader(dataset, batch_size=3, shuffle=True) for i in batch]
    (choice,) = settled
    assert choice.num_workers > 0 and choice.trials[-1].prefetch_factor == 4
    assert len(choice.trials) <= plan.max_segments
    assert loader.prefetch_factor == choice.prefetch_factor and loader.num_workers == choice.num_workers


class _Where(Dataset[Tensor]):
    """Sample ``i`` is ``[i, 1 if loaded in the main process else 0]``, after 2 ms of loading."""

    def __len__(self) -> int:
        return 240

    def __getitem__(self, index: int) -> Tensor:
        time.sleep(0.002)
        return torch.tensor([index, torch.utils.data.get_worker_info() is None])


def test_a_segment_loading_in_the_main_process_ends_once_loading_dominates() -> None:
    """Nothing but loading runs between batches, so the first segment (no workers, 8 batches
    planned) spent all its time loading: after its warm-up step and `MIN_SEGMENT_BATCHES` more it
    ends, and its two unloaded batches open the next segment; the epoch is still the sampler's.
    Not where ranks share trials: each would end on its own timings, at different batches."""
    hardware = EXAMPLES["cpu"].replace(cpus_available=2)
    plan = SegmentPlan(8, 3)

    def epoch(share: Any = None) -> tuple[list[bool], WorkerChoice]:
        settled: list[WorkerChoice] = []
        start = functools.partial(search_online, hardware, TUNING, plan, Setting(0))
        search = OnlineSearch(start, plan, TUNING, Setting(0), share=share, settled=settled.append)
        torch.manual_seed(0)
        batches = list(SegmentedDataLoader(_Where(), batch_size=3, shuffle=True, online=search))
        torch.manual_seed(0)
        expected = [int(i) for batch in DataLoader(range(240), batch_size=3, shuffle=True) for i in batch]
        assert [int(i) for batch in batches for i in batch[:, 0]] == expected
        return [bool(batch[:, 1].all()) for batch in batches], settled[0]

    in_main, choice = epoch()
    assert in_main[:6] == [True] * 6 and not in_main[6]
    assert choice.trials[0].num_workers == 0 and choice.trials[1].num_workers == 2
    in_main, _ = epoch(share=lambda trial: trial)  # ranks sharing trials switch at the planned batch
    assert in_main[:8] == [True] * 8 and not in_main[8]


def test_an_epoch_dropped_before_its_first_segment_ended_starts_the_search_over() -> None:
    """A tuner that draws one batch of the training loader and drops it settles nothing."""
    _, loader, search, settled = _driver(shuffle=False)
    peek = iter(loader)
    next(peek)
    del peek
    assert not settled and search.choice is None
    assert [int(i) for (batch,) in loader for i in batch] == list(range(200))
    assert len(settled) == 1 and len(settled[0].trials) >= 2


class _SaveSeen(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(pl_module, Recorder) and isinstance(trainer.datamodule, Data)
        choices = {k: c.to_dict() for k, c in trainer.datamodule.worker_tuner.choices.items()}
        payload = {"seen": pl_module.seen, "choices": choices}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


@pytest.mark.ddp
def test_two_ranks_search_together_and_each_trains_its_share_once(tmp_path: Path) -> None:
    data = Data(IndexedData(2 * SAMPLES))
    options = {"callbacks": [_SaveSeen(tmp_path)], "devices": 2, "strategy": "ddp_spawn", "max_epochs": 2}
    _fit(tmp_path, data, **options)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["choices"] == ranks[1]["choices"]  # rank zero's measurements decided for both
    (choice,) = ranks[0]["choices"].values()
    assert choice["source"] == "searched" and len(choice["trials"]) >= 2  # one CPU each: 0 and 1 workers
    for rank, saved in enumerate(ranks):
        for epoch in (0, 1):
            sampler = DistributedSampler(range(2 * SAMPLES), num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            assert saved["seen"][str(epoch)] == list(sampler)


@pytest.mark.parametrize("cpus", [None, 16])
def test_auto_num_workers_searches_the_users_own_training_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int | None
) -> None:
    if cpus:  # simulated: a 16-CPU machine (the H100's), where max_workers=2 still gets its segments
        monkeypatch.setattr("lightning_boost.hardware.available_cpus", lambda: cpus)

    def fit(callbacks: list[L.Callback]) -> Recorder:
        L.seed_everything(0, verbose=False)
        model = Recorder()
        # 1 ms a sample: the run waits for its data, so the search goes to workers at once
        loader = DataLoader(IndexedData(load_s=0.001), batch_size=4, shuffle=True)
        options = {"logger": False, "enable_checkpointing": False, "callbacks": callbacks}
        trainer = tiny_trainer(tmp_path, max_epochs=2, limit_train_batches=1.0, **options)
        trainer.fit(
            model, train_dataloaders=loader, val_dataloaders=DataLoader(IndexedData(16), batch_size=4)
        )
        return model

    tuner = AutoNumWorkers(TUNING)
    searched = fit([tuner])
    (choice,) = [
        c for c in tuner.worker_tuner.choices.values() if c.source != "short run"
    ]  # the val set: too small
    assert choice.source == "searched" and len(choice.trials) >= 3
    assert searched.seen == fit([]).seen  # plain Lightning, the user's loader untouched: the same order


def test_a_gpu_run_still_faster_at_the_most_workers_a_segment_times_keeps_the_cpu_budget() -> None:
    """128 CPUs: a 10,000-batch epoch's segments time up to 81 workers; a loader still scaling
    there gets the budget (127), not the last count timed; a plateau keeps its fewest fast count."""
    hardware = EXAMPLES["h100"].replace(cpus_available=128, cpu_count=128)
    plan = plan_segments(10_000, None, hardware.cpus_per_process)
    budget = prior_setting(hardware, WorkerTuning()).num_workers
    measured, choice = _run(lambda n: 200.0 * n if n else 180.0, hardware, plan)
    assert max(measured) < budget == choice.num_workers and "still rose" in choice.reason
    measured, choice = _run(lambda n: min(200.0 * n, 6000.0) if n else 180.0, hardware, plan)
    assert 30 <= choice.num_workers <= max(measured) < budget  # 30 feed the 6000
