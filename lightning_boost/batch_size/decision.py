"""What `AutoBatchSize` decided, as a frozen record, and the findings that explain it.

No Lightning here. A `BatchSizeDecision` is the whole answer to "why did this run get batch B":
the size and accumulation, the learning-rate factor and its warm-up, every trial with its
throughput, peak and gradient statistics, the noise scale and efficiency they gave, why the search
stopped (or why the run kept the user's size), what it cost and where the answer came from. It is
the callback's ``state_dict`` payload and cache entry (`to_dict`; keys an older checkpoint lacks
take their defaults) and the only input of `findings`. `decide` makes it from two trial callables.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_boost.batch_size.goodput import LR_FACTOR_WARN
from lightning_boost.batch_size.search import (
    Limits,
    choose,
    fitting_validation,
    goodput,
    largest_effective,
    lr_factor,
    noise_of,
    search,
)
from lightning_boost.report import Finding, Severity, plot_data
from lightning_boost.trials import Trial

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
        configured_accumulate: the ``accumulate_grad_batches`` the user configured.
        noise_scale: the gradient noise scale the trials measured (``None``: too few sizes).
        efficiency: the statistical efficiency of the chosen size against the user's.
        min_efficiency: the least efficiency a size could be chosen with.
        lr_warmup_steps: optimizer steps over which a raised learning rate is ramped in.
        kept: why the run kept the user's size without measuring (``""`` when it measured).
        eval_batch_size: the evaluation batch size measured (``None``: not measured).
        eval_trials: the evaluation steps measured for it, in order.
        eval_stopped: why its doubling stopped, or why it was not measured.
        growth: each time the run grew the batch (`lightning_boost.batch_size.regrow`), as a dict:
            ``epoch`` and optimizer ``step`` after which it grew, ``from`` and ``to`` (batch
            sizes), the re-read ``noise_scale`` and its ``pairs``, the new size's ``efficiency``
            (against the reference batch), its trial's ``speedup`` and ``goodput`` over the old
            size's, ``lr_before`` and ``lr_factor`` (the factors from the reference batch) and the
            ``warmup_steps`` of the raise.
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
    configured_accumulate: int = 1
    noise_scale: float | None = None
    efficiency: float = 1.0
    min_efficiency: float = 0.0
    lr_warmup_steps: int = 0
    kept: str = ""
    eval_batch_size: int | None = None
    eval_trials: tuple[Trial, ...] = field(default_factory=tuple)
    eval_stopped: str = ""
    growth: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def tuned(self) -> dict[str, Any]:
        """The values the run was given, for the report."""
        return {
            "batch_size": self.batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "effective_batch_size": self.effective_batch_size,
            "lr_factor": self.lr_factor,
        }

    def rate_at(self, size: int) -> float | None:
        """Training samples/s per rank the trial at `size` measured; ``None`` when no trial ran
        there or it ran out of memory.

        Example:
            >>> trials = (Trial(64, 800.0, 10), Trial(128, 0.0, None, oom=True))
            >>> decision = BatchSizeDecision(64, trials=trials)
            >>> decision.rate_at(64), decision.rate_at(128), decision.rate_at(256)
            (800.0, None, None)
        """
        rates = [t.samples_per_s for t in self.trials if t.size == size and not t.oom and t.samples_per_s > 0]
        return rates[0] if rates else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the ``state_dict`` and cache format (trials as dicts)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["trials"] = [t.to_dict() for t in self.trials]
        data["validation"] = [t.to_dict() for t in self.validation]
        data["eval_trials"] = [t.to_dict() for t in self.eval_trials]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchSizeDecision:
        """From `to_dict`'s form, or an older checkpoint's (keys it lacks take their defaults)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["trials"] = tuple(Trial.from_dict(t) for t in data.get("trials", ()))
        values["validation"] = tuple(Trial.from_dict(t) for t in data.get("validation", ()))
        values["eval_trials"] = tuple(Trial.from_dict(t) for t in data.get("eval_trials", ()))
        values["growth"] = tuple(dict(g) for g in data.get("growth", ()))
        return cls(**values)

    def replace(self, **changes: Any) -> BatchSizeDecision:
        return dataclasses.replace(self, **changes)


