"""The first epoch cut into segments of its own batches, each loaded at one worker setting.

`SegmentedDataLoader` is a ``DataLoader`` (its length, sampler and arguments are the user's, so
Lightning treats it as one, distributed sampler included) whose iteration, while an
`OnlineSearch` is pending, draws the epoch's batches from its own batch sampler in order and
hands consecutive runs of them to short-lived loaders at the settings the search asks for. Every
batch the sampler gives is yielded once, in its order: the batches of a segment are taken from
the sampler before its loader starts, and a segment whose workers fail hands the batches it had
not delivered to a loader at the last setting that worked; one loading in the main process
that ends early (`_Timing.loader_bound`) hands its batches, not loaded yet, to the next segment
in their order. The global RNG is drawn as a plain
``DataLoader`` draws it (one base seed, then the sampler), so the epoch's order is the one the
same run without tuning would have seen; each segment's workers get their own seeds.

Once the search has settled, the loader takes the winning setting and iterates as a plain
``DataLoader`` from then on (persistent workers included).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_boost import instrumented
from lightning_boost.workers.loaders import SameOrderDataLoader, loader_options
from lightning_boost.workers.online import (
    LOADER_BOUND,
    MIN_SEGMENT_BATCHES,
    MIN_TIMED_STEPS,
    SegmentPlan,
    Setting,
    queue_depth,
)
from lightning_boost.workers.search import (
    COPY_FAILED,
    WorkerChoice,
    WorkerTrial,
    WorkerTuning,
    describe_failure,
    end_workers,
    tensor_bytes,
    watch_worker_deaths,
)

Clock = Callable[[], float]

#: Pairs of steps of the model's copy (one on the probe's threads, one on the run's) a probe of
#: its threads on a copy times, after one warm-up step (`_Timing`'s ``copy_step``).
COPY_PAIRS = 2

#: Steps the run's first segment leaves untimed besides its first batch's wait: the fit's first
#: step builds the optimizer's state and Lightning's first-batch work (the time-to-quality MLP's
#: took 12 ms against 2 ms later, timed by hand once), so it would count against the setting the
#: run starts at.
WARMUP_STEPS = 1


class OnlineSearch:
    """One pending worker search over the first epoch's batches.

    Args:
        search: makes the `search_online` generator (a fresh one if an epoch is dropped before its
            first segment ended, e.g. by a tuner that drew one batch).
        plan: the segment length and count.
        tuning: the tuning the search runs with (its `timeout_s` bounds a worker's batch).
        prior: the setting the search starts at (loaders built before it settles use it).
        share: what every rank uses of a trial (rank zero's, broadcast; the identity alone).
            Called once per segment, at the same batch on every rank; with it, no segment ends
            early (`_Timing.loader_bound`), since that would be each rank's own call.
        configure: applies a setting's process side when its loader starts (its workers load while
            the segment before steps its last batch): ``configure(num_workers, threads)`` sets the
            model's threads (those the workers leave, or `threads` when given).
        copy_steps: makes a stepper of a fresh copy of the model (`StepProbe.stepper`): with it, a
            probe of the model's threads times a copy on them beside the run's own steps, which
            keep the run's threads, so none of the run's training is taken on other threads (their
            rounding differs); without it (an evaluation pass, a module whose step cannot run on a
            copy) the run's own steps alternate the threads.
        settled: told the choice once the search ends.
        clock: the time source.
    """

    def __init__(
        self,
        search: Callable[[], Generator[Setting, WorkerTrial | None, WorkerChoice]],
        plan: SegmentPlan,
        tuning: WorkerTuning,
        prior: Setting,
        *,
        share: Callable[[WorkerTrial], WorkerTrial] | None = None,
        configure: Callable[[int, int | None], None] = lambda num_workers, threads: None,
        copy_steps: Callable[[], Callable[[Any, int | None], float]] | None = None,
        settled: Callable[[WorkerChoice], None] = lambda choice: None,
        clock: Clock = time.perf_counter,
    ) -> None:
        self.new_search = search
        self.search = search()
        self.plan = plan
        self.tuning = tuning
        self.share = share or (lambda trial: trial)
        # ranks switch settings at the same batch: only a lone process ends a segment on its own timings
        self.may_end_early = share is None
        self.configure = configure
        self.copy_steps = copy_steps
        self.on_settled = settled
        self.clock = clock
        self.choice: WorkerChoice | None = None
        self.prior = Setting(*prior)
        self.followers: list[DataLoader[Any]] = []
        self._trials: list[WorkerTrial] = []
        self._start_s = 0.0  # the last `_start`'s seconds

    def follow(self, loader: DataLoader[Any]) -> None:
        """Give `loader` (an evaluation loader built at the prior) the winning setting too."""
        if self.choice is not None:
            apply_setting(loader, self.choice)
        else:
            self.followers.append(loader)

    def epoch(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """The epoch of `loader`: segments at the settings the search asks for, then the rest at
        the winner. Each segment's loader, the winner's included, starts (with its process side:
        `configure`) while the one before delivers its last batch."""
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
        seeds = itertools.count(seed)  # each loader started gets its own workers' base seed
        # after the seed, as DataLoader draws; a generator, since `iter()` on Lightning's predict
        # wrapper of the sampler (`_IndexBatchSamplerWrapper`) starts it over
        batches: Iterator[list[int]] = (batch for batch in loader.batch_sampler)  # type: ignore[union-attr]
        first = Setting(*next(self.search))
        setting: Setting | None = first
        chunk = list(itertools.islice(batches, self.plan.segment_batches))
        stream = self._start(loader, chunk, first, next(seeds))
        last_good = Setting(0)
        try:
            while setting is not None and chunk:
                warmup = 0 if self._trials else WARMUP_STEPS  # the run's first segment
                timing = _Timing(
                    setting,
                    chunk,
                    self.clock,
                    warmup,
                    start_s=self._start_s,
                    alternate=self._threads,
                    copy_step=self._copy_step(setting),
                )
                following: tuple[Setting | None, list[list[int]], Iterator[Any]] = (None, [], iter(()))
                fallback = functools.partial(self._resume, loader, chunk, last_good, next(seeds))
                for batch in timing.run(stream, fallback):
                    if self.may_end_early and timing.arrived < len(chunk) and timing.loader_bound():
                        batches = itertools.chain(chunk[timing.arrived :], batches)
                        del chunk[timing.arrived :]  # not loaded yet (no workers), so they open the next
                    if timing.arrived == len(chunk):  # the last: decide and start the next before its step
                        following = self._advance(loader, timing, batches, next(seeds), stream)
                    yield batch
                if not timing.failed:
                    last_good = setting
                setting, chunk, stream = following
            if self.choice is None:  # the epoch's batches ran out before the search ended
                stream = self._rest(loader, itertools.chain(chunk, batches), next(seeds))
            yield from stream
        finally:
            if self.choice is None and not self._trials:  # dropped before a segment ended: start over
                self.search.close()
                self.search = self.new_search()
            elif self.choice is None:  # the fit stopped during the search (max_steps, an error)
                self._settle([loader])

    def _advance(
        self,
        loader: DataLoader[Any],
        timing: _Timing,
        batches: Iterator[list[int]],
        seed: int,
        stream: Iterator[Any],
    ) -> tuple[Setting | None, list[list[int]], Iterator[Any]]:
        """The segment's trial to the search; the next segment's setting, batches and loader (no
        setting once the search has ended: the loader of the epoch's remaining batches). The
        segment's loader (`stream`: every batch of it has arrived) stops its workers first."""
        stopping = self.clock()
        stop_loader(stream)
        trial = self.share(timing.trial(stop_s=self.clock() - stopping))
        self._trials.append(trial)
        try:
            setting = Setting(*self.search.send(trial))
        except StopIteration as stop:
            self.choice = stop.value
            return None, [], self._rest(loader, batches, seed)
        chunk = list(itertools.islice(batches, self.plan.segment_batches))
        return setting, chunk, self._start(loader, chunk, setting, seed) if chunk else iter(())

    def _start(
        self, loader: DataLoader[Any], batches: Iterable[list[int]], setting: Setting, seed: int
    ) -> Iterator[Any]:
        """A loader at `setting`, its process side applied first: its workers load beside the
        step of the batch before, which must not keep the threads of a setting with fewer workers
        (on 2 CPUs, the model's 2 threads beside 2 starting workers made that step 330-560 ms
        against 45 ms, `data_bound` timed by hand, 2026-11-25)."""
        starting = self.clock()
        # a probe on a copy: the run's own steps keep the threads of loading in the main process
        self.configure(setting.num_workers, None if self._copies(setting) else setting.threads)
        stream = start_loader(loader, batches, setting, seed, self.tuning.timeout_s)
        self._start_s = self.clock() - starting  # the forks, on the training thread: a cost of the search
        return stream

    def _copies(self, setting: Setting) -> bool:
        """Whether `setting` is a probe of the model's threads that steps a copy."""
        return self.copy_steps is not None and setting.probe

    def _copy_step(self, setting: Setting) -> Callable[[Any, int | None], float] | None:
        """A probe's stepper of a fresh copy (`copy_steps`); one that raises when no copy can be
        made, so the probe's trial says why."""
        if self.copy_steps is None or not self._copies(setting):
            return None
        try:
            return self.copy_steps()
        except Exception as err:
            return functools.partial(_raise, err)

    def _threads(self, threads: int | None) -> None:
        """A paired probe's turn: the model at the probe's `threads`, or at those of loading in the
        main process (``None``)."""
        self.configure(0, threads)

    def _rest(self, loader: DataLoader[Any], batches: Iterable[list[int]], seed: int) -> Iterator[Any]:
        """The search settled (`_settle`, which applies the winner's process side) and the epoch's
        remaining `batches` at the winner."""
        choice = self._settle([loader])
        setting = Setting(choice.num_workers, choice.prefetch_factor)
        return start_loader(loader, batches, setting, seed, self.tuning.timeout_s)

    def _resume(
        self, loader: DataLoader[Any], chunk: list[list[int]], setting: Setting, seed: int, done: int
    ) -> Iterator[Any]:
        return self._start(loader, chunk[done:], setting, seed)

    def _settle(self, loaders: list[DataLoader[Any]]) -> WorkerChoice:
        """The choice (what was measured, when the search ended early), applied everywhere."""
        if self.choice is None:
            try:
                self.search.send(None)  # ends the search: it returns its choice of what was measured
            except StopIteration as stop:
                self.choice = stop.value
            assert self.choice is not None, "search_online returns when sent None"
        for loader in [*loaders, *self.followers]:
            apply_setting(loader, self.choice)
        self.followers.clear()
        self.configure(self.choice.num_workers, self.choice.threads)
        self.on_settled(self.choice)
        return self.choice


def _raise(error: Exception, *args: Any) -> float:
    raise error


def probe_first(step: int) -> bool:
    """Whether a paired probe's step `step` runs at the probe's threads: pairs of steps, the probe
    first in every other pair (ABBA), so a host that speeds up or slows down favours neither.

    Example:
        >>> "".join("P" if probe_first(step) else "-" for step in range(8))
        'P--PP--P'
    """
    return (step // 2) % 2 == step % 2


class _Timing:
    """One segment's batches as they arrive: when each came, and whether its workers failed;
    the steps of its first `warmup` batches are not timed when enough steps remain, nor are the
    steps a guard checked (`marks`, by default `instrumented.count`).

    A probe of the model's threads (no workers, `Setting.threads`) given `alternate` is paired: it
    calls ``alternate(threads)`` before each step, the probe's threads and ``None`` (the threads
    loading in the main process runs) taking turns (`probe_first`), and its trial compares the two
    step for step (`WorkerTrial.paired`): two segments of a few steps, one after the other, differ
    by up to 25 % on a busy 2-CPU host, steps interleaved in one segment by far less. Given
    `copy_step` instead (``copy_step(batch, threads)``, ``None``: the run's threads), the run's
    steps keep their threads and a copy of the model takes a step on the probe's threads and one on
    the run's at a batch before the run's own step (`COPY_PAIRS`, the first pair's order swapped in
    the second, after a warm-up step): the probe's step is the run's with the copy's difference
    between the two added, its Lightning work and its wait for the next batch as they were
    (`_moved`)."""

    def __init__(
        self,
        setting: Setting,
        chunk: list[list[int]],
        clock: Clock,
        warmup: int = 0,
        marks: Callable[[], int] | None = None,
        start_s: float = 0.0,
        alternate: Callable[[int | None], None] | None = None,
        copy_step: Callable[[Any, int | None], float] | None = None,
    ) -> None:
        self.setting = setting
        self.start_s = start_s
        self.warmup = warmup
        self.chunk = chunk
        self.clock = clock
        self.marks = marks or instrumented.count
        self.started = clock()
        self.times: list[float] = []
        self.marked: list[int] = []  # `marks()` at each arrival: a step between two that differ was checked
        self.waits: list[float] = []  # in `next`: the host's wait for each batch (the first's is start-up)
        self.arrived = 0
        self.failed = ""
        self.batch_bytes = 0
        self.copy_step = copy_step if setting.probe else None
        self.alternate = alternate if setting.probe and self.copy_step is None else None
        self.probed: list[bool] = []  # of a paired probe: whether each step ran at the probe's threads
        self.copied: list[float] = []  # a probe on a copy: the seconds of its steps at each arrival
        # a probe on a copy, per arrival paired: the copy's step on the probe's threads, on the run's
        self.copy_pairs: dict[int, tuple[float, float]] = {}
        self.copy_error = ""

    def run(self, stream: Iterator[Any], fallback: Callable[[int], Iterator[Any]]) -> Iterator[Any]:
        """Yield the segment's batches in order; if its workers fail, the rest from `fallback`
        (a loader at the last setting that worked), untimed."""
        while self.arrived < len(self.chunk):
            asked = self.clock()
            try:
                batch = next(stream)
            except Exception as err:
                if self.setting.num_workers == 0 or self.failed:
                    raise  # the dataset's own error, not a worker's: the user must see it
                self.failed = describe_failure(err)
                stream = fallback(self.arrived)  # the workers of the failed loader shut down with it
                continue
            if not self.failed:
                self.times.append(self.clock())
                self.waits.append(self.times[-1] - asked if self.arrived else 0.0)
                self.marked.append(self.marks())
                self.copied.append(self._step_copy(batch))
            if self.arrived == 0:
                self.batch_bytes = tensor_bytes(batch)
            if self.alternate is not None:  # the step of this batch, at the threads of its turn
                self.probed.append(probe_first(self.arrived))
                self.alternate(self.setting.threads if self.probed[-1] else None)
            self.arrived += 1
            yield batch

    def _step_copy(self, batch: Any) -> float:
        """A probe on a copy: its steps at this batch (their seconds, 0.0 for none), a pair while
        it has pairs left and one of the run's steps follows in the segment."""
        if self.copy_step is None or self.copy_error or len(self.copy_pairs) >= COPY_PAIRS:
            return 0.0
        if self.arrived >= len(self.chunk) - 1:
            return 0.0
        threads = (
            (self.setting.threads, None) if len(self.copy_pairs) % 2 == 0 else (None, self.setting.threads)
        )
        try:
            warmup = 0.0 if self.copy_pairs else self.copy_step(batch, self.setting.threads)
            first, second = (self.copy_step(batch, count) for count in threads)
        except Exception as err:  # the step needs the live fit: no probe, the run goes on
            self.copy_error = f"{COPY_FAILED} ({type(err).__name__}: {err})"
            return 0.0
        probe, run = (first, second) if threads[0] is not None else (second, first)
        self.copy_pairs[self.arrived] = (probe, run)
        return warmup + first + second

    def loader_bound(self) -> bool:
        """Whether this segment loads in the main process (no workers, not a probe of the model's
        threads) and its steps so far, at least `MIN_SEGMENT_BATCHES` past the first `warmup`,
        spent at least `LOADER_BOUND` of their time loading: workers match or beat it, so it may
        end early."""
        workers, _, threads = self.setting
        first = self.warmup
        if workers or threads is not None or self.failed or len(self.times) <= first + MIN_SEGMENT_BATCHES:
            return False
        return self._load_share(range(first, len(self.times) - 1)) >= LOADER_BOUND

    def _span(self, steps: Iterable[int]) -> float:
        """The seconds of `steps`, each from its batch's arrival to the next's (a copy's step in
        between left out)."""
        return max(sum(self.times[step + 1] - self.times[step] - self.copied[step] for step in steps), 1e-9)

    def _load_share(self, steps: Sequence[int]) -> float:
        """The share of `steps`' time spent waiting for the batch after each."""
        return min(sum(self.waits[step + 1] for step in steps) / self._span(steps), 1.0)

    def _unchecked(self, first: int, last: int) -> list[int]:
        """The intervals from arrival `first` to arrival `last` during which no guard checked a
        step, when there are `MIN_TIMED_STEPS` of them; else all of them."""
        every = range(first, last)
        unchecked = [step for step in every if self.marked[step + 1] == self.marked[step]]
        return unchecked if len(unchecked) >= MIN_TIMED_STEPS else list(every)

    def trial(self, stop_s: float = 0.0) -> WorkerTrial:
        """Samples per second from the first batch's arrival to the last's (the steps between
        included), or the failure. The last steps, at the batches the workers' queue held when the
        segment started (loaded while the segment before ran), are left out when enough steps
        remain: no loading competes with them, so they would flatter the setting; so are the steps
        at the first `warmup` batches, and the steps a guard checked (slower than the run's, they
        would count against the setting). Starting its loader (`start_s`) and stopping it
        (`stop_s`) are its `overhead_s`."""
        workers, factor, threads = self.setting
        seconds = self.clock() - self.started
        overhead = self.start_s + stop_s
        if self.copy_step is not None and not self.copy_pairs:
            self.copy_error = self.copy_error or "too few batches to time a copy of the model beside"
        if self.failed or self.copy_error or len(self.times) < 2:
            error = self.failed or self.copy_error or "too few batches to time"
            return WorkerTrial(
                workers,
                factor,
                0.0,
                seconds,
                self.batch_bytes,
                error,
                threads=threads,
                overhead_s=overhead + sum(self.copied),
                on_copy=self.copy_step is not None,
            )
        last, queued = len(self.times) - 1, queue_depth(workers, factor)
        if last - queued >= MIN_TIMED_STEPS:
            last -= queued
        first = self.warmup if last - self.warmup >= MIN_TIMED_STEPS else 0
        if self.copy_step is not None:  # a guard's check slows a pair's run step and its moved one alike
            rate, share, paired = self._copy_rates(list(range(first, last)))
            overhead += sum(self.copied)  # the copy's steps: a cost of the search, as its workers' start is
        else:
            rate, share, paired = self._rates(self._unchecked(first, last))
        startup = self.times[0] - self.started
        return WorkerTrial(
            workers,
            factor,
            rate,
            seconds,
            self.batch_bytes,
            "",
            startup,
            threads,
            share,
            overhead,
            paired,
            on_copy=self.copy_step is not None,
        )

    def _rate(self, steps: Sequence[int]) -> float:
        """Samples per second over `steps`."""
        return sum(len(self.chunk[step]) for step in steps) / self._span(steps)

    def _moved(self, step: int) -> float:
        """The run's step `step` (and the wait after it) with its model's part on the probe's
        threads: the copy's step on the run's threads stands for that part, the copy's on the
        probe's for what it becomes. A copy's step slower than the run's whole step less its wait
        (noise) stands for that time at most, scaled by the copy's ratio: subtracted whole, it
        left the wait alone, and on 2 CPUs beside six busy processes probes read 150-800x the
        run's rate (by hand, the thread-probe test's trials)."""
        probe, run = self.copy_pairs[step]
        span, wait = self._span([step]), self.waits[step + 1]
        model = min(run, max(span - wait, 0.0))
        return span - model + model * probe / max(run, 1e-9)

    def _rates(self, steps: list[int]) -> tuple[float, float, float]:
        """The rate of `steps` (each from one arrival to the next: a step and a wait), the share
        of it waiting, and a paired probe's rate over the other threads' steps beside it when
        each took `MIN_TIMED_STEPS` (the probe's steps' rate and share then; else 0)."""
        paired = 0.0
        if self.probed:
            probe = [step for step in steps if self.probed[step]]
            other = [step for step in steps if not self.probed[step]]
            if min(len(probe), len(other)) >= MIN_TIMED_STEPS:
                paired = self._rate(probe) / self._rate(other)
                steps = probe
        return self._rate(steps), self._load_share(steps), paired

    def _copy_rates(self, steps: list[int]) -> tuple[float, float, float]:
        """A probe on a copy: the rate of the run's steps beside its pairs, each step's time moved
        by the copy's step on the probe's threads less the one on the run's (never under the wait
        for the next batch), the share of that time waiting, and the rate over the run's own on
        the same steps when `MIN_TIMED_STEPS` were paired (else 0)."""
        probe = [step for step in steps if step in self.copy_pairs]
        span = max(sum(self._moved(step) for step in probe), 1e-9)
        rate = sum(len(self.chunk[step]) for step in probe) / span
        paired = rate / self._rate(probe) if len(probe) >= MIN_TIMED_STEPS else 0.0
        return rate, sum(self.waits[step + 1] for step in probe) / span, paired


def start_loader(
    loader: DataLoader[Any], batches: Iterable[list[int]], setting: Setting, seed: int, timeout_s: float
) -> Iterator[Any]:
    """An iterator over `batches` of `loader`'s dataset at `setting`, its workers started now."""
    workers, factor = setting.num_workers, setting.prefetch_factor
    options = loader_options(loader) | {
        "num_workers": workers,
        "prefetch_factor": factor if workers else None,
        "persistent_workers": False,
        "timeout": (loader.timeout or timeout_s) if workers else 0,
        "generator": torch.Generator().manual_seed(seed & ((1 << 63) - 1)),
    }
    if workers:
        watch_worker_deaths()
    return _owned(iter(DataLoader(loader.dataset, batch_sampler=_Once(batches), **options)))


def _owned(iterator: Iterator[Any]) -> Generator[Any, None, None]:
    """`iterator`'s items, from a generator that holds the only reference to it: `stop_loader` releases
    it, and a worker loader's iterator stops its workers when released (at once, when it failed)."""
    try:
        yield from iterator
    except Exception:
        end_workers(iterator)
        raise


def stop_loader(stream: Iterator[Any]) -> None:
    """Stop `stream` (from `start_loader`) at once: its workers, if any, exit now (joined)."""
    close = getattr(stream, "close", None)
    if close is not None:
        close()


class _Once:
    """A batch sampler over given index lists (iterated once)."""

    def __init__(self, batches: Iterable[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)


def apply_setting(loader: DataLoader[Any], choice: WorkerChoice) -> None:
    """Give `loader` the chosen worker setting from its next iteration on, within its
    ``workers_cap`` (an evaluation loader's batches per pass: `BoostedDataModule`)."""
    workers = min(choice.num_workers, getattr(loader, "workers_cap", choice.num_workers))
    loader.num_workers = workers
    loader.prefetch_factor = choice.prefetch_factor if workers else None
    # DataLoader refuses `persistent_workers` after construction; this loader has no iterator yet
    object.__setattr__(loader, "persistent_workers", bool(workers) and _persists(loader))
    loader._iterator = None


def _persists(loader: DataLoader[Any]) -> bool:
    return bool(getattr(loader, "persist_after_search", True))


class SegmentedDataLoader(SameOrderDataLoader):
    """A ``DataLoader`` whose first epoch searches worker settings on its own batches (`OnlineSearch`).

    Takes every ``DataLoader`` argument, plus `online` (the pending search; ``None``: a plain
    ``DataLoader``) and `persist_after_search` (keep the winner's workers between epochs). Its
    draws from the global RNG are a loader's without persistent workers (`SameOrderDataLoader`).
    """

    def __init__(
        self, *args: Any, online: OnlineSearch | None = None, persist_after_search: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.online = online
        self.persist_after_search = persist_after_search

    def __iter__(self) -> Any:
        online = self.online
        if online is None or online.choice is not None or self.batch_sampler is None:
            if (
                online is not None
                and online.choice is not None
                and self.num_workers != online.choice.num_workers
            ):
                apply_setting(self, online.choice)  # a copy Lightning made before the search settled
            return super().__iter__()
        return online.epoch(self)
