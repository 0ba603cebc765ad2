"""What every benchmark returns, and how a result row names the machine it ran on."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from lightning_boost.hardware import HardwareInfo


@dataclass(frozen=True)
class Row:
    """One figure for RESULTS.md: `ratio` is boosted / baseline (above 1 means faster)."""

    benchmark: str
    ratio: float
    detail: str
    command: str


def machine(hw: HardwareInfo) -> str:
    devices = ", ".join(sorted(set(hw.device_names))) or "no GPU"
    return f"{hw.cpus_available} CPUs, {devices}, torch {hw.torch_version}"


T = TypeVar("T")


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """`items` started at position `turn` (modulo their count): the order of a round's fits, so
    each setting goes first in turn and a host that drifts favours none.

    Example:
        >>> rotated(["plain", "preset", "fp32"], 4)
        ['preset', 'fp32', 'plain']
    """
    start = turn % len(items)
    return [*items[start:], *items[:start]]


def median_ratio(boosted: list[float], baseline: list[float]) -> float:
    return statistics.median(boosted) / statistics.median(baseline)
