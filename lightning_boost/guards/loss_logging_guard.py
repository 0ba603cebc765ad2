"""`LossLoggingGuard`: what a run keeps of its losses holds a number, never an autograd graph."""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, get_args

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch import Tensor
from typing_extensions import override

from lightning_boost import instrumented
from lightning_boost._validation import Matches, validated
from lightning_boost.guards.base import EveryNSteps, Guard, GuardMode, Overhead, no_op
from lightning_boost.guards.graphs import census, footprint, graph_tensors, growth, holds_graph, thin
from lightning_boost.guards.retained import Holder, format_bytes, unnamed_growth_fix
from lightning_boost.guards.sampling import Sampler, TimeBudget
from lightning_boost.guards.sources import Site, return_sites, store_sites, user_frame
from lightning_boost.report import Finding, Severity, plot_data

MODES = get_args(GuardMode)
#: An attribute of the module, or a dotted path into one.
AttributePath = Annotated[str, Matches(r"(self\.)?[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", "hidden")]


class RetainedGraphError(RuntimeError):
    """Raised by ``LossLoggingGuard(mode="error")`` at the first value that keeps an autograd graph."""


@functools.cache
def _module_internals() -> frozenset[str]:
    """The attributes every LightningModule has: Lightning's and torch's own state, not the user's."""
    return frozenset(vars(L.LightningModule()))


