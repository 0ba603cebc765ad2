"""Averages of the weights counted in optimizer steps (an EMA), kept to the configured run's span
in samples when the tuned batch changes the samples each optimizer step trains.

An exponential moving average updated at each optimizer step with decay ``d`` still holds
``d**n`` of the weights it started from after ``n`` updates. At a batch that trains ``g`` times
the configured samples per step the run takes ``g`` times fewer steps, so at the same decay the
average spans ``g`` times more of the run's samples and ends holding more of its early weights:
over a run of 4x fewer steps an ``EMAWeightAveraging(decay=0.99)``, which Lightning copies into the
model at the end of the fit, ended at 1.72x the tuned model's own validation loss, where plain's
average ends at 1.07x plain's model (`tests/test_weight_averages.py`). ``d**g`` forgets as much per
sample as ``d`` did at the configured size. A start counted in steps (``update_starting_at_step``)
moves to the same sample: counted for the configured run, it fell past the tuned run's end, the
average was never updated, and Lightning copied it (the initial weights) into the model.

Found: Lightning's `WeightAveraging` callbacks and the `AveragedModel` objects the LightningModule
holds, whose function is torch's EMA (`get_ema_avg_fn`, `get_ema_multi_avg_fn`): the decay is read
from it. An equal-weight average (SWA, the default) needs nothing. What is changed here is put
back at the end of the fit.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import lightning as L
from torch.optim import swa_utils

from lightning_boost._lightning import callbacks_of, is_lightning
from lightning_boost.report import Finding, Severity

#: torch's EMA function factories, by the name of the function each returns.
EMA_FACTORIES: dict[str, Callable[[float], Callable[..., Any]]] = {
    "get_ema_avg_fn.<locals>.ema_update": swa_utils.get_ema_avg_fn,
    "get_ema_multi_avg_fn.<locals>.ema_update": swa_utils.get_ema_multi_avg_fn,
}


@dataclasses.dataclass(frozen=True)
class Average:
    """An EMA of the weights the run updates per optimizer step, as it was written."""

    averaged: swa_utils.AveragedModel
    attribute: str  # its function's: "avg_fn" or "multi_avg_fn"
    written: Callable[..., Any]
    decay: float
    name: str  # for the finding
    callback: Any = None  # the `WeightAveraging` callback that updates it, if one does
    start: int | None = None  # the callback's `update_starting_at_step`, as written


def ema_decay(function: Any) -> float | None:
    """The decay torch's EMA `function` was made with (`EMA_FACTORIES`); ``None`` for another.

    Example:
        >>> ema_decay(swa_utils.get_ema_multi_avg_fn(0.99)), ema_decay(swa_utils.get_swa_avg_fn())
        (0.99, None)
    """
    inner = inspect.unwrap(function) if callable(function) else None  # torch wraps it in no_grad
    code = getattr(inner, "__code__", None)
    if (
        code is None
        or getattr(inner, "__qualname__", None) not in EMA_FACTORIES
        or getattr(inner, "__module__", None) != swa_utils.__name__
    ):
        return None
    cells = dict(zip(code.co_freevars, getattr(inner, "__closure__", None) or (), strict=False))
    value = cells["decay"].cell_contents if "decay" in cells else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def moving_averages(trainer: L.Trainer, pl_module: L.LightningModule) -> list[Average]:
    """The EMAs of the weights in this fit: its `WeightAveraging` callbacks' (built in their
    ``setup``) and those the LightningModule holds."""
    holders: list[tuple[Any, str, Any]] = [
        (getattr(callback, "_average_model", None), type(callback).__name__, callback)
        for callback in callbacks_of(trainer)
        if is_lightning(callback, "WeightAveraging")
    ]
    holders += [
        (module, f"`{name}` of the LightningModule", None)
        for name, module in pl_module.named_modules()
        if isinstance(module, swa_utils.AveragedModel)
    ]
    found = []
    for averaged, name, callback in holders:
        for attribute in ("multi_avg_fn", "avg_fn"):  # AveragedModel's order
            function = getattr(averaged, attribute, None)
            decay = ema_decay(function)
            if decay is not None and function is not None:
                start = getattr(callback, "update_starting_at_step", None)
                start = start if isinstance(start, int) and not isinstance(start, bool) else None
                found.append(Average(averaged, attribute, function, decay, name, callback, start))
                break
    return found


def span(averages: list[Average], growth: float, start: bool = True) -> None:
    """Give each average the decay that forgets as much per sample as it did at the configured
    samples per optimizer step, which each step now trains `growth` times of; with `start`, move a
    callback's first update to the same sample. A `growth` of 1 puts back what was written."""
    for average in averages:
        function = average.written
        if growth != 1.0:
            factory = EMA_FACTORIES[inspect.unwrap(function).__qualname__]
            function = factory(average.decay**growth)
        setattr(average.averaged, average.attribute, function)
        if start and average.start is not None:
            average.callback.update_starting_at_step = math.ceil(average.start / growth)


def spanned_finding(averages: list[Average], growth: float, per_step: tuple[int, int]) -> Finding:
    """INFO: which averages' decays (and starts) now follow the tuned run's samples per step."""
    configured, tuned = per_step
    changes = [f"{a.name}'s decay {a.decay:g} -> {a.decay**growth:.6g}" for a in averages]
    changes += [
        f"its first update at step {a.start} -> {math.ceil(a.start / growth)}"
        for a in averages
        if a.start is not None
    ]
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"Weight average kept to the configured run's samples: {', '.join(changes)}",
        f"An average updated at each optimizer step with decay d forgets its early weights by d a"
        f" step. Each step now trains {tuned} samples, against the configured {configured}, so the"
        f" run takes {growth:.3g}x fewer steps: at the same decay its final average would hold far"
        f" more of the early weights. d**{growth:.3g} forgets as much per sample. Put back at the end"
        " of the fit.",
        data={"averages": [a.name for a in averages], "decay_power": growth},
    )
