"""`BoostCallback`: what every boost callback shares with the others."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_boost._lightning import skip_unused_batch_hooks
from lightning_boost.guards.sources import Site
from lightning_boost.report import BoostWarning
from lightning_boost.report.callback import attach_report


class BoostCallback(L.Callback):
    """Base of the boost callbacks that produce findings.

    - ``setup`` attaches one `BoostReport` to the trainer (subclasses call ``super().setup``);
    - the ``state_key`` is built once from the identifying arguments (`_set_state_key`), since
      Lightning reads it on every hook call it makes, several times per step;
    - `_warn` gives a `BoostWarning` on rank zero that points at the user's line;
    - the per-batch hooks a subclass does not override are not called (`skip_unused_batch_hooks`).
    """

    _state_key: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        skip_unused_batch_hooks(cls)

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
