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
    """Make `scheduler` `tuned` steps long when its length is `configured` (within `slack`);
    the attribute and the length it had, or ``None`` when it was left as it is.

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1024)
        >>> resize(cosine, configured=1024, tuned=256, slack=2), cosine.T_max
        (('T_max', 1024), 256)
        >>> resize(cosine, configured=1024, tuned=256, slack=2)  # 256 is no run's configured length
    """
    attribute = HORIZONS.get(type(scheduler).__name__, "")
    length = getattr(scheduler, attribute, None) if attribute else None
    if not isinstance(length, int) or length == tuned or abs(length - configured) > slack:
        return None
    if attribute == "total_steps":
        _one_cycle_phases(scheduler, length, tuned)
    setattr(scheduler, attribute, tuned)
    return attribute, length


def _one_cycle_phases(scheduler: Any, old: int, new: int) -> None:
    """OneCycleLR's phase ends for `new` steps, by torch's own formula (its ``__init__``): the
    first ends at ``pct_start * total - 1``, a three-phase cycle's second at twice that less one
    more, the last at ``total - 1``."""
    phases = scheduler._schedule_phases
    pct_start = (float(phases[0]["end_step"]) + 1) / old
    ends = [pct_start * new - 1, 2 * pct_start * new - 2, new - 1]
    for phase, end in zip(phases, [*ends[: len(phases) - 1], ends[-1]], strict=True):
        phase["end_step"] = float(end)


def resized_finding(name: str, attribute: str, old: int, new: int, sizes: tuple[int, int]) -> Finding:
    """INFO: `name`'s length `old` counted the configured batch's steps, and is now `new`."""
    configured, tuned = sizes
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"{name}'s {attribute}={old} counted the configured batch's steps: now {new}, the tuned run's",
        f"The program counted the schedule's steps before the fit, at batch {configured}. At batch"
        f" {tuned} the run takes {new}, so it would have stopped {new / old:.0%} of the way through the"
        " schedule, at a rate a plain run passes long before its end. Counted in"
        " `configure_optimizers` from `self.trainer.estimated_stepping_batches`, a schedule follows"
        " the tuned run by itself.",
        data={"schedule": name, attribute: new, "counted": old},
    )
