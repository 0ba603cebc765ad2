"""`AutoBatchSize`: the batch size with the best measured throughput that fits with headroom."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sized
from pathlib import Path
from typing import Annotated, Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_boost import cache
from lightning_boost._lightning import (
    callbacks_of,
    datamodule_of,
    hardware_for,
    overrides,
    preserved_rng,
    user_dataloaders,
)
from lightning_boost._validation import Fraction, Identifier, PositiveInt, Range, Seconds, validated
from lightning_boost.batch_size.decision import BatchSizeDecision, findings, restored_finding
from lightning_boost.batch_size.search import (
    Limits,
    Trial,
    accumulation,
    choose,
    lr_factor,
    merge,
    next_size,
)
from lightning_boost.callbacks.base import BoostCallback
from lightning_boost.data.datamodule import BoostedDataMixin
from lightning_boost.report import BoostWarning, Finding
from lightning_boost.step_probe import StepProbe, first_batch, is_oom
from lightning_boost.workers.loaders import (
    describe_dataset,
    describe_model,
    hardware_parts,
    loader_batch_size,
)

#: Keys of an optimizer's param group that hold learning rates (schedulers such as OneCycleLR add some).
LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")

_GIB = 1024**3
#: How learning rates follow the effective batch size (`lightning_boost.batch_size.search.LR_RULES`).
LRScaling = Literal["linear", "sqrt"]
#: Timed steps per size: past 100 a trial only repeats itself.
MAX_STEPS = 100

CACHE_FILE = "batch_size.json"
#: What a cached result must hold to be used.
_RESULT_KEYS = {"batch_size", "accumulate_grad_batches", "effective_batch_size", "lr_factor", "trials"}
#: The arguments a measurement depends on (the time budget bounds its cost, not its answer).
_KEYED = ("init_batch_size", "max_batch_size", "headroom", "cpu_memory_fraction", "memory_budget_gib",
          "tolerance", "steps", "target_global_batch_size", "lr_scaling", "reference_batch_size",
          "check_validation", "attr_name")  # fmt: skip


class AutoBatchSize(BoostCallback):
    """Sets the batch size to the smallest measured size within `tolerance` of the best throughput
    whose training step peaks within the memory budget; keeps the effective batch when asked.

    At the start of fit it takes real training steps (forward, backward, optimizer step on real
    batches, in the run's precision) on a copy of the model at growing sizes, then refines,
    measuring samples/s and peak memory; validation is checked at the chosen size. The run's
    weights, optimizer, schedulers, RNG states, loop counters and data order are not touched: a run
    tuned to size B trains exactly like one given B by hand. Under DDP every rank measures each size
    and the ranks merge the results (any OOM, the largest peak, the slowest rank) before deciding,
    so they choose the same size. The result is kept in ``state_dict``: resuming does not tune again.

    The batch size is found as Lightning's tuner finds it: an attribute `attr_name` on the model,
    its ``hparams`` or the datamodule (`BoostedDataModule` has one), read by ``train_dataloader()``.

    Args:
        init_batch_size: the first size measured (default: the configured batch size); the search
            doubles from it, and halves from it when it does not fit.
        max_batch_size: the largest size measured (also bounded by the samples per rank).
        headroom: fraction of the device's memory a training step may peak at (CUDA, MPS).
        cpu_memory_fraction: on CPU, fraction of the RAM available at the start that a step may
            use (shared by the processes on the node); no OOM is waited for.
        memory_budget_gib: the peak a step may reach per process, in GiB, instead of the two above.
        tolerance: sizes within this fraction of the best throughput count as equally fast, and
            the smallest of them is chosen; growth stops when two doublings gain less.
        time_budget_s: no new size is measured once the trials took this long.
        steps: timed steps per size after a warm-up step; the fastest counts (fewer for slow
            steps: about 2 s of timed steps per size at most).
        target_global_batch_size: sets ``accumulate_grad_batches`` so that batch x accumulation x
            world size comes closest to it (and bounds the batch size by it).
        lr_scaling: ``"linear"`` or ``"sqrt"``: scale the optimizers' learning rates (and schedulers'
            base rates) by the change of the effective batch size from `reference_batch_size`.
        reference_batch_size: the effective batch the learning rates were set for (default: the
            batch size configured, times ``accumulate_grad_batches``, times world size).
        check_validation: also run a validation step at the chosen size, stepping down if it fails.
        attr_name: the name of the batch-size attribute.
        retune: measure even when the cache holds a result for this machine, model and data.
        cache_dir: where results are cached as JSON (default ``$LIGHTNING_BOOST_CACHE_DIR`` or
            ``~/.cache/lightning_boost``), keyed by the machine, the model, its precision and
            optimizers, the dataset, the world size and these arguments.

    Example::

        trainer = L.Trainer(callbacks=[AutoBatchSize(target_global_batch_size=512, lr_scaling="linear")])
        trainer.fit(model, datamodule=CIFAR(batch_size=64))
    """

    @validated
    def __init__(
        self,
        *,
        init_batch_size: PositiveInt | None = None,
        max_batch_size: PositiveInt | None = None,
        headroom: Fraction = 0.9,
        cpu_memory_fraction: Fraction = 0.5,
        memory_budget_gib: Annotated[float, Range(gt=0, unit="GiB")] | None = None,
        tolerance: Annotated[float, Range(ge=0, lt=1)] = 0.05,
        time_budget_s: Seconds = 60.0,
        steps: Annotated[int, Range(ge=1, le=MAX_STEPS)] = 3,
        target_global_batch_size: PositiveInt | None = None,
        lr_scaling: LRScaling | None = None,
        reference_batch_size: PositiveInt | None = None,
        check_validation: bool = True,
        attr_name: Annotated[str, Identifier()] = "batch_size",
        retune: bool = False,
        cache_dir: str | Path | None = None,
    ) -> None:
        if reference_batch_size is not None and lr_scaling is None:
            raise ValueError(
                "`reference_batch_size` only applies with `lr_scaling`: pass lr_scaling='linear' or 'sqrt'."
            )
        if max_batch_size is not None and init_batch_size is not None and init_batch_size > max_batch_size:
            raise ValueError(
                f"`init_batch_size` ({init_batch_size}) expected to be at most"
                f" `max_batch_size` ({max_batch_size})."
            )
        self.init_batch_size = init_batch_size
        self.max_batch_size = max_batch_size
        self.headroom = headroom
        self.cpu_memory_fraction = cpu_memory_fraction
        self.memory_budget_gib = memory_budget_gib
        self.tolerance = tolerance
        self.time_budget_s = float(time_budget_s)
        self.steps = steps
        self.target_global_batch_size = target_global_batch_size
        self.lr_scaling = lr_scaling
        self.reference_batch_size = reference_batch_size
        self.check_validation = check_validation
        self.attr_name = attr_name
        self.retune = retune
        self.cache_dir = cache_dir
        self.decision: BatchSizeDecision | None = None
        self.findings: list[Finding] = []
        self._restored = False
        self._set_state_key(attr_name=attr_name)

    @property
    def result(self) -> dict[str, Any]:
        """`decision` as a plain dict (empty before the first fit); what ``state_dict`` holds."""
        return self.decision.to_dict() if self.decision is not None else {}

    @property
    def tuned(self) -> dict[str, Any]:
        """The values this run was given, for the report."""
        return self.decision.tuned if self.decision is not None else {}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        if self.target_global_batch_size is not None and any(
            isinstance(c, GradientAccumulationScheduler) for c in callbacks_of(trainer)
        ):
            raise ValueError(
                "`target_global_batch_size` sets `accumulate_grad_batches`, which the"
                " GradientAccumulationScheduler callback also sets: remove one of them."
            )
        _check_has_batch_size(pl_module, self.attr_name)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        configured = int(lightning_getattr(pl_module, self.attr_name))  # type: ignore[arg-type]
        if not (self._restored and self.decision is not None):
            _check_loader_reads(trainer, pl_module, self.attr_name, configured)
            self.decision = self._tune(trainer, pl_module, configured)
        decision = self.decision
        self.findings += (
            [restored_finding(decision)] if self._restored else findings(decision, self.tolerance)
        )
        lightning_setattr(pl_module, self.attr_name, decision.batch_size)
        trainer.accumulate_grad_batches = decision.accumulate_grad_batches
        if not self._restored:  # a checkpoint's optimizer state already holds the scaled rates
            _scale_learning_rates(trainer, decision.lr_factor)
        self._restored = False

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        chosen = self.decision.batch_size if self.decision is not None else None
        if isinstance(loader, DataLoader) and chosen is not None and loader_batch_size(loader) != chosen:
            raise RuntimeError(
                f"AutoBatchSize set `{self.attr_name}` to {chosen}, but the training DataLoader was built"
                f" with batch_size={loader_batch_size(loader)}: build it with"
                f" `batch_size=self.{self.attr_name}` in `train_dataloader()`."
            )

    def _tune(self, trainer: L.Trainer, pl_module: L.LightningModule, configured: int) -> BatchSizeDecision:
        started = time.perf_counter()
        world = trainer.world_size
        train_data = _split_data(trainer, "train")
        if train_data is None:
            raise RuntimeError("AutoBatchSize needs a training DataLoader to take batches from.")
        path = Path(self.cache_dir or cache.default_cache_dir()) / CACHE_FILE
        key = cache.fingerprint(self._cache_parts(trainer, pl_module, train_data[0], configured))
        cached = self._cached(trainer, path, key)
        if cached is not None:
            return cached
        limits = self._limits(trainer, pl_module, train_data[0], world)
        probe = StepProbe(
            pl_module,
            trainer.optimizers,
            self.steps,
            trainer.precision_plugin.train_step_context,
            trainer.precision_plugin.val_step_context,
        )
        with preserved_rng():
            start = self.init_batch_size or configured
            trials, reason = _search(trainer, probe, train_data, start, limits)
            choice = choose(trials, limits.budget_bytes, self.tolerance)
            if choice is None:
                raise MemoryError(_nothing_fits(trials, limits, reason))
            validates = self.check_validation and overrides(pl_module, "validation_step")
            val_data = _split_data(trainer, "val") if validates else None
            checks: list[Trial] = []
            if val_data is not None:
                choice = _fitting_validation(trainer, probe, val_data, trials, choice, limits, checks)
        accumulate = trainer.accumulate_grad_batches
        if self.target_global_batch_size is not None:
            accumulate = accumulation(self.target_global_batch_size, choice.size, world)
        reference = self.reference_batch_size or configured * trainer.accumulate_grad_batches * world
        effective = choice.size * accumulate * world
        decision = BatchSizeDecision(
            batch_size=choice.size,
            accumulate_grad_batches=accumulate,
            effective_batch_size=effective,
            configured_batch_size=configured,
            reference_batch_size=reference,
            lr_factor=lr_factor(self.lr_scaling, effective, reference),
            lr_scaling=self.lr_scaling,
            target_global_batch_size=self.target_global_batch_size,
            world_size=world,
            budget_bytes=limits.budget_bytes,
            budget=_budget_text(pl_module, self),
            stopped=reason,
            trials=tuple(trials),
            validation=tuple(checks),
            seconds=time.perf_counter() - started,
        )
        if trainer.is_global_zero:
            cache.store_entry(path, key, {"result": decision.to_dict()})
        return decision

    def _cache_parts(
        self, trainer: L.Trainer, pl_module: L.LightningModule, dataset: Any, configured: int
    ) -> dict[str, Any]:
        return {
            "kind": "batch_size",
            "hardware": hardware_parts(hardware_for(trainer)),
            "model": describe_model(pl_module),
            "precision": str(trainer.precision),
            "optimizers": [type(optimizer).__qualname__ for optimizer in trainer.optimizers],
            "dataset": describe_dataset(dataset),
            "world_size": trainer.world_size,
            "configured": configured,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "arguments": {name: getattr(self, name) for name in _KEYED},
        }

    def _cached(self, trainer: L.Trainer, path: Path, key: str) -> BatchSizeDecision | None:
        """Rank zero's cached result, broadcast (every rank uses the same); ``None`` to measure."""
        entry: dict[str, Any] | None = None
        if trainer.is_global_zero and not self.retune:
            entry, problem = cache.load_entry(path, key)
            result = entry.get("result") if entry else None
            if (
                problem is None
                and entry is not None
                and not (isinstance(result, dict) and set(result) >= _RESULT_KEYS)
            ):
                problem = f"{path} holds a malformed entry {key!r}"
            if problem is not None:
                rank_zero_warn(
                    f"Ignoring the batch-size cache, measuring again: {problem}.", category=BoostWarning
                )
                entry = None
        entry = trainer.strategy.broadcast(entry, src=0)
        return None if entry is None else BatchSizeDecision.from_dict({**entry["result"], "source": "cache"})

    def _limits(self, trainer: L.Trainer, pl_module: L.LightningModule, dataset: Any, world: int) -> Limits:
        bounds = [self.max_batch_size or math.inf]
        if isinstance(dataset, Sized):
            bounds.append(max(1, len(dataset) // world))
        if self.target_global_batch_size is not None:
            bounds.append(max(1, self.target_global_batch_size // world))
        largest = min(bounds)
        return Limits(
            max_size=int(largest) if largest != math.inf else 2**31,
            budget_bytes=self._memory_budget(trainer, pl_module),
            tolerance=self.tolerance,
            time_budget_s=self.time_budget_s,
        )

    def _memory_budget(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """Bytes a training step may peak at on this process."""
        device = pl_module.device
        if self.memory_budget_gib is not None:
            return int(self.memory_budget_gib * _GIB)
        if device.type == "cuda":
            return int(self.headroom * torch.cuda.get_device_properties(device).total_memory)
        if device.type == "mps":
            return int(self.headroom * torch.mps.recommended_max_memory())
        hardware = hardware_for(trainer)
        available = hardware.ram_available_bytes or hardware.ram_total_bytes or 8 * _GIB
        return int(self.cpu_memory_fraction * available / hardware.local_world_size)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.result

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.decision = BatchSizeDecision.from_dict(state_dict) if state_dict else None
        self._restored = self.decision is not None


def _check_has_batch_size(pl_module: L.LightningModule, name: str) -> None:
    if not lightning_hasattr(pl_module, name):
        raise AttributeError(
            f"AutoBatchSize found no `{name}` to tune on the model, its `hparams` or the datamodule."
            f" Give the datamodule a `{name}` attribute that `train_dataloader()` reads"
            f" (`BoostedDataModule(batch_size=...)` has one), or take `{name}` in the model's `__init__`"
            " with `self.save_hyperparameters()`. Loaders passed to `trainer.fit(train_dataloaders=...)`"
            " cannot be re-batched: pass a datamodule instead."
        )


def _check_loader_reads(trainer: L.Trainer, pl_module: L.LightningModule, name: str, configured: int) -> None:
    """Raise before any measurement when the training loader does not take its batch size from `name`."""
    datamodule = datamodule_of(trainer)
    if isinstance(datamodule, BoostedDataMixin) and (
        type(datamodule).train_dataloader is BoostedDataMixin.train_dataloader
    ):
        if name == "batch_size":
            return
        built: int | None = datamodule.batch_size
    else:
        lightning_setattr(pl_module, name, configured + 1)
        try:
            loader = user_dataloaders(trainer, "train")
        finally:
            lightning_setattr(pl_module, name, configured)
        if isinstance(loader, (list, tuple)) and loader:
            loader = loader[0]
        if not isinstance(loader, DataLoader):
            return  # `_split_data` says what is wrong with it
        built = loader_batch_size(loader)
        if built == configured + 1:
            return
    raise ValueError(
        f"`attr_name` is {name!r}, but the training DataLoader does not read it: with `{name}` set to"
        f" {configured + 1} it was built with batch_size={built}, so a tuned size would never reach"
        f" training. Build the loader with `batch_size=self.{name}` in `train_dataloader()`, or pass"
        " `attr_name=` the attribute it reads."
    )


def _split_data(trainer: L.Trainer, split: str) -> tuple[Any, Any] | None:
    """The dataset and collate function of the run's `split` loader (the first one if several)."""
    datamodule = datamodule_of(trainer)
    if isinstance(
        datamodule, BoostedDataMixin
    ):  # its datasets are at hand; building a loader would tune workers
        dataset = getattr(datamodule, f"{split}_dataset")
        return None if dataset is None else (dataset, datamodule.collate_fn)
    loaders = user_dataloaders(trainer, split)
    if isinstance(loaders, (list, tuple)) and loaders:
        loaders = loaders[0]
    if loaders is None:
        return None
    if not isinstance(loaders, DataLoader):
        raise TypeError(
            f"AutoBatchSize takes batches from one DataLoader per split, but the {split} loader is a"
            f" {type(loaders).__name__}: return a DataLoader, or set the batch size by hand."
        )
    return loaders.dataset, loaders.collate_fn


def _search(
    trainer: L.Trainer, probe: StepProbe, data: tuple[Any, Any], start: int, limits: Limits
) -> tuple[list[Trial], str]:
    trials: list[Trial] = []
    while True:
        size, reason = next_size(trials, start, limits)
        if size is None:
            return trials, reason
        trials.append(_measured(trainer, data, size, probe.train))


def _fitting_validation(
    trainer: L.Trainer,
    probe: StepProbe,
    data: tuple[Any, Any],
    trials: list[Trial],
    choice: Trial,
    limits: Limits,
    checks: list[Trial],
) -> Trial:
    """`choice`, or the next smaller fitting size, whose validation step fits too."""
    candidates = sorted(
        (t for t in trials if t.fits(limits.budget_bytes) and t.size <= choice.size), key=lambda t: -t.size
    )
    for candidate in candidates:
        check = _measured(trainer, data, candidate.size, probe.validate)
        checks.append(check)
        if check.fits(limits.budget_bytes):
            return candidate
    raise MemoryError(
        f"AutoBatchSize: a validation step does not fit at any batch size whose training step fits (down to"
        f" {candidates[-1].size}): lower the validation batch size or the model's memory use."
    )


def _measured(trainer: L.Trainer, data: tuple[Any, Any], size: int, run: Any) -> Trial:
    """One trial at `size` on every rank, merged; a failure other than OOM on any rank stops all ranks."""
    fetch_started = time.perf_counter()
    error: BaseException | None = None
    trial = Trial(size, oom=True)
    try:
        batch = trainer.strategy.batch_to_device(first_batch(data[0], data[1], size))
        fetch_s = time.perf_counter() - fetch_started
        trial = run(batch, size)
        del batch
        trial = dataclasses.replace(trial, seconds=trial.seconds + fetch_s)
    except Exception as caught:  # told to every rank first, so none waits for the others forever
        if is_oom(caught):  # the batch itself did not fit on the device
            trial = Trial(size, oom=True, seconds=time.perf_counter() - fetch_started)
        else:
            error = caught
    per_rank, failed = _gather(trainer, trial, error is not None)
    if failed:
        raise RuntimeError(
            f"AutoBatchSize: the step failed at batch size {size} on a copy of the model, outside the fit"
            f"{f': {error!r}' if error else ' on another rank'}. If `training_step` needs the trainer"
            " (`self.trainer`, `self.optimizers()`), set the batch size by hand instead."
        ) from error
    return merge(size, per_rank)


def _gather(trainer: L.Trainer, trial: Trial, failed: bool) -> tuple[list[Trial], bool]:
    """Every rank's trial and whether any rank failed (one all-gather; none when single-process)."""
    if trainer.world_size == 1:
        return [trial], failed
    values = torch.tensor(
        [trial.samples_per_s, float(trial.peak_bytes or -1), float(trial.oom), trial.seconds, float(failed)],
        dtype=torch.float64,
        device=trainer.strategy.root_device,
    )
    rows = trainer.strategy.all_gather(values).reshape(-1, 5).tolist()
    trials = [
        Trial(trial.size, tp, int(peak) if peak >= 0 else None, bool(oom), s) for tp, peak, oom, s, _ in rows
    ]
    return trials, any(row[4] for row in rows)


def _budget_text(pl_module: L.LightningModule, callback: AutoBatchSize) -> str:
    device = pl_module.device
    peak = "an estimate of live tensors" if device.type != "cuda" else "the allocator's measured peak"
    if callback.memory_budget_gib is not None:
        return f"`memory_budget_gib={callback.memory_budget_gib:g}` ({peak})"
    if device.type == "cpu":
        return f"{callback.cpu_memory_fraction:.0%} of available RAM per process ({peak})"
    return f"{callback.headroom:.0%} of {device.type.upper()} device memory ({peak})"


def _scale_learning_rates(trainer: L.Trainer, factor: float) -> None:
    """Multiply every learning rate of the run's optimizers and schedulers by `factor`."""
    if factor == 1.0:
        return
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for key in LR_KEYS:
                if isinstance(group.get(key), (int, float, torch.Tensor)):
                    group[key] = group[key] * factor
    for config in trainer.lr_scheduler_configs:
        base_lrs = getattr(config.scheduler, "base_lrs", None)
        if isinstance(base_lrs, list):
            config.scheduler.base_lrs = [lr * factor for lr in base_lrs]


def _nothing_fits(trials: list[Trial], limits: Limits, reason: str) -> str:
    smallest = min(trials, key=lambda t: t.size)
    need = "runs out of memory" if smallest.oom else f"needs {(smallest.peak_bytes or 0) / _GIB:.2f} GiB"
    return (
        f"AutoBatchSize: a training step at batch size {smallest.size} {need}, over the budget of"
        f" {limits.budget_bytes / _GIB:.2f} GiB (stopped: {reason}). Train in lower precision"
        " (`Trainer(precision='bf16-mixed')`, or `preset('auto')`), shard the model with `preset('fsdp')`,"
        " or use a smaller model."
    )
