"""`Trial`: one measured step size, as every part that measures steps records it (pure).

The step probe fills it in, the batch-size search and the evaluation sizing decide over it, the
ranks' trials are merged into one (`merge`), and it is cached and checkpointed as a plain dict.
This is the measuring layer below the feature folders (DESIGN.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Trial:
    """One measured batch size (merged over ranks: any OOM, the largest peak, the slowest pace).

    Args:
        size: samples per batch on each rank.
        samples_per_s: per-rank training throughput; 0 when the step ran out of memory.
        peak_bytes: peak memory of the step (measured on CUDA, estimated elsewhere); ``None`` after OOM.
        oom: the step ran out of memory on some rank.
        seconds: wall time the trial took, fetching the batch included.
        grad_sq: the squared gradient norm of its first batch at the run's parameters (every
            trial starts from them), for the noise scale; ``None`` when not measured.
        spread: how far its timed steps strayed from the fastest (median / fastest - 1): a gain
            smaller than this is not told apart from noise.
        half_grad_sq: the mean squared gradient norm of one batch's two halves, taken at the
            same parameters as a full-batch one: a second size for the noise scale from one trial.
        double_grad_sq: the squared norm of the mean gradient of that batch and the next, at the
            same parameters (a gradient over twice the size): a third size from the same trial.
        losses: the training loss of each timed step (this rank's), in order.
        batch_grad_sq: the mean squared gradient norm of several independent batches of `size`
            at the run's parameters (the first trial on an accelerator); ``None`` when not read.
        cross_grad_sq: the mean dot product of those batches' gradients, every pair: an
            unbiased estimate of the true gradient's squared norm (`goodput.cross_noise`).
        cross_se: its standard error (from disjoint pairs: wider than the mean's own, cautious).
    """

    size: int
    samples_per_s: float = 0.0
    peak_bytes: int | None = None
    oom: bool = False
    seconds: float = 0.0
    grad_sq: float | None = None
    spread: float = 0.0
    half_grad_sq: float | None = None
    double_grad_sq: float | None = None
    losses: tuple[float, ...] = ()
    batch_grad_sq: float | None = None
    cross_grad_sq: float | None = None
    cross_se: float | None = None

    def fits(self, budget_bytes: int) -> bool:
        """Ran without OOM and peaked within `budget_bytes`."""
        return not self.oom and self.peak_bytes is not None and self.peak_bytes <= budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trial:
        """From `to_dict`'s form (an older cache's or checkpoint's lacks the gradient fields and `spread`)."""
        names = (
            "size",
            "samples_per_s",
            "peak_bytes",
            "oom",
            "seconds",
            "grad_sq",
            "spread",
            "half_grad_sq",
            "double_grad_sq",
            "batch_grad_sq",
            "cross_grad_sq",
            "cross_se",
        )
        trial = cls(**{key: data[key] for key in names if key in data})
        return dataclasses.replace(trial, losses=tuple(data.get("losses", ())))


def merge(size: int, per_rank: Sequence[Trial]) -> Trial:
    """One trial from every rank's: OOM anywhere, the largest peak, the slowest rank's throughput,
    the ranks' mean squared gradient norm (each an estimate at the same size) and widest spread."""
    oom = any(t.oom for t in per_rank)
    peaks = [t.peak_bytes for t in per_rank if t.peak_bytes is not None]
    return Trial(
        size=min(size, *(t.size for t in per_rank)),
        samples_per_s=0.0 if oom else min(t.samples_per_s for t in per_rank),
        peak_bytes=None if oom or not peaks else max(peaks),
        oom=oom,
        seconds=max(t.seconds for t in per_rank),
        grad_sq=None if oom else mean_known(t.grad_sq for t in per_rank),
        spread=max(t.spread for t in per_rank),
        half_grad_sq=None if oom else mean_known(t.half_grad_sq for t in per_rank),
        double_grad_sq=None if oom else mean_known(t.double_grad_sq for t in per_rank),
        losses=() if oom else per_rank[0].losses,
        batch_grad_sq=None if oom else mean_known(t.batch_grad_sq for t in per_rank),
        cross_grad_sq=None if oom else mean_known(t.cross_grad_sq for t in per_rank),
        cross_se=None if oom else mean_known(t.cross_se for t in per_rank),  # the ranks' draws may match
    )


#: Standard errors by which the cross products' ``|G|^2`` is taken higher: their cautious side.
CAUTIOUS_ERRORS = 2.0


def cautious_grad_sq(cross: float, se: float) -> float:
    """``|G|^2`` from independent batches' mean pair product `cross`, `CAUTIOUS_ERRORS` standard
    errors `se` higher: the largest the products allow, so the noise scale from it is the smallest
    (a larger batch looks least efficient). Not positive: the products did not resolve ``|G|^2``.

    Example:
        >>> cautious_grad_sq(1.0, 0.5), cautious_grad_sq(-3.0, 1.0) > 0
        (2.0, False)
    """
    return cross + CAUTIOUS_ERRORS * se


def mean_known(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are known (``None`` when none is)."""
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


class StepFailed(RuntimeError):
    """A trial's step raised an error other than running out of memory (`cause`: what it raised)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class StepSkipped(StepFailed):
    """A trial's ``training_step`` returned ``None``: Lightning skips such a batch, so the trial has
    no loss to time (a step that skips by `batch_idx` or by the batch's content)."""

    def __init__(self, message: str = "`training_step` returned None") -> None:
        super().__init__(message, "`training_step` returned None")


def why_failed(trial: Trial) -> str:
    """Why a trial that does not fit failed: ``"out of memory"`` or ``"over the memory budget"``."""
    return "out of memory" if trial.oom else "over the memory budget"
