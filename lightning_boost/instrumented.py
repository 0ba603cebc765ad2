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
"""

from __future__ import annotations

_count = 0


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
