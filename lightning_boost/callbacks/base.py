"""`BoostCallback`: what every boost callback shares with the others."""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from lightning_boost.callbacks.boost_report import attach_report


class BoostCallback(L.Callback):
    """Base of the boost callbacks that produce findings.

    - ``setup`` attaches one `BoostReport` to the trainer (subclasses call ``super().setup``);
    - the ``state_key`` is built once from the identifying arguments (`_set_state_key`), since
      Lightning reads it on every hook call it makes, several times per step.
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
