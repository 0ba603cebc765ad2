"""Growing the batch during the run: the noise scale re-estimated from the run's own gradients.

No Lightning here. The gradient noise scale grows as training goes on (the true gradient shrinks
faster than the per-sample noise), so a larger batch that taught the model too little per sample
at the start can be worth it later. Pollux (Qiao et al., OSDI 2021) re-estimates the noise scale
from the gradients the run computes and grows the batch when goodput says so; its AdaptDL reads,
on a single device, every step's gradient beside a full copy of the one before and a host read of
their norms. `NoiseMeter` reads pairs of consecutive optimizer steps' gradients only every
`PAIR_EVERY` steps, holds at most `MAX_HELD` elements of the first (a strided sample of them in a
larger model), and keeps its sums on the device, read once per epoch.

The two gradients of a pair are batches of ``B`` at nearly the same weights: their mean squared
norm reads ``|G|^2 + tr(Σ)/B``, the squared norm of their mean ``|G|^2 + tr(Σ)/2B``, the two sizes
`estimate_noise` fits. The weights move between the two steps, which adds the change of the
true gradient to the noise: the estimate leans high, so the growth it allows is bounded by the
sizes the start's trials measured (their throughput and memory) and by `Limits.min_efficiency`.

A growth also rescales an adaptive optimizer's running average of squared gradients
(`SECOND_MOMENTS`): it holds the smaller batch's noisier squares and would divide the steps by
them for about ``1 / (1 - beta2)`` steps (1,000 for Adam's default), undoing the raised learning
rate. On the MLP of `benchmarks.time_to_quality` with Adam, 8 epochs grown 32 -> 64 -> 128 ended
at val loss 0.3124 without it and 0.2872 with it, against 0.2879 at 32 throughout (mean of 3 seeds,
``python -m benchmarks growth_moments``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_boost.batch_size.decision import BatchSizeDecision, limits_of
from lightning_boost.batch_size.goodput import NoiseScale, estimate_noise, warmup_factor
from lightning_boost.batch_size.gradients import flat_dot, flat_sample
from lightning_boost.batch_size.search import Limits, choose, lr_factor
from lightning_boost.trials import Trial

#: A pair of consecutive optimizer steps is read every this many steps.
PAIR_EVERY = 8
#: Pairs an estimate needs; with fewer, the meter goes on adding.
MIN_PAIRS = 8
#: A run with fewer optimizer steps after its first epoch does not grow: the trial of a larger
#: size (a warm-up and `AutoBatchSize.steps` timed steps at twice the size: about 8 steps' worth,
#: estimated, not measured) would cost more than 2 % of the steps a growth could speed up.
GROW_AFTER_STEPS = 400
#: Gradient elements held from a pair's first step to its second (16 MiB in fp32); a model with
#: more holds every n-th element of each gradient, the same ones at both steps.
MAX_HELD = 2**22


class NoiseMeter:
    """The gradient noise scale of the run's optimizer steps, from pairs of consecutive steps.

    Args:
        batch: samples per optimizer step (batch x accumulation x world size): what each gradient
            averages over.
        every: a pair starts at every step whose index is a multiple of this.

    Example:
        >>> meter = NoiseMeter(batch=4, every=2)
        >>> for step in range(2 * MIN_PAIRS):  # |G|^2 = 1 and tr(Σ) = 8: a noise scale of 8
        ...     meter.observe(step, [torch.tensor([1.0 + (-1) ** step, 1.0])])
        >>> round(meter.estimate().value), meter.pairs
        (8, 8)
    """

    def __init__(self, batch: int, every: int = PAIR_EVERY) -> None:
        self.batch = batch
        self.every = every
        self.pairs = 0
        self._stride = 0
        self._held: list[Tensor] | None = None
        self._sums: Tensor | None = None  # [mean squared norm, squared norm of the mean, pairs]

    def reads(self, step: int) -> bool:
        """Whether optimizer step `step` is one of a pair (the others need no gradients listed)."""
        return step % self.every in (0, 1)

    def observe(self, step: int, grads: Sequence[Tensor]) -> None:
        """Read the gradients of optimizer step `step` (from 0) if it is one of a pair: no host read."""
        phase = step % self.every
        if phase == 0:
            self._held = [g.clone() for g in self._sample(grads)]
        elif phase == 1 and self._held is not None:
            held, self._held = self._held, None
            current = self._sample(grads)
            if [g.shape for g in held] != [g.shape for g in current]:
                return
            first, second = _squared(held), _squared(current)
            dot = sum((flat_dot(a, b) for a, b in zip(held, current, strict=True)), torch.zeros(()))
            small, large = (first + second) / 2, (first + second + 2 * dot) / 4
            row = torch.stack([small, large, torch.ones_like(small)])
            row = torch.where(torch.isfinite(row).all(), row, torch.zeros_like(row))  # a skipped fp16 step
            self._sums = row if self._sums is None else self._sums + row

    def estimate(self) -> NoiseScale | None:
        """The noise scale of the pairs read since the last `reset` (one host read); ``None``
        with fewer than `MIN_PAIRS`."""
        if self._sums is None:
            return None
        small, large, pairs = self._sums.tolist()
        self.pairs = int(pairs)
        if self.pairs < MIN_PAIRS:
            return None
        return estimate_noise([(self.batch, small / pairs), (2 * self.batch, large / pairs)])

    def reset(self, batch: int | None = None) -> None:
        """Start again (at a new batch per step, when given)."""
        self.batch = batch or self.batch
        self.pairs = 0
        self._held = None
        self._sums = None

    def _sample(self, grads: Sequence[Tensor]) -> list[Tensor]:
        if not self._stride:
            self._stride = max(1, math.ceil(sum(g.numel() for g in grads) / MAX_HELD))
        return [flat_sample(g, self._stride) for g in grads]  # a sparse one (an embedding's) stays sparse


def _squared(grads: list[Tensor]) -> Tensor:
    return sum((flat_dot(g, g) for g in grads), torch.zeros(()))


def could_grow(trials: Sequence[Trial], limits: Limits, current: int, cap: int) -> bool:
    """Whether some noise scale could make a size above `current` worth more: a measured one that
    fits and ran more than `limits.tolerance` faster (its efficiency is at most 1), or the
    unmeasured doubling (`size_to_measure`), at most `cap`.

    Example:
        >>> table = [Trial(64, 1000.0, 10), Trial(128, 1800.0, 20), Trial(256, 1900.0, 99)]
        >>> limits = Limits(256, budget_bytes=50)
        >>> could_grow(table, limits, 64, cap=64), could_grow(table, limits, 128, cap=512)
        (True, False)
    """
    now = next((t for t in trials if t.size == current and t.fits(limits.budget_bytes)), None)
    if now is None:
        return False
    faster = any(
        t.size > current
        and t.fits(limits.budget_bytes)
        and t.samples_per_s > (1 + limits.tolerance) * now.samples_per_s
        for t in trials
    )
    return faster or size_to_measure(trials, limits, current, None, cap) is not None


def size_to_measure(
    trials: Sequence[Trial], limits: Limits, current: int, noise: NoiseScale | None, cap: int
) -> int | None:
    """Twice `current`, when no trial measured it, it is at most `cap`, no smaller size failed to
    fit, and at `noise` (any, when ``None``) its efficiency reaches `limits.min_efficiency`.

    Example:
        >>> limits = Limits(4096, budget_bytes=50, reference=64, min_efficiency=0.8)
        >>> table = [Trial(64, 1000.0, 10)]
        >>> size_to_measure(table, limits, 64, NoiseScale(1000.0, 1.0, 1000.0, (64, 128)), cap=4096)
        128
        >>> size_to_measure(table, limits, 64, NoiseScale(50.0, 1.0, 50.0, (64, 128)), cap=4096) is None
        True
    """
    size = 2 * current
    if size > cap or any(
        t.size == size or (t.size < size and not t.fits(limits.budget_bytes)) for t in trials
    ):
        return None
    return size if noise is None or limits.efficiency(size, noise) >= limits.min_efficiency else None


class Growth:
    """One fit's growing batch: the meter of its steps, and at each epoch's end the noise scale
    read, the next size measured when it could pay, and the growth when it does.

    Args:
        meter: reads the run's steps (`observe`).
        cap: the largest batch the run may take (``max_batch_size``, the data, the run's length,
            the learning rates' limit: `lr_capped`).
        tolerance: a larger size must beat the current one's goodput by more than this.
        measure: a trial of a size on a copy of the model, as the start's trials (its gradient
            statistics are dropped: they were read at other weights than the start's).
        share: makes every rank use rank zero's noise scale (the identity on one process).
    """

    def __init__(
        self,
        meter: NoiseMeter,
        cap: int,
        tolerance: float,
        measure: Callable[[int], Trial],
        share: Callable[[NoiseScale | None], NoiseScale | None] = lambda noise: noise,
    ) -> None:
        self.meter = meter
        self.cap = cap
        self.tolerance = tolerance
        self.measure = measure
        self.share = share
        self.reads: list[tuple[int, float, int]] = []  # (epoch, noise scale, pairs)

    def epoch_end(
        self, decision: BatchSizeDecision, epoch: int, step: int, epoch_batches: int
    ) -> BatchSizeDecision:
        """`decision`, grown when the epoch's noise scale makes a larger size pay, with any size
        measured for it added to its trials."""
        noise = self.share(self.meter.estimate())
        if noise is None:
            return decision
        pairs = self.meter.pairs
        self.reads.append((epoch, noise.value, pairs))
        self.meter.reset()
        limits = growth_limits(decision, self.tolerance)
        size = size_to_measure(decision.trials, limits, decision.batch_size, noise, self.cap)
        if size is not None:
            trial = self.measure(size)
            trial = dataclasses.replace(
                trial, grad_sq=None, half_grad_sq=None, double_grad_sq=None, cross_grad_sq=None
            )
            decision = decision.replace(trials=(*decision.trials, trial))
        within = [t for t in decision.trials if t.size <= self.cap]  # a cache's trials may go past it
        larger = grown_size(within, limits, decision.batch_size, noise)
        if larger is None:
            return decision
        steps = epoch_batches * decision.batch_size // larger.size // decision.accumulate_grad_batches
        after = grown(
            decision, larger, noise, epoch=epoch, step=step, pairs=pairs, warmup_steps=max(1, steps // 10)
        )
        self.meter.reset(after.effective_batch_size)
        return after


#: Optimizer class -> its state's running averages of squared gradients (torch's names).
SECOND_MOMENTS: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("exp_avg_sq", "max_exp_avg_sq"),
    "NAdam": ("exp_avg_sq",),
    "RAdam": ("exp_avg_sq",),
    "SparseAdam": ("exp_avg_sq",),
    "RMSprop": ("square_avg",),
}


def second_moment_factor(noise: float, before: int, after: int) -> float:
    """The expected squared gradient at `after` samples per optimizer step over that at `before`,
    at gradient noise scale `noise`: ``E|g|^2 = |G|^2 (1 + noise / B)`` (McCandlish et al. 2018).

    Example:
        >>> round(second_moment_factor(400.0, 32, 64), 3)  # mostly noise: about a half
        0.537
        >>> round(second_moment_factor(4.0, 32, 64), 3)  # mostly the true gradient: about the same
        0.944
    """
    return (1 + noise / after) / (1 + noise / before)


def rescale_second_moments(optimizer: torch.optim.Optimizer, factor: float) -> str | None:
    """Multiply `optimizer`'s running averages of squared gradients by `factor`, in place; the
    name of its class (or of the optimizer a ``ZeroRedundancyOptimizer`` shards) when it has
    them (`SECOND_MOMENTS`, a subclass's too), else ``None``, touching nothing.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> adam = torch.optim.Adam([w])
        >>> w.grad = torch.full((2,), 2.0); adam.step()
        >>> rescale_second_moments(adam, 0.5), adam.state[w]["exp_avg_sq"]
        ('Adam', tensor([0.0020, 0.0020]))
        >>> rescale_second_moments(torch.optim.SGD([w], lr=0.1), 0.5) is None
        True
    """
    inner = getattr(optimizer, "optim", None)
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer" and isinstance(inner, torch.optim.Optimizer):
        optimizer = inner  # its state is this rank's shard of the optimizer it wraps
    found = next((c.__name__ for c in type(optimizer).__mro__ if c.__name__ in SECOND_MOMENTS), None)
    if found is None:
        return None
    for state in optimizer.state.values():
        for key in SECOND_MOMENTS[found]:
            value = state.get(key)
            if isinstance(value, Tensor):
                value.mul_(factor)
    return type(optimizer).__name__


def grown_size(trials: Sequence[Trial], limits: Limits, current: int, noise: NoiseScale) -> Trial | None:
    """The measured size above `current` that `choose` takes at the re-estimated `noise` (the
    smallest within the tolerance of the best goodput, at least `limits.min_efficiency`
    efficient), or ``None`` when `current` stays: a larger size must beat it by more than the
    tolerance, and the batch never shrinks.

    Example:
        >>> table = [Trial(64, 1000.0, 10), Trial(128, 1800.0, 20)]
        >>> limits = Limits(256, budget_bytes=50, reference=64, min_efficiency=0.8)
        >>> grown_size(table, limits, 64, NoiseScale(1000.0, 1.0, 1000.0, (64, 128))).size
        128
        >>> grown_size(table, limits, 64, NoiseScale(100.0, 1.0, 100.0, (64, 128))) is None  # 72 %
        True
    """
    choice = choose([t for t in trials if t.size >= current], limits, noise)
    return choice if choice is not None and choice.size > current else None


def growth_limits(decision: BatchSizeDecision, tolerance: float) -> Limits:
    """The limits a growth is judged by: the start's (reference, accumulation, world, efficiency
    floor, memory budget), any measured size."""
    return dataclasses.replace(limits_of(decision), max_size=2**31, tolerance=tolerance)


def grown(
    decision: BatchSizeDecision,
    trial: Trial,
    noise: NoiseScale,
    *,
    epoch: int,
    step: int,
    pairs: int,
    warmup_steps: int,
) -> BatchSizeDecision:
    """`decision` grown to `trial`'s size after `epoch` (at optimizer step `step`), the noise scale
    read from `pairs` pairs of steps, with the learning-rate factor of its rule from the reference
    batch (a raise ramped in over `warmup_steps`) and the record of why (`BatchSizeDecision.growth`).

    Example:
        >>> trials = (Trial(64, 1000.0, 10), Trial(128, 1800.0, 20))
        >>> start = BatchSizeDecision(64, effective_batch_size=64, configured_batch_size=64,
        ...     reference_batch_size=64, lr_scaling="sqrt", trials=trials)
        >>> noise = NoiseScale(1000.0, 1.0, 1000.0, (64, 128))
        >>> after = grown(start, start.trials[1], noise, epoch=2, step=300, pairs=12, warmup_steps=11)
        >>> after.batch_size, round(after.lr_factor, 3), round(after.growth[0]["goodput"], 2)
        (128, 1.414, 1.7)
    """
    limits = limits_of(decision)
    before = next(t for t in decision.trials if t.size == decision.batch_size)
    effective = limits.effective(trial.size)
    factor = lr_factor(decision.lr_scaling, effective, decision.reference_batch_size)
    reached = limits.efficiency(trial.size, noise)
    gained = reached / limits.efficiency(decision.batch_size, noise)
    entry = {
        "epoch": epoch,
        "step": step,
        "from": decision.batch_size,
        "to": trial.size,
        "noise_scale": noise.value,
        "pairs": pairs,
        "efficiency": reached,
        "speedup": trial.samples_per_s / before.samples_per_s,
        "goodput": trial.samples_per_s / before.samples_per_s * gained,
        "lr_before": decision.lr_factor,
        "lr_factor": factor,
        "warmup_steps": warmup_steps if factor > decision.lr_factor else 0,
        "second_moment": second_moment_factor(noise.value, limits.effective(decision.batch_size), effective),
    }
    return decision.replace(
        batch_size=trial.size,
        effective_batch_size=effective,
        lr_factor=factor,
        efficiency=reached,
        growth=(*decision.growth, entry),
    )


def lr_ramp(decision: BatchSizeDecision, step: int) -> float:
    """What the learning rates are multiplied by at optimizer step `step` while a raise is warmed
    up: the start's raise (from step 0) and each growth's (from its step), each ramped in linearly.

    Example:
        >>> d = BatchSizeDecision(128, lr_factor=2.0, growth=({"step": 10, "warmup_steps": 4,
        ...     "lr_before": 1.0, "lr_factor": 2.0},))
        >>> [lr_ramp(d, step) for step in (9, 10, 12, 14)]
        [1.0, 0.5, 0.75, 1.0]
    """
    first = decision.growth[0]["lr_before"] if decision.growth else decision.lr_factor
    ramp = warmup_factor(step, decision.lr_warmup_steps, first)
    for grew in decision.growth:
        if step >= grew["step"]:
            raise_ = grew["lr_factor"] / grew["lr_before"]
            ramp *= warmup_factor(step - grew["step"], grew["warmup_steps"], raise_)
    return ramp
