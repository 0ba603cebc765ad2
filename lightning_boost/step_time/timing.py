"""Data wait vs compute per training step, as plain numbers: the input-bound verdict and its fixes.

`HostClock` (CPU) and `CudaClock` (GPU events, read late) time each step's wait and compute;
`StepTimes` accumulates those ``(wait, step)`` seconds, hands out windows for logging and keeps a
bounded history for the plot; `input_bound_fixes` orders the fixes by likely payoff for the loader
the run uses. No Lightning here: `lightning_boost.callbacks.StepTimeMonitor` drives them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from lightning_boost import instrumented


def wait_fraction(wait_s: float, step_s: float, between_s: float = 0.0) -> float:
    """The share of ``wait + between + step`` spent waiting for data (0 when nothing was timed).

    Example:
        >>> wait_fraction(1.0, 3.0)
        0.25
        >>> wait_fraction(1.0, 2.0, between_s=1.0)  # the loop's own time between steps is not data
        0.25
    """
    total = wait_s + between_s + step_s
    return wait_s / total if total > 0 else 0.0


class Sample(NamedTuple):
    """One step's seconds: waiting for its batch (the loader's fetch and the batch's move to the
    device), the rest of the time since the step before (Lightning's loop, callbacks, logged
    values), the step itself, and the pack's own steps on a copy of the model in that time (the
    worker search's probe: `instrumented.own_steps`), left out of the other three."""

    wait_s: float
    step_s: float
    between_s: float = 0.0
    tuning_s: float = 0.0


#: A moment on the host: its clock, and the seconds this thread had spent in the pack's own steps.
Mark = tuple[float, float]


@dataclass
class StepWindow:
    """The steps between two logged points.

    Args:
        last_step: the number of the last step in the window, counted from 1.
        steps: how many steps it holds.
        wait_s: seconds waiting for batches.
        step_s: seconds in the steps (forward, backward, optimizer, hooks).
        between_s: the other seconds between steps (Lightning's loop, callbacks, logged values).
    """

    last_step: int
    steps: int
    wait_s: float
    step_s: float
    between_s: float = 0.0

    @property
    def fraction(self) -> float:
        return wait_fraction(self.wait_s, self.step_s, self.between_s)

    def merge(self, later: StepWindow) -> StepWindow:
        return StepWindow(
            later.last_step,
            self.steps + later.steps,
            self.wait_s + later.wait_s,
            self.step_s + later.step_s,
            self.between_s + later.between_s,
        )


@dataclass
class StepTimes:
    """Per-step wait, compute and between-step seconds, with the first `warmup_steps` left out of
    the totals.

    Args:
        warmup_steps: steps at the start not counted in the verdict (worker start-up, first
            CUDA kernels, cuDNN autotuning). They still appear in the logged windows.
        max_points: the plotted history is halved (neighbours merged) when it grows past this.

    Example:
        >>> times = StepTimes(warmup_steps=1)
        >>> for wait, step in [(5.0, 1.0), (1.0, 3.0), (1.0, 3.0)]:
        ...     times.add(Sample(wait, step))
        >>> times.fraction, times.take_window().fraction
        (0.25, 0.5)
    """

    warmup_steps: int = 0
    max_points: int = 256
    steps: int = 0
    counted: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    between_s: float = 0.0
    tuning_s: float = 0.0
    history: list[StepWindow] = field(default_factory=list)
    _window: StepWindow | None = None

    def add(self, sample: Sample) -> None:
        """Record one step's seconds."""
        self.steps += 1
        if self.steps > self.warmup_steps:
            self.counted += 1
            self.wait_s += sample.wait_s
            self.step_s += sample.step_s
            self.between_s += sample.between_s
            self.tuning_s += sample.tuning_s
        point = StepWindow(self.steps, 1, sample.wait_s, sample.step_s, sample.between_s)
        self._window = point if self._window is None else self._window.merge(point)

    def take_window(self) -> StepWindow | None:
        """The steps since the last call (``None`` if there were none); kept for the plot."""
        window, self._window = self._window, None
        if window is not None:
            self.history.append(window)
            if len(self.history) > self.max_points:
                pairs = zip(self.history[0::2], self.history[1::2], strict=False)
                merged = [a.merge(b) for a, b in pairs]
                self.history = merged + self.history[len(merged) * 2 :]
        return window

    @property
    def fraction(self) -> float:
        """The data-wait fraction over every counted step."""
        return wait_fraction(self.wait_s, self.step_s, self.between_s)

    @property
    def between_fraction(self) -> float:
        """The share of every counted step's time spent between steps on other than data."""
        return wait_fraction(self.between_s, self.step_s, self.wait_s)


