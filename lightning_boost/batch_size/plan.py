"""What the run will train, from the Trainer's limits and the dataset: whether tuning can pay,
and how large a batch the run can take. No Lightning here (the callback reads the Trainer).

A batch-size search costs real steps, so a run too short to repay them keeps the user's size:
``fast_dev_run`` and ``overfit_batches`` (Lightning's debugging modes), runs whose length is a
count of batches or steps (``limit_train_batches=N``, ``max_steps``: a larger batch would train
more samples, not the same ones sooner) and runs of fewer than `MIN_RUN_STEPS` optimizer steps.
A batch is never so large that an epoch has fewer than `MIN_STEPS_PER_EPOCH` batches, or fewer
than an integer ``val_check_interval`` (Lightning rejects that), or none left by a fractional
``limit_train_batches``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

#: A run of fewer optimizer steps cannot repay the trials (about a dozen steps' worth) and the risk.
MIN_RUN_STEPS = 100
#: No batch size leaves an epoch fewer batches than this: a few huge steps per epoch train a
#: worse model for the same samples (and leave schedulers, logging and validation too few steps).
MIN_STEPS_PER_EPOCH = 16
#: cudnn.benchmark (the preset's default on CUDA) is kept for a run whose steps take at least this
#: long (seconds, from the trial at the chosen size). On an H200 its autotuning cost 0.9-1.7 s per
#: new training shape and 0.3-0.5 s per new evaluation shape, 7.3-7.5 s at the first shape a
#: machine autotunes (even after runs without it); the autotuned steps at 256 ran from 10 % slower
#: to 14 % faster in three pairs of processes (the demo's ResNet-18 in bf16, `python -m benchmarks
#: cudnn_autotune`). The 3-5 s a run's few shapes cost is 5 % of 100 s, what a gain that size returns.
AUTOTUNE_MIN_RUN_S = 100.0


@dataclass(frozen=True)
class RunPlan:
    """The Trainer's limits and the training data, per rank.

    Args:
        samples: training samples per epoch on each rank; ``None`` when the dataset has no length.
        max_epochs: the epochs the run trains; ``None`` when only `max_steps` ends it.
        max_steps: ``Trainer(max_steps=)``, -1 for none.
        limit_batches: ``Trainer(limit_train_batches=)``: a fraction, or a count of batches.
        val_check_interval: ``Trainer(val_check_interval=)``: a count of batches binds the size.
        check_every: ``Trainer(check_val_every_n_epoch=)``; ``None``: an integer
            `val_check_interval` counts batches across epochs.
        accumulate: batches per optimizer step.
        drop_last: the training loader drops the last partial batch.
        debugging: why Lightning runs this fit as a check, not a training (``"fast_dev_run"``,
            ``"overfit_batches"``), or ``""``.
    """

    samples: int | None
    max_epochs: int | None = 1
    max_steps: int = -1
    limit_batches: int | float = 1.0
    val_check_interval: int | float = 1.0
    check_every: int | None = 1
    accumulate: int = 1
    drop_last: bool = False
    debugging: str = ""

    def batches_per_epoch(self, size: int) -> int | None:
        """Training batches per epoch at `size`, as Lightning counts them; ``None`` if unknown.

        Example:
            >>> RunPlan(1000, limit_batches=0.1).batches_per_epoch(64), RunPlan(1000).batches_per_epoch(64)
            (1, 16)
        """
        if self.samples is None:
            return self.limit_batches if isinstance(self.limit_batches, int) else None
        batches = self.samples // size if self.drop_last else math.ceil(self.samples / size)
        if isinstance(self.limit_batches, int):
            return min(batches, self.limit_batches)
        return int(batches * self.limit_batches)

    def optimizer_steps(self, size: int) -> int | None:
        """Optimizer steps the run takes at `size`; ``None`` when its length is unknown.

        Example:
            >>> RunPlan(6400, 3).optimizer_steps(64), RunPlan(6400, 3, max_steps=50).optimizer_steps(64)
            (300, 50)
        """
        per_epoch = self.batches_per_epoch(size)
        by_epochs = (
            math.ceil(per_epoch / self.accumulate) * self.max_epochs
            if per_epoch is not None and self.max_epochs is not None
            else None
        )
        if self.max_steps < 0:
            return by_epochs
        return self.max_steps if by_epochs is None else min(by_epochs, self.max_steps)

    def samples_planned(self, size: int) -> float:
        """Samples the run trains on each rank at `size` (``inf`` when unknown)."""
        steps = self.optimizer_steps(size)
        return math.inf if steps is None else float(steps * self.accumulate * size)

    def repays_autotuning(self, size: int, samples_per_s: float) -> bool:
        """Whether the run's steps at `size`, at its trial's `samples_per_s` per rank, take
        `AUTOTUNE_MIN_RUN_S` or longer (a run of unknown length does).

        Example:
            >>> RunPlan(16384, max_epochs=2).repays_autotuning(256, 20_000.0)  # the demo: 1.6 s
            False
            >>> RunPlan(1_281_167, max_epochs=90).repays_autotuning(256, 3_000.0)  # ImageNet: 11 h
            True
        """
        return samples_per_s <= 0 or self.samples_planned(size) / samples_per_s >= AUTOTUNE_MIN_RUN_S

    def ends_by_steps(self, size: int) -> bool:
        """Whether `max_steps` ends the run at `size` before its epochs would (or without them)."""
        by_epochs = dataclasses.replace(self, max_steps=-1).optimizer_steps(size)
        return self.max_steps >= 0 and (by_epochs is None or by_epochs > self.max_steps)

    def validations(self, size: int) -> int | None:
        """The validation runs of the fit at training batch `size`, as Lightning schedules them
        (``val_check_batch = max(1, int(batches * val_check_interval))`` for a fraction); ``None``
        when unknown (no dataset length, no epoch count, `max_steps` ending it sooner).

        Example:
            >>> RunPlan(16384, max_epochs=2, val_check_interval=0.25).validations(64)
            8
            >>> RunPlan(16384, max_epochs=3, val_check_interval=100, check_every=None).validations(64)
            7
        """
        batches = self.batches_per_epoch(size)
        if batches is None or self.max_epochs is None or self.ends_by_steps(size):
            return None
        if isinstance(self.val_check_interval, int):
            if self.check_every is None:
                return batches * self.max_epochs // self.val_check_interval
            per_epoch = batches // self.val_check_interval
        else:
            per_epoch = batches // max(1, int(batches * self.val_check_interval))
        return per_epoch * (self.max_epochs // (self.check_every or 1))

    def largest_size(self) -> int | None:
        """The largest batch that leaves each epoch `MIN_STEPS_PER_EPOCH` batches (or an integer
        ``val_check_interval``'s); ``None`` without a dataset length.

        Example:
            >>> RunPlan(7168).largest_size(), RunPlan(7168, limit_batches=0.1).largest_size()
            (448, 44)
        """
        if self.samples is None:
            return None
        need = MIN_STEPS_PER_EPOCH
        if isinstance(self.val_check_interval, int):
            need = max(need, self.val_check_interval)
        if isinstance(self.limit_batches, float):
            need = math.ceil(need / self.limit_batches) if self.limit_batches > 0 else need
        return max(1, self.samples // need)

    def keep_reason(self, size: int, target: bool) -> str:
        """Why the run keeps the user's `size` untuned, or ``""`` to tune. `target`: the user asked
        for a global batch (then a run counted in steps or batches may still re-split it).

        Example:
            >>> RunPlan(1000, max_epochs=1).keep_reason(64, target=False)
            'the run is 16 optimizer steps, too few to repay batch-size trials (at least 100)'
            >>> RunPlan(100_000, max_epochs=None, max_steps=5000).keep_reason(64, target=True)
            ''
        """
        if self.debugging:
            return f"`{self.debugging}` runs the fit as a check, not a training"
        if not target:
            batches = self.batches_per_epoch(size)
            if (
                isinstance(self.limit_batches, int)
                and self.samples is not None
                and batches == self.limit_batches
            ):
                return (
                    f"`limit_train_batches={self.limit_batches}` counts batches: a larger batch would"
                    " train more samples, not the same ones sooner"
                )
            if self.ends_by_steps(size):
                return (
                    f"`max_steps={self.max_steps}` ends the run by steps: a larger batch would train more"
                    " samples, not the same ones sooner (pass `target_global_batch_size` to re-split it)"
                )
        steps = self.optimizer_steps(size)
        if steps is not None and steps < MIN_RUN_STEPS:
            return (
                f"the run is {steps} optimizer steps, too few to repay batch-size trials"
                f" (at least {MIN_RUN_STEPS})"
            )
        largest = self.largest_size()
        if largest is not None and largest <= size:
            return (
                f"a larger batch would leave an epoch fewer than {MIN_STEPS_PER_EPOCH} batches"
                " (or the `val_check_interval` it needs)"
            )
        return ""
