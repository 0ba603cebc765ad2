"""AutoBatchSize vs an exhaustive sweep vs Lightning's BatchSizeFinder, on one model, in one run.

The model is the demo's ResNet-18 on 32x32 images (random tensors, so the step, not the data, is
measured). Under a memory budget of `budget_gib` per step:

- the sweep trains a real Lightning fit at every power of two from 8 to `largest` and times the
  steps after a warm-up (best of `rounds` rounds, interleaved), and estimates each size's peak the
  way AutoBatchSize does on CPU (live tensors of a step on a copy of the model);
- `AutoBatchSize(memory_budget_gib=budget_gib, lr_scaling=None)` chooses a size at the start of
  a fit planned as 10 epochs of `tune_samples` images and stopped after its first step (a run
  long enough to repay the trials, with room for every swept size; the learning rates kept:
  random images teach nothing, so only throughput and memory count);
- `BatchSizeFinder(mode="power")` chooses a size in a fit of its own (it has no memory budget on
  CPU: it grows until OOM, ``max_val`` or the dataset's length).

Each choice's throughput is then read from the sweep (or measured the same way when the sweep did
not try it). The row's ratio is AutoBatchSize's choice / the sweep's best within the budget
(target >= 0.95). Run: ``python -m benchmarks batch_size``.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from benchmarks.common import Row
from lightning_boost import AutoBatchSize
from lightning_boost.demo import ResNet18Classifier
from lightning_boost.step_probe import StepProbe

COMMAND = "python -m benchmarks batch_size"
GIB = 1024**3


class Images(L.LightningDataModule):
    """`samples` random 3x32x32 images with labels; ``batch_size`` is what the tuners change."""

    def __init__(self, samples: int, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(samples, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (samples,), generator=generator),
        )

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True)


class StepTimer(L.Callback):
    """Seconds from the start of batch `warmup` to the end of the last batch."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.started = self.ended = 0.0

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        if idx == self.warmup:
            self.started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.ended = time.perf_counter()


class TimedFinder(BatchSizeFinder):
    """Lightning's BatchSizeFinder, with the time its search takes."""

    seconds = 0.0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        started = time.perf_counter()
        super().on_fit_start(trainer, pl_module)
        self.seconds = time.perf_counter() - started


class StopAtFirstStep(L.Callback):
    """Ends the fit after its first step: what comes before it (the tuning) is what is measured."""

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.should_stop = True


def _trainer(
    callbacks: list[L.Callback], batches: int | None, epochs: int = 1, accelerator: str = "auto"
) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator,  # "auto": the GPU where there is one, where users train
        max_epochs=epochs,
        limit_train_batches=batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def throughput(size: int, steps: int = 3, warmup: int = 1, accelerator: str = "auto") -> float:
    """Samples/s of a plain fit at `size`, timed after `warmup` steps."""
    L.seed_everything(0, verbose=False)
    timer = StepTimer(warmup)
    _trainer([timer], warmup + steps, accelerator=accelerator).fit(
        ResNet18Classifier(), datamodule=Images(size * (warmup + steps), size)
    )
    return size * steps / (timer.ended - timer.started)


def estimated_peak(size: int) -> int:
    """AutoBatchSize's CPU estimate of a training step's peak at `size`."""
    model = ResNet18Classifier()
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    probe = StepProbe(model, [optimizer], 1, torch.enable_grad, torch.no_grad)
    batch = (torch.randn(size, 3, 32, 32), torch.randint(0, 10, (size,)))
    peak = probe.train(batch, size).peak_bytes
    assert peak is not None
    return peak


def run(
    budget_gib: float = 0.25,
    largest: int = 512,
    rounds: int = 2,
    samples: int = 2048,
    tune_samples: int = 8192,
    accelerator: str = "auto",
) -> list[Row]:
    sizes = [2**k for k in range(3, largest.bit_length()) if 2**k <= largest]
    started = time.perf_counter()
    rates = {size: 0.0 for size in sizes}
    for _ in range(rounds):  # interleaved, so a busy moment does not hit one size alone
        for size in sizes:
            rates[size] = max(rates[size], throughput(size, accelerator=accelerator))
    peaks = {size: estimated_peak(size) for size in sizes}
    sweep_s = time.perf_counter() - started
    budget = int(budget_gib * GIB)
    best = max((s for s in sizes if peaks[s] <= budget), key=lambda s: rates[s])

    # throughput and memory alone, as the sweep judges them (by default the learning rates would
    # stop the search at 4x the configured 32: `lr_capped`)
    auto = AutoBatchSize(memory_budget_gib=budget_gib, lr_scaling=None)
    L.seed_everything(0, verbose=False)
    # 10 epochs planned, stopped at the first step (`limit_train_batches` would keep 32)
    tuned = _trainer([auto, StopAtFirstStep()], None, epochs=10, accelerator=accelerator)
    tuned.fit(ResNet18Classifier(), datamodule=Images(tune_samples, 32))
    finder = TimedFinder(mode="power")
    L.seed_everything(0, verbose=False)
    finder_data = Images(samples, 2)
    _trainer([finder], 1, accelerator=accelerator).fit(ResNet18Classifier(), datamodule=finder_data)

    chosen, found = auto.result["batch_size"], finder_data.batch_size
    for size in (chosen, found):
        if size not in rates:
            rates[size] = max(throughput(size, accelerator=accelerator) for _ in range(rounds))
    found_peak = peaks.get(found) or estimated_peak(found)
    table = ", ".join(f"{s}: {rates[s]:.0f}/s {peaks[s] / GIB:.2f} GiB" for s in sizes)
    detail = (
        f"ResNet-18 32x32 on CPU, budget {budget_gib:g} GiB per step (CPU estimate). Sweep best in budget:"
        f" {best} at {rates[best]:.0f} samples/s ({len(sizes)} sizes x {rounds} rounds, {sweep_s:.0f} s)."
        f" AutoBatchSize: {chosen} at {rates[chosen]:.0f} samples/s, {auto.result['seconds']:.1f} s tuning,"
        f" {len(auto.result['trials'])} sizes, stopped at {auto.result['stopped']}."
        f" BatchSizeFinder: {found} at {rates[found]:.0f} samples/s ({rates[found] / rates[best]:.2f}x best),"
        f" peak {found_peak / GIB:.2f} GiB ({'within' if found_peak <= budget else 'over'} budget),"
        f" {finder.seconds:.1f} s tuning. Sweep: {table}"
    )
    return [
        Row(
            "batch size: AutoBatchSize choice / exhaustive sweep best (ResNet-18, CPU)",
            rates[chosen] / rates[best],
            detail,
            COMMAND,
        )
    ]