def input_bound_fixes(
    *,
    num_workers: int,
    max_workers: int,
    pin_memory: bool,
    on_gpu: bool,
    tuned_workers: bool,
    measured_workers: tuple[int, ...] = (),
    dataset: str = "samples",
    larger_batch: str | None = None,
    no_workers: str = "",
    unsearched: str = "",
) -> list[str]:
    """What to try when a run waits for data, most likely payoff first, for the data at hand.

    Args:
        num_workers: the training loader's workers.
        max_workers: the most workers this process's CPU share allows.
        pin_memory: whether the loader pins its batches.
        on_gpu: whether the model trains on a GPU.
        tuned_workers: whether lightning-boost chose the worker count.
        measured_workers: the worker counts whose loading was measured (none: chosen another way).
        dataset: ``"tensors"`` (a `TensorDataset`: tensors in memory, nothing to decode or
            augment), ``"arrays"`` (samples held in one array in memory, as torchvision's MNIST and
            CIFAR hold theirs: transformed one by one, but nothing to decode), ``"stream"`` (an
            `IterableDataset`), ``"batched tensors"`` (a `TensorDataset` the loader already gathers
            whole batches of, `WholeBatches`), ``"collated tensors"`` (a `TensorDataset` under a
            ``collate_fn`` of the user's own, which takes samples one by one), ``"records"``
            (samples or a stream whose batches hold no image: tokens, audio, rows),
            ``"samples"`` (any other: images to decode, augment) or ``"rollouts"`` (a stream that
            runs the model it holds to make its samples, a policy's rollouts: workers would run
            untrained copies of it).
        larger_batch: what to say of a larger batch where the run's `AutoBatchSize` chose the size
            (``None``: none in the run, and the fix names it).
        no_workers: why the worker search ruled out every worker count without measuring one
            (``""``: it did not).
        unsearched: why lightning-boost's worker tuning kept `num_workers` without searching (a
            first epoch too short to time two settings), ``""`` where it searched.

    Example:
        >>> fixes = input_bound_fixes(
        ...     num_workers=0, max_workers=8, pin_memory=False, on_gpu=True, tuned_workers=False
        ... )
        >>> fixes[0].split(":")[0], len(fixes)
        ('More DataLoader workers (now 0, up to 8 here)', 4)
        >>> input_bound_fixes(num_workers=0, max_workers=2, pin_memory=False, on_gpu=False,
        ...                   tuned_workers=True, dataset="tensors")[0].split(":")[0]
        'Index whole batches'
        >>> in_memory = input_bound_fixes(num_workers=2, max_workers=2, pin_memory=False, on_gpu=False,
        ...                               tuned_workers=True, dataset="arrays")
        >>> any("Decode" in fix for fix in in_memory)
        False
    """
    fixes = []
    if dataset == "rollouts":
        fixes.append(
            "Batch the rollouts: the stream runs the model one sample at a time; step several"
            " environments at once (a vectorized environment, `gymnasium.vector`) so that each forward"
            " makes a batch of samples. Keep them in the main process: DataLoader workers would each run"
            " a copy of the model made when they start, which training never updates."
        )
    if dataset == "tensors":
        fixes.append(
            "Index whole batches: a `TensorDataset` is gathered and collated sample by sample;"
            " `BoostedDataModule` and `AutoNumWorkers` load it one gather a batch (the same batches),"
            " or by hand `DataLoader(dataset, batch_size=None, sampler=BatchSampler(RandomSampler("
            "dataset), batch_size, drop_last=False))` slices each batch with one `__getitem__`."
        )
    elif dataset == "collated tensors":
        fixes.append(
            "Index whole batches: a `TensorDataset` is gathered sample by sample, and your `collate_fn`"
            " takes the samples one by one (`BoostedDataModule` and `AutoNumWorkers` gather whole"
            " batches under PyTorch's default collate only): build what it builds from the default"
            " batch in the LightningModule's `on_after_batch_transfer` hook (or in the step), and"
            " drop the `collate_fn`."
        )
    if dataset in ("tensors", "batched tensors", "collated tensors"):
        fixes.append(
            larger_batch
            or "A larger batch (`AutoBatchSize`) spreads the per-step loading cost over more samples."
        )
    if num_workers < max_workers and unsearched and dataset != "rollouts":
        fixes.append(
            f"More DataLoader workers (now {num_workers}, up to {max_workers} here): the worker tuning"
            f" kept {num_workers}, not searched: {unsearched}. Set `num_workers=` by hand (1 to"
            f" {max_workers}; on a CPU run the model shares those CPUs with them)."
        )
    elif num_workers < max_workers and not tuned_workers and dataset != "rollouts":
        fixes.append(
            f"More DataLoader workers (now {num_workers}, up to {max_workers} here): "
            "`Trainer(callbacks=[AutoNumWorkers()])` or subclass `BoostedDataModule`."
        )
    if dataset == "arrays":
        fixes.append(
            "Transform whole batches instead of single samples: the samples sit in one array in memory"
            " (`dataset.data`) and go through `transform` one by one; index the array per batch and"
            " transform the batch (`BoostedDataModule(device_transforms=...)` applies batched"
            " transforms.v2 once per batch)."
        )
    elif dataset == "records":
        fixes.append(
            "Precompute the per-sample work: what `__getitem__` (and the `collate_fn`) compute for each"
            " sample every epoch (tokenizing, parsing, features) done once ahead of training and stored"
            " (tensors, memory-mapped arrays), so loading a sample is an index into it."
        )
    elif dataset not in ("tensors", "batched tensors", "collated tensors", "rollouts"):
        fixes += _sample_work_fixes(on_gpu)
    if on_gpu and not pin_memory:
        fixes.append("Pin host memory: `DataLoader(pin_memory=True)` (BoostedDataModule does it on GPU).")
    if num_workers >= max_workers:
        fixes.append(
            f"The workers use this process's whole CPU share ({num_workers} of {max_workers}): "
            "give the job more CPUs or run fewer processes per node."
        )
    elif len(set(measured_workers)) > 1:
        counts = ", ".join(str(n) for n in sorted(set(measured_workers)))
        joiner = "and" if dataset == "batched tensors" else "so"
        fixes.append(
            f"num_workers={num_workers} was the fastest of the counts measured ({counts}); more workers did"
            f" not help, {joiner} {_what_is_left(dataset)}."
        )
    elif no_workers and num_workers == 0:
        fixes.append(
            f"Not workers, on this machine: {no_workers}. With more CPUs per process they could load"
            f" beside the model; here {_what_is_left(dataset)}."
        )
    return fixes


