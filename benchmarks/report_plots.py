"""What the report's plots cost to draw, against what `BoostReport` estimates before drawing them.

A fit that did not ask for plots gets them only when `drawing_s` (`PLOT_S` a plot, and
`IMPORT_S` for matplotlib's import where nothing has imported it yet) is at most 1 % of its wall
time. This benchmark checks that estimate on the host it runs on: one real boosted fit of the
demo's small CNN (`AutoBatchSize`, `boost_callbacks()`, plots left undrawn) writes a report whose
findings ask for plots; fresh processes, with Lightning and the pack imported as in a fit, make
the report's estimate and then draw the plots with `redraw` twice: the first as a fit's end
draws them, the second once the process has drawn before.
Run: ``python -m benchmarks report_plots``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.common import Row
from lightning_boost import AutoBatchSize, boost_callbacks, preset
from lightning_boost.cache import CACHE_DIR_ENV
from lightning_boost.demo import FakeCIFAR, fit_fake_cifar
from lightning_boost.hardware import HardwareInfo
from lightning_boost.report import Report
from lightning_boost.report.plots import IMPORT_S, PLOT_S, plot_specs

COMMAND = "python -m benchmarks report_plots"

#: Run in a fresh process: Lightning and the pack imported as in a fit, the estimate the report
#: makes there for its `count` plots, then the plots drawn twice, the first time as a fit's end
#: draws them; prints JSON. Arguments: the report's directory, `count`.
DRAW = """
import json, sys, time
import lightning, torch
from lightning_boost.report import plots
count = int(sys.argv[2])
imported = "matplotlib.figure" in sys.modules
estimate = plots.drawing_s(count)
start = time.perf_counter(); plots.redraw(sys.argv[1]); first = time.perf_counter() - start
start = time.perf_counter(); plots.redraw(sys.argv[1]); again = time.perf_counter() - start
print(json.dumps(dict(imported=imported, estimate=estimate, first=first, again=again)))
"""


def run(samples: int = 8192, repeats: int = 5) -> list[Row]:
    """One fit, then `repeats` fresh processes that draw its plots; medians of their times.

    Raises:
        ValueError: when the fit's report asks for no plot (too few `samples` to tune or watch).
    """
    with tempfile.TemporaryDirectory() as root, mock.patch.dict(os.environ, {CACHE_DIR_ENV: f"{root}/cache"}):
        directory = _report_with_plots(root, samples)  # a cold cache: every tuner measures, and plots
        count = len(plot_specs(Report.read(directory / "boost_report.json").findings))
        if not count:
            raise ValueError(
                f"`samples` too few for the report to ask for a plot, got {samples}: try 1024 or more."
            )
        times = [_draw_in_fresh_process(directory, count) for _ in range(repeats)]
    estimate = statistics.median(t["estimate"] for t in times)
    first = statistics.median(t["first"] for t in times)
    again = statistics.median(t["again"] for t in times) / count
    imported = (
        "already imported by `import lightning` (torchmetrics imports it), so not estimated"
        if all(t["imported"] for t in times)
        else f"not imported by Lightning: its import estimated at IMPORT_S {IMPORT_S} s"
    )
    return [
        Row(
            "report plots: BoostReport's estimate of drawing a fit's plots / the time they took"
            " (>= 1: the budget errs toward skipping them)",
            estimate / first,
            f"median of {repeats} fresh processes after one boosted fit of the demo's small CNN"
            f" ({samples} images, cold cache): {count} plots {first:.2f} s the first time in a process,"
            f" estimated {estimate:.2f} s; {again:.3f} s a plot drawn again (PLOT_S {PLOT_S});"
            f" matplotlib {imported}",
            COMMAND,
        )
    ]


def _report_with_plots(root: str, samples: int) -> Path:
    """The log directory of a boosted fit whose report left its plots undrawn."""
    callbacks = [
        AutoBatchSize(max_batch_size=128),
        *boost_callbacks(boost_report={"console": False, "plots": False}),
    ]
    strategy = preset("auto", hardware=HardwareInfo.detect())
    data = FakeCIFAR(samples, batch_size=32)
    trainer, _ = fit_fake_cifar(
        data,
        strategy,
        1,
        root,
        "plots",
        callbacks,
        enable_progress_bar=False,
        log_every_n_steps=min(10, samples // 32),
    )
    return Path(trainer.log_dir or root)


def _draw_in_fresh_process(directory: Path, count: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", DRAW, str(directory), str(count)], check=True, capture_output=True, text=True
    )
    times: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return times
