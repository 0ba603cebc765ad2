"""What `AutoBatchSize` decided, as a frozen record, and the findings that explain it.

No Lightning here. A `BatchSizeDecision` is the whole answer to "why did this run get batch B":
the size and accumulation, the learning-rate factor, every trial with its throughput and peak,
why the search stopped, what it cost and where the answer came from. It is the callback's
``state_dict`` payload and cache entry (`to_dict`, the same keys checkpoints have always held) and
the only input of `findings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_boost.batch_size.search import Trial
from lightning_boost.report import Finding, Severity, plot_data

_GIB = 1024**3


@dataclass(frozen=True)
class BatchSizeDecision:
    """The batch size a run trains at, with its evidence.

    Args:
        batch_size: samples per batch on each rank.
        accumulate_grad_batches: batches accumulated per optimizer step.
        effective_batch_size: batch x accumulation x world size.
        configured_batch_size: the size the user configured.
        reference_batch_size: the effective batch the learning rates were set for.
        lr_factor: what the learning rates were multiplied by (1.0 without `lr_scaling`).
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``None``.
        target_global_batch_size: the effective batch asked for, if any.
        world_size: processes in the run.
        budget_bytes: the peak memory a step could reach.
        budget: where that budget came from, in words.
        stopped: why the search stopped.
        trials: every size measured, in order.
        validation: the validation steps checked at the chosen size.
        seconds: what the search took.
        source: ``"measured"`` or ``"cache"``.
    """

    batch_size: int
    accumulate_grad_batches: int = 1
    effective_batch_size: int = 0
    configured_batch_size: int = 0
    reference_batch_size: int = 0
    lr_factor: float = 1.0
    lr_scaling: str | None = None
    target_global_batch_size: int | None = None
    world_size: int = 1
    budget_bytes: int = 0
    budget: str = ""
    stopped: str = ""
    trials: tuple[Trial, ...] = field(default_factory=tuple)
    validation: tuple[Trial, ...] = field(default_factory=tuple)
    seconds: float = 0.0
    source: str = "measured"

    @property
    def tuned(self) -> dict[str, Any]:
        """The values the run was given, for the report."""
        return {
            "batch_size": self.batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "effective_batch_size": self.effective_batch_size,
            "lr_factor": self.lr_factor,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the ``state_dict`` and cache format (trials as dicts)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["trials"] = [t.to_dict() for t in self.trials]
        data["validation"] = [t.to_dict() for t in self.validation]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchSizeDecision:
        """From `to_dict`'s form, or an older checkpoint's (keys it lacks take their defaults)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["trials"] = tuple(Trial.from_dict(t) for t in data.get("trials", ()))
        values["validation"] = tuple(Trial.from_dict(t) for t in data.get("validation", ()))
        return cls(**values)

    def replace(self, **changes: Any) -> BatchSizeDecision:
        return dataclasses.replace(self, **changes)


def findings(decision: BatchSizeDecision, tolerance: float) -> list[Finding]:
    """What the report says about a measured or cached `decision`: the size, with its trials."""
    trials = sorted(decision.trials, key=lambda t: t.size)
    budget = decision.budget_bytes
    chosen = next(t for t in trials if t.size == decision.batch_size)
    best = max((t for t in trials if t.fits(budget)), key=lambda t: t.samples_per_s)
    cached = decision.source == "cache"
    how = (
        f"Reused the cached measurement of {len(trials)} sizes (`retune=True` measures again)"
        if cached
        else f"Measured {len(trials)} sizes in {decision.seconds:.1f} s"
    )
    target = f" (target {decision.target_global_batch_size})" if decision.target_global_batch_size else ""
    rates = (
        f"; learning rates x{decision.lr_factor:.3g} ({decision.lr_scaling},"
        f" from {decision.reference_batch_size})."
        if decision.lr_scaling
        else "."
    )
    detail = (
        f"{how}; stopped at {decision.stopped}."
        f" Memory budget: {budget / _GIB:.2f} GiB, {decision.budget}. The smallest size within"
        f" {tolerance:.0%} of the best throughput ({best.size}: {best.samples_per_s:,.0f} samples/s) is kept."
        f" Effective batch: {decision.batch_size} x {decision.accumulate_grad_batches} accumulated x"
        f" {decision.world_size} processes = {decision.effective_batch_size}{target}{rates}\n"
        + "\n".join(_row(t, budget) for t in trials)
    )
    plot = plot_data(
        "batch_size",
        "Batch size: training throughput and peak memory",
        "batch size",
        [t.size for t in trials],
        {"samples/s": [t.samples_per_s for t in trials]},
        {"peak GiB": [(t.peak_bytes or 0) / _GIB for t in trials]},
        chosen=chosen.size,
    )
    data = {k: v for k, v in decision.to_dict().items() if k != "budget"}
    return [
        Finding(
            "AutoBatchSize",
            "batch size",
            Severity.INFO,
            f"Batch size {chosen.size} (was {decision.configured_batch_size}):"
            f" {chosen.samples_per_s:,.0f} samples/s, peak {format_size(chosen.peak_bytes)}",
            detail=detail,
            data={**data, "plot": plot},
            cost="" if cached else f"{decision.seconds:.1f} s tuning",
        )
    ]


def restored_finding(decision: BatchSizeDecision) -> Finding:
    """What the report says about `decision` restored from a checkpoint: not tuned again."""
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"Batch size {decision.batch_size} from the checkpoint, not tuned again",
        detail=(
            f"Accumulation {decision.accumulate_grad_batches},"
            f" effective batch {decision.effective_batch_size}."
        ),
        data={k: v for k, v in decision.to_dict().items() if k != "budget"},
    )


def _row(trial: Trial, budget: int) -> str:
    status = "out of memory" if trial.oom else "ok" if trial.fits(budget) else "over budget"
    size = format_size(trial.peak_bytes)
    return f"  {trial.size:>6}  {trial.samples_per_s:>10,.0f} samples/s  {size:>10}  {status}"


def format_size(nbytes: int | None) -> str:
    """Bytes in the largest unit that keeps a number >= 1 (``-`` when unknown).

    Example:
        >>> format_size(3 * 2**20), format_size(None)
        ('3.0 MiB', '-')
    """
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
