"""`Guard`: what `SyncGuard` and `LossLoggingGuard` share besides what they watch."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import lightning as L
from typing_extensions import override

from lightning_boost._validation import PositiveInt, Range
from lightning_boost.callbacks.base import BoostCallback
from lightning_boost.guards.sampling import Sampler
from lightning_boost.ranks import from_rank_zero
from lightning_boost.report import Finding

#: What a guard does with what it finds: warn at the line, raise (for CI), or only report.
GuardMode = Literal["warn", "error", "report"]
#: How often a guard checks, when not following its overhead budget.
EveryNSteps = PositiveInt | None
#: The share of step time a guard's checks may take.
Overhead = Annotated[float, Range(gt=0, lt=1)]


def no_op() -> None:
    """Does nothing; picklable where a lambda is not (an idle undo)."""


class Guard(BoostCallback):
    """Base of the guards (`SyncGuard`, `LossLoggingGuard`): what they share besides what they watch.

    - the arguments every guard takes: `mode` (``"warn"``, ``"error"``, ``"report"``), `allow`,
      and the sampling pair `every_n_steps` / `max_overhead`;
    - rank consensus (`_agree`): under DDP every rank checks the same steps, so all raise together;
    - pickling: the attributes in `_transient` (closures, watchers) are left out and given back
      their idle value, to be rebuilt at the next fit;
    - `_finish` on an exception too, so the report shows what was found before the failure.
    """

    #: Attribute -> its value when idle; not pickled (rebuilt when training starts).
    _transient: ClassVar[dict[str, Any]] = {}

    def __init__(
        self, mode: str, allow: tuple[str, ...], every_n_steps: int | None, max_overhead: float
    ) -> None:
        self.mode = mode
        self.allow = allow
        self.every_n_steps = every_n_steps
        self.max_overhead = float(max_overhead)
        self.findings: list[Finding] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **self._transient}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name, idle in self._transient.items():
            setattr(self, name, idle)

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._finish(pl_module)

    def _finish(self, pl_module: L.LightningModule) -> None:
        """Stop watching and turn what was found into `findings`."""
        raise NotImplementedError

    @staticmethod
    def _agree(trainer: L.Trainer, found: bool, sampler: Sampler) -> bool:
        """Whether any rank found something; the ranks keep checking the same steps after it."""
        if trainer.world_size > 1:
            found = trainer.strategy.reduce_boolean_decision(found, all=False)
            sampler.next_step = from_rank_zero(trainer.strategy, sampler.next_step)
        return found
