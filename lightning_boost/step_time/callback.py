"""`StepTimeMonitor`: is this run waiting for data, or computing?"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import lightning as L
import numpy as np
import torch
from lightning_utilities.core.apply_func import is_dataclass_instance
from torch import Tensor
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    Subset,
    TensorDataset,
    default_collate,
    default_convert,
)
from typing_extensions import override

from lightning_boost._lightning import (
    callbacks_of,
    datamodule_of,
    hardware_for,
    on_training_fetch,
    training_log_step,
)
from lightning_boost._validation import Count, Range, validated
from lightning_boost.batch_size.callback import AutoBatchSize
from lightning_boost.batch_size.decision import BatchSizeDecision
from lightning_boost.batch_size.goodput import efficiency
from lightning_boost.callbacks.base import BoostCallback
from lightning_boost.data.datamodule import BoostedDataMixin
from lightning_boost.micro_batch.split import listed_length
from lightning_boost.report import Finding, Severity, plot_data
from lightning_boost.step_time.timing import (
    CudaClock,
    FitTime,
    HostClock,
    StepTimes,
    host_bound_fixes,
    input_bound_fixes,
)
from lightning_boost.workers.callback import AutoNumWorkers
from lightning_boost.workers.loaders import holds_module, loader_batch_size
from lightning_boost.workers.online import NO_WORKERS
from lightning_boost.workers.search import WorkerChoice
from lightning_boost.workers.tuner import NOT_SEARCHED
from lightning_boost.workers.whole_batches import WholeBatches, collate_whole

#: A verdict rests on at least this many timed steps and seconds (fewer: an INFO that says so).
MIN_STEPS = 20
MIN_SECONDS = 1.0

#: A GPU run's steps that take this many times the model's own step (`AutoBatchSize`'s trial at
#: the trained size, its steps queued back to back) are host-bound: the GPU waits on the host.
HOST_BOUND = 1.5
#: A DataLoader's collate functions that are PyTorch's (or the pack's whole-batch one), not the user's.
DEFAULT_COLLATES = (None, default_collate, default_convert, collate_whole)


class StepTimeMonitor(BoostCallback):
    """Measures, per training step, the time spent waiting for the batch vs computing it.

    The wait is measured from where Lightning's loop asks the loader for the batch to the start of
    the step (loading, collating and the host-to-device copy); the step from its start to its end
    (forward, backward, optimizer); the rest of the time since the step before is the loop's own
    work between steps (its hooks, callbacks, logged values), not data. On CPU the host clock
    times them. On CUDA, events time the steps and the GPU's idle gap between them, read a few
    steps late so monitoring adds no host-device sync; of the gap, the host's wait for the batch
    (its last part) is the wait for data, the rest the host's other work. The step after a
    validation run is left out (validation and checkpoint saving are not data wait), and so are
    the first `warmup_steps` of the verdict.

    At the end of training it adds a finding: input-bound when the data-wait fraction is above
    `threshold`, with the fixes in order of likely payoff for this run's loader; on a GPU, host-bound
    when the steps take `HOST_BOUND` times the model's own step or more (`AutoBatchSize`'s trial at
    the trained size: forward, backward and optimizer step without Lightning's loop around them),
    or when the GPU idles between steps on other host work for more than `threshold` of the time,
    with what to try; otherwise the fraction for the record. The fraction over steps is plotted in
    the report. Each finding also splits the fit's wall time (`FitTime`): before the first step, in
    steps, in validation runs, after them (where `ModelCheckpoint` saves) and between steps.

    Logged to every logger on the batches Lightning logs (``log_every_n_steps``), at its step, over
    the steps timed since the last log, without a device sync (on CUDA the window lags a few steps):

    ============================ ========================================================
    key                          meaning
    ============================ ========================================================
    ``boost/data_wait_fraction`` share of the window's time spent waiting for batches
    ``boost/data_wait_ms``       mean wait per step in the window, milliseconds
    ``boost/step_ms``            mean step time in the window, milliseconds
    ``boost/between_steps_ms``   mean other time between steps in the window, milliseconds
    ============================ ========================================================

    Args:
        threshold: the data-wait fraction above which the run counts as input-bound (0 to 1).
        warmup_steps: first steps left out of the verdict (worker start-up, CUDA warm-up).

    Raises:
        TypeError, ValueError: for a threshold that is not a number in (0, 1) or `warmup_steps`
            that is not an int >= 0.

    Example::

        trainer = L.Trainer(callbacks=[StepTimeMonitor(threshold=0.1)])
    """

    @validated
    def __init__(self, threshold: Annotated[float, Range(gt=0, lt=1)] = 0.1, warmup_steps: Count = 3) -> None:
        self.threshold = float(threshold)
        self.warmup_steps = warmup_steps
        self.times = StepTimes(warmup_steps)
        self.findings: list[Finding] = []
        self._set_state_key(threshold=self.threshold, warmup_steps=warmup_steps)
        self._clock: HostClock | CudaClock | None = None
        self._on_gpu = False
        self._fit: FitTime | None = None
        self._stop_fetches: Callable[[], None] = _nothing
        self._images: bool | None = None  # whether the training batches hold images (`holds_images`)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._fit = FitTime(start=time.perf_counter()) if stage == "fit" else None

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, error: BaseException) -> None:
        self._stop_fetches()  # a fit that raised before its end
        self._stop_fetches = _nothing

    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is not None:
            self._fit.sanity_start(time.perf_counter())

    @override
    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is not None:
            self._fit.sanity_end(time.perf_counter())

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.times = StepTimes(self.warmup_steps)
        self._images = None
        clock = self._clock = CudaClock() if pl_module.device.type == "cuda" else HostClock()
        self._on_gpu = _times_a_gpu(clock)
        self._stop_fetches()
        self._stop_fetches = on_training_fetch(trainer, clock.fetch_start)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._clock is not None:
            self._clock.idle()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is not None:
            self._clock.batch_start()
        if self._fit is not None:
            self._fit.batch_start(time.perf_counter())
        if self._images is None:  # what the loader makes, for the fixes of an input-bound run
            self._images = holds_images(batch)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._fit is not None:
            self._fit.batch_end(time.perf_counter())
        if self._clock is None:
            return
        for sample in self._clock.batch_end():
            self.times.add(sample)
        step = training_log_step(trainer)
        if step is not None:
            self._log(trainer, step)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._clock is not None and not trainer.sanity_checking:
            self._clock.skip()
        if self._fit is not None and not trainer.sanity_checking:
            self._fit.validation_start(time.perf_counter())

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is not None and not trainer.sanity_checking:
            self._fit.validation_end(time.perf_counter())

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_fetches()
        self._stop_fetches = _nothing
        if self._clock is None:
            return
        for sample in self._clock.flush():
            self.times.add(sample)
        self._clock = None
        self._log(trainer, trainer.global_step)
        self.findings = [self._finding(trainer, pl_module, time.perf_counter())]

    def _log(self, trainer: L.Trainer, step: int) -> None:
        window = self.times.take_window()
        if window is None or not trainer.loggers:
            return
        metrics = {
            "boost/data_wait_fraction": window.fraction,
            "boost/data_wait_ms": 1000 * window.wait_s / window.steps,
            "boost/step_ms": 1000 * window.step_s / window.steps,
            "boost/between_steps_ms": 1000 * window.between_s / window.steps,
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _finding(self, trainer: L.Trainer, pl_module: L.LightningModule, end: float) -> Finding:
        times = self.times
        # the verdict is decided on the figures the report shows (4 places), so it agrees with them
        fraction, between = round(times.fraction, 4), round(times.between_fraction, 4)
        history = times.history
        data: dict[str, Any] = {
            "data_wait_fraction": fraction,
            "wait_s": round(times.wait_s, 4),
            "between_s": round(times.between_s, 4),
            "between_fraction": between,
            "tuning_s": round(times.tuning_s, 4),
            "step_s": round(times.step_s, 4),
            "steps": times.counted,
            "threshold": self.threshold,
        }
        if len(history) > 1:
            data["plot"] = plot_data(
                "data_wait",
                "Data-wait fraction over training",
                "training step",
                [w.last_step for w in history],
                {"data-wait fraction": [round(w.fraction, 4) for w in history]},
                reference=("input-bound above", self.threshold),
            )
        share = f"{times.fraction:.0%} of step time waiting for data"  # one rounding, not two
        detail = (
            f"{times.wait_s:.1f} s waiting for data, {times.step_s:.1f} s computing and"
            f" {times.between_s:.1f} s ({times.between_fraction:.0%}) between steps on other work"
            f" (Lightning's loop, callbacks, logged values) over {times.counted} steps (the first"
            f" {self.warmup_steps} left out)."
        )
        if times.tuning_s >= 0.05:
            detail += (
                f" Left out of those: {times.tuning_s:.1f} s of lightning-boost's own steps on a copy of"
                " the model between them (the worker search's probe of the model's threads)."
            )
        if self._fit is not None:  # the fit's wall time, for where the rest went
            detail += " " + self._fit.text(end, checkpoints=trainer.checkpoint_callback is not None)
            data["fit_time"] = self._fit.shares(end) | {"validations": self._fit.validations}
            data["before_first_step"] = self._fit.before_parts()
        if times.counted == 0:
            return Finding(
                type(self).__name__,
                "step time",
                Severity.INFO,
                "No training step was timed",
                f"The run took {trainer.global_step} optimizer step(s); the first `warmup_steps="
                f"{self.warmup_steps}` training steps are left out of the verdict.",
                "Lower `warmup_steps` (default 3) to time a run this short.",
                data=data,
            )
        if times.counted < MIN_STEPS or times.wait_s + times.step_s + times.between_s < MIN_SECONDS:
            return Finding(
                type(self).__name__,
                "step time",
                Severity.INFO,
                f"Too little timed to judge: {share}",
                f"{detail} A verdict needs at least {MIN_STEPS} steps and {MIN_SECONDS:g} s of them.",
                data=data,
            )
        model = _model_step(trainer) if self._on_gpu else None
        if fraction <= self.threshold and model and times.step_s >= HOST_BOUND * model[1] * times.counted:
            return _host_bound(times, model, detail, data)
        if fraction <= self.threshold and self._on_gpu and between > self.threshold:
            loader = trainer.train_dataloader
            size = loader_batch_size(loader) if isinstance(loader, DataLoader) else None
            return _idle_between_steps(times, size, detail, data)
        if fraction <= self.threshold:
            return Finding(
                type(self).__name__, "step time", Severity.INFO, f"Compute-bound: {share}", detail, data=data
            )
        fixes = self._fixes(trainer, pl_module)
        return Finding(
            type(self).__name__,
            "step time",
            Severity.WARN,
            f"Input-bound: {share}",
            detail,
            _numbered(fixes),
            data=data | {"fixes": fixes},
            cost=f"{times.wait_s:.1f} s over {times.counted} steps",  # the title gives the share
        )

    def _fixes(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        loader = trainer.train_dataloader
        datamodule = datamodule_of(trainer)
        tuners = [c.worker_tuner for c in callbacks_of(trainer) if isinstance(c, AutoNumWorkers)]
        if isinstance(datamodule, BoostedDataMixin) and datamodule.num_workers is None:
            tuners.append(datamodule.worker_tuner)
        choices = [choice for tuner in tuners for choice in tuner.choices.values()]
        measured = tuple(trial.num_workers for choice in choices for trial in choice.trials)
        ruled_out = [
            reason.removeprefix(NO_WORKERS)
            for choice in choices
            for reason in choice.skipped
            if reason.startswith(NO_WORKERS)
        ]
        dataset = dataset_kind(getattr(loader, "dataset", None), pl_module)
        if dataset == "tensors" and getattr(loader, "collate_fn", None) not in DEFAULT_COLLATES:
            dataset = "collated tensors"  # the user's collate_fn takes the samples one by one
        if dataset in ("samples", "stream") and self._images is False:
            dataset = "records"  # per-sample work, but no image to decode or augment
        return input_bound_fixes(
            num_workers=loader.num_workers if isinstance(loader, DataLoader) else 0,
            max_workers=hardware_for(trainer).cpus_per_process,  # the budget worker tuning searches
            pin_memory=bool(getattr(loader, "pin_memory", False)),
            on_gpu=pl_module.device.type == "cuda",
            tuned_workers=bool(tuners),
            measured_workers=measured,
            dataset=dataset,
            larger_batch=_larger_batch(trainer, self.times.fraction),
            no_workers=ruled_out[0] if ruled_out else "",
            unsearched=_unsearched(choices),
        )


def _unsearched(choices: list[WorkerChoice]) -> str:
    """Why the training loader's worker count was kept unsearched (its first epoch or run too short
    to time two settings), ``""`` where it was searched.

    Example:
        >>> short = "0 workers, not searched: the first epoch has 75 batches: 10% of it cannot time ..."
        >>> _unsearched([WorkerChoice(0, None, short, source="short run")])
        'the first epoch has 75 batches: 10% of it cannot time ...'
    """
    for choice in choices:
        why = choice.reason.partition(NOT_SEARCHED)[2]
        if choice.source == "short run" and not choice.trials and ("first epoch" in why or "run has" in why):
            return why
    return ""


def _larger_batch(trainer: L.Trainer, wait_fraction: float) -> str | None:
    """What to say of a larger batch where the run has an `AutoBatchSize` (``None``: none): set it
    yourself where it kept yours; not, where its noise scale says a batch twice the size would not
    reach the model sooner even with its loading halved per sample; else that its trials timed the
    model's step without the loading."""
    tuner = next((c for c in callbacks_of(trainer) if isinstance(c, AutoBatchSize)), None)
    if tuner is None:
        return None
    decision, spread = tuner.decision, "spreads the per-step loading cost over more samples"
    if decision is None or decision.kept:
        title = next((f.title for f in tuner.findings if f.area == "batch size"), "")
        why = decision.kept if decision else title.partition(": ")[2]  # "Batch size kept as written: ..."
        return f"A larger `batch_size` {spread}; `AutoBatchSize` kept yours ({why})."
    size = decision.batch_size
    teaches = doubled_batch_efficiency(decision)
    if teaches / (1 - wait_fraction / 2) < 1:  # its best goodput gain: the loading halved per sample
        return (
            f"Not a larger batch: {size} is `AutoBatchSize`'s choice, and at twice the size each sample"
            f" would teach the model {teaches:.0%} as much (noise scale"
            f" {decision.noise_scale:.0f}), more than spreading the loading over twice the samples saves"
            f" (at most {wait_fraction / 2:.0%} of the time)."
        )
    grow = (
        ""
        if tuner.grow
        else " `AutoBatchSize(grow=True)` grows it between epochs where the run's own steps say it pays."
    )
    return (
        f"A larger batch {spread}: `AutoBatchSize` chose {size} timing the model's step alone, without the"
        f" loading.{grow}"
    )


