"""bf16 autocast on a CPU, kept only where the model's own training step is faster with it.

A CPU with bf16 dot products (AVX512-BF16, AMX) runs a convolutional network's step faster under
bf16 autocast and a small MLP's slower, the casts costing more than its matmuls gain (ResNet-18
1.26x, a 32-128-10 MLP 0.74x: `benchmarks/RESULTS.md`). So before the first training step, a
copy of the model trains on one of the run's own batches, alternating fp32 and bf16 autocast
step by step (`autocast_setting`; weights, optimizer and RNG of the run untouched), and
`decide_autocast` keeps the faster. The run's own steps all run at the chosen setting: when fp32
is kept, the run trains exactly the model plain Lightning trains. Every rank keeps rank zero's
decision. Manual optimization is not measured (its step needs the trainer): it stays in fp32,
with a finding.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_boost._lightning import preserved_rng
from lightning_boost.precision import AutocastChoice, autocast_budget, autocast_setting, decide_autocast
from lightning_boost.report import Finding, Severity
from lightning_boost.step_probe import StepProbe, first_batch

if TYPE_CHECKING:  # the mixin is typed as the plugin it is mixed into
    _Plugin = MixedPrecision
else:
    _Plugin = object


class MeasuredAutocastMixin(_Plugin):
    """``MixedPrecision("bf16-mixed", "cpu")`` that keeps bf16 autocast only if the model's
    training step is faster with it (`measure`, before the first step); ``precision`` reads
    ``"32-true"`` until then, and after when it was not.

    ``choice`` holds the decision once made. ``owner``, the preset strategy (set when it sets up),
    broadcasts rank zero's decision to every rank and receives the finding.
    """

    def __init__(self) -> None:
        super().__init__("bf16-mixed", "cpu")
        self.autocast = False  # fp32 until the trial says otherwise, and `precision` says so:
        self.precision = "32-true"  # Lightning's model summary warns about any "-mixed" string
        self.seconds: list[float] = []
        self.choice: AutocastChoice | None = None
        self.owner: Any = None

    @override
    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        context = self.autocast_context_manager() if self.autocast else contextlib.nullcontext()
        with context:
            yield

    def measure(self, trainer: Any, batch: Any = None, run_steps: float | None = None) -> None:
        """Decide before the first training step, on a copy of the model and one of the run's
        batches: `batch` (on the device) when given, else the training loader's first; `run_steps`,
        the optimizer steps the run plans (the trial's budget), else the trainer's estimate."""
        if self.choice is not None:
            return
        module = trainer.lightning_module
        if not module.automatic_optimization:
            self._settle(AutocastChoice(False, None, 0, "manual optimization"))
            return
        with preserved_rng():
            try:
                choice = self._trial(module, trainer, batch, run_steps)
            except Exception as error:  # the run's own step says so itself, if it is real
                choice = AutocastChoice(False, None, 0, f"the step failed on a copy of the model ({error!r})")
        self._settle(choice)

    def _trial(self, module: Any, trainer: Any, batch: Any, run_steps: float | None) -> AutocastChoice:
        batch = one_batch(trainer) if batch is None else batch
        if batch is None:
            return AutocastChoice(False, None, 0, "no training batch to time the step on")
        probe = StepProbe(module, trainer.optimizers, 1, contextlib.nullcontext, contextlib.nullcontext)
        settings = (autocast_setting(step) for step in itertools.count())
        contexts = (self.autocast_context_manager if bf16 else contextlib.nullcontext for bf16 in settings)
        start, budget = time.perf_counter(), None
        with contextlib.closing(probe.time_steps(batch, contexts)) as steps:  # frees the copy on return
            for seconds in steps:
                self.seconds.append(seconds)
                if budget is None:
                    steps_planned = trainer.estimated_stepping_batches if run_steps is None else run_steps
                    budget = autocast_budget(seconds, steps_planned)
                choice = decide_autocast(self.seconds, final=time.perf_counter() - start > budget)
                if choice is not None:
                    return choice
        raise AssertionError("unreachable: the contexts never end")  # pragma: no cover

    def _settle(self, choice: AutocastChoice) -> None:
        bf16 = choice.bf16 if self.owner is None else bool(self.owner.broadcast(choice.bf16, src=0))
        self.choice = choice._replace(bf16=bf16)
        self.autocast = bf16
        self.precision = "bf16-mixed" if bf16 else "32-true"
        if self.owner is not None:
            self.owner.findings.append(autocast_finding(self.choice, len(self.seconds)))


class MeasuredAutocast(MeasuredAutocastMixin, MixedPrecision):
    """`MeasuredAutocastMixin` on ``lightning.pytorch``'s `MixedPrecision`."""


def autocast_finding(choice: AutocastChoice, steps: int) -> Finding:
    """What the measured autocast decided, and from which steps.

    Example:
        >>> autocast_finding(AutocastChoice(True, 1.25, 3), 8).title
        'bf16 autocast kept on this CPU: its steps ran 1.25x as fast as fp32'
    """
    data: dict[str, Any] = {"autocast_bf16": choice.bf16, "speedup": choice.speedup, "steps": steps}
    keep_fp32 = "preset('auto', precision='32-true')"
    if choice.why_not:
        detail = f"not measured: {choice.why_not}"
        fix = "preset('auto', precision='bf16-mixed') uses bf16 autocast unmeasured"
        return Finding(
            "preset", "precision and strategy", Severity.INFO, "fp32 kept on this CPU", detail, fix, data=data
        )
    detail = (
        f"before training, {steps} steps of a copy of the model on one of the run's batches alternated"
        f" bf16 autocast and fp32 (one warm-up each, then {choice.pairs} timed pairs; median fp32/bf16"
        " step time"
        f" {choice.speedup:.2f}, kept above 1.05); weights, gradients and optimizer state are fp32"
        " either way"
    )
    if choice.bf16:
        title = f"bf16 autocast kept on this CPU: its steps ran {choice.speedup:.2f}x as fast as fp32"
        return Finding("preset", "precision and strategy", Severity.INFO, title, detail, keep_fp32, data=data)
    title = f"fp32 kept on this CPU: bf16 autocast steps ran {choice.speedup:.2f}x as fast"
    return Finding("preset", "precision and strategy", Severity.INFO, title, detail, data=data)


def one_batch(trainer: Any) -> Any:
    """The first batch of the run's training set, collated and moved as the run's are (the
    module's batch-transfer hooks included); ``None`` without a DataLoader with a batch size."""
    loader = trainer.train_dataloader
    if isinstance(loader, (list, tuple)) and loader:
        loader = loader[0]
    if not isinstance(loader, DataLoader) or not loader.batch_size:
        return None
    batch = first_batch(loader.dataset, loader.collate_fn, loader.batch_size)
    return trainer.lightning_module._apply_batch_transfer_handler(batch)
