"""`AutoBatchSize`: the batch size that reaches the model soonest (best measured goodput) that fits."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_boost import cache
from lightning_boost._lightning import (
    callbacks_of,
    datamodule_of,
    forget_train_loader,
    hardware_for,
    has_callback,
    moved_as_the_loop_moves,
    overrides,
    preserved_rng,
    rebuild_train_loader,
    redo_optimizers,
    train_loader_built,
    train_loaders,
)
from lightning_boost._validation import (
    Directory,
    Fraction,
    Identifier,
    PositiveInt,
    Range,
    Seconds,
    validated,
)
from lightning_boost.batch_size.attribute import (
    adopted_finding,
    attribute_the_loader_reads,
    not_tunable,
    several_loaders_finding,
)
from lightning_boost.batch_size.averages import (
    Average,
    moving_averages,
    other_averages,
    span,
    spanned_finding,
    unspanned_finding,
)
from lightning_boost.batch_size.decision import (
    BatchSizeDecision,
    decide,
    findings,
    growth_finding,
    kept,
    noise_reads_finding,
    optimizers_finding,
    own_rates_finding,
    restored_finding,
)
from lightning_boost.batch_size.finetuning import unfrozen_finding, unfrozen_later
from lightning_boost.batch_size.goodput import NoiseScale, lr_rule
from lightning_boost.batch_size.held_rates import ARGUMENTS, held_rates, put_back, scale_held_rates
from lightning_boost.batch_size.horizons import resize, resized_finding
from lightning_boost.batch_size.measure import (
    SeveralLoaders,
    SplitData,
    autocast_trial,
    evaluated_samples,
    measured,
    run_plan,
    split_data,
    summed_loss,
    train_trial,
    val_trial,
    wants_eval_size,
    with_eval_size,
    without_autotuning,
)
from lightning_boost.batch_size.plan import AUTOTUNE_MIN_RUN_S
from lightning_boost.batch_size.regrow import (
    GROW_AFTER_STEPS,
    Growth,
    NoiseMeter,
    could_grow,
    growth_limits,
    lr_ramp,
    rescale_second_moments,
)
from lightning_boost.batch_size.search import Limits, lr_capped
from lightning_boost.batch_size.untrialable import lazy_reason, scripted_reason, skipped_reason
from lightning_boost.batch_size.watch import LossWatch, reference_of
from lightning_boost.batch_size.written_rates import rate_writers
from lightning_boost.callbacks.base import BoostCallback
from lightning_boost.fingerprints import describe_dataset, describe_model, hardware_parts
from lightning_boost.presets.autocast import MeasuredAutocastMixin
from lightning_boost.presets.plans import PresetPlan
from lightning_boost.ranks import decided_on_rank_zero
from lightning_boost.report import BoostWarning, Finding, Severity
from lightning_boost.step_probe import StepProbe, remembered
from lightning_boost.trials import StepSkipped, Trial
from lightning_boost.workers.loaders import loader_batch_size, start_deferred_workers

#: Keys of an optimizer's param group that hold learning rates (schedulers such as OneCycleLR and
#: SWALR add some).
LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "swa_lr")
#: A scheduler's lists of learning rates it computes from (CyclicLR keeps its peaks as `max_lrs`).
SCHEDULE_KEYS = ("base_lrs", "max_lrs")

_GIB = 1024**3
#: How learning rates follow the effective batch size: ``"auto"`` picks the optimizers' rule
#: (`lightning_boost.batch_size.goodput.lr_rule`), the others are `batch_size.search.LR_RULES`.
LRScaling = Literal["auto", "linear", "sqrt"]
#: Independent batches whose gradients the first trial reads on an accelerator
#: (`_reads_cross_products`): 28 pairs for the true gradient's squared norm, 4 disjoint ones for
#: its error; 8 resolved the demo's noise scale at every size from 32 to 256 on its initial
#: weights, where the halves' fit did in 1 draw of 12 (`python -m benchmarks noise_scale`).
CROSS_BATCHES = 8
#: Timed steps per size: past 100 a trial only repeats itself.
MAX_STEPS = 100

CACHE_FILE = "batch_size.json"
#: What a cached result must hold to be used.
_RESULT_KEYS = {"batch_size", "accumulate_grad_batches", "effective_batch_size", "lr_factor", "trials"}
#: The arguments a measurement depends on (the time budget bounds its cost, not its answer).
_KEYED = ("init_batch_size", "max_batch_size", "headroom", "cpu_memory_fraction", "memory_budget_gib",
          "tolerance", "steps", "target_global_batch_size", "lr_scaling", "reference_batch_size",
          "check_validation", "attr_name", "min_efficiency")  # fmt: skip


class AutoBatchSize(BoostCallback):
    """Sets the batch size that reaches the model soonest: the smallest measured size within
    `tolerance` of the best goodput (throughput x statistical efficiency) whose training step peaks
    within the memory budget; scales the learning rates the way the optimizers need, warmed up.

    At the start of fit it takes real training steps (forward, backward, optimizer step on real
    batches, in the run's precision) on a copy of the model at growing sizes, then refines,
    measuring samples/s, peak memory and the squared gradient norm, from which it fits the gradient
    noise scale: past it a larger batch teaches the model less per sample, so it must run that much
    faster to be worth it, and a size under `min_efficiency` is not chosen (the run keeps its
    epochs). A size is measured only while it can repay its trial over the planned run, and a run
    too short for any trial (``fast_dev_run``, ``overfit_batches``, a count of batches or steps, a
    few steps) keeps the configured size, with a finding that says why. Validation is checked at
    the chosen size. The run's
    weights, optimizer, schedulers, RNG states, loop counters and data order are not touched: a run
    tuned to size B trains exactly like one given B by hand. Under DDP every rank measures each size
    and the ranks merge the results (any OOM, the largest peak, the slowest rank) before deciding,
    so they choose the same size. The result is kept in ``state_dict``: resuming does not tune again.
    The attribute is put back to the configured size at the end of the fit, so a second fit, a
    resumed run and a reused datamodule scale from the size the user wrote.

    With `grow`, during the run the noise scale is read again from pairs of the run's own consecutive
    steps (`lightning_boost.batch_size.regrow`), and at an epoch's end the batch grows to a larger
    measured size once that size's goodput beats the current one's by more than `tolerance`, with
    the learning rates of its rule, warmed up; the loader is built again at the new size for the
    next epoch. Runs whose length or schedule is counted in steps or batches are not grown.

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
        tolerance: sizes within this fraction (or their measured spread, if wider) of the best
            goodput count as equally good, and the smallest of them is chosen; growth stops when
            two doublings gain less.
        time_budget_s: no new size is measured once the trials took this long.
        steps: timed steps per size after a warm-up step; the fastest counts (fewer for slow
            steps: about 2 s of timed steps per size at most).
        target_global_batch_size: sets ``accumulate_grad_batches`` so that batch x accumulation x
            world size comes closest to it (and bounds the batch size by it).
        lr_scaling: scale the optimizers' learning rates (and schedulers' base rates) by the change
            of the effective batch size from `reference_batch_size`: ``"auto"`` by its square
            root for every optimizer (SGD's linear rule ended worse on the demo's short runs:
            `LR_FACTOR_WARN`) but LBFGS, whose rates it keeps (its ``lr`` multiplies a step the
            curvature sizes), or ``"linear"``, ``"sqrt"``; ``None`` keeps them. A raised rate is
            warmed up; the search chooses no size past x2 the rates (`lr_capped`: 4x the batch
            under the square root), and a target past it is a warning.
        reference_batch_size: the effective batch the learning rates were set for (default: the
            batch size configured, times ``accumulate_grad_batches``, times world size).
        min_efficiency: the least statistical efficiency (progress per sample against the
            configured size) a larger size may have.
        lr_warmup_steps: optimizer steps over which a raised learning rate rises from the configured
            one (default: a tenth of the planned run).
        check_validation: also run a validation step at the chosen size (when not the configured
            one), stepping down if it fails.
        grow: read the gradient noise scale again during the run and grow the batch between
            epochs when a larger measured size has become worth more (see above). Off by default:
            on a run whose last epochs still teach the model, the larger batch can end it short
            of the fixed batch's model (``docs/batch-size.md``).
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
        lr_scaling: LRScaling | None = "auto",
        reference_batch_size: PositiveInt | None = None,
        min_efficiency: Fraction = 0.8,
        lr_warmup_steps: Annotated[int, Range(ge=0)] | None = None,
        check_validation: bool = True,
        grow: bool = False,
        attr_name: Annotated[str, Identifier()] = "batch_size",
        retune: bool = False,
        cache_dir: Directory | None = None,
    ) -> None:
        if reference_batch_size is not None and lr_scaling is None:
            raise ValueError(
                "`reference_batch_size` only applies with `lr_scaling`:"
                " pass lr_scaling='auto', 'linear' or 'sqrt'."
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
        self.min_efficiency = min_efficiency
        self.lr_warmup_steps = lr_warmup_steps
        self.check_validation = check_validation
        self.grow = grow
        self.attr_name = attr_name
        self.retune = retune
        self.cache_dir = cache_dir
        self.decision: BatchSizeDecision | None = None
        self.findings: list[Finding] = []
        self._restored = False
        self._configured: int | None = None  # the size the user wrote, put back at the end of fit
        # (param group, its lr) under warm-up
        self._ramped: list[tuple[dict[str, Any], float | torch.Tensor]] = []
        self._after_step: RemovableHandle | None = None  # puts them back once the optimizer stepped
        self._held: list[tuple[Any, str, Any]] = []  # rates callbacks hold, as the user set them
        self._averages: list[Average] = []  # the fit's EMAs of the weights, as the user wrote them
        #: The attribute `attr_name` was found derived from, and how many times larger that one is
        #: (a template's global `batch_size` for its `batch_size_per_device`); for config files.
        self.derived_from: tuple[str, float] | None = None
        self._watch: LossWatch | None = None
        self._watch_reports = False  # whether the watch's verdict is said (the pack changed something)
        self._growth: Growth | None = None  # the noise scale read during the run (`grow`)
        self._explicit_attr = attr_name != "batch_size"
        self._not_tuned: Finding | None = None  # why this fit cannot be tuned, found in `setup`
        #: the training batch size may still change: a training loader built now defers its workers
        self.batch_size_pending = False
        self._autotuning_off = False  # the preset's cudnn.benchmark turned off for a short run
        self._set_state_key(attr_name=attr_name)

    @property
    def result(self) -> dict[str, Any]:
        """`decision` as a plain dict (empty before the first fit); what ``state_dict`` holds."""
        return self.decision.to_dict() if self.decision is not None else {}

    @property
    def tuned(self) -> dict[str, Any]:
        """The values this run was given, for the report."""
        off = {"cudnn_benchmark": False} if self._autotuning_off else {}
        return {**self.decision.tuned, **off} if self.decision is not None else {}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self.findings = []  # this fit's: the callback may be handed to another Trainer after one
        if has_callback(trainer, "BatchSizeFinder"):
            raise ValueError(
                f"`Trainer(callbacks=...)` holds AutoBatchSize and Lightning's BatchSizeFinder (which"
                f" `Tuner.scale_batch_size` also adds), and both set `{self.attr_name}`: keep one."
                " AutoBatchSize picks the size that trains the model soonest (goodput),"
                " BatchSizeFinder the largest that fits."
            )
        scheduled = has_callback(trainer, "GradientAccumulationScheduler")
        if self.target_global_batch_size is not None and scheduled:
            raise ValueError(
                "`target_global_batch_size` sets `accumulate_grad_batches`, which the"
                " GradientAccumulationScheduler callback also sets: remove one of them."
            )
        self._not_tuned = not_tunable(pl_module, self.attr_name, explicit=self._explicit_attr)
        self.batch_size_pending = self._not_tuned is None  # until `on_fit_start` decides

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._autotuning_off = False
        self.batch_size_pending = False
        if self._not_tuned is not None:  # the run goes on as written, and the report says why
            self.decision = None
            self.findings.append(self._not_tuned)
            return
        configured = int(lightning_getattr(pl_module, self.attr_name))  # type: ignore[arg-type]
        self._configured = configured
        if not (self._restored and self.decision is not None):
            try:
                self.decision = self._tune(trainer, pl_module, configured)
            except SeveralLoaders as several:  # the run goes on as written, and the report says why
                self.decision = None
                self.findings.append(several_loaders_finding(str(several)))
                return
        decision = self.decision
        lightning_setattr(pl_module, self.attr_name, decision.batch_size)
        datamodule = datamodule_of(trainer)
        if decision.eval_batch_size is not None and wants_eval_size(trainer):
            datamodule.tuned_eval_batch_size = decision.eval_batch_size  # type: ignore[union-attr]
        trainer.accumulate_grad_batches = decision.accumulate_grad_batches
        redone = []
        if train_loader_built(trainer):  # asked for early, as `estimated_stepping_batches` does
            redone = self._rebuild_early_loader(trainer, decision)
            decision = self.decision  # its rates the user's, where configure_optimizers set them
        self.findings += (
            [restored_finding(decision)] if self._restored else findings(decision, self.tolerance)
        )
        autotuning = _short_run_autotuning(trainer, decision)
        if autotuning is not None:
            self._autotuning_off = True
            self.findings.append(autotuning)
        self.findings += redone
        self._held = held_rates(trainer)  # the callbacks' arguments, put back at teardown
        if not self._restored:  # a checkpoint's optimizer state already holds the scaled rates
            _scale_learning_rates(trainer, decision.lr_factor)
        else:  # a callback's arguments are not in the checkpoint
            scale_held_rates(trainer, decision.lr_factor, ARGUMENTS)
        # the schedulers' lengths; a resumed fit's, restored after this, hold them already, but a
        # LambdaLR's read-at-pace factor is a function its `state_dict` leaves out
        fitted, every = _fit_schedules(trainer, decision)
        if every:  # a WARN that they count the configured size's steps no longer holds
            self.findings = [f for f in self.findings if "unfitted_schedules" not in f.data]
        self.findings += fitted
        self._averages = moving_averages(trainer, pl_module)  # each fit's: built in `setup`
        growth = _samples_growth(decision)
        if self._averages and growth != 1.0:
            span(self._averages, growth)
            self.findings.append(spanned_finding(self._averages, growth, _samples_per_step(decision)))
        others = other_averages(pl_module) if growth != 1.0 else []
        if others:
            self.findings.append(unspanned_finding(others, growth))
        changed = decision.batch_size != decision.configured_batch_size or decision.lr_factor != 1.0
        self._restored = False
        self._growth = self._start_growth(trainer, pl_module, decision)
        # watched from the first step where a growth may change the size later: a divergence is
        # read against the run's whole loss (a verdict counts once the pack changed something)
        self._watch = (
            LossWatch(reference=reference_of(decision) if changed else None, batch_size=decision.batch_size)
            if changed or self._growth is not None
            else None
        )
        self._watch_reports = changed

    def _rebuild_early_loader(self, trainer: L.Trainer, decision: BatchSizeDecision) -> list[Finding]:
        """A training loader built before the fit started is built again when its size is not the
        decision's; ``configure_optimizers``, which counted its steps, runs again when the samples
        per optimizer step changed (a size and accumulation that trade places keep them). Rates it
        then sets otherwise than the first time were derived from the batch size by the user's own
        rule (`rates_followed`): the decision takes them as they are (``lr_factor`` 1), not scaled
        a second time."""
        loaders = train_loaders(trainer)
        if any(_other_size(loader, decision) for loader in loaders):
            forget_train_loader(trainer)  # its workers never started (`DeferredStartDataLoader`)
        else:
            for loader in loaders:
                start_deferred_workers(loader)
        configured, per_step = _samples_per_step(decision)
        if per_step == configured:
            return []
        before = learning_rates(trainer)
        redone = redo_optimizers(trainer)
        after = learning_rates(trainer)
        growths = (decision.batch_size / decision.configured_batch_size, per_step / configured)
        if not redone or decision.lr_factor == 1.0 or not rates_followed(before, after, growths):
            return [optimizers_finding(decision, redone)]
        self.decision = dataclasses.replace(decision, lr_factor=1.0, lr_warmup_steps=0)
        return [own_rates_finding(decision, before, after)]

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

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """During the warm-up, lower the scaled rates for this optimizer step only: put back right
        after it, before Lightning steps a step-interval scheduler (which reads and writes them),
        or at the batch's end when the step was skipped (an fp16 scaler's inf)."""
        decision = self.decision
        if decision is None:
            return
        if self._growth is not None and self._growth.meter.reads(trainer.global_step):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self._growth.meter.observe(trainer.global_step, grads)
        ramp = lr_ramp(decision, trainer.global_step)
        if ramp == 1.0:
            return
        for group in optimizer.param_groups:
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor):  # in place, without reading it (no sync)
                self._ramped.append((group, lr.clone()))
                lr.mul_(ramp)
            elif isinstance(lr, float):
                self._ramped.append((group, lr))
                group["lr"] = lr * ramp
        if self._ramped and self._after_step is None:
            self._after_step = optimizer.register_step_post_hook(lambda *_: self._end_ramp())

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end_ramp()
        if self._watch is not None and self.decision is not None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            verdict = self._watch.add(loss) if isinstance(loss, torch.Tensor) else None
            if verdict is not None and self._watch_reports:
                self.findings.append(self._watch.finding(verdict, self.decision))
                self._watch = None

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Read the noise scale of the epoch's pairs of steps; grow the batch when it pays."""
        growth, before = self._growth, self.decision
        last = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs
        if growth is None or before is None or last or trainer.should_stop:
            return
        epoch_batches = int(trainer.num_training_batches)
        self.decision = after = growth.epoch_end(
            before, trainer.current_epoch, trainer.global_step, epoch_batches
        )
        if after.batch_size == before.batch_size:
            return
        lightning_setattr(pl_module, self.attr_name, after.batch_size)
        rebuild_train_loader(trainer)  # at the new size, for the next epoch
        _scale_learning_rates(trainer, after.lr_factor / before.lr_factor)
        factor = after.growth[-1]["second_moment"]
        rescaled = [rescale_second_moments(optimizer, factor) for optimizer in trainer.optimizers]
        span(self._averages, _samples_growth(after), start=False)  # a start not yet reached stays
        if self._watch is None:  # a divergence was reported: the new size is watched afresh
            self._watch = LossWatch(batch_size=after.batch_size)
        self._watch.batch_size, self._watch_reports = after.batch_size, True
        self.findings.append(growth_finding(after, sorted({name for name in rescaled if name})))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        watch = self._watch
        verdict = watch.flush() if watch is not None else None  # the last windows' means
        if watch is not None and verdict is not None and self._watch_reports and self.decision is not None:
            self.findings.append(watch.finding(verdict, self.decision))
            self._watch = None
        if self._growth is not None and self._growth.reads and self.decision is not None:
            self.findings.append(noise_reads_finding(self.decision, self._growth.reads))

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self.batch_size_pending = False
        self._growth = None
        self._end_ramp()
        if stage == "fit" and self._configured is not None:
            lightning_setattr(pl_module, self.attr_name, self._configured)
            self._configured = None
        put_back(self._held)
        self._held = []
        span(self._averages, 1.0)
        self._averages = []

    def _start_growth(
        self, trainer: L.Trainer, pl_module: L.LightningModule, decision: BatchSizeDecision
    ) -> Growth | None:
        """The batch's growth during the run, when the run is long enough to repay it, a larger size
        could pay, and nothing in the run stops the batch from growing (else a finding says what)."""
        if not self.grow or decision.kept:
            return None
        data = split_data(trainer, "train")
        if data is None:
            return None
        plan = run_plan(trainer, data, trainer.world_size)
        steps, epoch = plan.optimizer_steps(decision.batch_size), plan.batches_per_epoch(decision.batch_size)
        if (
            steps is None
            or epoch is None
            or steps - epoch // decision.accumulate_grad_batches < GROW_AFTER_STEPS
        ):
            return None
        limits = self._limits(trainer, pl_module, data, trainer.world_size, decision.configured_batch_size)
        cap = lr_capped(limits, decision.lr_scaling, decision.configured_batch_size).max_size
        if not could_grow(decision.trials, growth_limits(decision, self.tolerance), decision.batch_size, cap):
            return None
        blocker = _growth_blocker(trainer, decision)
        if blocker:
            self.findings.append(
                Finding(
                    "AutoBatchSize",
                    "batch size",
                    Severity.INFO,
                    f"Batch size not grown during the run: {blocker}",
                    detail="A larger size could become worth more once the noise scale read from the run's"
                    " own steps grows.",
                )
            )
            return None
        probe = self._probe(trainer, pl_module, unfrozen_later(trainer, pl_module))

        def measure(size: int) -> Trial:
            with preserved_rng():
                return measured(trainer, size, train_trial(trainer, probe, data, size, split=False))

        def share(noise: NoiseScale | None) -> NoiseScale | None:
            return trainer.strategy.broadcast(noise, src=0) if trainer.world_size > 1 else noise

        return Growth(NoiseMeter(decision.effective_batch_size), cap, self.tolerance, measure, share)

    def _probe(self, trainer: L.Trainer, pl_module: L.LightningModule, unfrozen: list[str]) -> StepProbe:
        """Trial steps on a copy of the run's model and optimizers, in the run's precision, with
        the parameters a fine-tuning callback unfreezes later trainable."""
        plugin = trainer.precision_plugin
        return StepProbe(
            pl_module,
            trainer.optimizers,
            self.steps,
            plugin.train_step_context,
            plugin.val_step_context,
            move=functools.partial(moved_as_the_loop_moves, trainer),
            unfreeze=unfrozen,
            resize=functools.partial(set_size, self.attr_name),
        )

    def _end_ramp(self) -> None:
        if self._after_step is not None:
            self._after_step.remove()
            self._after_step = None
        for group, lr in self._ramped:
            if isinstance(lr, torch.Tensor) and isinstance(group["lr"], torch.Tensor):
                group["lr"].copy_(lr)
            else:
                group["lr"] = lr
        self._ramped.clear()

    def _tune(self, trainer: L.Trainer, pl_module: L.LightningModule, configured: int) -> BatchSizeDecision:
        started = time.perf_counter()
        world = trainer.world_size
        train_data = split_data(trainer, "train")
        if train_data is None:
            raise RuntimeError("AutoBatchSize needs a training DataLoader to take batches from.")
        limits = self._limits(trainer, pl_module, train_data, world, configured)
        plan = run_plan(trainer, train_data, world)
        why = plan.keep_reason(configured, target=self.target_global_batch_size is not None)
        why = why or (_rates_written(trainer, pl_module) if self.lr_scaling is not None else "")
        why = why or lazy_reason(pl_module) or scripted_reason(pl_module)
        if why:
            return kept(configured, trainer.accumulate_grad_batches, limits, why)
        read = attribute_the_loader_reads(trainer, pl_module, self.attr_name, configured)
        if read != self.attr_name:  # a template's per-device size, derived from ours in `setup()`
            self.findings.append(adopted_finding(self.attr_name, read))
            adopted = int(lightning_getattr(pl_module, read))  # type: ignore[arg-type]
            self.derived_from = (self.attr_name, configured / adopted)
            self.attr_name, self._configured = read, adopted
            return self._tune(trainer, pl_module, adopted)
        unfrozen = unfrozen_later(trainer, pl_module)  # measured trainable: the batch must fit then
        if unfrozen:
            self.findings.append(unfrozen_finding(pl_module, unfrozen))
        path = Path(self.cache_dir or cache.default_cache_dir()) / CACHE_FILE
        parts = self._cache_parts(trainer, pl_module, train_data[0], configured)
        key = cache.fingerprint({**parts, "trained": _trained_parameters(pl_module, unfrozen)})
        cached = self._cached(trainer, path, key)
        if cached is not None:
            return cached
        limits = dataclasses.replace(limits, planned_samples=plan.samples_planned(configured))
        probe = self._probe(trainer, pl_module, unfrozen)
        validates = self.check_validation and overrides(pl_module, "validation_step")
        val_data = split_data(trainer, "val") if validates else None
        # each trial loads only what is new
        train_data = train_data._replace(dataset=remembered(train_data.dataset))
        val_data = None if val_data is None else val_data._replace(dataset=remembered(val_data.dataset))
        rule = lr_rule(self.lr_scaling, [type(optimizer).__name__ for optimizer in trainer.optimizers])
        limits = lr_capped(limits, rule, configured)  # no size the rule's learning rates fail at
        start = self.init_batch_size or configured
        parameter_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        crossed = _reads_cross_products(pl_module.device, parameter_bytes, limits.budget_bytes)
        with without_autotuning():  # its samples are remembered: the first trial loads them no more
            summed = summed_loss(trainer, probe, train_data, configured)
        if summed:
            return kept(configured, trainer.accumulate_grad_batches, limits, summed)
        autocast = autocast_trial(trainer, train_data, start, plan.optimizer_steps(configured))

        def train(size: int) -> Trial:  # the first trial also times the autocast trial's steps
            nonlocal autocast
            alternate = autocast
            split = size == start
            cross = CROSS_BATCHES if split and crossed else 0
            measure = train_trial(trainer, probe, train_data, size, split, alternate, cross)
            trial = measured(trainer, size, measure)
            if alternate is not None:  # every rank, after the trial's all-gather
                plugin = trainer.precision_plugin
                assert isinstance(plugin, MeasuredAutocastMixin)  # whose trial `alternate` is
                plugin.settle_trial(trainer, alternate)
                autocast = None if plugin.choice is not None else alternate.again()  # out of memory
            return trial

        with preserved_rng(), without_autotuning():
            try:
                decision = decide(
                    train,
                    None
                    if val_data is None
                    else lambda size: measured(trainer, size, val_trial(trainer, probe, val_data, size)),
                    start,
                    configured,
                    limits,
                    rule,
                )
            except StepSkipped:  # at the first size; a later one's skip ends the search there
                return kept(configured, trainer.accumulate_grad_batches, limits, skipped_reason(start))
            if val_data is not None and wants_eval_size(trainer):
                evaluated = evaluated_samples(trainer, val_data[0], plan.validations(decision.batch_size))
                decision = with_eval_size(trainer, probe, val_data, decision, limits.budget_bytes, evaluated)
        steps = plan.optimizer_steps(decision.batch_size)
        warmup = self.lr_warmup_steps if self.lr_warmup_steps is not None else max(1, (steps or 1000) // 10)
        decision = decision.replace(
            budget=_budget_text(pl_module, self),
            seconds=time.perf_counter() - started,
            lr_warmup_steps=warmup if decision.lr_factor > 1.0 else 0,
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

        def load() -> dict[str, Any] | None:
            if self.retune:
                return None
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
                return None
            return entry

        entry = decided_on_rank_zero(trainer.strategy, trainer.is_global_zero, load)
        return None if entry is None else BatchSizeDecision.from_dict({**entry["result"], "source": "cache"})

    def _limits(
        self, trainer: L.Trainer, pl_module: L.LightningModule, data: SplitData, world: int, configured: int
    ) -> Limits:
        bounds = [self.max_batch_size or math.inf]
        largest_for_run = run_plan(trainer, data, world).largest_size()
        if largest_for_run is not None:
            bounds.append(largest_for_run)
        if self.target_global_batch_size is not None:
            bounds.append(max(1, self.target_global_batch_size // world))
        largest = min(bounds)
        accumulate = trainer.accumulate_grad_batches
        return Limits(
            max_size=int(largest) if largest != math.inf else 2**31,
            budget_bytes=self._memory_budget(trainer, pl_module),
            tolerance=self.tolerance,
            time_budget_s=self.time_budget_s,
            reference=self.reference_batch_size or configured * accumulate * world,
            accumulate=accumulate,
            world=world,
            target=self.target_global_batch_size,
            min_efficiency=self.min_efficiency,
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


def _trained_parameters(pl_module: L.LightningModule, unfrozen: list[str]) -> int:
    """Parameters the trials train: those that train now and those `unfrozen` later."""
    wanted = set(unfrozen)
    return sum(p.numel() for name, p in pl_module.named_parameters() if p.requires_grad or name in wanted)


def _reads_cross_products(device: torch.device, parameter_bytes: int, budget_bytes: int) -> bool:
    """The first trial reads `CROSS_BATCHES` independent batches' gradients on an accelerator,
    where they cost little next to the run (at most 8 x 24 ms, the H100 demo's whole step at 64 in
    RESULTS: about 0.2 s) and two more gradient-sized buffers take at most a tenth of the memory
    budget. Not on a CPU: at the 519-548 samples/s of a whole step at 64 (the `batch_size`
    benchmark's sweep) the demo's ResNet-18 on 2 CPUs would spend up to about 1 s on them before
    its first step, past the 3 % of the fit issue 30 allows there. Both are estimates from those
    step times, not timings of the passes.

    Example:
        >>> gpu, cpu = torch.device("cuda"), torch.device("cpu")
        >>> _reads_cross_products(gpu, 10**8, 80 * 2**30), _reads_cross_products(cpu, 10**8, 80 * 2**30)
        (True, False)
        >>> _reads_cross_products(gpu, 5 * 10**9, 80 * 2**30)  # 10 GB of buffers: over 8 GiB
        False
    """
    return device.type != "cpu" and 2 * parameter_bytes <= budget_bytes // 10


def _other_size(loader: Any, decision: BatchSizeDecision) -> bool:
    """Whether `loader`, built before the decision, batches at another size than it: a DataLoader
    by its own size (the configured one, or another where a resumed run's configuration changed),
    any other iterable by whether the decision changed the size."""
    if isinstance(loader, DataLoader):
        return loader_batch_size(loader) != decision.batch_size
    return decision.batch_size != decision.configured_batch_size


def set_size(name: str, module: L.LightningModule, size: int) -> None:
    """`module`'s batch-size attribute `name` (on it and its ``hparams``, where it has one) set to
    `size`, as `lightning_setattr` sets the run's."""
    if lightning_hasattr(module, name):
        lightning_setattr(module, name, size)


def _rates_written(trainer: L.Trainer, pl_module: L.LightningModule) -> str:
    """Why the run keeps its size when its program writes its own learning rates during the fit
    (`batch_size.written_rates`), else ``""``."""
    writers = rate_writers([pl_module, *callbacks_of(trainer)])
    if not writers:
        return ""
    return (
        f"`{writers[0]}` writes the learning rate itself (`pg['lr'] = ...`), so a larger batch would"
        " train at the rate it writes for the configured one, through any warm-up it counts in steps"
        " over more of the run. Put the warm-up in a scheduler (`LinearLR` then yours, in a"
        " `SequentialLR` counted from `self.trainer.estimated_stepping_batches`), which AutoBatchSize"
        " scales, or pass `lr_scaling=None` to tune the size at the rates it writes"
    )


def _samples_per_step(decision: BatchSizeDecision) -> tuple[int, int]:
    """The samples each optimizer step trains on a rank: as configured, and as decided."""
    configured = decision.configured_batch_size * decision.configured_accumulate
    return configured, decision.batch_size * decision.accumulate_grad_batches


def _samples_growth(decision: BatchSizeDecision) -> float:
    configured, tuned = _samples_per_step(decision)
    return tuned / configured


def _short_run_autotuning(trainer: L.Trainer, decision: BatchSizeDecision) -> Finding | None:
    """Turns the preset's default cudnn.benchmark off for a run whose steps, at the chosen size's
    measured rate, take under `AUTOTUNE_MIN_RUN_S`; the finding that says so, else ``None``. A
    value the user passed, or set without a preset, is left as it is; the strategy puts the flag
    back at teardown."""
    plan = getattr(trainer.strategy, "plan", None)
    if not (
        torch.backends.cudnn.benchmark
        and isinstance(plan, PresetPlan)
        and plan.cudnn_benchmark
        and not plan.cudnn_benchmark_by_hand
    ):
        return None
    rate = decision.rate_at(decision.batch_size)
    data = split_data(trainer, "train")
    if rate is None or data is None:
        return None
    run = run_plan(trainer, data, trainer.world_size)
    if run.repays_autotuning(decision.batch_size, rate):
        return None
    torch.backends.cudnn.benchmark = False
    seconds = run.samples_planned(decision.batch_size) / rate
    return Finding(
        "AutoBatchSize",
        "precision and strategy",
        Severity.INFO,
        f"cudnn.benchmark off: the run's steps take about {seconds:.2g} s",
        f"Its autotuning costs about a second per new input shape (measured on an H200, for steps at"
        f" most 14 % faster after it): a run of under {AUTOTUNE_MIN_RUN_S:g} s of steps does not repay it.",
        "preset(..., cudnn_benchmark=True) keeps it on.",
        data={"cudnn_benchmark": False, "run_seconds": seconds},
    )


def _budget_text(pl_module: L.LightningModule, callback: AutoBatchSize) -> str:
    device = pl_module.device
    peak = "an estimate of live tensors" if device.type != "cuda" else "the allocator's measured peak"
    if callback.memory_budget_gib is not None:
        return f"`memory_budget_gib={callback.memory_budget_gib:g}` ({peak})"
    if device.type == "cpu":
        return f"{callback.cpu_memory_fraction:.0%} of available RAM per process ({peak})"
    return f"{callback.headroom:.0%} of {device.type.upper()} device memory ({peak})"


def _growth_blocker(trainer: L.Trainer, decision: BatchSizeDecision) -> str:
    """Why this run's batch must not grow between epochs (``""`` when it may)."""
    strategies = {cls.__name__ for cls in type(trainer.strategy).__mro__}
    if not strategies & {"SingleDeviceStrategy", "DDPStrategy"} or "DeepSpeedStrategy" in strategies:
        return f"{type(trainer.strategy).__name__} shards or wraps the gradients the noise scale is read from"
    if decision.target_global_batch_size is not None:
        return "`target_global_batch_size` fixes the effective batch"
    if any(config.interval == "step" for config in trainer.lr_scheduler_configs):
        return "a learning-rate scheduler steps per optimizer step: a larger batch ends the run mid-schedule"
    if isinstance(trainer.val_check_interval, int) or not isinstance(trainer.limit_train_batches, float):
        return "the run counts training batches (`val_check_interval` or `limit_train_batches`)"
    if trainer.limit_train_batches != 1.0:
        return "`limit_train_batches` takes part of each epoch"
    if has_callback(trainer, "GradientAccumulationScheduler"):
        return "a GradientAccumulationScheduler sets the accumulation"
    return ""


def rates_followed(before: list[float], after: list[float], growths: Sequence[float]) -> bool:
    """Whether ``configure_optimizers``, run again at another batch size, set its rates by a rule
    of its own that follows the batch size (`learning_rates` of the optimizers before, and of the
    rerun): every rate moved by one factor, one of the batch's `growths` (its size's, its samples
    per optimizer step's) or its square root. Rates moved otherwise were moved by something else
    (Lightning < 2.6's `LearningRateFinder` leaves the optimizers at the configured rate and the
    model at the one it found); rates that cannot be paired (another count of them) say nothing.

    Example:
        >>> rates_followed([0.02, 0.002], [0.08, 0.008], [4.0]), rates_followed([0.02], [0.02], [4.0])
        (True, False)
        >>> rates_followed([0.02], [0.08, 0.08], [4.0]), rates_followed([0.001], [0.0123], [4.0])
        (False, False)
    """
    if len(before) != len(after):
        return False
    pairs = [(b, a) for b, a in zip(before, after, strict=True) if b or a]  # a rate of 0 stays 0
    if not pairs or any(b == 0 for b, _ in pairs):
        return False
    factor = pairs[0][1] / pairs[0][0]
    rules = [rule for growth in growths if growth != 1.0 for rule in (growth, math.sqrt(growth))]
    one_factor = all(math.isclose(a / b, factor, rel_tol=1e-3) for b, a in pairs)
    return one_factor and any(math.isclose(factor, rule, rel_tol=0.01) for rule in rules)


def learning_rates(trainer: L.Trainer) -> list[float]:
    """Every learning rate the run's optimizers and schedulers hold (`LR_KEYS`, `SCHEDULE_KEYS`),
    in order; read once, before the first step (a tensor rate is read from its device)."""
    rates = [
        float(group[key])
        for optimizer in trainer.optimizers
        for group in optimizer.param_groups
        for key in LR_KEYS
        if isinstance(group.get(key), (int, float, torch.Tensor))
    ]
    for config in trainer.lr_scheduler_configs:
        for key in SCHEDULE_KEYS:
            values = getattr(config.scheduler, key, None)
            rates += [float(value) for value in values] if isinstance(values, list) else []
    return rates


def _scale_learning_rates(trainer: L.Trainer, factor: float) -> None:
    """Multiply every learning rate of the run's optimizers and schedulers by `factor`."""
    if factor == 1.0:
        return
    scaled: set[int] = set()
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for key in LR_KEYS:
                value = group.get(key)
                if isinstance(value, torch.Tensor):  # in place, as torch's schedulers `fill_` one: a
                    if id(value) not in scaled:  # compiled or captured step keeps reading that tensor
                        scaled.add(id(value))
                        value.mul_(factor)
                elif isinstance(value, (int, float)):
                    group[key] = value * factor
    seen: set[int] = set()
    for config in trainer.lr_scheduler_configs:
        _scale_schedule(config.scheduler, factor, seen)
    scale_held_rates(trainer, factor)  # those a callback sets the optimizer's from later


def _fit_schedules(trainer: L.Trainer, decision: BatchSizeDecision) -> tuple[list[Finding], bool]:
    """Step-interval schedules the program sized for the configured run's steps, made as long as
    the tuned run (`batch_size.horizons`), each with a finding; and whether that was every one."""
    stepped = [config for config in trainer.lr_scheduler_configs if config.interval == "step"]
    per_step = (decision.batch_size, decision.accumulate_grad_batches)
    if not stepped or per_step == (decision.configured_batch_size, decision.configured_accumulate):
        return [], False  # no step schedule, or the run's steps as configured: no loader read
    data = split_data(trainer, "train")
    if data is None:
        return [], False
    plan = run_plan(trainer, data, trainer.world_size)
    configured = dataclasses.replace(plan, accumulate=decision.configured_accumulate)
    tuned = dataclasses.replace(plan, accumulate=decision.accumulate_grad_batches)
    steps = (
        configured.optimizer_steps(decision.configured_batch_size),
        tuned.optimizer_steps(decision.batch_size),
    )
    if steps[0] is None or steps[1] is None or steps[0] == steps[1]:
        return [], False
    slack = max(1, plan.max_epochs or 1)  # a count rounded down per epoch by hand
    found = []
    for config in stepped:
        frequency = max(1, config.frequency)
        resized = resize(config.scheduler, steps[0] // frequency, steps[1] // frequency, slack)
        if resized is not None:
            sizes = (decision.configured_batch_size, decision.batch_size)
            name = type(config.scheduler).__name__
            found.append(resized_finding(name, resized[0], resized[1], steps[1] // frequency, sizes))
    return found, len(found) == len(stepped)


def _scale_schedule(scheduler: Any, factor: float, seen: set[int]) -> None:
    """Multiply the learning rates `scheduler` computes from by `factor`, and those of the
    schedulers it runs in turn (``SequentialLR``) or together (``ChainedScheduler``): at a
    milestone ``SequentialLR`` starts the next one from its own ``base_lrs``, so a warm-up then
    cosine schedule fell back to the unscaled rates after its warm-up."""
    if id(scheduler) in seen:
        return
    seen.add(id(scheduler))
    for key in SCHEDULE_KEYS:
        rates = getattr(scheduler, key, None)
        if isinstance(rates, list):
            setattr(scheduler, key, [lr * factor for lr in rates])
    for child in getattr(scheduler, "_schedulers", ()):  # torch's attribute for both, private
        _scale_schedule(child, factor, seen)