def doubled_batch_efficiency(decision: BatchSizeDecision) -> float:
    """The statistical efficiency of a batch twice `decision`'s against it, from the noise scale
    its trials measured (1 with none measured). Where a fixed loading cost per step takes a share
    `w` of the time, the doubled batch gains at most this over ``1 - w / 2`` in goodput.

    Example:
        >>> from lightning_boost.batch_size.decision import BatchSizeDecision
        >>> decision = BatchSizeDecision(32, effective_batch_size=32, noise_scale=62.0)
        >>> round(doubled_batch_efficiency(decision), 3)  # (62 + 32) / (62 + 64)
        0.746
    """
    effective = decision.effective_batch_size or decision.batch_size
    noise = decision.noise_scale
    return 1.0 if noise is None else efficiency(noise, 2 * effective, effective)


def _numbered(fixes: list[str]) -> str:
    return "\n".join(f"{n}. {fix}" for n, fix in enumerate(fixes, 1))


def _nothing() -> None:
    pass


def _times_a_gpu(clock: HostClock | CudaClock) -> bool:
    return isinstance(clock, CudaClock)


def _model_step(trainer: L.Trainer) -> tuple[int, float] | None:
    """The trained batch size and the seconds of the model's own step there, from `AutoBatchSize`'s
    trial at that size; ``None`` without one, when the batch grew during the run, or with several
    processes (their steps also all-reduce, which no trial times)."""
    loader = trainer.train_dataloader
    if trainer.world_size > 1 or not isinstance(loader, DataLoader):
        return None
    size = loader_batch_size(loader)
    if size is None:  # a batch sampler without a batch size: no size a trial ran at
        return None
    for callback in callbacks_of(trainer):
        decision = callback.decision if isinstance(callback, AutoBatchSize) else None
        rate = None if decision is None or decision.growth else decision.rate_at(size)
        if rate is not None:
            return size, size / rate
    return None