def _what_is_left(dataset: str) -> str:
    """What loading cost is left to cut once workers do not help: a `TensorDataset` gathered whole
    a batch (`WholeBatches`) has no work per sample to make cheaper."""
    if dataset == "batched tensors":
        return (
            "the batches are already loaded one gather a batch: what is left is the DataLoader's own"
            " work per batch, not work per sample"
        )
    return "the per-sample work itself has to get cheaper"


def host_bound_fixes(batch_size: int | None) -> list[str]:
    """What to try when a GPU waits on the host within each step (the step takes far longer than
    the model's forward, backward and optimizer step alone), most likely payoff first.

    Example:
        >>> [fix.split(":")[0] for fix in host_bound_fixes(64)]
        ['Fewer, larger steps', 'Fewer values read per step', 'Fewer kernel launches per step']
    """
    larger = "a larger batch" if batch_size is None else f"a batch larger than {batch_size}"
    return [
        f"Fewer, larger steps: the host's work is paid once per step, so {larger}"
        " spreads it over more samples. `AutoBatchSize` timed the model's step alone, without it, so a"
        " larger size gains more than its trials showed (`max_batch_size=` lets it search further).",
        "Fewer values read per step: Lightning reads each step-level `prog_bar=True` value with `.item()`"
        " after every batch (the syncs section counts them); log them per epoch"
        " (`on_step=False, on_epoch=True`) or without `prog_bar`.",
        "Fewer kernel launches per step: `torch.compile(model)` fuses the model's small kernels, and"
        ' `mode="reduce-overhead"` replays the step as one CUDA graph.',
    ]


