"""The trials `AutoBatchSize` runs, on every rank, and the run's data and plan they read: training
steps at a size (with the autocast trial's alternation and the noise scale's reads), validation
steps, and the evaluation batch size measured on the run's validation data."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any, NamedTuple

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_boost._lightning import (
    datamodule_of,
    debugging_mode,
    hardware_for,
    moved_as_the_loop_moves,
    preserved_rng,
    train_loader_built,
    user_dataloaders,
)
from lightning_boost.batch_size.decision import BatchSizeDecision
from lightning_boost.batch_size.evaluation import eval_batch_size
from lightning_boost.batch_size.plan import RunPlan
from lightning_boost.batch_size.reduction import summed_reason
from lightning_boost.data.datamodule import BoostedDataMixin, builds_loader, first_of, several, sizing_only
from lightning_boost.micro_batch.split import batch_length
from lightning_boost.presets.autocast import AutocastTrial, MeasuredAutocastMixin
from lightning_boost.ranks import decided_on_rank_zero
from lightning_boost.step_probe import StepProbe, first_batch, is_oom, sample_batches
from lightning_boost.trials import StepFailed, StepSkipped, Trial, merge
from lightning_boost.workers.tuner import epoch_length


class SeveralLoaders(TypeError):
    """The run trains on several loaders at once (a list, dict or `CombinedLoader` of them): a
    trial times one loader's batches, so the batch sizes stay as written."""


class SplitData(NamedTuple):
    """What a split's loader loads: its dataset, collate function and, for training, its sampler."""

    dataset: Any
    collate_fn: Any
    sampler: Any = None  # the training loader's: its draws are an epoch (`epoch_length`)


def split_data(trainer: L.Trainer, split: str) -> SplitData | None:
    """The dataset, collate function and training sampler of the run's `split` loader (the first
    evaluation loader if several): a `BoostedDataModule`'s own, or the loader the user's hook
    returns (one they override on a `BoostedDataModule` too).

    Raises:
        SeveralLoaders: when the run trains on several loaders at once.
    """
    datamodule = datamodule_of(trainer)
    if builds_loader(datamodule, split):  # its datasets at hand: a loader would tune workers
        dataset = getattr(datamodule, f"{split}_dataset")
        if several(dataset):  # a loader each: the first, as for a user's list of loaders
            dataset = first_of(dataset)
        sampler = datamodule.train_sampler if split == "train" else None
        return None if dataset is None else SplitData(dataset, datamodule.collate_fn, sampler)
    with sizing_only(datamodule):  # read, not loaded from: no workers decided for it
        loaders = user_dataloaders(trainer, split)
    several_loaders = isinstance(loaders, (list, tuple, Mapping)) and len(loaders) > 1
    if split == "train" and (several_loaders or type(loaders).__name__ == "CombinedLoader"):
        raise SeveralLoaders(f"the training loaders are a {type(loaders).__name__} of several")
    if isinstance(loaders, (list, tuple, Mapping)) and loaders:
        loaders = first_of(loaders)
    if loaders is None:
        return None
    if not isinstance(loaders, DataLoader):
        raise TypeError(
            f"AutoBatchSize takes batches from one DataLoader per split, but the {split} loader is a"
            f" {type(loaders).__name__}: return a DataLoader, or set the batch size by hand."
        )
    return SplitData(loaders.dataset, loaders.collate_fn, loaders.sampler if split == "train" else None)


def run_plan(trainer: L.Trainer, data: SplitData, world: int) -> RunPlan:
    """What the run will train: the Trainer's limits over the training data (an epoch the
    sampler's draws), per rank."""
    datamodule = datamodule_of(trainer)
    drop_last = (
        bool(getattr(datamodule, "drop_last", False)) if isinstance(datamodule, BoostedDataMixin) else False
    )
    max_epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
    length = epoch_length(data.dataset, data.sampler)
    return RunPlan(
        samples=None if length is None else length // world,
        max_epochs=max_epochs,
        max_steps=trainer.max_steps,
        limit_batches=trainer.limit_train_batches,
        val_check_interval=trainer.val_check_interval,
        check_every=trainer.check_val_every_n_epoch,
        accumulate=trainer.accumulate_grad_batches,
        drop_last=drop_last,
        debugging=debugging_mode(trainer),
    )


def autocast_trial(
    trainer: L.Trainer, data: SplitData, size: int, run_steps: int | None
) -> AutocastTrial | None:
    """A CPU's measured bf16 autocast (`MeasuredAutocast`) decides before the batch-size trials
    time other sizes, so they time the step at the precision the run trains at (it would decide
    at the run's first step otherwise, after them): from the cache, else in the timed steps of
    the first batch-size trial (this trial, handed to it; to the next when that one runs out of
    memory before deciding)."""
    plugin = trainer.precision_plugin
    if not isinstance(plugin, MeasuredAutocastMixin) or plugin.choice is not None:
        return None
    with preserved_rng():  # a DataLoader's iterator draws its seed from the run's generator
        batch = first_batch(data[0], data[1], size)
    batch = moved_as_the_loop_moves(trainer, batch)  # the cache key: its shapes
    return plugin.begin_trial(trainer, batch, float("inf") if run_steps is None else run_steps)