def _host_bound(times: StepTimes, model: tuple[int, float], detail: str, data: dict[str, Any]) -> Finding:
    size, alone = model
    mean = times.step_s / times.counted
    fixes = host_bound_fixes(size)
    return Finding(
        StepTimeMonitor.__name__,
        "step time",
        Severity.WARN,
        f"Host-bound: steps take {1000 * mean:.1f} ms, {mean / alone:.1f}x the model's own",
        f"{detail} AutoBatchSize timed the model's training step alone at batch {size} (forward, backward"
        f" and optimizer step, queued back to back): {1000 * alone:.1f} ms. The other"
        f" {1000 * (mean - alone):.1f} ms of each step is host work the GPU waits on: Lightning's loop"
        " and hooks, callbacks, logged values, and taking each batch from the loader.",
        _numbered(fixes),
        data=data | {"model_step_s": round(alone, 6), "host_bound": round(mean / alone, 3), "fixes": fixes},
        cost=f"{times.step_s - alone * times.counted:.1f} s over {times.counted} steps",
    )


def _idle_between_steps(times: StepTimes, size: int | None, detail: str, data: dict[str, Any]) -> Finding:
    fixes = host_bound_fixes(size)
    return Finding(
        StepTimeMonitor.__name__,
        "step time",
        Severity.WARN,
        f"Host-bound between steps: the GPU idles {times.between_fraction:.0%} of the time on host work",
        f"{detail} Between steps the GPU waited {times.between_s:.1f} s, beyond its wait for data, on"
        " the host: Lightning's loop and hooks, callbacks, logged values read with `.item()`.",
        _numbered(fixes),
        data=data | {"fixes": fixes},
        cost=f"{times.between_s:.1f} s over {times.counted} steps",
    )