class LossLoggingGuard(Guard):
    """Finds values kept between training steps that still hold an autograd graph.

    ``self.losses.append(loss)``, ``self.total += loss``, extra tensors returned from
    ``training_step`` and side metrics computed with grad enabled keep a graph (and, when no
    backward ran through it, its activations) alive step after step, until the run slows down and
    dies of OOM hours later. After checked training steps this guard looks for tensors with a
    ``grad_fn`` in:

    - the LightningModule's attributes, through lists, tuples, dicts, deques, sets, dataclasses and
      namespaces (parameters, buffers and submodules such as torchmetrics metrics excluded);
    - the values ``training_step`` returns besides ``loss`` (Lightning detaches only the loss);
    - tensors passed straight to a logger's ``log_metrics`` (``self.log`` is safe: Lightning
      detaches the value, and updates its results under ``no_grad`` even with ``enable_graph=True``).

    Each holder is reported with its path (``self.losses[17]``), how many graphs it holds and
    whether that grows per step, the memory they keep alive, the lines of the user's class that
    store into it, and the fix: ``self.log(...)``, ``.detach()``, or a device-side
    ``MeanMetric(nan_strategy="disable")`` read once per epoch, rather than ``.item()`` every step,
    which syncs. A growth watch samples what graphs keep alive (CUDA: allocated memory; CPU: the
    autograd nodes held by live tensors, found by a garbage-collector scan) and reports steady
    growth with the step count as a probable leak even when the holder cannot be named.

    Checking is sampled: the first 3 steps, then as often as `max_overhead` allows (the time of
    each check sets the gap to the next), and once more at the end of training, so the report
    shows the final state. Nothing in training changes; the guard only reads.

    Args:
        mode: ``"warn"`` (a `BoostWarning` on rank zero, once per holder, pointing at the line that
            stores into it), ``"error"`` (raise `RetainedGraphError` at the first retained graph,
            on every rank; for CI) or ``"report"`` (findings in the report only).
        allow: attributes that keep a graph across steps on purpose (truncated BPTT's hidden
            state), e.g. ``["hidden"]``; a dotted path (``"state.h"``) allows just that part.
        every_n_steps: check every n-th step after the first 3 instead of following the budget.
        max_overhead: the share of training time checks may take (0 to 1), half for the holder
            checks and half for the growth watch's scans.

    Raises:
        ValueError: for an unknown `mode`, a bad `every_n_steps` or `max_overhead`, or an `allow`
            entry that is not an attribute name.
        TypeError: for an argument of the wrong type (`allow` given as one string, ...).

    Example::

        trainer = L.Trainer(callbacks=[LossLoggingGuard(mode="error")])  # in CI
    """

    _transient: ClassVar[dict[str, Any]] = {"_undo_spies": no_op}  # a closure over the loggers

    @validated
    def __init__(
        self,
        mode: GuardMode = "warn",
        allow: Sequence[AttributePath] = (),
        every_n_steps: EveryNSteps = None,
        max_overhead: Overhead = 0.005,
    ) -> None:
        super().__init__(
            mode, tuple(name.removeprefix("self.") for name in allow), every_n_steps, max_overhead
        )
        self._set_state_key(mode=mode, allow=self.allow)
        self._reset()

    def _reset(self) -> None:
        self._holders: dict[str, Holder] = {}
        self._series: list[tuple[int, float]] = []
        self._breaks: list[int] = []  # steps a full garbage collection freed objects before (`growth`)
        self._collected = _fully_collected()
        self._logged: list[tuple[str, Tensor, Site | None]] = []
        self._weights: list[Tensor] = []
        self._steps = 0
        self._checked = 0
        self._one_off_s = 0.0
        self._undo_spies: Callable[[], None] = no_op
        self._sampler = Sampler(first=3, every_n_steps=self.every_n_steps, budget=self.max_overhead / 2)
        self._census = TimeBudget(self.max_overhead / 2, initial_cost_s=0.1)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        self.findings = []
        self._weights = [*pl_module.parameters(), *pl_module.buffers()]
        self._undo_spies = _spy_on_loggers(trainer.loggers, self._logged.append)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps += 1
        if self._sampler.due(self._steps):
            self._run_check(trainer, pl_module, outputs)

    def _run_check(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any) -> None:
        instrumented.mark()  # tuners timing the run's steps leave this one out
        start = time.perf_counter()
        self._one_off_s = 0.0
        new = self._check(trainer, pl_module, outputs)
        # reading the class's source for a new holder is paid once, not per check
        self._sampler.record(self._steps, time.perf_counter() - start - self._one_off_s)
        self._checked = self._steps
        if self.mode == "error":
            self._raise_if_found(trainer, pl_module, new)
        elif self.mode == "warn":
            for holder in new:
                self._warn(
                    trainer,
                    f"LossLoggingGuard: {holder.title()}. {holder.fix()}",
                    next(iter(holder.sites), None),
                )

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._steps and self._checked != self._steps:  # the report shows the state at the end
            self._run_check(trainer, pl_module, None)
        self._finish(pl_module)

    @override
    def _finish(self, pl_module: L.LightningModule) -> None:
        self._undo_spies()
        self._undo_spies = no_op
        self._logged.clear()
        self._weights = []
        self.findings = self._make_findings(pl_module) if self._steps else []  # no step, nothing to say

    # -- checking ------------------------------------------------------------------------------

    def _check(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any) -> list[Holder]:
        """Look for graph holders at this step; return those seen for the first time."""
        roots: dict[str, tuple[str, object]] = {}
        internals = _module_internals()
        for name, value in vars(pl_module).items():
            if name not in internals:
                roots[f"self.{name}"] = ("attribute", value)
        if isinstance(outputs, Mapping):
            for key, value in outputs.items():
                if key != "loss":  # Lightning hands hooks a detached copy of the loss
                    roots[f'training_step()["{key}"]'] = ("output", value)
        allowed: list[Tensor] = []
        new: list[Holder] = []
        for root, (kind, value) in roots.items():
            paths: list[str] = []
            kept: list[Tensor] = []
            for path, tensor in graph_tensors({root: value}):
                if self._allowed(path):
                    allowed.append(tensor)
                else:
                    paths.append(path)
                    kept.append(tensor)
            if kept:
                new += self._note(pl_module, root, kind, paths, kept)
        for name, tensor, site in self._logged:
            new += self._note(pl_module, name, "logger", [name], [tensor], site)
        self._logged.clear()
        self._watch_growth(pl_module, allowed)
        return new

    def _allowed(self, path: str) -> bool:
        for name in self.allow:
            prefix = f"self.{name}"
            if path == prefix or path.startswith((prefix + "[", prefix + ".", prefix + "{")):
                return True
        return False

    def _note(
        self,
        pl_module: L.LightningModule,
        name: str,
        kind: str,
        paths: list[str],
        tensors: list[Tensor],
        site: Site | None = None,
    ) -> list[Holder]:
        holder = self._holders.get(name)
        is_new = holder is None
        if holder is None:
            start = time.perf_counter()
            sites = [site] if site is not None else _sites(type(pl_module), kind, name)
            self._one_off_s += time.perf_counter() - start
            holder = self._holders[name] = Holder(name, kind, sites=sites)
        holder.scalar = all(t.numel() == 1 for t in tensors)
        holder.add(self._steps, paths, footprint(tensors, exclude=self._weights))
        return [holder] if is_new else []

    def _watch_growth(self, pl_module: L.LightningModule, allowed: list[Tensor]) -> None:
        if pl_module.device.type == "cuda":  # the allocator's count: no sync, no scan
            value = float(torch.cuda.memory_allocated(pl_module.device))
        elif self.every_n_steps is not None or self._census.allows():
            start = time.perf_counter()
            skip = {id(t) for t in allowed}
            value = float(footprint([t for t in census() if id(t) not in skip], exclude=self._weights).nodes)
            self._census.spend(time.perf_counter() - start)
        else:
            return
        collected = _fully_collected()  # what it freed had been counted alive by the samples before
        if collected > self._collected:
            self._breaks.append(self._steps)
        self._collected = collected
        self._series = thin([*self._series, (self._steps, value)])

    def _raise_if_found(self, trainer: L.Trainer, pl_module: L.LightningModule, new: list[Holder]) -> None:
        if not self._agree(trainer, bool(new), self._sampler):
            return
        if not new:
            raise RetainedGraphError(
                "LossLoggingGuard: another rank found a value that keeps an autograd graph."
            )
        holder = new[0]
        self.findings = self._make_findings(pl_module)
        where = f" (stored at {holder.sites[0].location}: {holder.sites[0].code})" if holder.sites else ""
        raise RetainedGraphError(f"LossLoggingGuard: {holder.title()}{where}. {holder.fix()}")

    # -- findings ------------------------------------------------------------------------------

    def _make_findings(self, pl_module: L.LightningModule) -> list[Finding]:
        source = type(self).__name__
        checks = f"{self._sampler.checks} checked step(s) of {self._steps}"
        spent = self._sampler.spent_s
        cost = f"{spent:.2f} s checking" if spent >= 1 else f"{1000 * spent:.1f} ms checking"
        findings = [
            Finding(
                source,
                "retained graphs",
                Severity.WARN,
                holder.title(),
                holder.detail(),
                holder.fix(),
                holder.sites[0].location if holder.sites else None,
                data=holder.to_data(),
                cost=f"{format_bytes(holder.last.saved_bytes + holder.last.held_bytes)} kept alive",
            )
            for holder in self._holders.values()
        ]
        leak = self._growth_finding(pl_module.device.type == "cuda")
        if leak is not None:
            findings.append(leak)
        if not findings:
            findings.append(
                Finding(
                    source,
                    "retained graphs",
                    Severity.INFO,
                    "No autograd graph kept between training steps",
                    f"{checks}; nothing the module keeps, returns or logs holds a graph.",
                    data={"checks": self._sampler.checks, "steps": self._steps},
                    cost=cost,
                )
            )
        return findings

    def _growth_finding(self, on_cuda: bool) -> Finding | None:
        trend = growth(self._series, self._breaks)
        measures = ("saved_bytes", "held_bytes") if on_cuda else ("nodes",)  # bytes on CUDA, nodes on CPU
        named = sum(holder.growth(m).per_step for holder in self._holders.values() for m in measures)
        if not trend.steady or named >= 0.5 * trend.per_step:  # none, or explained by named holders
            return None
        if on_cuda:
            title = f"Allocated GPU memory grows by {format_bytes(trend.per_step)} per step: probable leak"
            span = f"{format_bytes(trend.first)} to {format_bytes(trend.last)}"
            label = "allocated bytes"
        else:
            title = f"Autograd nodes alive grow by {trend.per_step:.3g} per step: probable leak"
            span = f"{trend.first:.0f} to {trend.last:.0f} nodes"
            label = "autograd nodes alive"
        steps = [step for step, _ in self._series]
        detail = f"{span} between steps {steps[0]} and {steps[-1]}"
        detail += f" ({trend.samples} samples, correlation {trend.correlation:.2f})"
        collections = sum(steps[0] < step <= steps[-1] for step in self._breaks)
        if collections:  # the levels dropped as earlier garbage went: the growth is each stretch's
            detail += (
                f", fitted across {collections} full garbage collection(s) that freed what was left before"
            )
        detail += "."
        fix = unnamed_growth_fix()
        if on_cuda:
            fix += " Metrics that keep every prediction (AUROC, CatMetric) also grow, until their reset."
        data = {
            "per_step": round(trend.per_step, 4),
            "correlation": round(trend.correlation, 4),
            "unit": label,
            "plot": plot_data(
                "retained_growth",
                f"{label.capitalize()} over training",
                "training step",
                steps,
                {label: [v for _, v in self._series]},
            ),
        }
        return Finding(type(self).__name__, "retained graphs", Severity.WARN, title, detail, fix, data=data)