def kept(configured: int, accumulate: int, limits: Limits, why: str) -> BatchSizeDecision:
    """The decision of a run that keeps the user's size, and why: nothing measured, nothing scaled."""
    return BatchSizeDecision(
        batch_size=configured,
        accumulate_grad_batches=accumulate,
        effective_batch_size=configured * accumulate * limits.world,
        configured_batch_size=configured,
        reference_batch_size=limits.reference or configured * accumulate * limits.world,
        world_size=limits.world,
        budget_bytes=limits.budget_bytes,
        configured_accumulate=accumulate,
        kept=why,
        stopped=why,
    )


def decide(
    measure: Callable[[int], Trial],
    check: Callable[[int], Trial] | None,
    start: int,
    configured: int,
    limits: Limits,
    lr_rule: str | None,
) -> BatchSizeDecision:
    """The batch size for a run, from a training-step trial callable (`measure`) and a validation
    one (`check`, ``None`` to skip): search, choose by goodput, step down until validation fits
    (not checked at the `configured` size: that validation is the user's own, which Lightning's
    sanity check runs before the first step anyway), then the accumulation (kept unless
    `limits.target` is set) and the learning-rate factor from the user's effective batch
    (`limits.reference`) by `lr_rule`.

    Raises:
        MemoryError: when no size fits, or no fitting size's validation step does.

    Example:
        >>> flat = lambda size: Trial(size, 100.0 * size, 1, seconds=0.1, grad_sq=1.0 + 256.0 / size)
        >>> limits = Limits(1024, 10, reference=64, min_efficiency=0.8)
        >>> d = decide(flat, None, 64, 64, limits, "sqrt")
        >>> d.batch_size, round(d.noise_scale), round(d.efficiency, 2), d.lr_factor
        (128, 256, 0.83, 1.4142135623730951)
    """
    started = time.perf_counter()
    reference = limits.reference or configured * limits.accumulate * limits.world
    trials, reason = search(measure, start, limits)
    choice = choose(trials, limits)
    if choice is None:
        raise MemoryError(_nothing_fits(trials, limits, reason))
    checks: list[Trial] = []
    if check is not None and choice.size != configured:
        choice, checks = fitting_validation(check, trials, choice, limits)
    noise = noise_of(trials, limits.budget_bytes)
    effective = limits.effective(choice.size)
    return BatchSizeDecision(
        batch_size=choice.size,
        accumulate_grad_batches=effective // (choice.size * limits.world),
        effective_batch_size=effective,
        configured_batch_size=configured,
        reference_batch_size=reference,
        lr_factor=lr_factor(lr_rule, effective, reference),
        lr_scaling=lr_rule,
        target_global_batch_size=limits.target,
        world_size=limits.world,
        budget_bytes=limits.budget_bytes,
        stopped=reason,
        trials=tuple(trials),
        validation=tuple(checks),
        seconds=time.perf_counter() - started,
        configured_accumulate=limits.accumulate,
        noise_scale=None if noise is None else noise.value,
        efficiency=limits.efficiency(choice.size, noise),
        min_efficiency=limits.min_efficiency,
    )


def _nothing_fits(trials: list[Trial], limits: Limits, reason: str) -> str:
    smallest = min(trials, key=lambda t: t.size)
    need = "runs out of memory" if smallest.oom else f"needs {(smallest.peak_bytes or 0) / _GIB:.2f} GiB"
    return (
        f"AutoBatchSize: a training step at batch size {smallest.size} {need}, over the budget of"
        f" {limits.budget_bytes / _GIB:.2f} GiB (stopped: {reason}). Train in lower precision"
        " (`Trainer(precision='bf16-mixed')`, or `preset('auto')`), shard the model with `preset('fsdp')`,"
        " or use a smaller model."
    )


def findings(decision: BatchSizeDecision, tolerance: float) -> list[Finding]:
    """What the report says about a measured or cached `decision`: the size with its trials, and a
    WARN for a learning-rate factor past `LR_FACTOR_WARN`; a kept size says why."""
    if decision.kept:
        return [
            Finding(
                "AutoBatchSize",
                "batch size",
                Severity.INFO,
                f"Batch size {decision.batch_size} kept as configured: {decision.kept}",
                detail="No trial was run and no learning rate was changed.",
                data=_data(decision),
            )
        ]
    return [
        _size_finding(decision, tolerance),
        *_lr_findings(decision),
        *_accumulation_findings(decision),
        *_eval_findings(decision),
    ]


