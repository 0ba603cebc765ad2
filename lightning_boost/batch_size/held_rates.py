"""Learning rates Lightning's callbacks hold outside the optimizer, which they set its param groups
from later in the fit: they follow the batch's scaling as the optimizer's rates do, or the part of
the run they govern trains at the rate meant for the configured batch."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_boost._lightning import callbacks_of, is_lightning

#: Each callback's rates: `BackboneFinetuning` sets the unfrozen backbone's group from its
#: ``backbone_initial_lr``, then each epoch from ``previous_backbone_lr``; `StochasticWeightAveraging`
#: builds its `SWALR` from ``_swa_lrs`` (a float or one per param group) when averaging starts.
HELD_RATES = {
    "BackboneFinetuning": ("backbone_initial_lr", "previous_backbone_lr"),
    "StochasticWeightAveraging": ("_swa_lrs",),
}
#: The rates that are the user's arguments, not the callback's state: a checkpoint does not hold
#: them scaled, and they are put back as written at the end of the fit (the callback may serve another).
ARGUMENTS = ("backbone_initial_lr", "_swa_lrs")


def scale_held_rates(trainer: L.Trainer, factor: float, names: tuple[str, ...] | None = None) -> None:
    """Multiply the rates (`names` of them, every one by default) the run's callbacks hold by `factor`."""
    for callback, name, value in held_rates(trainer):
        if names is None or name in names:
            setattr(callback, name, _scaled(value, factor))


def held_rates(trainer: L.Trainer) -> list[tuple[Any, str, Any]]:
    """``(callback, name, value)`` of each rate the run's callbacks hold (`HELD_RATES`) now."""
    found = []
    for callback in callbacks_of(trainer):
        for kind, names in HELD_RATES.items():
            if is_lightning(callback, kind):
                found += [(callback, name, getattr(callback, name, None)) for name in names]
    return [(callback, name, value) for callback, name, value in found if _scaled(value, 1.0) is not None]


def put_back(written: list[tuple[Any, str, Any]]) -> None:
    """The `ARGUMENTS` among `written` (`held_rates` at the start of the fit) as they were."""
    for callback, name, value in written:
        if name in ARGUMENTS:
            setattr(callback, name, value)


def _scaled(value: Any, factor: float) -> Any:
    """`value` (a rate, or a list of them) times `factor`; ``None`` when it holds no rate.

    Example:
        >>> _scaled(0.01, 2.0), _scaled([0.01, 0.02], 2.0), _scaled(None, 2.0)
        (0.02, [0.02, 0.04], None)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value * factor
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return [v * factor for v in value]
    return None