def _sample_work_fixes(on_gpu: bool) -> list[str]:
    """Fixes for per-sample work: augmentation and decoding."""
    caveat = (
        " torchvision's v2 transforms draw one set of random parameters per call, so on a batch every"
        " sample gets the same crop and flip: move the deterministic steps (dtype, resize to a fixed"
        " size, normalize) and keep per-sample random ones in the dataset, or use a batched library"
        " that draws per sample (Kornia)."
    )
    if on_gpu:
        augment = (
            "Move augmentation to the GPU: `BoostedDataModule(device_transforms=...)` runs batched "
            "torchvision transforms.v2 after the transfer, off the workers." + caveat
        )
    else:
        augment = (
            "Augment whole batches instead of single samples: "
            "`BoostedDataModule(device_transforms=...)` applies batched transforms.v2 once per batch."
            + caveat
        )
    decode = (
        "Decode faster: store images pre-resized to the training size, decode JPEGs with "
        "`torchvision.io.decode_jpeg(device='cuda')`, or read a sequential format (WebDataset, LitData)."
    )
    return [augment, decode]


@dataclass
class FitTime:
    """Where a fit's wall time went, on the host clock, from its start (`start`) to the end of
    training: before the first training step (tuning, the sanity check, the workers' start), in
    the steps, in the validation runs, after each validation run until training goes on (where
    Lightning's `ModelCheckpoint` saves), and the rest (between steps: the loader, the loop; epoch
    ends). Feed it the events in order; `shares` gives the seconds, `before_parts` the time before
    the first step around Lightning's sanity check.

    Example:
        >>> fit = FitTime(start=0.0)
        >>> fit.batch_start(2.0); fit.batch_end(3.0); fit.validation_start(3.5); fit.validation_end(4.5)
        >>> fit.batch_start(5.5); fit.batch_end(6.5)
        >>> part = fit.shares(7.0)
        >>> part["before the first step"], part["steps"], part["validation"], part["after validation"]
        (2.0, 2.0, 1.0, 1.0)
        >>> part["other"], part["total"]  # 3 to 3.5 and 6.5 to 7
        (1.0, 7.0)
    """

    start: float
    first_step: float | None = None
    steps_s: float = 0.0
    validation_s: float = 0.0
    validations: int = 0
    after_validation_s: float = 0.0
    sanity: tuple[float, float] | None = None
    _step_start: float = 0.0
    _validation_end: float | None = None
    _validation_start: float = 0.0

    def sanity_start(self, now: float) -> None:
        self.sanity = (now, now)

    def sanity_end(self, now: float) -> None:
        if self.sanity is not None:
            self.sanity = (self.sanity[0], now)

    def batch_start(self, now: float) -> None:
        if self.first_step is None:
            self.first_step = now
        self._close_after_validation(now)
        self._step_start = now

    def batch_end(self, now: float) -> None:
        self.steps_s += now - self._step_start

    def validation_start(self, now: float) -> None:
        self._close_after_validation(now)
        self._validation_start = now

    def validation_end(self, now: float) -> None:
        self.validation_s += now - self._validation_start
        self.validations += 1
        self._validation_end = now

    def shares(self, end: float) -> dict[str, float]:
        """Seconds per part at `end` (the end of training); ``total`` is their sum."""
        last = 0.0 if self._validation_end is None else end - self._validation_end
        after = self.after_validation_s + last
        before = (self.first_step if self.first_step is not None else end) - self.start
        parts = {
            "total": end - self.start,
            "before the first step": before,
            "steps": self.steps_s,
            "validation": self.validation_s,
            "after validation": after,
        }
        parts["other"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
        return {key: round(value, 4) for key, value in parts.items()}

    def before_parts(self) -> dict[str, float]:
        """The seconds before the first step around the sanity check: to its start (set-up and
        tuning), in it, and from its end to the first step (the training loader's build, its
        workers' start, unless ``configure_optimizers`` asked for the loader early, and its first
        batch); empty without a sanity check or a first step.

        Example:
            >>> FitTime(0.0, first_step=2.7, sanity=(1.8, 2.1)).before_parts()
            {'to the sanity check': 1.8, 'sanity check': 0.3, 'training loader start': 0.6}
        """
        if self.sanity is None or self.first_step is None:
            return {}
        begun, ended = self.sanity
        parts = {
            "to the sanity check": begun - self.start,
            "sanity check": ended - begun,
            "training loader start": self.first_step - ended,
        }
        return {key: round(value, 4) for key, value in parts.items()}

    def text(self, end: float, checkpoints: bool) -> str:
        """One sentence of `shares`: after a validation run come `ModelCheckpoint`'s saves (when
        `checkpoints`) and, after an epoch's last, the epoch's end and the loader's restart.

        Example:
            >>> fit = FitTime(0.0, first_step=2.6, steps_s=1.9, validation_s=1.1, validations=8)
            >>> fit.after_validation_s = 1.0
            >>> print(fit.text(7.0, checkpoints=True))  # doctest: +NORMALIZE_WHITESPACE
            Of the fit's 7.0 s to the end of training: 2.6 s before the first step, 1.9 s in steps,
            1.1 s in 8 validation runs, 1.0 s after them (checkpoint saves, epoch ends), 0.4 s between
            steps.
        """
        part, before = self.shares(end), self.before_parts()
        saves = " (checkpoint saves, epoch ends)" if checkpoints else " (epoch ends)"
        split = (
            f" ({before['to the sanity check']:.1f} s to the sanity check, set-up and tuning;"
            f" {before['sanity check']:.1f} s in it; {before['training loader start']:.1f} s from its end,"
            " the training loader's start and first batch)"
            if before
            else ""
        )
        return (
            f"Of the fit's {part['total']:.1f} s to the end of training:"
            f" {part['before the first step']:.1f} s before the first step{split},"
            f" {part['steps']:.1f} s in steps, {part['validation']:.1f} s in {self.validations} validation"
            f" runs, {part['after validation']:.1f} s after them{saves}, {part['other']:.1f} s between steps."
        )

    def _close_after_validation(self, now: float) -> None:
        if self._validation_end is not None:
            self.after_validation_s += now - self._validation_end
            self._validation_end = None


def _now() -> float:
    return time.perf_counter()


def split_gap(last_end: Mark, fetch: Mark | None, start: Mark, end: Mark) -> Sample:
    """One step's `Sample` from host marks (`Mark`): the time from the step before's end to this
    step's start is split where the loop asked the loader for the batch (`fetch`): the wait for
    data from there, the loop's own work before it. Without a fetch in that span (a loop that did
    not report it), all of it counts as the wait. The pack's own steps in each part are taken out.

    Example:
        >>> split_gap((1.0, 0.0), (1.5, 0.0), (1.75, 0.0), (3.75, 0.0))
        Sample(wait_s=0.25, step_s=2.0, between_s=0.5, tuning_s=0.0)
        >>> split_gap((1.0, 0.0), None, (1.75, 0.0), (3.75, 0.0)).wait_s
        0.75
        >>> split_gap((1.0, 0.0), (1.5, 0.0), (2.0, 0.25), (4.0, 0.25))  # a probe's step in the wait
        Sample(wait_s=0.25, step_s=2.0, between_s=0.5, tuning_s=0.25)
    """
    step = end[0] - start[0] - (end[1] - start[1])
    tuning = end[1] - last_end[1]
    if fetch is None or not last_end[0] <= fetch[0] <= start[0]:
        return Sample(start[0] - last_end[0] - (start[1] - last_end[1]), step, 0.0, tuning)
    wait = start[0] - fetch[0] - (start[1] - fetch[1])
    return Sample(wait, step, fetch[0] - last_end[0] - (fetch[1] - last_end[1]), tuning)


class HostClock:
    """Wait, between-step and step seconds from the host's clock: exact on CPU, where the host
    does the work. `fetch_start` marks where the loop asks the loader for the next batch."""

    def __init__(
        self, now: Callable[[], float] | None = None, own: Callable[[], float] | None = None
    ) -> None:
        self.now = now or _now
        self.own = own or instrumented.own_seconds
        self._last_end: Mark | None = None
        self._fetch: Mark | None = None
        self._start: Mark = (0.0, 0.0)

    def mark(self) -> Mark:
        return self.now(), self.own()

    def idle(self) -> None:
        """Start timing the wait for the next batch from now (the epoch starts)."""
        self._last_end = self.mark()
        self._fetch = None

    def skip(self) -> None:
        """The next batch's wait is not measured (validation or checkpointing ran before it)."""
        self._last_end = None
        self._fetch = None

    def fetch_start(self) -> None:
        """The loop asks the loader for a batch now (the first time since the step before counts:
        a loop that fetches ahead fetches twice at an epoch's start)."""
        if self._fetch is None:
            self._fetch = self.mark()

    def batch_start(self) -> None:
        self._start = self.mark()

    def batch_end(self) -> list[Sample]:
        end = self.mark()
        last_end, self._last_end = self._last_end, end
        fetch, self._fetch = self._fetch, None
        return [] if last_end is None else [split_gap(last_end, fetch, self._start, end)]

    def flush(self) -> list[Sample]:
        return []


class CudaClock:
    """GPU-side timing from CUDA events, read a few steps late so the host never waits.

    The GPU's idle gap between one step's last kernel and the next step's first is the time lost
    between steps: a host that is late leaves a gap, a host that is ahead leaves none. The gap is
    the end of the host's time between the steps, so its last part, up to the host's own wait for
    data (from `fetch_start` to the step's start, on the host clock), is the wait for data; the
    rest is the host's other work (Lightning's loop, callbacks, logged values). `batch_end`
    returns the samples whose events have completed (``Event.query()`` does not block).
    """

    def __init__(
        self,
        event: Callable[[], Any] | None = None,
        max_pending: int = 64,
        now: Callable[[], float] | None = None,
    ) -> None:
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.host = HostClock(now)
        self.pending: deque[tuple[Any, Any, Any, Sample]] = deque(maxlen=max_pending)
        self._last_end: Any = None
        self._start: Any = None

    def _record(self) -> Any:
        event = self.event()
        event.record()
        return event

    def idle(self) -> None:
        self._last_end = self._record()
        self.host.idle()

    def skip(self) -> None:
        self._last_end = None
        self.host.skip()

    def fetch_start(self) -> None:
        self.host.fetch_start()

    def batch_start(self) -> None:
        self._start = self._record()
        self.host.batch_start()

    def batch_end(self) -> list[Sample]:
        end = self._record()
        host = self.host.batch_end()  # none where this clock has no end before it either
        if self._last_end is not None and host:
            self.pending.append((self._last_end, self._start, end, host[0]))
        self._last_end = end
        samples = []
        while self.pending and self.pending[0][2].query():
            samples.append(_gpu_sample(*self.pending.popleft()))
        return samples

    def flush(self) -> list[Sample]:
        """Everything still pending (one wait for the GPU, at the end of training)."""
        if self.pending:
            self.pending[-1][2].synchronize()
        samples = [_gpu_sample(*pending) for pending in self.pending]
        self.pending.clear()
        return samples


def _gpu_sample(before: Any, start: Any, end: Any, host: Sample) -> Sample:
    """A step's `Sample` from its events: of the GPU's idle gap before it, the last seconds, up to
    the host's wait for the batch (all of its time since the step before where the loop did not
    report its fetch), are the wait for data; before them, up to the pack's own steps on the host,
    tuning."""
    idle = before.elapsed_time(start) / 1000
    wait = min(idle, host.wait_s)
    tuning = min(idle - wait, host.tuning_s)
    return Sample(wait, start.elapsed_time(end) / 1000, idle - wait - tuning, tuning)
