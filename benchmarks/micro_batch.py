"""What `AutoMicroBatch` costs: per step when nothing runs out of memory, and when a step does.

1. Nothing runs out of memory: the 1 ms MLP of ``monitor_overhead`` (so any per-step cost shows),
   ``AutoMicroBatch()`` with a silent `BoostReport` (two callbacks) against two no-op callbacks,
   paired fits in rotating order.
2. A step runs out of memory: a small CNN whose steps run out of memory above 64 samples (the real
   exception type, raised above that size after the forward's convolutions, which are wasted: this
   machine has no GPU), trained at batch 128 with
   ``AutoMicroBatch`` (the first step fails, the batch runs again as two micro-batches of 64, and so
   do all later steps), against the same run started at batch 64 with ``accumulate_grad_batches=2``
   (the same optimizer steps, set by hand). Figures: the retry's one-off cost (the first step's
   time beyond the other run's first step, in steady steps), the steady steps' speed, and whether
   both end at the same weights.

Run: ``python -m benchmarks micro_batch``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from benchmarks.common import Row
from benchmarks.guard_overhead import _fastest, _ratio, _silent_report
from benchmarks.monitor_overhead import paired_fits
from lightning_boost import AutoMicroBatch

COMMAND = "python -m benchmarks micro_batch"


class CNN(L.LightningModule):
    """A small CNN on 32x32 images; a batch of more than `limit` samples runs out of memory."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(64, 10)
        self.limit = limit

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        features = self.features(x)
        if self.limit is not None and len(x) > self.limit:  # after the forward's work: it is wasted
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated above {self.limit} samples)")
        loss = F.cross_entropy(self.head(features), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class StepTimes(L.Callback):
    """Wall time of each optimizer step (its batches, forward and backward, and the update)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.times.append(time.perf_counter() - self._start)


def _fit(
    root: str, model: CNN, steps: int, batch_size: int, callbacks: list[L.Callback], **options: Any
) -> StepTimes:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(128 * steps, 3, 32, 32, generator=generator), torch.randint(0, 10, (128 * steps,))
    )
    times = StepTimes()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[times, *callbacks], **options,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=batch_size))
    return times


def _retry(repeats: int, steps: int) -> Row:
    retried, by_hand, first, same = [], [], [], []
    with tempfile.TemporaryDirectory() as root:
        _fit(root, CNN(), 2, 64, [])  # warm-up
        for repeat in range(repeats):
            runs = {}
            order = ["auto", "hand"] if repeat % 2 == 0 else ["hand", "auto"]
            for name in order:
                model = CNN(limit=64)
                if name == "auto":
                    runs[name] = (_fit(root, model, steps, 128, [AutoMicroBatch(), _silent_report()]), model)
                else:
                    runs[name] = (_fit(root, model, steps, 64, [], accumulate_grad_batches=2), model)
            auto, hand = runs["auto"][0].times, runs["hand"][0].times
            steady = statistics.median(auto[1:])
            retried.append(steady)
            by_hand.append(statistics.median(hand[1:]))
            first.append((auto[0] - hand[0]) / steady)  # both first steps include the warm-up
            same.append(
                all(
                    torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                    for a, b in zip(runs["auto"][1].parameters(), runs["hand"][1].parameters(), strict=True)
                )
            )
    ratio = _ratio(by_hand, retried)
    return Row(
        "AutoMicroBatch after an out-of-memory step: steady step speed / a run started at the smaller size",
        ratio,
        f"median of {repeats} paired fits of {steps} steps; small CNN, batch 128, out of memory above 64 "
        f"(simulated): steps as 2 micro-batches of 64 {1e3 * statistics.median(retried):.1f} ms vs batch 64 "
        f"with accumulate_grad_batches=2 {1e3 * statistics.median(by_hand):.1f} ms; the retry's one-off cost "
        f"(the first step's time beyond the started-small run's first) {statistics.median(first):.2f} steps; "
        f"same weights at the end in {sum(same)} of {repeats} pairs",
        COMMAND,
    )


def run(steps: int = 1000, repeats: int = 11, retry_repeats: int = 5, retry_steps: int = 24) -> list[Row]:
    per_step = paired_fits(
        {
            "two no-op callbacks": lambda: [L.Callback(), L.Callback()],
            "AutoMicroBatch": lambda: [AutoMicroBatch(), _silent_report()],
        },
        steps,
        repeats,
    )
    noop, micro = per_step["two no-op callbacks"], per_step["AutoMicroBatch"]
    ms = 1e3 * statistics.median(noop)
    overhead = Row(
        "AutoMicroBatch, nothing out of memory: step time / two no-op callbacks (own cost; target <= 1.02)",
        _ratio(micro, noop),
        f"median of {repeats} paired fits of {steps} steps; 3-layer MLP, batch 32, in-memory data, "
        f"{ms:.3f} ms per step with two no-op callbacks; {_fastest(micro, noop)}",
        COMMAND,
    )
    return [overhead, _retry(retry_repeats, retry_steps)]
