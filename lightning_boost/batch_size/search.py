"""Batch-size decisions over measured trials: which size to try next, which to keep, and the
accumulation and learning-rate scaling that keep the effective batch. Plain data, no Lightning.

The search grows the batch size by doubling from a start size while steps fit in memory and
throughput still improves (a doubling the peaks measured so far say would go over the memory
budget is replaced by the largest size they say fits, so no trial is spent over it), halves it
when the start does not fit, then refines between the largest size that fits and the smallest
that does not while throughput was still rising there.
The choice is the smallest measured size within a tolerance of the best measured throughput,
among sizes whose peak memory stays within the budget: a size that was never measured is never
returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: Learning-rate scaling rules: factor from (effective batch / reference batch).
LR_RULES: dict[str, Callable[[float], float]] = {"linear": lambda ratio: ratio, "sqrt": math.sqrt}


@dataclass(frozen=True)
class Trial:
    """One measured batch size (merged over ranks: any OOM, the largest peak, the slowest pace).

    Args:
        size: samples per batch on each rank.
        samples_per_s: per-rank training throughput; 0 when the step ran out of memory.
        peak_bytes: peak memory of the step (measured on CUDA, estimated elsewhere); ``None`` after OOM.
        oom: the step ran out of memory on some rank.
        seconds: wall time the trial took, fetching the batch included.
    """

    size: int
    samples_per_s: float = 0.0
    peak_bytes: int | None = None
    oom: bool = False
    seconds: float = 0.0

    def fits(self, budget_bytes: int) -> bool:
        """Ran without OOM and peaked within `budget_bytes`."""
        return not self.oom and self.peak_bytes is not None and self.peak_bytes <= budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trial:
        return cls(**{key: data[key] for key in ("size", "samples_per_s", "peak_bytes", "oom", "seconds")})


@dataclass(frozen=True)
class Limits:
    """What bounds the search.

    Args:
        max_size: the largest size to try (``max_batch_size``, the samples per rank, the target).
        budget_bytes: peak memory a step may reach.
        tolerance: sizes within this fraction of the best throughput count as equally fast.
        patience: stop growing after this many doublings in a row gain less than `tolerance`.
        time_budget_s: no trial starts that would end past this many seconds of trials.
    """

    max_size: int
    budget_bytes: int
    tolerance: float = 0.05
    patience: int = 2
    time_budget_s: float = float("inf")


def merge(size: int, per_rank: Sequence[Trial]) -> Trial:
    """One trial from every rank's: OOM anywhere, the largest peak, the slowest rank's throughput."""
    oom = any(t.oom for t in per_rank)
    peaks = [t.peak_bytes for t in per_rank if t.peak_bytes is not None]
    return Trial(
        size=size,
        samples_per_s=0.0 if oom else min(t.samples_per_s for t in per_rank),
        peak_bytes=None if oom or not peaks else max(peaks),
        oom=oom,
        seconds=max(t.seconds for t in per_rank),
    )


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
    return size, why


def _next_size(trials: Sequence[Trial], limits: Limits) -> tuple[int | None, str]:
    """The search's next size after `trials` (at least one), budget aside."""
    tried = {t.size for t in trials}
    ok = sorted((t for t in trials if t.fits(limits.budget_bytes)), key=lambda t: t.size)
    failed = sorted((t for t in trials if not t.fits(limits.budget_bytes)), key=lambda t: t.size)
    if not ok:
        smallest = failed[0].size
        return (smallest // 2, "") if smallest > 1 else (None, _why_failed(failed[0]))
    largest = ok[-1]
    above = [t for t in failed if t.size > largest.size]
    if not above:
        if largest.size >= limits.max_size:
            return None, f"the size limit of {limits.max_size}"
        if _plateaued(ok, limits):
            return (
                None,
                f"a throughput plateau ({limits.patience} doublings gained under {limits.tolerance:.0%})",
            )
        doubled = min(2 * largest.size, limits.max_size)
        fits = _projected_fit(ok, limits.budget_bytes)
        if fits is None or fits >= doubled:
            return doubled, ""
        if fits > largest.size:
            return fits, ""  # the largest size the peaks so far say fits: no trial over the budget
        return None, f"the memory budget ({doubled} would peak over it, by the peaks measured so far)"
    upper = above[0]
    if max(ok, key=lambda t: t.samples_per_s) is not largest:
        return None, f"{_why_failed(upper)} at {upper.size}, past the throughput peak"
    middle = _between(largest.size, upper.size)
    if middle is None or middle in tried:
        return None, f"{_why_failed(upper)} at {upper.size}"
    return middle, ""


def choose(trials: Sequence[Trial], budget_bytes: int, tolerance: float) -> Trial | None:
    """The smallest fitting trial within `tolerance` of the best fitting throughput; ``None`` if none fits.

    Example:
        >>> table = [Trial(32, 900.0, 10), Trial(64, 1000.0, 20), Trial(128, 1010.0, 40)]
        >>> choose(table, budget_bytes=100, tolerance=0.05).size
        64
        >>> choose(table + [Trial(256, oom=True)], budget_bytes=15, tolerance=0.05).size
        32
    """
    ok = [t for t in trials if t.fits(budget_bytes)]
    if not ok:
        return None
    best = max(t.samples_per_s for t in ok)
    return min((t for t in ok if t.samples_per_s >= (1 - tolerance) * best), key=lambda t: t.size)


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
    """The last `patience` fitting sizes gained less than `tolerance` over the best before them."""
    if len(ok) <= limits.patience:
        return False
    before = max(t.samples_per_s for t in ok[: -limits.patience])
    return max(t.samples_per_s for t in ok[-limits.patience :]) < (1 + limits.tolerance) * before


def _between(lower: int, upper: int) -> int | None:
    """A size half way, rounded down to a multiple of 8 when that stays above `lower`; ``None``
    once the gap is under an eighth of `lower` (refining further changes throughput by little)."""
    if upper - lower <= max(1, lower // 8):
        return None
    middle = (lower + upper) // 2
    rounded = middle // 8 * 8
    return rounded if rounded > lower else middle


def _why_failed(trial: Trial) -> str:
    return "out of memory" if trial.oom else "over the memory budget"