def train_trial(
    trainer: L.Trainer,
    probe: StepProbe,
    data: SplitData,
    size: int,
    split: bool,
    alternate: AutocastTrial | None = None,
    cross: int = 0,
) -> Callable[[], Trial]:
    """Training steps at `size`, each on other samples drawn at random from the training set;
    with `split`, the first batch's halves too (the noise scale from this one trial); with
    `alternate`, its steps alternate fp32 and bf16 autocast until that trial decides; with
    `cross`, that many other batches' gradients first (`StepProbe.train`)."""

    def trial() -> Trial:
        batches = sample_batches(data[0], data[1], size)  # the probe moves them as each step takes one
        first = moved_as_the_loop_moves(trainer, next(batches))
        # an iterable dataset may hold fewer samples; a detection batch's are its images, not the
        # first image's channels, which Lightning's count (the first tensor's first dimension) reads
        held = min(size, batch_length(first) or size)
        return probe.train(first, held, batches, split=split, alternate=alternate, cross=cross)

    return trial


def summed_loss(trainer: L.Trainer, probe: StepProbe, data: SplitData, size: int) -> str:
    """Why the run keeps its size when its loss sums over the batch (`batch_size.reduction`), else
    ``""``: read on rank zero, on the run's first `size` samples, the same on every rank."""

    def read() -> str:
        with preserved_rng():  # a DataLoader's iterator draws its seed from the run's generator
            batch = moved_as_the_loop_moves(trainer, first_batch(data[0], data[1], size))
            held = min(size, batch_length(batch) or size)
            return summed_reason(probe.halves_ratio(batch, held), held)

    return decided_on_rank_zero(trainer.strategy, trainer.is_global_zero, read)


def val_trial(
    trainer: L.Trainer, probe: StepProbe, data: SplitData, size: int, train_size: int | None = None
) -> Callable[[], Trial]:
    """A validation step at `size`, the copy's batch-size attribute `train_size` (default `size`)."""

    def trial() -> Trial:
        batch = moved_as_the_loop_moves(trainer, first_batch(data[0], data[1], size))
        return probe.validate(batch, size, train_size)

    return trial


def wants_eval_size(trainer: L.Trainer) -> bool:
    """A `BoostedDataModule` that builds the validation loader itself, with an evaluation batch size
    the user did not fix."""
    datamodule = datamodule_of(trainer)
    return builds_loader(datamodule, "val") and datamodule.eval_batch_size is None


@contextlib.contextmanager
def without_autotuning() -> Iterator[None]:
    """The trials run with cudnn.benchmark off, as it was before. Autotuning each trial's new
    shape cost 0.9-1.7 s on an H200 (7.3-7.5 s at a machine's first autotuned shape) where a step took
    7-11 ms (`AUTOTUNE_MIN_RUN_S`): the H200 demo's search stopped at 64 because its first trial,
    1.9 s, said the next would cost more than it could save. Off, a new shape cost 0.06-0.1 s, and
    the same search measured 64, 128 and 256 in 1.2 s."""
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


def _measures_eval_sizes(device: torch.device) -> bool:
    """Evaluation sizes are measured on an accelerator. On a CPU a larger evaluation batch is not
    faster per sample and host memory is not what limits it: the trials would only cost time."""
    return device.type != "cpu"


def evaluated_samples(trainer: L.Trainer, dataset: Any, runs: int | None) -> float | None:
    """The samples the fit validates on each rank over its `runs` validations; ``None`` when
    unknown (no length, a count of batches). A later ``trainer.test`` is not counted."""
    limit = trainer.limit_val_batches
    if runs is None or not isinstance(dataset, Sized) or isinstance(limit, int):
        return None
    return runs * len(dataset) / trainer.world_size * limit


def with_eval_size(
    trainer: L.Trainer,
    probe: StepProbe,
    val_data: SplitData,
    decision: BatchSizeDecision,
    budget: int,
    evaluated: float | None = None,
) -> BatchSizeDecision:
    """`decision` with the evaluation batch size measured on the run's validation data, for as
    long as the `evaluated` samples of the fit can repay the trials."""
    if not _measures_eval_sizes(trainer.lightning_module.device):
        return decision.replace(eval_stopped="not measured on a CPU, where a larger batch is not faster")

    # the validation step the search already ran at the chosen size is the first of that size's two
    checked = [t for t in decision.validation if t.size == decision.batch_size and not t.oom]

    def measure(size: int) -> Trial:  # the faster of two steps: the first at a size warms it up
        first = checked[-1] if checked and size == decision.batch_size else None
        trial = val_trial(trainer, probe, val_data, size, decision.batch_size)  # the run's attribute
        first = first or measured(trainer, size, trial)
        if first.oom:
            return first
        again = measured(trainer, size, trial)
        return max(first, again, key=lambda t: t.samples_per_s)

    dataset = val_data[0]
    limit = len(dataset) if hasattr(dataset, "__len__") else None
    per_pass = evaluated_samples(trainer, dataset, 1)
    spread = None if per_pass is None else (math.ceil(per_pass), _eval_workers(trainer))
    result = eval_batch_size(measure, decision.batch_size, budget, limit, evaluated, spread=spread)
    return decision.replace(
        eval_batch_size=result.size, eval_trials=result.trials, eval_stopped=result.stopped
    )