def _eval_findings(decision: BatchSizeDecision) -> list[Finding]:
    """The evaluation batch size, with the evaluation steps measured; or why none was measured."""
    if decision.eval_batch_size is None:
        if not decision.eval_stopped:
            return []
        title = f"Evaluation batch size {decision.batch_size}, the training size: {decision.eval_stopped}"
        return [Finding("AutoBatchSize", "batch size", Severity.INFO, title)]
    size, train = decision.eval_batch_size, decision.batch_size
    steps = ", ".join(_eval_step(t, decision.budget_bytes) for t in decision.eval_trials)
    return [
        Finding(
            "AutoBatchSize",
            "batch size",
            Severity.INFO,
            f"Evaluation batch size {size} ({size / train:.3g}x the training size)",
            detail=f"Validation steps measured at {steps}; stopped: {decision.eval_stopped}. Validation, "
            "test and predict loaders of the BoostedDataModule use it (`eval_batch_size=` fixes one).",
            data={"eval_batch_size": size, "eval_trials": [t.to_dict() for t in decision.eval_trials]},
        )
    ]


def _size_finding(decision: BatchSizeDecision, tolerance: float) -> Finding:
    trials = sorted(decision.trials, key=lambda t: t.size)
    budget = decision.budget_bytes
    limits = limits_of(decision)
    noise = noise_of(trials, budget)
    chosen = next(t for t in trials if t.size == decision.batch_size)
    cached = decision.source == "cache"
    how = (
        f"Reused the cached measurement of {len(trials)} sizes (`retune=True` measures again)"
        if cached
        else f"Measured {len(trials)} sizes in {decision.seconds:.1f} s"
    )
    target = f" (target {decision.target_global_batch_size})" if decision.target_global_batch_size else ""
    rates = (
        f"; learning rates x{decision.lr_factor:.3g} ({decision.lr_scaling},"
        f" from {decision.reference_batch_size}, warmed up over {decision.lr_warmup_steps} steps)."
        if decision.lr_scaling
        else "; learning rates unchanged (`lr_scaling=None`)."
    )
    bound = (
        "at least " if noise is not None and noise.lower_bound else ""
    )  # the noise hid the gradient at every size: the most cautious value
    statistics = (
        f" Gradient noise scale {bound}{decision.noise_scale:,.0f} samples: a batch of B teaches the model"
        f" (noise + {decision.reference_batch_size}) / (noise + B) as much per sample as the configured one;"
        f" sizes under {decision.min_efficiency:.0%} efficiency are not chosen."
        if decision.noise_scale is not None
        else " No noise scale (fewer than two sizes measured): judged by throughput."
    )
    detail = (
        f"{how}; stopped at {decision.stopped}.{statistics}"
        f" Memory budget: {budget / _GIB:.2f} GiB, {decision.budget}. The smallest size within"
        f" {tolerance:.0%} (or the measured spread) of the best goodput (throughput x efficiency) is kept."
        f" Effective batch: {decision.batch_size} x {decision.accumulate_grad_batches} accumulated x"
        f" {decision.world_size} processes = {decision.effective_batch_size}{target}{rates}\n"
        "    size     samples/s  efficiency    goodput        peak    trial  status\n"
        + "\n".join(_row(t, budget, limits.efficiency(t.size, noise)) for t in trials)
    )
    plot = plot_data(
        "batch_size",
        "Batch size: training throughput, goodput and peak memory",
        "batch size",
        [t.size for t in trials],
        {
            "samples/s": [t.samples_per_s for t in trials],
            "goodput": [goodput(t, limits, noise) for t in trials],
        },
        {"peak GiB": [(t.peak_bytes or 0) / _GIB for t in trials]},
        chosen=chosen.size,
    )
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"Batch size {chosen.size} (was {decision.configured_batch_size}):"
        f" {chosen.samples_per_s:,.0f} samples/s at {decision.efficiency:.0%} efficiency,"
        f" peak {format_size(chosen.peak_bytes)}",
        detail=detail,
        data={**_data(decision), "plot": plot},
        cost="" if cached else f"{decision.seconds:.1f} s tuning",
    )


