"""Is the tuned run still training? The training loss, watched in windows, for divergence.

No Lightning here. A batch size or learning rate that the trials called good can still make the
run diverge: the loss turns non-finite, or climbs for several windows in a row. `LossWatch` adds
the losses the run already returns (on their device: one read per window, not per step) and
`loss_verdict` says whether the window means show either; the callback then reports it once as a
WARN with the fix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch import Tensor

from lightning_boost.batch_size.decision import BatchSizeDecision
from lightning_boost.report import Finding, Severity

#: Training batches per window: one host read of the summed loss each.
WINDOW = 32
#: Windows in a row whose mean rose, ending this many times above the lowest mean, make a divergence.
RISING, RISE = 3, 1.5


def loss_verdict(means: Sequence[float], rising: int = RISING, rise: float = RISE) -> str | None:
    """What is wrong with a run whose window means of the training loss are `means`, or ``None``.

    Example:
        >>> loss_verdict([2.0, 1.5, 1.2]) is None, loss_verdict([2.0, float("nan")])
        (True, 'the training loss became nan')
        >>> loss_verdict([2.0, 1.0, 1.2, 1.4, 1.6])
        'the training loss rose for 3 windows in a row, from 1 to 1.6'
    """
    if not means:
        return None
    if not math.isfinite(means[-1]):
        return f"the training loss became {means[-1]}"
    recent = means[-rising - 1 :]
    climbing = len(recent) > rising and all(b > a for a, b in itertools.pairwise(recent))
    lowest = min(means)
    if climbing and means[-1] > rise * lowest:
        return f"the training loss rose for {rising} windows in a row, from {lowest:.3g} to {means[-1]:.3g}"
    return None


class LossWatch:
    """Window means of the training loss, kept on its device between reads."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.means: list[float] = []
        self._total: Tensor | None = None
        self._count = 0

    def add(self, loss: Tensor) -> str | None:
        """Add one step's loss; at the end of a window, `loss_verdict` over the means so far."""
        value = loss.detach().float().sum()
        self._total = value if self._total is None else self._total + value
        self._count += 1
        if self._count < self.window:
            return None
        self.means.append(float(self._total) / self._count)
        self._total, self._count = None, 0
        return loss_verdict(self.means)

    def finding(self, verdict: str, decision: BatchSizeDecision) -> Finding:
        """The WARN for a tuned run that `verdict` says diverges."""
        return Finding(
            "AutoBatchSize",
            "batch size",
            Severity.WARN,
            f"The tuned run may be diverging: {verdict}",
            detail=(
                f"Batch size {decision.batch_size} (configured {decision.configured_batch_size}),"
                f" learning rates x{decision.lr_factor:.3g} ({decision.lr_scaling}). Window means of"
                f" {self.window} steps: {', '.join(f'{m:.3g}' for m in self.means[-6:])}."
            ),
            fix=(
                f"Bound the batch with `AutoBatchSize(max_batch_size={decision.configured_batch_size})`,"
                " or keep the configured learning rates with `lr_scaling=None`."
            ),
            data={"window_means": [m if math.isfinite(m) else str(m) for m in self.means]},
        )
