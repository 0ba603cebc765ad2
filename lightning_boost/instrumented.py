"""Training steps the pack slows down on purpose, counted so that what times the run's own steps
leaves them out.

A guard's checked step runs slower than the run's other steps (SyncGuard routes every torch call
through a `TorchFunctionMode`: 1.53x on `guard_overhead`'s MLP when every step is checked), and
the guards check a fit's first steps, the ones the worker search's first segment times the setting
the run starts at with (`workers.segments`). The guards `mark` each checked step; a segment leaves
out the steps during which the count moved: on the time-to-quality autoencoder that segment reads
1.34x what it read with them counted, and the run keeps its own threads in 4 of 6 fits against 0
(`python -m benchmarks checked_steps`). Counted per process, on the
training thread. No Lightning here.

The pack also runs steps of its own on the training thread while the user's fit trains: the worker
search times a copy of the model between the run's steps. Those run inside `own_steps`, and what
watches the user's code and time leaves them out: the sync guard (a CPU run's Adam on that copy
read its step counters 8 times over 10 checked steps, a sync the guard then laid at torch's door)
and `StepTimeMonitor` (`own_seconds`: the probe ran while the loader made a batch, and its 1.2 s
counted as waiting for data in `make demo`'s boosted fit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_count = 0
_own = threading.local()


def mark() -> None:
    """Note that the current training step runs instrumented."""
    global _count
    _count += 1


def count() -> int:
    """How many instrumented steps this process has run (compare two readings).

    Example:
        >>> before = count()
        >>> mark()
        >>> count() - before
        1
    """
    return _count


@contextmanager
def own_steps() -> Iterator[None]:
    """Steps the pack runs itself, on this thread (a probe's, on a copy of the model); their
    seconds add up in `own_seconds`.

    Example:
        >>> before = own_seconds()
        >>> with own_steps():
        ...     in_own_steps()
        True
        >>> in_own_steps(), own_seconds() > before
        (False, True)
    """
    depth = getattr(_own, "depth", 0)
    _own.depth = depth + 1
    started = time.perf_counter()
    try:
        yield
    finally:
        _own.depth = depth
        if depth == 0:  # the outermost: nested ones are inside its time
            _own.seconds = own_seconds() + time.perf_counter() - started


def in_own_steps() -> bool:
    """Whether this thread is running the pack's own steps (`own_steps`)."""
    return getattr(_own, "depth", 0) > 0


def own_seconds() -> float:
    """The seconds this thread has spent in `own_steps` (compare two readings)."""
    return float(getattr(_own, "seconds", 0.0))
