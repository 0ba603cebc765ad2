"""One step run as micro-batches in lock-step rounds, halving the micro-batch on out-of-memory (pure).

Each round, every rank runs its next micro-batch (or nothing, once its own are done), then the
ranks agree on what happened (`Agree`: one all-reduce under DDP). An out-of-memory error on any
rank halves the micro-batch size on every rank in the same round; the rank that failed runs the
piece that failed again, in smaller pieces, and no rank repeats a piece that succeeded. So no
sample is skipped or seen twice, and every rank runs the same number of rounds (no hang).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lightning_boost.micro_batch.split import bounds

#: ``attempt(start, stop, final) -> ran``: run samples ``start:stop`` (the last piece when `final`);
#: ``False`` when it ran out of memory.
Attempt = Callable[[int, int, bool], bool]
#: ``agree(failed, done, stuck) -> (any failed, all done, any stuck)`` over the ranks.
Agree = Callable[[bool, bool, bool], tuple[bool, bool, bool]]


def alone(failed: bool, done: bool, stuck: bool) -> tuple[bool, bool, bool]:
    """`Agree` for a single process."""
    return failed, done, stuck


@dataclass(frozen=True)
class Shrink:
    """The micro-batch halved in a step: from `before` to `after` samples, because samples
    ``start:stop`` ran out of memory here (``start is None``: on another rank)."""

    before: int
    after: int
    start: int | None = None
    stop: int | None = None


@dataclass
class Rounds:
    """How a step ran: the micro-batch size it ended at and each halving on the way."""

    size: int
    shrinks: list[Shrink] = field(default_factory=list)


class NoSampleFits(RuntimeError):
    """Even a micro-batch of one sample ran out of memory (here, or on another rank: `here`)."""

    def __init__(self, tried: Sequence[int], here: bool) -> None:
        self.tried = tuple(tried)
        self.here = here
        where = "on this rank" if here else "on another rank"
        sizes = ", ".join(map(str, self.tried))
        super().__init__(
            f"Out of memory {where} even with a micro-batch of 1 sample (tried micro-batches of {sizes}): "
            "one sample of this batch does not fit with this model. Make the model or the sample smaller "
            "(shorter sequences, smaller images), shard the model (FSDP), use mixed precision "
            "(`precision='bf16-mixed'`), or use activation checkpointing."
        )


def run_rounds(length: int, size: int, attempt: Attempt, agree: Agree = alone) -> Rounds:
    """Run samples ``0:length`` in pieces of at most `size`, halving `size` on out-of-memory.

    Raises:
        NoSampleFits: a single sample ran out of memory on some rank (every rank raises it).

    Example:
        >>> ran = []
        >>> def attempt(start, stop, final):  # pieces of more than 3 samples run out of memory
        ...     ran.append((start, stop)) if stop - start <= 3 else None
        ...     return stop - start <= 3
        >>> rounds = run_rounds(10, 10, attempt)
        >>> rounds.size, ran
        (2, [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)])
        >>> [(s.before, s.after) for s in rounds.shrinks]
        [(10, 5), (5, 2)]
    """
    pending = bounds(0, length, size)
    tried = [size]
    shrinks: list[Shrink] = []
    while True:
        failed = False
        if pending:
            start, stop = pending[0]
            if attempt(start, stop, len(pending) == 1):
                pending.pop(0)
            else:
                failed = True
        any_failed, all_done, stuck = agree(failed, not pending, failed and size == 1)
        if stuck:
            raise NoSampleFits(tried, here=failed and size == 1)
        if any_failed:
            after = max(1, size // 2)
            here = pending[0] if failed else (None, None)
            shrinks.append(Shrink(size, after, *here))
            size = after
            tried.append(size)
            pending = bounds(pending[0][0], length, size) if pending else []
        elif all_done:
            return Rounds(size, shrinks)


def growing_retries(history: Sequence[tuple[int, int]], checks: int = 3) -> list[tuple[int, int]] | None:
    """The last `checks` + 1 samples of ``(step, allocator retries so far)`` when the retries grew
    at each of the last `checks` samples (the allocator freeing its cache to satisfy requests, step
    after step: memory is close to running out), else ``None``.

    Example:
        >>> growing_retries([(10, 0), (20, 1), (30, 3), (40, 4)])
        [(10, 0), (20, 1), (30, 3), (40, 4)]
        >>> growing_retries([(10, 0), (20, 1), (30, 1), (40, 4)]) is None
        True
    """
    recent = list(history[-(checks + 1) :])
    if len(recent) <= checks:
        return None
    grew = all(later[1] > earlier[1] for earlier, later in itertools.pairwise(recent))
    return recent if grew else None
