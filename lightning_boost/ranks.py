"""Decisions every rank of a run must share: made on rank zero, broadcast to the others (pure).

The measuring layer below the feature folders (DESIGN.md): the batch size, the workers, the
precision trial and the guards' sampling each take rank zero's value through here, so no rank
trains with a setting of its own and none waits forever on a rank zero that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Broadcasts(Protocol):
    """What a Lightning strategy offers for this: ``broadcast(obj, src)``, the identity on one process."""

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


def from_rank_zero(strategy: Broadcasts | None, value: T) -> T:
    """Rank zero's `value` on every rank (one broadcast); `value` itself without a strategy.

    Example:
        >>> class OneProcess:
        ...     def broadcast(self, obj, src=0):
        ...         return obj
        >>> from_rank_zero(OneProcess(), {"num_workers": 2}), from_rank_zero(None, 3)
        ({'num_workers': 2}, 3)
    """
    return value if strategy is None else strategy.broadcast(value, src=0)


def decided_on_rank_zero(strategy: Broadcasts | None, is_rank_zero: bool, decide: Callable[[], T]) -> T:
    """`decide()` run on rank zero alone, its result on every rank (one broadcast).

    The other ranks are waiting in that broadcast, so an exception on rank zero is sent to them
    too: rank zero raises it, every other rank a `RuntimeError` naming it, and none hangs.

    Example:
        >>> decided_on_rank_zero(None, True, lambda: 64)
        64
    """
    outcome: tuple[bool, Any] | None = None
    error: Exception | None = None
    if is_rank_zero:
        try:
            outcome = (True, decide())
        except Exception as caught:  # told to every rank first, then raised
            error = caught
            outcome = (False, f"{type(caught).__name__}: {caught}")
    outcome = from_rank_zero(strategy, outcome)
    if error is not None:
        raise error
    if outcome is None:
        raise RuntimeError("decided_on_rank_zero: no rank zero took part in the broadcast")
    succeeded, value = outcome
    if not succeeded:
        raise RuntimeError(f"rank zero failed while deciding for every rank: {value}")
    return value
