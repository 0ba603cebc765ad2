"""What `StepTimeMonitor` costs per step, and `BoostReport` once per fit, against plain Lightning.

A small MLP on in-memory tensors (so the step is short and any per-step cost shows), CSV logger
at Lightning's default cadence, fitted with no boost callback and with `StepTimeMonitor`,
alternating in one process. The training time is taken from ``on_train_start`` to
``on_train_end``. The paired ratios carry the host's noise; two figures by the pack's own clock do
not: the monitor's per-step hooks, timed in fits of their own, and `BoostReport`'s end-of-fit work
(doctor checks, JSON and Markdown; a fit this short is under the plots' budget, so none is drawn).
Run: ``python -m benchmarks monitor_overhead``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from benchmarks.common import Row, rotated
from lightning_boost import BoostReport, StepTimeMonitor

COMMAND = "python -m benchmarks monitor_overhead"


class MLP(L.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 10))  # fmt: skip

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self.net(inputs), targets)
        self.log("train_loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TrainTime(L.Callback):
    """Seconds from the start of training, or from training batch `from_step`, to its end."""

    def __init__(self, from_step: int = 0) -> None:
        self.seconds = 0.0
        self.from_step = from_step
        self._start = 0.0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.from_step:
            self._start = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.from_step and batch_idx == self.from_step:
            self._start = time.perf_counter()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seconds = time.perf_counter() - self._start


def fit_per_step(
    root: str, steps: int, callbacks: list[L.Callback], strategy: Strategy | str = "auto", from_step: int = 0
) -> float:
    """Seconds per training step of one fit of the MLP with `callbacks` and `strategy`, timed from
    step `from_step` (``guard_overhead`` and ``stack_overhead`` use it too)."""
    timer = TrainTime(from_step)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(steps * 32, 64, generator=generator), torch.randint(0, 10, (steps * 32,))
    )
    trainer = L.Trainer(
        accelerator="auto",  # the GPU where there is one: where users train
        strategy=strategy,
        max_epochs=1,
        logger=CSVLogger(root, name="overhead"),
        callbacks=[timer, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=min(50, steps),  # Lightning's default, or every step of a tiny run
    )
    L.seed_everything(0, verbose=False)
    trainer.fit(MLP(), train_dataloaders=DataLoader(data, batch_size=32))
    return timer.seconds / (steps - from_step)


def paired_fits(
    variants: dict[str, Callable[[], list[L.Callback]]], steps: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per step of each variant's fits, in rotating order within each repeat (so ratios
    can be taken within a repeat); ``guard_overhead`` and ``micro_batch`` use it too."""
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as root:
        fit_per_step(root, 50, [])  # warm-up: imports, allocator, first-fit costs
        for repeat in range(repeats):
            for name in rotated(list(variants), repeat):
                per_step[name].append(fit_per_step(root, steps, variants[name]()))
    return per_step


def run(steps: int = 1000, repeats: int = 11) -> list[Row]:
    """Paired fits of three variants; then the monitor's hooks and the report timed by their own clock."""
    variants: dict[str, Callable[[], list[L.Callback]]] = {
        "plain": list,
        "two no-op callbacks": lambda: [L.Callback(), L.Callback()],
        "monitor": lambda: [StepTimeMonitor()],  # attaches a BoostReport: two callbacks as well
    }
    per_step = paired_fits(variants, steps, repeats)
    with tempfile.TemporaryDirectory() as root:
        hook_us, hook_share = sorted(_time_hooks(root, steps) for _ in range(3))[1]  # the median fit
        report_ms = 1e3 * statistics.median(_time_report(Path(root), steps) for _ in range(3))
    monitor = per_step["monitor"]
    vs_plain = statistics.median(m / p for m, p in zip(monitor, per_step["plain"], strict=True))
    vs_noop = statistics.median(m / n for m, n in zip(monitor, per_step["two no-op callbacks"], strict=True))
    plain_ms, monitor_ms = 1e3 * statistics.median(per_step["plain"]), 1e3 * statistics.median(monitor)
    setup = (
        f"median of {repeats} paired fits of {steps} steps; 3-layer MLP, batch 32, in-memory data,"
        f" CSV logger every 50 steps: {plain_ms:.3f} ms plain vs {monitor_ms:.3f} ms per step"
    )
    return [
        Row(
            "StepTimeMonitor (+ the BoostReport it attaches): step time / plain Lightning, 1 ms steps",
            vs_plain,
            f"{setup}. Worst case: a longer step (any real model, any GPU step) dilutes the fixed"
            f" per-step cost. BoostReport's end-of-fit work (checks, JSON and Markdown, no plot in a fit"
            f" this short) {report_ms:.0f} ms once per fit",
            COMMAND,
        ),
        Row(
            "StepTimeMonitor (+ BoostReport): step time / two no-op callbacks (own cost; target <= 1.02)",
            vs_noop,
            f"{setup}; against two callbacks that do nothing, this is lightning-boost's own work,"
            " apart from Lightning's cost of calling any callback's hooks. By its own clock, the"
            f" monitor's per-step hooks took {hook_us:.1f} µs a step, {hook_share:.2%} of"
            " training time (median of 3 fits; logging its metrics every 50 steps included)",
            COMMAND,
        ),
    ]


def _clocked(hook: Callable[..., None], spent: list[float]) -> Callable[..., None]:
    """`hook`, adding the seconds each call takes to ``spent[0]``."""

    def run_hook(*args: Any) -> None:
        start = time.perf_counter()
        hook(*args)
        spent[0] += time.perf_counter() - start

    return run_hook


def _time_hooks(root: str, steps: int) -> tuple[float, float]:
    """Microseconds per step in `StepTimeMonitor`'s two per-step hooks during one fit, and their share
    of that fit's training time (the wrappers' own clock reads are in it: an overestimate)."""
    monitor = StepTimeMonitor()
    spent = [0.0]
    monitor.on_train_batch_start = _clocked(monitor.on_train_batch_start, spent)  # type: ignore[method-assign]
    monitor.on_train_batch_end = _clocked(monitor.on_train_batch_end, spent)  # type: ignore[method-assign]
    step_s = fit_per_step(root, steps, [monitor])
    return 1e6 * spent[0] / steps, spent[0] / (step_s * steps)


def _time_report(root: Path, steps: int) -> float:
    """Seconds BoostReport spends at the end of a fit (the table is not printed here)."""
    report = BoostReport(console=False)
    spent = [0.0]
    report.on_fit_end = _clocked(report.on_fit_end, spent)  # type: ignore[method-assign]
    fit_per_step(str(root), steps, [StepTimeMonitor(), report])
    return spent[0]
