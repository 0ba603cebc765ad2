"""`BoostCallback`: what every boost callback shares with the others."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_boost._validation import PositiveInt, Range
from lightning_boost.callbacks.boost_report import attach_report
from lightning_boost.report import BoostWarning
from lightning_boost.tuning.sources import Site

#: What a guard does with what it finds: warn at the line, raise (for CI), or only report.
GuardMode = Literal["warn", "error", "report"]
#: How often a guard checks, when not following its overhead budget.
EveryNSteps = PositiveInt | None
#: The share of step time a guard's checks may take.
Overhead = Annotated[float, Range(gt=0, lt=1)]


class BoostCallback(L.Callback):
    """Base of the boost callbacks that produce findings.

    - ``setup`` attaches one `BoostReport` to the trainer (subclasses call ``super().setup``);
    - the ``state_key`` is built once from the identifying arguments (`_set_state_key`), since
      Lightning reads it on every hook call it makes, several times per step;
    - `_warn` gives a `BoostWarning` on rank zero that points at the user's line.
    """

    _state_key: str

    def _set_state_key(self, **identifying: Any) -> None:
        self._state_key = self._generate_state_key(**identifying)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        attach_report(trainer)

    def _warn(self, trainer: L.Trainer, message: str, site: Site | None = None) -> None:
        """A `BoostWarning` on rank zero, attributed to the user's line `site` when known."""
        if not trainer.is_global_zero:
            return
        if site is None:
            rank_zero_warn(message, category=BoostWarning)
        else:
            warnings.warn_explicit(message, BoostWarning, site.file, site.line)