def _eval_workers(trainer: L.Trainer) -> int:
    """The workers of the `BoostedDataModule`'s evaluation loaders: its own fixed count, else the
    training loader's if built (they share the tuned count), else the most this process's CPUs
    allow (the tuner's bound: a tighter spread, so a smaller size, when it chooses fewer)."""
    fixed = getattr(datamodule_of(trainer), "num_workers", None)
    if fixed is not None:
        return int(fixed)
    loader = trainer.train_dataloader if train_loader_built(trainer) else None
    if isinstance(loader, DataLoader):
        return loader.num_workers
    return hardware_for(trainer).max_workers_per_process


def measured(trainer: L.Trainer, size: int, run: Callable[[], Trial]) -> Trial:
    """One trial at `size` on every rank, merged; a failure other than OOM on any rank stops all ranks."""
    started = time.perf_counter()
    error: BaseException | None = None
    trial = Trial(size, oom=True)
    try:
        trial = run()
    except Exception as caught:  # told to every rank first, so none waits for the others forever
        if not is_oom(caught):  # an OOM loading the batch onto the device is a trial that did not fit
            error = caught
    trial = dataclasses.replace(trial, seconds=time.perf_counter() - started)
    per_rank, failed = _gather(trainer, trial, _failure(error))
    if failed == _SKIPPED:  # on every rank that did not train: the run skips that batch too
        raise StepSkipped(
            f"AutoBatchSize: `training_step` returned None at batch size {size} on a copy of the model"
            " (Lightning skips such a batch), so the trial had no step to time."
        )
    if failed:
        raised = error if failed == _failure(error) else None  # a skip here, an error elsewhere: theirs
        cause = repr(raised) if raised else "on another rank"
        raise StepFailed(
            f"AutoBatchSize: the step failed at batch size {size} on a copy of the model, outside the fit"
            f"{': ' if raised else ' '}{cause}. If `training_step` needs the live fit (`self.all_gather`"
            " on several processes, `self.logger.experiment`), set the batch size by hand instead.",
            cause,
        ) from raised
    return dataclasses.replace(merge(size, per_rank), losses=trial.losses)  # this rank's own


#: How a rank's trial ended, gathered as the largest over the ranks: an error outranks a skip.
_RAN, _SKIPPED, _RAISED = 0, 1, 2


def _failure(error: BaseException | None) -> int:
    return _RAN if error is None else _SKIPPED if isinstance(error, StepSkipped) else _RAISED


def _gather(trainer: L.Trainer, trial: Trial, failed: int) -> tuple[list[Trial], int]:
    """Every rank's trial and how the worst rank's ended (`_RAISED`, `_SKIPPED`, else `_RAN`: one
    all-gather; none when single-process)."""
    if trainer.world_size == 1:
        return [trial], failed

    def nan_for_none(value: float | None) -> float:
        return value if value is not None else math.nan

    def none_for_nan(value: float) -> float | None:
        return None if math.isnan(value) else value

    values = torch.tensor(
        [trial.samples_per_s, float(trial.peak_bytes or -1), float(trial.oom), trial.seconds, float(failed),
         nan_for_none(trial.grad_sq), trial.spread, nan_for_none(trial.half_grad_sq),
         nan_for_none(trial.double_grad_sq), nan_for_none(trial.batch_grad_sq),
         nan_for_none(trial.cross_grad_sq), nan_for_none(trial.cross_se)],
        dtype=torch.float64,
        device=trainer.strategy.root_device,
    )  # fmt: skip
    rows = trainer.strategy.all_gather(values).reshape(-1, 12).tolist()
    trials = [
        Trial(
            trial.size, tp, int(peak) if peak >= 0 else None, bool(oom), s, none_for_nan(g), sp,
            none_for_nan(half), none_for_nan(double), batch_grad_sq=none_for_nan(batch),
            cross_grad_sq=none_for_nan(cross), cross_se=none_for_nan(se),
        )
        for tp, peak, oom, s, _, g, sp, half, double, batch, cross, se in rows
    ]  # fmt: skip
    return trials, int(max(row[4] for row in rows))
