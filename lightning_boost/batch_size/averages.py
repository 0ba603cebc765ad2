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
back at the end of the fit. An EMA of another class the LightningModule holds (timm's
``ModelEmaV3``, ``ema_pytorch.EMA``, a ``LitEma`` of the program's own), whose decay may be saved in
its checkpoints and read back, is left as it is, with a WARN giving the decay for the tuned run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
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


def other_averages(pl_module: L.LightningModule) -> list[tuple[str, str, float]]:
    """``(attribute, class, decay)`` of each EMA of a class of its own the LightningModule holds
    (an attribute or submodule whose name or class name has the word "EMA", or a class named
    "ExponentialMovingAverage") with a decay (``decay``, or ema_pytorch's ``beta``) between 0.5
    and 1.

    Example:
        >>> _words("ModelEmaV3"), _words("model_ema"), _words("Schema")
        (['model', 'ema', 'v'], ['model', 'ema'], ['schema'])
    """
    held = [(name, item) for name, item in vars(pl_module).items() if not name.startswith("_")]
    held += [(name, module) for name, module in pl_module.named_modules() if name]
    found = []
    for name, item in held:
        kind = _words(type(item).__name__)
        named = "ema" in kind + _words(name.rsplit(".", 1)[-1])
        if not named and kind != ["exponential", "moving", "average"]:
            continue
        for attribute in ("decay", "beta"):
            value = getattr(item, attribute, None)
            if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
                value = float(value)
            if isinstance(value, float) and 0.5 < value < 1.0:
                found.append((name, type(item).__name__, value))
                break
    return found


def _words(name: str) -> list[str]:
    return [word.lower() for word in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", name)]


def unspanned_finding(others: list[tuple[str, str, float]], growth: float) -> Finding:
    """WARN: EMAs whose decay the pack leaves as it is, with the decay for the tuned run."""
    listed = ", ".join(f"`{name}` ({kind}, decay {decay:g})" for name, kind, decay in others)
    decays = ", ".join(f"{decay**growth:.6g}" for _, _, decay in others)
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.WARN,
        f"An average of the weights counted in steps spans {growth:.3g}x the configured run's samples:"
        f" {listed}",
        f"Each optimizer step now trains {growth:.3g}x the configured samples, so the run takes"
        f" {growth:.3g}x fewer steps, and an average updated each step with the same decay ends holding"
        " far more of its early weights (in the test, torch's EMA at 0.99 over 4x fewer steps ended at"
        " 1.72x the model's own validation loss, against 1.07x for plain's). Its decay is left as it"
        " is: an average of another class may save it in its checkpoints.",
        f"Give it decay {decays} for this run (decay**{growth:.3g}), or use Lightning's"
        " `EMAWeightAveraging`, which AutoBatchSize keeps to the configured run's samples.",
        data={"averages": [name for name, _, _ in others], "decay_power": growth},
    )


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