def _lr_findings(decision: BatchSizeDecision) -> list[Finding]:
    if decision.lr_factor <= LR_FACTOR_WARN or decision.lr_scaling is None:
        return []
    largest = largest_effective(decision.reference_batch_size, decision.lr_scaling)
    return [
        Finding(
            "AutoBatchSize",
            "batch size",
            Severity.WARN,
            f"Learning rates x{decision.lr_factor:.3g} for batch {decision.effective_batch_size}"
            f" (from {decision.reference_batch_size})",
            detail=(
                f"Past x{LR_FACTOR_WARN:g}, the {decision.lr_scaling} scaling rule is known to fail:"
                " training may diverge or end at a worse model than the configured batch gives."
            ),
            fix=(
                f"An effective batch of at most {largest:,} keeps them within x{LR_FACTOR_WARN:g}: ask"
                f" for it with `target_global_batch_size={largest}`, or keep the learning rates with"
                " `lr_scaling=None`."
            ),
            data={"lr_factor": decision.lr_factor, "lr_scaling": decision.lr_scaling},
        )
    ]


def _accumulation_findings(decision: BatchSizeDecision) -> list[Finding]:
    if decision.accumulate_grad_batches == decision.configured_accumulate:
        return []
    return [
        Finding(
            "AutoBatchSize",
            "batch size",
            Severity.INFO,
            f"accumulate_grad_batches {decision.accumulate_grad_batches}"
            f" (was {decision.configured_accumulate}) for the target global batch"
            f" {decision.target_global_batch_size}",
            detail=(
                f"{decision.batch_size} x {decision.accumulate_grad_batches} x"
                f" {decision.world_size} processes"
                f" = {decision.effective_batch_size}."
            ),
            data={
                "accumulate_grad_batches": decision.accumulate_grad_batches,
                "configured_accumulate": decision.configured_accumulate,
            },
        )
    ]


def limits_of(decision: BatchSizeDecision) -> Limits:
    """The limits that give `decision`'s efficiencies and goodputs again (sizes aside)."""
    return Limits(
        max_size=decision.batch_size,
        budget_bytes=decision.budget_bytes,
        reference=decision.reference_batch_size,
        accumulate=decision.configured_accumulate,
        world=decision.world_size,
        target=decision.target_global_batch_size,
        min_efficiency=decision.min_efficiency,
    )


def _data(decision: BatchSizeDecision) -> dict[str, Any]:
    return {k: v for k, v in decision.to_dict().items() if k != "budget"}


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
        data=_data(decision),
    )


def _eval_step(trial: Trial, budget_bytes: int) -> str:
    if trial.oom:
        return f"{trial.size}: out of memory"
    over = "" if trial.fits(budget_bytes) else ", over the memory budget"
    return f"{trial.size}: {trial.samples_per_s:,.0f} samples/s, {format_size(trial.peak_bytes)}{over}"


def own_rates_finding(decision: BatchSizeDecision, before: list[float], after: list[float]) -> Finding:
    """What the report says when ``configure_optimizers``, run again at the tuned size, set other
    learning rates than at the configured one: the user's code derives them from the batch size,
    so they are kept as it set them, not scaled again (`decision` is the one before).

    Example:
        >>> d = BatchSizeDecision(64, configured_batch_size=16, lr_factor=2.0)
        >>> own_rates_finding(d, [0.02], [0.08]).title
        'configure_optimizers set the learning rates for batch 64 itself: not scaled again'
    """
    changed = ", ".join(f"{a:.3g} -> {b:.3g}" for a, b in zip(before, after, strict=True) if a != b)
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"configure_optimizers set the learning rates for batch {decision.batch_size} itself: not"
        " scaled again",
        detail=(
            f"It read the step count before the fit started, so it ran again at the tuned batch"
            f" ({decision.configured_batch_size} -> {decision.batch_size}), and its rates followed the"
            f" batch size by its own rule ({changed}). They are kept as it set them: `AutoBatchSize`'s"
            f" x{decision.lr_factor:.3g} ({decision.lr_scaling}) and its warm-up are left out."
        ),
    )


