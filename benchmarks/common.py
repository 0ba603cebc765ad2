"""What every benchmark returns, and how a result row names the machine it ran on."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

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


def median_ratio(boosted: list[float], baseline: list[float]) -> float:
    return statistics.median(boosted) / statistics.median(baseline)
