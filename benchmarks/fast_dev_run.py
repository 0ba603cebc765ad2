"""`fast_dev_run=True` costs next to nothing more than plain Lightning: the README's set-up runs
the check without tuning anything (issue 28: it took 66.5 s, tuned to the whole dataset).

Each pair fits `time_to_quality`'s MLP on 7,168 samples with ``fast_dev_run=True``: plain
(PyTorch's ``DataLoader``, ``Trainer()``) and boosted (`BoostedDataModule`, ``boost_callbacks()``,
``AutoBatchSize()``), after one warm-up fit of each; the row's ratio is plain / boosted wall time
(the median of the pairs), its detail the seconds each took.

Run: ``python -m benchmarks fast_dev_run``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

import lightning as L
from torch.utils.data import DataLoader

from benchmarks.common import Row
from benchmarks.time_to_quality import MLP, WORKLOADS, Data
from lightning_boost import AutoBatchSize, boost_callbacks

COMMAND = "python -m benchmarks fast_dev_run"


def _trainer(callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        fast_dev_run=True,
        accelerator="cpu",
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _plain() -> None:
    workload = next(w for w in WORKLOADS if w.name == "mlp")
    train = DataLoader(workload.train(), batch_size=64, shuffle=True)
    _trainer([]).fit(MLP(), train, DataLoader(workload.val(), batch_size=64))


def _boosted() -> None:
    workload = next(w for w in WORKLOADS if w.name == "mlp")
    callbacks = [*boost_callbacks(boost_report={"console": False}), AutoBatchSize()]
    _trainer(callbacks).fit(MLP(), datamodule=Data(workload, batch_size=64))


def _seconds(fit: Callable[[], None]) -> float:
    started = time.perf_counter()
    fit()
    return time.perf_counter() - started


def run(pairs: int = 5) -> list[Row]:
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)  # whatever a fit writes lands here (under fast_dev_run: nothing)
        try:
            _plain(), _boosted()  # warm-up: imports, first-call allocations
            times = [(_seconds(_plain), _seconds(_boosted)) for _ in range(pairs)]
            written = os.listdir(folder)
        finally:
            os.chdir(here)
    plain = statistics.median(p for p, _ in times)
    boosted = statistics.median(b for _, b in times)
    return [
        Row(
            "fast_dev_run=True: plain / boosted wall time (README set-up, MLP, 7,168 samples)",
            plain / boosted,
            f"median of {pairs} pairs: plain {plain:.3f} s, boosted {boosted:.3f} s"
            f" ({boosted - plain:+.3f} s); files written: {len(written)}; it took 66.5 s before issue 28"
            " (tuned to the whole dataset).",
            COMMAND,
        )
    ]