def optimizers_finding(decision: BatchSizeDecision, redone: bool) -> Finding:
    """What the report says when ``configure_optimizers`` read the step count (the training loader
    was built before the fit started) and the tuned batch changed it: run again, or could not be."""
    sizes = (
        f"batch {decision.configured_batch_size} x {decision.configured_accumulate} accumulated ->"
        f" {decision.batch_size} x {decision.accumulate_grad_batches}"
    )
    if redone:
        return Finding(
            "AutoBatchSize",
            "batch size",
            Severity.INFO,
            "configure_optimizers ran again at the tuned batch size",
            detail=(
                f"It read the step count ({sizes}) before the fit started, as"
                " `trainer.estimated_stepping_batches` does, so its schedulers now count the steps the"
                " run takes."
            ),
        )
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.WARN,
        "The schedulers count the steps of the configured batch size",
        detail=(
            f"`configure_optimizers` read the step count before the fit started ({sizes}), and this"
            " strategy wraps its optimizers, so they could not be made again: a schedule sized from"
            " `trainer.estimated_stepping_batches` ends at another step than the run."
        ),
        fix="Set the batch size by hand (drop AutoBatchSize), or size the schedule in epochs.",
        data={"unfitted_schedules": True},
    )


def _row(trial: Trial, budget: int, efficiency: float) -> str:
    status = "out of memory" if trial.oom else "ok" if trial.fits(budget) else "over budget"
    size = format_size(trial.peak_bytes)
    spread = f" ±{trial.spread:.0%}" if trial.spread >= 0.01 else ""
    return (
        f"  {trial.size:>6}  {trial.samples_per_s:>12,.0f}  {efficiency:>10.0%}"
        f"  {trial.samples_per_s * efficiency:>9,.0f}  {size:>10}  {trial.seconds:>5.1f} s  {status}{spread}"
    )


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


def growth_finding(decision: BatchSizeDecision, rescaled: Sequence[str] = ()) -> Finding:
    """What the report says about the run's last growth of the batch (`decision.growth[-1]`), whose
    optimizers' running squared gradients were `rescaled` (their class names)."""
    grew = decision.growth[-1]
    raised = (
        f" Learning rates x{grew['lr_factor'] / grew['lr_before']:.3g} ({decision.lr_scaling} rule),"
        f" warmed up over {grew['warmup_steps']} steps."
        if grew["lr_factor"] != grew["lr_before"]
        else ""
    )
    if rescaled:
        raised += (
            f" {'/'.join(rescaled)}'s running squared gradients x{grew['second_moment']:.2f}, as"
            f" expected at {grew['to']} (less noisy gradients)."
        )
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"Batch size grown from {grew['from']} to {grew['to']} after epoch {grew['epoch']}: the noise"
        f" scale grew to {grew['noise_scale']:,.0f}",
        detail=(
            f"Re-read from {grew['pairs']} pairs of the run's own consecutive steps"
            f" ({_start_noise(decision)} at the start): {grew['to']} now teaches the model"
            f" {grew['efficiency']:.0%} as much per sample as the user's batch and its trial ran"
            f" {grew['speedup']:.2f}x as fast as {grew['from']}'s: {grew['goodput']:.2f}x the goodput."
            f"{raised}"
        ),
        data={"growth": list(decision.growth), "batch_size": decision.batch_size},
    )


def noise_reads_finding(decision: BatchSizeDecision, reads: list[tuple[int, float, int]]) -> Finding:
    """The noise scales re-read during the run, ``(epoch, noise scale, pairs)`` each."""
    listed = ", ".join(f"{value:,.0f} after epoch {epoch}" for epoch, value, _ in reads)
    sizes = [g["to"] for g in decision.growth]
    outcome = f"the batch grew to {sizes[-1]}" if sizes else f"batch {decision.batch_size} stayed"
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"Gradient noise scale re-read during the run: {listed}; {outcome}",
        detail=(
            f"{_start_noise(decision)} at the start. A larger measured size is taken once its goodput"
            " at the re-read noise scale beats the current size's by more than the tolerance, at"
            f" {decision.min_efficiency:.0%} efficiency or more."
        ),
        data={"noise_reads": [list(read) for read in reads]},
    )


def _start_noise(decision: BatchSizeDecision) -> str:
    return "unknown" if decision.noise_scale is None else f"{decision.noise_scale:,.0f}"
