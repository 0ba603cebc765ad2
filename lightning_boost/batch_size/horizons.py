"""Schedules a program sized by hand for the configured batch, made as long as the tuned run.

A program that counts its steps before the fit (in ``setup()`` or ``__init__``, from the training
set and the batch size it was configured with) sizes a step-interval schedule for that many
steps. At a larger tuned batch the run takes fewer, so it ended part-way through the schedule:
a one-cycle schedule a quarter of the way through is still warming up, and the run ends near its
peak rate instead of annealed (a test reads it); at a smaller one (the configured batch did not
fit) `OneCycleLR` raised past its end. One counted in ``configure_optimizers`` from
``trainer.estimated_stepping_batches`` is counted again at the tuned size (`AutoBatchSize` runs it
again), so it never matches here.

`resize` changes only a schedule whose length is the configured run's steps, give or take one per
epoch (a count rounded down per epoch by hand): one sized otherwise is the program's choice and
is left alone. Pure: torch's schedulers and plain numbers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from lightning_boost.report import Finding, Severity

#: Scheduler class -> the attribute that holds its length in steps (torch's names).
HORIZONS = {
    "OneCycleLR": "total_steps",
    "CosineAnnealingLR": "T_max",
    "LinearLR": "total_iters",
    "PolynomialLR": "total_iters",
    "ConstantLR": "total_iters",
}


def resize(scheduler: Any, configured: int, tuned: int, slack: int) -> tuple[str, int] | None:
    """Make `scheduler` `tuned` steps long when its length is `configured` (within `slack`):
    what held its length (``"T_max=1024"``) and the length it had, or ``None`` when it was left as
    it is. A `LambdaLR`'s length is read from its factors (`ends_at`).

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1024)
        >>> resize(cosine, configured=1024, tuned=256, slack=2), cosine.T_max
        (('T_max=1024', 1024), 256)
        >>> resize(cosine, configured=1024, tuned=256, slack=2)  # 256 is no run's configured length
    """
    if type(scheduler).__name__ == "LambdaLR":
        return _warp(scheduler, configured, tuned, slack)
    if type(scheduler).__name__ == "SequentialLR":
        return _sequence(scheduler, configured, tuned, slack)
    attribute = HORIZONS.get(type(scheduler).__name__, "")
    length = getattr(scheduler, attribute, None) if attribute else None
    if not isinstance(length, int) or length == tuned or abs(length - configured) > slack:
        return None
    if attribute == "total_steps":
        _one_cycle_phases(scheduler, length, tuned)
    setattr(scheduler, attribute, tuned)
    return f"{attribute}={length}", length


def _sequence(scheduler: Any, configured: int, tuned: int, slack: int) -> tuple[str, int] | None:
    """A `SequentialLR` (a warm-up, then a decay) whose last schedule ends at the configured run's
    end: its milestones move at the tuned run's pace, and each schedule as long as its span is made
    its new span's (`resize`, one step of slack). Torch's attributes, as `_scale_schedule` reads."""
    milestones, children = list(scheduler._milestones), scheduler._schedulers
    attribute = HORIZONS.get(type(children[-1]).__name__, "")
    last = getattr(children[-1], attribute, None) if attribute and milestones else None
    if not isinstance(last, int) or abs(milestones[-1] + last - configured) > slack or configured == tuned:
        return None
    end = milestones[-1] + last
    moved = [round(milestone * tuned / configured) for milestone in milestones]
    old_spans, new_spans = itertools.pairwise([0, *milestones, end]), itertools.pairwise([0, *moved, tuned])
    for child, (start, stop), (new_start, new_stop) in zip(children, old_spans, new_spans, strict=True):
        resize(child, stop - start, new_stop - new_start, 1)
    scheduler._milestones = moved
    return f"end at step {end}", end


def _warp(scheduler: Any, configured: int, tuned: int, slack: int) -> tuple[str, int] | None:
    """A `LambdaLR` whose factors fall to zero at the configured run's end (`ends_at`: a linear
    or cosine decay with warm-up, as ``transformers``' schedules are) is read at the tuned run's
    pace: its step ``s`` gets the factor of the configured run's step ``s * configured / tuned``,
    warm-up and decay alike, so it ends with the run. The wrapper is a plain function, which the
    scheduler's ``state_dict`` leaves out (a callable object's attributes it would save)."""
    factors = scheduler.lr_lambdas
    ending = [i for i, factor in enumerate(factors) if ends_at(factor, configured, slack)]
    if not ending:
        return None
    for i in ending:
        factors[i] = _read_at(factors[i], configured / tuned)
    return f"decay ending at step {configured}", configured


def _read_at(factor: Callable[[int], float], pace: float) -> Callable[[int], float]:
    def warped(step: int) -> float:
        return factor(round(step * pace))

    return warped


def ends_at(factor: Callable[[int], float], end: int, slack: int) -> bool:
    """Whether `factor` (a `LambdaLR`'s, of the step) falls to zero at `end`, give or take
    `slack`: above zero before, at most a thousandth of its midpoint's value after, and still a
    hundredth of it nine tenths of the way (a decay that fades long before, as an exponential
    one does, has no end to move). A factor that raises is not one to read.

    Example:
        >>> ends_at(lambda step: max(0.0, 1 - step / 1000), 1000, slack=2)
        True
        >>> ends_at(lambda step: max(0.0, 1 - step / 2000), 1000, slack=2)  # ends later
        False
        >>> ends_at(lambda step: 0.95**step, 1000, slack=2)  # never ends
        False
    """
    try:
        steps = (max(0, end - slack - 1), end + slack, end // 2, end * 9 // 10)
        before, after, middle, late = (float(factor(step)) for step in steps)
    except Exception:
        return False
    return before > 0 and middle > 0 and after <= 1e-3 * middle and late >= 1e-2 * middle


def _one_cycle_phases(scheduler: Any, old: int, new: int) -> None:
    """OneCycleLR's phase ends for `new` steps, by torch's own formula (its ``__init__``): the
    first ends at ``pct_start * total - 1``, a three-phase cycle's second at twice that less one
    more, the last at ``total - 1``."""
    phases = scheduler._schedule_phases
    pct_start = (float(phases[0]["end_step"]) + 1) / old
    ends = [pct_start * new - 1, 2 * pct_start * new - 2, new - 1]
    for phase, end in zip(phases, [*ends[: len(phases) - 1], ends[-1]], strict=True):
        phase["end_step"] = float(end)


def resized_finding(name: str, what: str, old: int, new: int, sizes: tuple[int, int]) -> Finding:
    """INFO: `name`'s length `old` (`what` says where it is held) counted the configured batch's
    steps, and is now `new`."""
    configured, tuned = sizes
    ended = (
        f"stopped {new / old:.0%} of the way through the schedule, at a rate a plain run passes"
        " long before its end"
        if new < old
        else "run past the schedule's end (where `OneCycleLR` raises)"
    )
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"{name}'s {what} counted the configured batch's steps: now {new}, the tuned run's",
        f"The program counted the schedule's steps before the fit, at batch {configured}. At batch"
        f" {tuned} the run takes {new}, so it would have {ended}. Counted in `configure_optimizers`"
        " from `self.trainer.estimated_stepping_batches`, a schedule follows the tuned run by itself.",
        data={"schedule": name, "steps": new, "counted": old},
    )
