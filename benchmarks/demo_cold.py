"""``make demo`` from a cold cache, as a user's first run: the boosted fit must reach the plain
fit's final validation accuracy sooner (issue 28), its wall time must not be longer, and the
time before its first step must stay small (issue 30).

Each repeat is one `run_demo` at the demo's defaults (ResNet-18, 8192 images x 2 epochs,
validated four times an epoch) with a fresh cache directory, so every measurement is made again;
the order alternates, plain first in the first repeat. Each row's ratio is the worst repeat's;
the detail gives every repeat. Run: ``python -m benchmarks demo_cold``.
"""

from __future__ import annotations

import os
import tempfile
from unittest import mock

from benchmarks.common import Row
from lightning_boost.cache import CACHE_DIR_ENV
from lightning_boost.demo import DemoRun, run_demo

COMMAND = "python -m benchmarks demo_cold"


def run(repeats: int = 3, samples: int = 8192, epochs: int = 2) -> list[Row]:
    runs = [_cold_demo(samples, epochs, plain_first=repeat % 2 == 0) for repeat in range(repeats)]
    sooner = [_time_to_quality(plain, boosted) for plain, boosted in runs]
    walls = [plain.seconds / boosted.seconds for plain, boosted in runs]
    shares = [boosted.before_training_s / boosted.seconds for _, boosted in runs]
    setup = f"ResNet-18, {samples} images x {epochs} epochs, cold cache each, {repeats} repeats"
    return [
        Row(
            "time to quality (`make demo`, cold cache): plain's time to its final accuracy / boosted's",
            min(sooner),
            f"per repeat: {_each(sooner)}; {'; '.join(_describe(p, b) for p, b in runs)}; {setup}",
            COMMAND,
        ),
        Row(
            "demo wall time (cold cache): plain / boosted (target >= 1.0 each)",
            min(walls),
            f"per repeat: {_each(walls)} (plain {_each([p.seconds for p, _ in runs], 's')}, boosted"
            f" {_each([b.seconds for _, b in runs], 's')}); {setup}",
            COMMAND,
        ),
        Row(
            "demo time before the first step / boosted fit (target <= 0.03)",
            max(shares),
            f"per repeat: {_each(shares, '%')}"
            f" ({_each([b.before_training_s for _, b in runs], 's')}: the"
            " batch-size trial with the precision pairs in its steps, Lightning's sanity check, the"
            f" channels_last trial, what the tuners read before training); {setup}",
            COMMAND,
        ),
    ]


def _cold_demo(samples: int, epochs: int, plain_first: bool) -> tuple[DemoRun, DemoRun]:
    with tempfile.TemporaryDirectory() as root, mock.patch.dict(os.environ, {CACHE_DIR_ENV: f"{root}/cache"}):
        return run_demo(samples, epochs, root, say=lambda line: None, quiet=True, plain_first=plain_first)


def _time_to_quality(plain: DemoRun, boosted: DemoRun) -> float:
    """Plain's seconds to its own final accuracy over boosted's (0 when boosted never reached it)."""
    target = plain.final_accuracy
    mine, theirs = plain.seconds_to(target or 0.0), boosted.seconds_to(target or 0.0)
    return mine / theirs if mine and theirs else 0.0


def _describe(plain: DemoRun, boosted: DemoRun) -> str:
    target = plain.final_accuracy or 0.0
    reached, own = boosted.seconds_to(target), plain.seconds_to(target) or 0.0
    return (
        f"final {target:.1%} / {boosted.final_accuracy or 0.0:.1%}, reached at {own:.1f} s"
        f" / {'never' if reached is None else f'{reached:.1f} s'} ({boosted.settings['precision']},"
        f" {boosted.settings['memory format']},"
        f" batch {boosted.settings['batch size']}, {boosted.settings['num_workers']} workers)"
    )


def _each(values: list[float], unit: str = "x") -> str:
    """``"1.13x, 1.12x"``; with ``unit="%"`` shares as ``"2.8%, 2.5%"``; else ``"0.9 s, 0.8 s"``."""
    if unit == "%":
        return ", ".join(f"{value:.1%}" for value in values)
    return ", ".join(f"{value:.2f}{unit}" if unit == "x" else f"{value:.1f} {unit}" for value in values)
