"""Does a larger batch reach the same model on the demo's task, and at which learning rate?

The demo's ResNet-18 (BatchNorm, SGD under the one-cycle schedule) on its learnable images, fitted
from the same seeds at the demo's batch 64 and learning rate 0.05, then at larger batches with the
learning rate scaled linearly with the batch (Goyal et al. 2017) and by its square root (what
`AutoBatchSize` does for every optimizer, since these rows showed the linear rule's x4 ending
worse). Each row is a final validation accuracy over the batch-64 fit's: 1.00x is the same model.
These fits show where the rule, and the fewer steps of a larger batch, end worse: on an H200 the
x4 rates at 256 and the square root's x2.83 at 512 did, the x2 at 256 did not (`LR_FACTOR_WARN`).
Plain Lightning fits, one process; no timing. Each fit is repeated over `seeds` (the
weights' and the data order's), and a row is the mean final accuracy over the batch-64 fits' mean,
each seed's value in its detail. On a CUDA device the fits run there in bf16, as the boosted demo
trains, over 10 seeds by default (a fit takes seconds); on the CPU in fp32, over seed 0 (a minute).
Run: ``python -m benchmarks batch_quality``.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import tempfile

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.common import Row
from lightning_boost.demo import VAL_SAMPLES, ValidatedResNet18, demo_dataset
from lightning_boost.testing import cpu_only

COMMAND = "python -m benchmarks batch_quality"
BASE_BATCH, BASE_LR = 64, 0.05


def run(
    samples: int = 16384,
    epochs: int = 2,
    sizes: tuple[int, ...] = (256, 512),
    seeds: tuple[int, ...] | None = None,
) -> list[Row]:
    if seeds is None:
        seeds = tuple(range(10)) if torch.cuda.is_available() else (0,)
    base = [_final(samples, epochs, BASE_BATCH, BASE_LR, seed) for seed in seeds]
    where = "bf16 on the GPU" if torch.cuda.is_available() else "fp32 on the CPU"
    setup = (
        f"ResNet-18 (demo), {samples} images x {epochs} epochs, one-cycle SGD, {where}, seeds"
        f" {', '.join(map(str, seeds))}; batch {BASE_BATCH} at lr {BASE_LR}: {_values(base)}"
    )
    rows = []
    for size in sizes:
        factor = size / BASE_BATCH
        for name, lr in (("linear lr", BASE_LR * factor), ("square-root lr", BASE_LR * math.sqrt(factor))):
            finals = [_final(samples, epochs, size, lr, seed) for seed in seeds]
            rows.append(
                Row(
                    f"larger batch, same epochs: batch {size} at {name} (x{lr / BASE_LR:.3g}) / batch"
                    f" {BASE_BATCH}, final accuracy",
                    statistics.mean(finals) / statistics.mean(base),
                    f"{setup}; batch {size} at lr {lr:g}: {_values(finals)}",
                    COMMAND,
                )
            )
    return rows


def _values(finals: list[float]) -> str:
    each = ", ".join(f"{value:.4f}" for value in finals)
    return each if len(finals) == 1 else f"{statistics.mean(finals):.4f} ({each})"


def _final(samples: int, epochs: int, batch_size: int, lr: float, seed: int = 0) -> float:
    """The final validation accuracy of one plain fit at `batch_size` and peak learning rate `lr`."""
    L.seed_everything(seed, verbose=False)
    gpu = torch.cuda.is_available()
    train = DataLoader(
        demo_dataset(samples),
        batch_size=batch_size,
        shuffle=True,
        num_workers=8 if gpu else 1,
        pin_memory=gpu,
    )
    val = DataLoader(demo_dataset(VAL_SAMPLES, train=False), batch_size=256)
    with tempfile.TemporaryDirectory() as root, contextlib.nullcontext() if gpu else cpu_only():
        trainer = L.Trainer(
            accelerator="gpu" if gpu else "cpu",
            devices=1,
            precision="bf16-mixed" if gpu else "32-true",
            max_epochs=epochs,
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(ValidatedResNet18(lr=lr), train, val)
    return float(trainer.callback_metrics["val_acc"])
