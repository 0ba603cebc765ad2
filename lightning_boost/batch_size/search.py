"""Batch-size decisions over measured trials: which size to try next, which to keep, and the
accumulation and learning-rate scaling that keep the effective batch. Plain data, no Lightning.

Sizes are judged by *goodput*: measured throughput times the statistical efficiency of the
effective batch (`lightning_boost.batch_size.goodput`), with the gradient noise scale fitted to the
squared gradient norms the same trials measured. A size is worth measuring only while it can
still pay for its trial over the planned run, and kept only when its gain is beyond the spread
its own timed steps showed.

The search grows the batch size by doubling from a start size while steps fit in memory and
throughput still improves (a doubling the peaks measured so far say would go over the memory
budget is replaced by the largest size they say fits, so no trial is spent over it), halves it
when the start does not fit, then refines between the largest size that fits and the smallest
that does not while throughput was still rising there.
The choice is the smallest measured size within a tolerance (or the measured spread, if larger)
of the best goodput, among sizes whose peak memory stays within the budget and whose statistical
efficiency is at least `Limits.min_efficiency`: a size that was never measured is never returned.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_boost.batch_size.goodput import (
    LR_FACTOR_WARN,
    NoiseScale,
    cross_noise,
    efficiency,
    estimate_noise,
)
from lightning_boost.trials import StepFailed, Trial, mean_known, why_failed

#: Learning-rate scaling rules: factor from (effective batch / reference batch).
LR_RULES: dict[str, Callable[[float], float]] = {"linear": lambda ratio: ratio, "sqrt": math.sqrt}


@dataclass(frozen=True)
class Limits:
    """What bounds the search.

    Args:
        max_size: the largest size to try (``max_batch_size``, the samples per rank, the target).
        budget_bytes: peak memory a step may reach.
        tolerance: sizes within this fraction of the best throughput count as equally fast.
        patience: stop growing after this many doublings in a row gain less than `tolerance`.
        time_budget_s: no trial starts that would end past this many seconds of trials.
        reference: the effective batch the user's settings train with: statistical efficiency
            is relative to it; ``None`` judges sizes by throughput alone.
        accumulate: ``accumulate_grad_batches`` (the user's, or set from `target`).
        world: processes in the run.
        target: a global batch the user asked for: accumulation keeps the effective batch near it.
        min_efficiency: a size whose statistical efficiency is below this is not chosen (nor
            measured once the noise scale says so): the run keeps its epochs, so each sample must
            teach the model nearly as much as at the user's size.
        planned_samples: samples the run trains on each rank; a size that cannot save more time
            over them than its trial costs is not measured.
        max_reason: what sets `max_size` when the search should say so where it stops there
            (`lr_capped`).
    """

    max_size: int
    budget_bytes: int
    tolerance: float = 0.05
    patience: int = 2
    time_budget_s: float = float("inf")
    reference: int | None = None
    accumulate: int = 1
    world: int = 1
    target: int | None = None
    min_efficiency: float = 0.0
    planned_samples: float = float("inf")
    max_reason: str = ""

    def effective(self, size: int) -> int:
        """The effective batch at `size` per rank: size x accumulation x world size."""
        accumulate = self.accumulate if self.target is None else accumulation(self.target, size, self.world)
        return size * accumulate * self.world

    def efficiency(self, size: int, noise: NoiseScale | None, *, at_most: bool = False) -> float:
        """Statistical efficiency at `size`: 1 without a reference or a noise estimate. A noise
        scale known only as a lower bound gives the most cautious efficiency (for choosing), or with
        `at_most` the most it could be, 1 (for deciding whether a larger size is worth measuring:
        its gradient may resolve the noise scale)."""
        if self.reference is None or noise is None or (at_most and noise.lower_bound):
            return 1.0
        return efficiency(noise.value, self.effective(size), self.reference)


def noise_of(trials: Sequence[Trial], budget_bytes: int) -> NoiseScale | None:
    """The gradient noise scale fitted to the fitting trials' squared gradient norms (a trial's
    halves count at half its size). Where those leave the gradient hidden by the noise, a trial's
    two batches' mean gradient joins them at twice its size: it stands in for the trial of the
    larger size the search would measure for its gradient (without BatchNorm it is exactly that
    trial's first gradient: the same samples at the same weights), so the search decides as it
    did with that trial, one pass instead of a trial later. A trial that read independent batches'
    gradients (the first, on an accelerator) gives the noise scale from their cross products
    instead (`cross_noise`, cautious): the halves' fit is biased by BatchNorm, those are not."""
    ok = [t for t in trials if t.fits(budget_bytes)]
    for t in sorted(ok, key=lambda t: t.size):
        if t.batch_grad_sq is not None and t.cross_grad_sq is not None:
            crossed = cross_noise(t.size, t.batch_grad_sq, t.cross_grad_sq, t.cross_se or 0.0)
            if crossed is not None:
                return crossed
    points = [(t.size, t.grad_sq) for t in ok if t.grad_sq is not None] + [
        (t.size // 2, t.half_grad_sq) for t in ok if t.half_grad_sq is not None
    ]
    noise = estimate_noise(points)
    doubles = [(t.size * 2, t.double_grad_sq) for t in ok if t.double_grad_sq is not None]
    if not doubles or (noise is not None and not noise.lower_bound):
        return noise
    return estimate_noise(points + doubles)


def goodput(trial: Trial, limits: Limits, noise: NoiseScale | None) -> float:
    """Throughput times statistical efficiency: the samples per second the model is worth."""
    return trial.samples_per_s * limits.efficiency(trial.size, noise)


def search(measure: Callable[[int], Trial], start: int, limits: Limits) -> tuple[list[Trial], str]:
    """Measure sizes from `start` until `next_size` stops (or a batch comes back short of its size:
    the data holds no more; or the step fails at a size other than one that ran: BatchNorm's at 1,
    a step that reshapes by the size it was written for at any other), then `settle` them; the
    trials and why. A step that fails at the first size raises: the run would fail the same.

    Example:
        >>> def measure(size):  # nothing fits a budget of 10, and the step cannot run at 1
        ...     if size == 1:
        ...         raise StepFailed("...", "ValueError('Expected more than 1 value per channel')")
        ...     return Trial(size, 100.0 * size, 20 * size)
        >>> trials, why = search(measure, 4, Limits(64, budget_bytes=10))
        >>> [t.size for t in trials], why
        ([4, 2], "the step failed at batch size 1 (ValueError('Expected more than 1 value per channel'))")
    """
    trials: list[Trial] = []
    while True:
        size, reason = next_size(trials, start, limits)
        if size is None:
            return settle(measure, trials, limits), reason
        try:
            trials.append(measure(size))
        except StepFailed as failed:
            if not trials:
                raise  # the user's step itself fails, at the size it was written for
            return settle(measure, trials, limits), f"the step failed at batch size {size} ({failed.cause})"
        if trials[-1].size < size:  # the data ran out before the batch was full
            return settle(
                measure, trials, limits
            ), f"the data: a batch of {size} held {trials[-1].size} samples"


def settle(measure: Callable[[int], Trial], trials: list[Trial], limits: Limits) -> list[Trial]:
    """Measure again a size whose step was timed slower than a larger size's (a step cannot take
    longer on fewer samples: a busy moment hit that trial), keeping the faster of the two, so a
    disturbed small size does not make a larger one look better than it is.

    Example:
        >>> disturbed = [Trial(64, 736.0, 1), Trial(128, 32_000.0, 2)]  # 87 ms at 64, 4 at 128
        >>> again = settle(lambda size: Trial(size, 32_000.0, 1), disturbed, Limits(256, 9))
        >>> [t.samples_per_s for t in again]
        [32000.0, 32000.0]
    """
    settled = list(trials)
    ok = sorted((t for t in settled if t.fits(limits.budget_bytes)), key=lambda t: t.size)
    for small, large in itertools.pairwise(ok):
        if small.size / small.samples_per_s > large.size / large.samples_per_s:
            again = measure(small.size)
            if again.fits(limits.budget_bytes) and again.samples_per_s > small.samples_per_s:
                settled[settled.index(small)] = dataclasses.replace(
                    again,
                    seconds=small.seconds + again.seconds,
                    grad_sq=mean_known(t.grad_sq for t in (small, again)),
                    half_grad_sq=mean_known(t.half_grad_sq for t in (small, again)),
                )
    return settled


def next_size(trials: Sequence[Trial], start: int, limits: Limits) -> tuple[int | None, str]:
    """The next size to measure, or ``(None, why the search stopped)``.

    A size whose trial would end past the time budget is not measured. Its time is bounded by
    the nearest smaller trial's, scaled by the sizes' ratio (a trial's fixed costs do not grow
    with the batch, so this overestimates rather than overruns).

    Example:
        >>> limits = Limits(max_size=64, budget_bytes=100)
        >>> next_size([Trial(8, 80.0, 10)], 8, limits)
        (16, '')
        >>> next_size([Trial(8, 0.0, None, oom=True)], 8, limits)
        (4, '')
        >>> next_size([Trial(8, 80.0, 10, seconds=40.0)], 8, Limits(64, 100, time_budget_s=60.0))
        (None, 'the time budget of 60 s (16 would take about 80 s more)')
        >>> next_size([Trial(8, 80.0, 10, seconds=1.0)], 8, Limits(64, 100, planned_samples=240))
        (None, 'the planned run (240 samples): 16 could save at most 1.5 s, less than its trial (about 2 s)')
    """
    if not trials:
        return min(start, limits.max_size), ""
    spent = sum(t.seconds for t in trials)
    if spent >= limits.time_budget_s:
        return None, f"the time budget of {limits.time_budget_s:g} s"
    size, why = _next_size(trials, limits)
    if size is None:
        return size, why
    ran = [t for t in trials if not t.oom] or list(trials)
    below = [t for t in ran if t.size <= size]
    nearest = max(below, key=lambda t: t.size) if below else min(ran, key=lambda t: t.size)
    expected = nearest.seconds * max(size / nearest.size, 1.0)
    if spent + expected > limits.time_budget_s:
        more = f"{size} would take about {expected:.2g} s more"
        return None, f"the time budget of {limits.time_budget_s:g} s ({more})"
    saving = _largest_saving(trials, size, limits)
    if saving is not None and saving <= expected:
        return None, (
            f"the planned run ({limits.planned_samples:,.0f} samples): {size} could save at most"
            f" {saving:.2g} s, less than its trial (about {expected:.2g} s)"
        )
    return size, why


def _largest_saving(trials: Sequence[Trial], size: int, limits: Limits) -> float | None:
    """The most seconds measuring `size` could save over the planned run: its step can take no
    less time than the largest fitting size's below it, so its throughput is at most that size's
    scaled by the sizes' ratio; ``None`` when there is nothing to bound it with."""
    ok = [t for t in trials if t.fits(limits.budget_bytes)]
    below = [t for t in ok if t.size < size]
    if not below or math.isinf(limits.planned_samples):
        return None
    noise = noise_of(trials, limits.budget_bytes)
    best = max(goodput(t, limits, noise) for t in ok)
    nearest = max(below, key=lambda t: t.size)
    bound = (
        nearest.samples_per_s
        * size
        / nearest.size
        * limits.efficiency(size, noise, at_most=_unresolved(noise))
    )
    if bound <= best:
        return 0.0
    return limits.planned_samples / best - limits.planned_samples / bound


def _next_size(trials: Sequence[Trial], limits: Limits) -> tuple[int | None, str]:
    """The search's next size after `trials` (at least one), budget aside."""
    tried = {t.size for t in trials}
    ok = sorted((t for t in trials if t.fits(limits.budget_bytes)), key=lambda t: t.size)
    failed = sorted((t for t in trials if not t.fits(limits.budget_bytes)), key=lambda t: t.size)
    if not ok:
        smallest = failed[0].size
        return (smallest // 2, "") if smallest > 1 else (None, why_failed(failed[0]))
    largest = ok[-1]
    above = [t for t in failed if t.size > largest.size]
    if not above:
        if largest.size >= limits.max_size:
            return None, f"the size limit of {limits.max_size}" + (
                f" ({limits.max_reason})" if limits.max_reason else ""
            )
        if _plateaued(ok, limits):
            return (
                None,
                f"a throughput plateau ({limits.patience} doublings gained under {limits.tolerance:.0%})",
            )
        doubled = min(2 * largest.size, limits.max_size)
        noise = noise_of(trials, limits.budget_bytes)
        if limits.efficiency(doubled, noise, at_most=_unresolved(noise)) < limits.min_efficiency:
            return None, (
                f"the statistical efficiency ({doubled} would teach the model"
                f" {limits.efficiency(doubled, noise):.0%} as much per sample, under"
                f" {limits.min_efficiency:.0%}; noise scale {_noise_text(noise)})"
            )
        fits = _projected_fit(ok, limits.budget_bytes)
        if fits is None or fits >= doubled:
            return doubled, ""
        if fits > largest.size:
            return fits, ""  # the largest size the peaks so far say fits: no trial over the budget
        return None, f"the memory budget ({doubled} would peak over it, by the peaks measured so far)"
    upper = above[0]
    noise = noise_of(trials, limits.budget_bytes)
    if max(ok, key=lambda t: goodput(t, limits, noise)) is not largest:
        return None, f"{why_failed(upper)} at {upper.size}, past the goodput peak"
    middle = _between(largest.size, upper.size)
    if middle is None or middle in tried:
        return None, f"{why_failed(upper)} at {upper.size}"
    return middle, ""


def choose(trials: Sequence[Trial], limits: Limits, noise: NoiseScale | None = None) -> Trial | None:
    """The smallest fitting trial whose goodput is within `tolerance` (or the two trials' measured
    spread, if wider) of the best, among those efficient enough; ``None`` if none fits. Efficiency
    is at `noise`, or at the noise scale the trials' gradients give.

    The smallest fitting size is always a candidate, whatever its efficiency: it is the closest
    to what the user wrote.

    Example:
        >>> table = [Trial(32, 900.0, 10), Trial(64, 1000.0, 20), Trial(128, 1010.0, 40)]
        >>> choose(table, Limits(256, budget_bytes=100)).size
        64
        >>> choose(table + [Trial(256, oom=True)], Limits(256, budget_bytes=15)).size
        32
        >>> noisy = [Trial(32, 900.0, 10, spread=0.1), Trial(64, 1000.0, 20, spread=0.1)]
        >>> choose(noisy, Limits(256, budget_bytes=100)).size  # an 11% gain within 20% of noise
        32
    """
    ok = sorted((t for t in trials if t.fits(limits.budget_bytes)), key=lambda t: t.size)
    if not ok:
        return None
    noise = noise or noise_of(trials, limits.budget_bytes)
    candidates = [ok[0], *(t for t in ok[1:] if limits.efficiency(t.size, noise) >= limits.min_efficiency)]
    best = max(candidates, key=lambda t: goodput(t, limits, noise))
    top = goodput(best, limits, noise)
    return min(
        (
            t
            for t in candidates
            if goodput(t, limits, noise) >= (1 - max(limits.tolerance, t.spread + best.spread)) * top
        ),
        key=lambda t: t.size,
    )


def fitting_validation(
    check: Callable[[int], Trial], trials: Sequence[Trial], choice: Trial, limits: Limits
) -> tuple[Trial, list[Trial]]:
    """`choice`, or the next smaller fitting size, whose validation step (`check`) runs and fits too;
    with the checks made.

    Raises:
        MemoryError: when no fitting size's validation step fits.
        StepFailed: when the validation step fails at every size.
    """
    candidates = sorted(
        (t for t in trials if t.fits(limits.budget_bytes) and t.size <= choice.size), key=lambda t: -t.size
    )
    checks: list[Trial] = []
    failed: StepFailed | None = None
    for candidate in candidates:
        try:
            checks.append(check(candidate.size))
        except StepFailed as error:  # a step written for another size: the run's would fail too
            failed = error
            continue
        if checks[-1].fits(limits.budget_bytes):
            return candidate, checks
    if failed is not None:
        raise failed
    raise MemoryError(
        f"AutoBatchSize: a validation step does not fit at any batch size whose training step fits (down to"
        f" {candidates[-1].size}): lower the validation batch size or the model's memory use."
    )


def accumulation(target_global: int, batch_size: int, world_size: int) -> int:
    """``accumulate_grad_batches`` that brings batch x accumulation x world size closest to `target_global`.

    Example:
        >>> accumulation(256, 32, 2), accumulation(256, 96, 1), accumulation(64, 128, 1)
        (4, 3, 1)
    """
    per_step = batch_size * world_size
    below = max(1, target_global // per_step)
    above = below + 1
    return below if abs(target_global - below * per_step) <= abs(above * per_step - target_global) else above


def lr_capped(limits: Limits, rule: str | None, configured: int = 1) -> Limits:
    """`limits` whose largest size keeps the learning rates within `LR_FACTOR_WARN` (x2) of the
    reference batch's under `rule`, where the search picks the size itself: past it the rule is
    known to fail (the demo's ResNet-18 over 10 seeds on an H200, `LR_FACTOR_WARN`: batch 256 at
    x4 and 512 at x2.83 ended worse than batch 64, 256 at x2 did not), so a faster step there would
    buy a worse model. A `target` global batch is the user's request (its factor stays a warning);
    without a rule nothing is scaled, so nothing is capped. Never below the `configured` size: the
    user's own (past x2 of a `reference_batch_size` it is a warning).

    Example:
        >>> lr_capped(Limits(2**31, 100, reference=64), "sqrt").max_size
        256
        >>> lr_capped(Limits(2**31, 100, reference=64, world=2), "sqrt").max_size  # x4 in all: x2
        128
        >>> lr_capped(Limits(2**31, 100, reference=64), "linear").max_size
        128
        >>> lr_capped(Limits(128, 100, reference=64), "sqrt").max_size  # a lower limit stays
        128
        >>> lr_capped(Limits(2**31, 100, reference=64, target=2048), "sqrt").max_size
        2147483648
        >>> lr_capped(Limits(2**31, 100, reference=16), "sqrt", configured=128).max_size
        128
    """
    if rule is None or limits.reference is None or limits.target is not None:
        return limits
    largest = max(configured, largest_effective(limits.reference, rule) // (limits.accumulate * limits.world))
    if largest >= limits.max_size:
        return limits
    why = f"larger sizes would need learning rates past x{LR_FACTOR_WARN:g} under the {rule} rule"
    return dataclasses.replace(limits, max_size=largest, max_reason=why)


def largest_effective(reference: int, rule: str) -> int:
    """The largest effective batch whose learning rates stay within `LR_FACTOR_WARN` of the
    `reference` batch's under `rule` (`LR_RULES` inverted at the limit).

    Example:
        >>> largest_effective(64, "sqrt"), largest_effective(64, "linear")
        (256, 128)
    """
    return int(reference * {"linear": LR_FACTOR_WARN, "sqrt": LR_FACTOR_WARN**2}[rule])


def lr_factor(rule: str | None, effective: int, reference: int) -> float:
    """The learning-rate multiplier for going from a `reference` effective batch to `effective`.

    Example:
        >>> lr_factor("linear", 512, 128), lr_factor("sqrt", 512, 128), lr_factor(None, 512, 128)
        (4.0, 2.0, 1.0)
    """
    return 1.0 if rule is None else LR_RULES[rule](effective / reference)


def _projected_fit(ok: Sequence[Trial], budget_bytes: int) -> int | None:
    """The largest size whose peak, on the line through the two largest fitting trials' peaks,
    stays within `budget_bytes` (rounded down to a multiple of 8 above the largest); ``None``
    without two peaks that grow with the size.

    Example:
        >>> _projected_fit([Trial(32, 1.0, 1000 + 32 * 10), Trial(64, 1.0, 1000 + 64 * 10)], 3000)
        200
    """
    peaked = [t for t in ok if t.peak_bytes is not None]
    if len(peaked) < 2:
        return None
    small, large = peaked[-2], peaked[-1]
    slope = (large.peak_bytes - small.peak_bytes) / (large.size - small.size)  # type: ignore[operator]
    if slope <= 0:
        return None
    size = int(large.size + (budget_bytes - large.peak_bytes) / slope)  # type: ignore[operator]
    rounded = size // 8 * 8
    return rounded if rounded > large.size else size


def _plateaued(ok: Sequence[Trial], limits: Limits) -> bool:
    """The last `patience` fitting sizes gained less than `tolerance` in goodput over the best before them."""
    if len(ok) <= limits.patience:
        return False
    noise = noise_of(ok, limits.budget_bytes)
    before = max(goodput(t, limits, noise) for t in ok[: -limits.patience])
    return max(goodput(t, limits, noise) for t in ok[-limits.patience :]) < (1 + limits.tolerance) * before


def _between(lower: int, upper: int) -> int | None:
    """A size half way, rounded down to a multiple of 8 when that stays above `lower`; ``None``
    once the gap is under an eighth of `lower` (refining further changes throughput by little)."""
    if upper - lower <= max(1, lower // 8):
        return None
    middle = (lower + upper) // 2
    rounded = middle // 8 * 8
    return rounded if rounded > lower else middle


def _unresolved(noise: NoiseScale | None) -> bool:
    """A noise scale known only as a lower bound from two sizes (a first trial that could not read
    the next batch's gradient): one larger size is measured, whose gradient may resolve it; past
    three sizes, the bound stands (the search stops)."""
    return noise is not None and noise.lower_bound and len(noise.sizes) < 3


def _noise_text(noise: NoiseScale | None) -> str:
    if noise is None:
        return "unknown"
    return f"{'at least ' if noise.lower_bound else ''}{noise.value:,.0f}"
