"""Which steps a guard checks, so that checking costs a bounded share of training time.

A `Sampler` checks the first few steps (so a problem shows at once and its growth per step is
exact), then either every `every_n_steps`-th step or, by default, as often as a time budget
allows: after a check that took ``c`` seconds on steps taking ``s`` seconds, the next one comes
``c / (budget * s)`` steps later. Expensive checks thus happen rarely and cheap ones often, and
the share of time spent checking stays near `budget` whatever the model. The schedule is a step
number (`next_step`), so ranks can agree on it. `TimeBudget` gates an occasional expensive extra
(a garbage-collector scan) by wall time. No Lightning here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Sampler:
    """Decides, step by step, whether to check this one.

    Args:
        first: steps checked unconditionally at the start (steps 1 to `first`).
        every_n_steps: after those, check every n-th step; ``None`` to follow `budget`.
        budget: with ``every_n_steps=None``, the share of step time checks may take (0 to 1).
        clock: the time source (patched in tests).

    Example:
        >>> s = Sampler(first=2, every_n_steps=3)
        >>> checked = []
        >>> for step in range(1, 12):
        ...     if s.due(step):
        ...         checked.append(step)
        ...         s.record(step, cost_s=0.0)
        >>> checked
        [1, 2, 5, 8, 11]
    """

    first: int = 3
    every_n_steps: int | None = None
    budget: float = 0.005
    clock: Callable[[], float] = time.perf_counter
    next_step: int = 1
    spent_s: float = 0.0
    checks: int = 0
    _last: tuple[int, float] | None = field(default=None, repr=False)

    def due(self, step: int) -> bool:
        """Whether `step` (counted from 1) should be checked."""
        return step >= self.next_step

    def record(self, step: int, cost_s: float) -> None:
        """Note that checking `step` took `cost_s` seconds, and schedule the next check."""
        now = self.clock()
        self.spent_s += cost_s
        self.checks += 1
        if step < self.first:
            interval = 1
        elif self.every_n_steps is not None:
            interval = self.every_n_steps
        elif self._last is None:  # one more step, to time the steps themselves
            interval = 1
        else:
            last_step, last_time = self._last
            step_s = max((now - cost_s - last_time) / max(step - last_step, 1), 1e-9)
            interval = max(1, math.ceil(cost_s / (self.budget * step_s) - 1e-9))  # 1e-9: float noise
        self._last = (step, now)
        self.next_step = step + interval


@dataclass
class TimeBudget:
    """Allows an expensive action only while its total cost stays within `share` of elapsed time.

    Args:
        share: the fraction of wall time the action may take (0 to 1).
        initial_cost_s: the cost assumed before the action has been timed once.
        clock: the time source (patched in tests).

    Example:
        >>> now = [0.0]
        >>> b = TimeBudget(share=0.01, initial_cost_s=0.1, clock=lambda: now[0])
        >>> b.allows()
        False
        >>> now[0] = 10.0; b.allows()
        True
    """

    share: float
    initial_cost_s: float
    clock: Callable[[], float] = time.perf_counter
    spent_s: float = 0.0
    _start: float | None = field(default=None, repr=False)
    _estimate_s: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._start = self.clock()
        self._estimate_s = self.initial_cost_s

    def allows(self) -> bool:
        elapsed = self.clock() - (self._start or 0.0)
        return elapsed * self.share >= self.spent_s + (self._estimate_s or 0.0)

    def spend(self, cost_s: float) -> None:
        self.spent_s += cost_s
        self._estimate_s = cost_s
