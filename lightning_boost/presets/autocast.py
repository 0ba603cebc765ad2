"""bf16 autocast on a CPU, kept only where the run's own training steps are faster with it.

A CPU with bf16 dot products (AVX512-BF16, AMX) trains a convolutional network about 1.2x faster
under bf16 autocast, and a small MLP about 1.4x slower (the casts cost more than the matmuls
gain). Weights, gradients and optimizer state stay fp32 either way, so the two can alternate
step by step: the first training steps alternate (`autocast_setting`), each timed on the host
from the start of the optimizer step to its end (forward, backward and update; a CPU step is
synchronous, and data loading is outside it), and `decide_autocast` keeps the faster. No step is
thrown away. Every rank keeps rank zero's decision. Manual optimization is not measured: its
forward runs outside the optimizer step, so it stays in fp32, with a finding.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from typing_extensions import override

from lightning_boost.precision import AutocastChoice, autocast_setting, decide_autocast
from lightning_boost.report import Finding, Severity

if TYPE_CHECKING:  # the mixin is typed as the plugin it is mixed into
    _Plugin = MixedPrecision
else:
    _Plugin = object


class MeasuredAutocastMixin(_Plugin):
    """``MixedPrecision("bf16-mixed", "cpu")`` that keeps bf16 autocast only if the run's first
    training steps are faster with it; ``precision`` then reads ``"32-true"`` if they were not.

    ``choice`` holds the decision once made. ``owner``, the preset strategy (set when it sets up),
    broadcasts rank zero's decision to every rank and receives the finding.
    """

    def __init__(self) -> None:
        super().__init__("bf16-mixed", "cpu")
        self.autocast = False  # fp32 until a trial step says otherwise
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

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.choice is not None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        if not getattr(model, "automatic_optimization", True):
            self._settle(AutocastChoice(False, None, 0, "manual optimization"))
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        self.autocast = autocast_setting(len(self.seconds))
        start = time.perf_counter()
        result = super().optimizer_step(optimizer, model, closure, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        choice = decide_autocast(self.seconds)
        if choice is not None:
            self._settle(choice)
        return result

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
        detail = f"not measured under {choice.why_not}: its forward runs outside the optimizer step"
        fix = "preset('auto', precision='bf16-mixed') uses bf16 autocast unmeasured"
        return Finding(
            "preset", "precision and strategy", Severity.INFO, "fp32 kept on this CPU", detail, fix, data=data
        )
    detail = (
        f"the first {steps} training steps alternated bf16 autocast and fp32 (one warm-up each, then"
        f" {choice.pairs} timed pairs; median fp32/bf16 step time {choice.speedup:.2f}, kept above"
        " 1.05); weights, gradients and optimizer state are fp32 either way"
    )
    if choice.bf16:
        title = f"bf16 autocast kept on this CPU: its steps ran {choice.speedup:.2f}x as fast as fp32"
        return Finding("preset", "precision and strategy", Severity.INFO, title, detail, keep_fp32, data=data)
    title = f"fp32 kept on this CPU: bf16 autocast steps ran {choice.speedup:.2f}x as fast"
    return Finding("preset", "precision and strategy", Severity.INFO, title, detail, data=data)