def dataset_kind(dataset: Any, model: torch.nn.Module | None = None) -> str:
    """What `input_bound_fixes` calls `dataset` (through `Subset`s, as `random_split` makes them).

    Example:
        >>> import torch
        >>> from torch.utils.data import Subset
        >>> tensors = TensorDataset(torch.zeros(4, 2))
        >>> dataset_kind(Subset(tensors, [0, 1])), dataset_kind([1, 2])
        ('tensors', 'samples')
        >>> dataset_kind(WholeBatches(tensors, tensors.tensors, None))
        'batched tensors'
    """
    if isinstance(dataset, WholeBatches):
        return "batched tensors"
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if isinstance(dataset, TensorDataset):
        return "tensors"
    if isinstance(dataset, IterableDataset):
        return "rollouts" if model is not None and holds_module(dataset, model) else "stream"
    if isinstance(getattr(dataset, "data", None), (Tensor, np.ndarray)):  # torchvision's MNIST, CIFAR
        return "arrays"
    return "samples"


def holds_images(batch: Any) -> bool:
    """Whether `batch` holds images: a float or ``uint8`` tensor of 4 dimensions or more (a batch
    of images, channels first or last; video), or a list of samples (`listed_length`) of one of
    3 dimensions each (torchvision's detection batches). Token ids, audio and feature rows have
    fewer.

    Example:
        >>> import torch
        >>> holds_images((torch.zeros(8, 3, 32, 32), torch.zeros(8))), holds_images([torch.zeros(8, 32)])
        (True, False)
    """
    return _holds_images(batch, listed_length(batch))


def _holds_images(batch: Any, listed: int | None) -> bool:
    if isinstance(batch, Tensor):
        return batch.dim() >= 4 and _pixels(batch)
    if isinstance(batch, (list, tuple)) and len(batch) == listed and _images_per_sample(batch):
        return True
    if isinstance(batch, Mapping):
        return any(_holds_images(value, listed) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return any(_holds_images(value, listed) for value in batch)
    if is_dataclass_instance(batch):
        return any(_holds_images(getattr(batch, f.name), listed) for f in dataclasses.fields(batch))
    return False


def _images_per_sample(items: list[Any] | tuple[Any, ...]) -> bool:
    """One (C, H, W) image a sample."""
    return all(isinstance(item, Tensor) and item.dim() == 3 and _pixels(item) for item in items)


def _pixels(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.dtype == torch.uint8