def _fully_collected() -> int:
    """Objects freed so far by collections of the garbage collector's oldest generation."""
    return int(gc.get_stats()[-1]["collected"])


def _sites(cls: type, kind: str, name: str) -> list[Site]:
    """The user's lines behind a holder: the stores into the attribute, or ``training_step``'s return."""
    if kind == "attribute":  # holders are named by their root attribute: ``self.<attribute>``
        return store_sites(cls, name.removeprefix("self."))
    if kind == "output":
        return return_sites(cls, "training_step")
    return []


def _spy_on_loggers(
    loggers: Iterable[Logger], record: Callable[[tuple[str, Tensor, Site | None]], None]
) -> Callable[[], None]:
    """Route each logger's ``log_metrics`` through a check for tensors with a graph; return the undo.

    Lightning hands loggers plain numbers, so a tensor with a graph there came from the user's own
    call, whose line `user_frame` finds.
    """
    patched = []
    for logger in loggers:
        original = logger.log_metrics

        def log_metrics(
            metrics: Mapping[str, Any],
            step: int | None = None,
            *,
            _original: Any = original,
            _name: str = type(logger).__name__,
        ) -> None:
            for key, value in metrics.items():
                if holds_graph(value):
                    record((f'{_name}.log_metrics("{key}")', value, user_frame()))
            _original(metrics, step)

        logger.log_metrics = log_metrics  # type: ignore[method-assign]
        patched.append(logger)

    def undo() -> None:
        for logger in patched:
            logger.__dict__.pop("log_metrics", None)

    return undo
