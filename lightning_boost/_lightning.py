"""The one place lightning-boost reads Lightning internals that have no public API (tested)."""

from __future__ import annotations

import lightning as L


def trainer_precision_flag(trainer: L.Trainer) -> str:
    """The precision the user passed to `Trainer` ("32-true" when none was passed).

    `trainer.precision` reports the strategy's plugin, which is the preset's when the strategy
    carries one, so the user's own choice is only on the accelerator connector.
    """
    return str(trainer._accelerator_connector._precision_flag)
