"""Goodput: what a batch size is worth to the model, not only how many samples per second it runs.

No Lightning here. A larger batch runs more samples per second, but past the gradient noise scale
each sample teaches the model less: the steps needed to reach a loss fall by less than the batch
grows (McCandlish et al., "An Empirical Model of Large-Batch Training", 2018). Pollux (Qiao et
al., OSDI 2021) calls throughput x statistical efficiency *goodput* and picks the batch size that
maximizes it. This module holds the pieces, each over plain numbers:

- `estimate_noise`: the gradient noise scale from the squared gradient norms the batch-size
  trials measured at several sizes, all at the same (the run's initial) parameters
  (``E|G_B|^2 = |G|^2 + tr(Σ)/B``, fitted by least squares over ``1/B``);
- `efficiency`: the progress per sample at an effective batch, relative to the user's;
- `lr_rule`: the learning-rate scaling rule (the square root of the batch's growth, Malladi et al.
  2022 for adaptive optimizers, and for SGD too: Goyal et al. 2017's linear rule ended worse on the
  demo's short one-cycle SGD run; see `LR_FACTOR_WARN`);
- `warmup_factor`: the multiplier that ramps a scaled learning rate in over the first steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_boost.trials import cautious_grad_sq

#: The largest learning-rate factor a chosen size may need, and past which a requested one is a
#: warning: large-batch training is known to diverge or end worse past it without more care than a
#: rule of thumb gives. Measured on the demo's ResNet-18 (one-cycle SGD, 16,384 images x 2 epochs,
#: bf16 on an H200, 10 seeds of `batch_quality`'s fits; RESULTS' GPU rows): batch 64's mean final
#: accuracy 99.53 %; batch 256 at x2 99.45 % (within the seeds' spread), at x4 99.08 % (9 seeds of
#: 10 below); batch 512 at x2.83 98.98 % (all 10 below). Goyal et al. 2017 reach x32 on ImageNet,
#: but over 90 epochs with 5 of warm-up, not the few hundred steps a short run has.
LR_FACTOR_WARN = 2.0


@dataclass(frozen=True)
class NoiseScale:
    """The gradient noise scale ``B_noise = tr(Σ) / |G|^2``, in samples.

    Args:
        value: the noise scale; 0 when no noise was seen. When the gradient's noise hid its mean
            at every measured size, the largest of them: a lower bound, the most cautious value
            the measurements allow (a larger batch then looks least efficient).
        grad_sq: the estimate of the squared norm of the true gradient ``|G|^2``.
        trace: the estimate of the per-sample gradient variance ``tr(Σ)``.
        sizes: the batch sizes it was fitted on.
        lower_bound: `value` is a lower bound (the noise hid the gradient), not an estimate.
    """

    value: float
    grad_sq: float
    trace: float
    sizes: tuple[int, ...]
    lower_bound: bool = False


def estimate_noise(points: Sequence[tuple[int, float]]) -> NoiseScale | None:
    """The noise scale from ``(batch size, squared gradient norm at that size)`` pairs.

    ``E|G_B|^2 = |G|^2 + tr(Σ)/B``: a least-squares line over ``1/B`` gives both terms. A fitted
    trace at or below zero means no noise was seen (0: a larger batch teaches nothing more per
    step); a true-gradient term at or below zero means the noise hid the gradient at every size
    measured, so the noise scale is beyond them: the largest size is returned as a lower bound,
    which keeps every larger batch's efficiency at its most cautious. ``None`` with fewer than two
    sizes.

    Example:
        >>> est = estimate_noise([(64, 1.0 + 640.0 / 64), (128, 1.0 + 640.0 / 128), (256, 1.0 + 2.5)])
        >>> round(est.value), round(est.grad_sq, 3), round(est.trace)
        (640, 1.0, 640)
        >>> estimate_noise([(64, 1.0), (128, 1.2)]).value, estimate_noise([(64, 1.0)]) is None
        (0.0, True)
        >>> hidden = estimate_noise([(64, 2.0), (128, 0.9)])
        >>> hidden.value, hidden.lower_bound
        (128.0, True)
    """
    finite = [(size, sq) for size, sq in points if math.isfinite(sq)]
    sizes = tuple(sorted({size for size, _ in finite}))
    if len(sizes) < 2:
        return None
    xs = [1.0 / size for size, _ in finite]
    ys = [sq for _, sq in finite]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    trace = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    grad_sq = mean_y - trace * mean_x
    if trace <= 0:
        return NoiseScale(0.0, grad_sq, trace, sizes)
    if grad_sq <= 0:
        return NoiseScale(float(max(sizes)), grad_sq, trace, sizes, lower_bound=True)
    return NoiseScale(trace / grad_sq, grad_sq, trace, sizes)


def cross_noise(size: int, batch_sq: float, cross: float, se: float) -> NoiseScale | None:
    """The noise scale from the gradients of independent batches of `size`, at one set of
    parameters: their mean squared norm `batch_sq` (``E|G_B|^2 = |G|^2 + tr(Σ)/B``) and the mean
    dot product of every pair, `cross`, whose expectation is ``|G|^2`` itself: unbiased, since
    the noise of independent batches cancels between them, the noise BatchNorm's per-batch
    statistics add within a batch too (which biases the fit over sizes of one batch and its
    halves, `estimate_noise`). ``|G|^2`` is taken two standard errors (`se`) higher, so the value
    is cautious: the smallest noise scale the measurements allow (a larger batch then looks least
    efficient). ``None`` when that ``|G|^2`` is not positive or a value is not finite.

    Example (``|G|^2 = 1``, ``tr(Σ) = 640``, batches of 64):
        >>> round(cross_noise(64, 1.0 + 640 / 64, 1.0, 0.0).value)
        640
        >>> round(cross_noise(64, 11.0, 1.0, 0.5).value)  # |G|^2 read as 2: cautious
        288
        >>> cross_noise(64, 11.0, -3.0, 1.0) is None, cross_noise(64, 2.0, 3.0, 0.0).value
        (True, 0.0)
    """
    grad_sq = cautious_grad_sq(cross, se)
    if not all(map(math.isfinite, (batch_sq, cross, se))) or grad_sq <= 0:
        return None
    trace = size * (batch_sq - grad_sq)
    if trace <= 0:
        return NoiseScale(0.0, grad_sq, trace, (size,))
    return NoiseScale(trace / grad_sq, grad_sq, trace, (size,))


def efficiency(noise: float, effective: int, reference: int) -> float:
    """Progress per sample at an `effective` batch relative to the `reference` one (the user's):
    ``(B_noise + reference) / (B_noise + effective)``. Below 1 for a larger batch: the run needs
    more samples for the same model, so it must run that much faster to be worth it.

    Example:
        >>> efficiency(1000.0, 128, 64), efficiency(0.0, 128, 64), efficiency(math.inf, 4096, 64)
        (0.9432624113475178, 0.5, 1.0)
    """
    if math.isinf(noise):
        return 1.0
    return (noise + reference) / (noise + effective)


#: Optimizers (class names) whose rate scales a step already sized by the loss's curvature: a
#: larger batch gives them a better gradient, not a reason for a longer step.
CURVATURE_STEPPED = frozenset({"LBFGS"})


def lr_rule(requested: str | None, optimizers: Sequence[str] = ()) -> str | None:
    """The learning-rate scaling rule: `requested` unless it is ``"auto"``, which is ``"sqrt"``
    for every optimizer but those in `CURVATURE_STEPPED` (LBFGS, whose ``lr`` multiplies a
    quasi-Newton step), where the rates are kept (``None``). For Adam, AdamW, RMSprop and other
    adaptive ones the square root is the rule that keeps their updates' noise alike (Malladi et
    al. 2022); for SGD it is the milder rule the measurements in `LR_FACTOR_WARN` support: at 4x
    the batch, SGD's linear x4 ended worse, the square root's x2 did not.

    Example:
        >>> lr_rule("auto", ["AdamW"]), lr_rule("auto", ["LBFGS"]), lr_rule("linear", ["LBFGS"])
        ('sqrt', None, 'linear')
    """
    if requested != "auto":
        return requested
    return None if CURVATURE_STEPPED.intersection(optimizers) else "sqrt"


def warmup_factor(step: int, steps: int, factor: float) -> float:
    """What to multiply the scaled learning rate by at optimizer step `step` (from 0) so that it
    rises linearly from the unscaled rate to the scaled one over `steps` steps; 1 once warmed up
    and for a factor at or below 1 (a smaller rate needs no warm-up).

    Example:
        >>> [round(warmup_factor(k, 4, 4.0), 4) for k in range(5)]
        [0.25, 0.4375, 0.625, 0.8125, 1.0]
    """
    if factor <= 1.0 or step >= steps:
        return 1.0
    return (1.0 + (factor - 1.0) * step / steps) / factor
