"""Is the tuned run still training? The training loss, watched in windows, for divergence and
against where the configured settings took it in their trial.

No Lightning here. A batch size or learning rate that the trials called good can still make the
run diverge: the loss turns non-finite, or climbs for several windows in a row. `LossWatch` adds
the losses the run already returns (on their device: one copy to the host per window, which the
host reads once it has landed, so the watch never waits for the device) and `loss_verdict` says
whether the window means show either; the callback then reports it once as a WARN with the fix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_boost.batch_size.decision import BatchSizeDecision
from lightning_boost.report import Finding, Severity

#: Training batches per window: one copy of the window's mean loss to the host each.
WINDOW = 32
#: Windows in a row whose mean rose, ending this many times above the lowest mean and this part of
#: the way back from the lowest mean to the first, make a divergence. Near a loss of 0.05 a healthy
#: run's window means wobble 2-3x (rising 3 in a row by chance), but 7 % of the way back at most
#: (6 runs of an MLP with Adam recorded by hand, 2026-11-29; one is `tests/test_goodput.py`'s
#: `CONVERGED`).
RISING, RISE, BACK = 3, 1.5, 0.15


def loss_verdict(
    means: Sequence[float], rising: int = RISING, rise: float = RISE, back: float = BACK
) -> str | None:
    """What is wrong with a run whose window means of the training loss are `means`, or ``None``.

    Example:
        >>> loss_verdict([2.0, 1.5, 1.2]) is None, loss_verdict([2.0, float("nan")])
        (True, 'the training loss became nan')
        >>> loss_verdict([2.0, 1.0, 1.2, 1.4, 1.6])
        'the training loss rose for 3 windows in a row, from 1 to 1.6 (60% of the way back to 2)'
        >>> loss_verdict([2.0, 0.04, 0.05, 0.07, 0.09]) is None  # 2.6 % of the way back: noise
        True
    """
    if not means:
        return None
    last, lowest = means[-1], min(means)
    if not math.isfinite(last):
        return f"the training loss became {last}"
    recent = means[-rising - 1 :]
    climbing = len(recent) > rising and all(b > a for a, b in itertools.pairwise(recent))
    undone = (last - lowest) / (means[0] - lowest) if means[0] > lowest else math.inf
    if not (climbing and last > rise * lowest and undone > back):
        return None
    way = f" ({undone:.0%} of the way back to {means[0]:.3g})" if math.isfinite(undone) else ""
    return f"the training loss rose for {rising} windows in a row, from {lowest:.3g} to {last:.3g}{way}"


def reference_of(decision: BatchSizeDecision) -> tuple[float, float] | None:
    """``(samples, loss)``: where the configured batch size and learning rate took the training loss
    in their trial (the mean of its last two steps, after its warm-up and timed steps' samples, per
    rank); ``None`` without such a trial, under accumulation (the trial steps every batch), or
    for a loss that is not positive (a ratio would mean nothing).

    Example:
        >>> from lightning_boost.trials import Trial
        >>> d = BatchSizeDecision(128, configured_batch_size=64, trials=(Trial(64, losses=(2.3, 2.1, 1.9)),))
        >>> reference_of(d)
        (256, 2.0)
    """
    trial = next((t for t in decision.trials if t.size == decision.configured_batch_size), None)
    if trial is None or len(trial.losses) < 2 or decision.configured_accumulate != 1:
        return None
    loss = sum(trial.losses[-2:]) / 2
    samples = (1 + len(trial.losses)) * trial.size
    return (samples, loss) if math.isfinite(loss) and loss > 0 else None


class HostCopy:
    """A scalar on its way to the host without waiting for the device: a CUDA tensor is copied
    into pinned memory behind the work queued before it, and read once an event recorded after
    the copy says it has landed (`Event.query` does not block); a CPU tensor at once. Any other
    device's copy waits (it has no such event here).

    Example:
        >>> copy = HostCopy(torch.tensor(1.5))
        >>> copy.landed(), copy.value()
        (True, 1.5)
    """

    def __init__(self, value: Tensor) -> None:
        cuda = value.device.type == "cuda"
        self._host = torch.empty((), dtype=value.dtype, device="cpu", pin_memory=cuda)
        self._host.copy_(value.detach().reshape(()), non_blocking=value.device.type in ("cuda", "cpu"))
        self._landed: torch.cuda.Event | None = None
        if cuda:
            self._landed = torch.cuda.Event()
            self._landed.record()

    def landed(self) -> bool:
        return self._landed is None or self._landed.query()

    def value(self) -> float:
        """The copied value (waiting for the copy to land, where it has not)."""
        if self._landed is not None:
            self._landed.synchronize()
        return float(self._host)


class LossWatch:
    """Window means of the training loss, kept on its device between reads.

    Args:
        window: training batches per window.
        reference: ``(samples, loss)`` from `reference_of`: once the run has trained that many
            samples, a window mean more than `RISE` times that loss is a verdict too.
        batch_size: the run's batch size per rank (to count its samples).
    """

    def __init__(
        self, window: int = WINDOW, reference: tuple[float, float] | None = None, batch_size: int = 1
    ) -> None:
        self.window = window
        self.reference = reference
        self.batch_size = batch_size
        self.means: list[float] = []
        self._total: Tensor | None = None
        self._count = 0
        self._copies: list[HostCopy] = []  # window means on their way to the host, oldest first

    def add(self, loss: Tensor) -> str | None:
        """Add one step's loss; for each window whose mean has reached the host since,
        `loss_verdict` over the means so far (and the first window past the reference's samples
        against its loss)."""
        value = loss.detach().float().sum()
        self._total = value if self._total is None else self._total + value
        self._count += 1
        if self._count == self.window:
            self._copies.append(HostCopy(self._total / self._count))
            self._total, self._count = None, 0
        return self._read(landed_only=True)

    def flush(self) -> str | None:
        """Read the windows still on their way (waiting for them: at the end of training, outside
        the steps), with `add`'s verdict."""
        return self._read(landed_only=False)

    def _read(self, landed_only: bool) -> str | None:
        verdict = None
        while self._copies and (self._copies[0].landed() or not landed_only):
            self.means.append(self._copies.pop(0).value())
            verdict = verdict or loss_verdict(self.means) or self._above_reference()
        return verdict

    def _above_reference(self) -> str | None:
        if self.reference is None or len(self.means) * self.window * self.batch_size < self.reference[0]:
            return None
        samples, loss = self.reference
        self.reference = None  # one comparison: the first window past the trial's samples
        mean = self.means[-1]
        if mean <= RISE * loss:
            return None
        return (
            f"the training loss averaged {mean:.3g} over its first {len(self.means) * self.window} steps,"
            f" above the {loss:.3g} the configured batch size and learning rate reached after"
            f" {samples:,.0f} samples in their trial"
        )

    def finding(self, verdict: str, decision: BatchSizeDecision) -> Finding:
        """The WARN for a tuned run that `verdict` says diverges."""
        return Finding(
            "AutoBatchSize",
            "batch size",
            Severity.WARN,
            f"The tuned run may be diverging: {verdict}"
            if "configured batch size" not in verdict
            else f"The tuned run trains worse than the configured settings: {verdict}",
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
