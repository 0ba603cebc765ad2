"""Does a larger batch reach the same model on the demo's task, and at which learning rate?

The demo's ResNet-18 (BatchNorm, SGD under the one-cycle schedule) on its learnable images, fitted
from the same seed at the demo's batch 64 and learning rate 0.05, then at larger batches with the
learning rate scaled linearly with the batch (Goyal et al. 2017, what `AutoBatchSize` does for
SGD) and at half that. Each row is a final validation accuracy over the batch-64 fit's: 1.00x is
the same model. The noise scale at these initial weights (`noise_scale`'s second row) says every
size here is efficient per sample; these fits show where the learning-rate rule, not the batch,
ends worse. Plain Lightning fits, one process; no timing. Run: ``python -m benchmarks batch_quality``.
"""

from __future__ import annotations

import tempfile

import lightning as L
from torch.utils.data import DataLoader

from benchmarks.common import Row
from lightning_boost.demo import VAL_SAMPLES, ValidatedResNet18, demo_dataset
from lightning_boost.testing import cpu_only

COMMAND = "python -m benchmarks batch_quality"
BASE_BATCH, BASE_LR = 64, 0.05


def run(samples: int = 16384, epochs: int = 2, sizes: tuple[int, ...] = (256, 512)) -> list[Row]:
    base = _final(samples, epochs, BASE_BATCH, BASE_LR)
    rows = []
    for size in sizes:
        factor = size / BASE_BATCH
        linear = _final(samples, epochs, size, BASE_LR * factor)
        half = _final(samples, epochs, size, BASE_LR * factor / 2)
        setup = (
            f"ResNet-18 (demo), {samples} images x {epochs} epochs, one-cycle SGD, seed 0; batch {BASE_BATCH}"
            f" at lr {BASE_LR}: {base:.4f}"
        )
        rows += [
            Row(
                f"larger batch, same epochs: batch {size} at linear lr (x{factor:g}) / batch {BASE_BATCH},"
                " final accuracy",
                linear / base,
                f"{setup}; batch {size} at lr {BASE_LR * factor:g}: {linear:.4f}",
                COMMAND,
            ),
            Row(
                f"larger batch, same epochs: batch {size} at half the linear lr (x{factor / 2:g}) / batch"
                f" {BASE_BATCH}, final accuracy",
                half / base,
                f"{setup}; batch {size} at lr {BASE_LR * factor / 2:g}: {half:.4f}",
                COMMAND,
            ),
        ]
    return rows


def _final(samples: int, epochs: int, batch_size: int, lr: float) -> float:
    """The final validation accuracy of one plain fit at `batch_size` and peak learning rate `lr`."""
    L.seed_everything(0, verbose=False)
    train = DataLoader(demo_dataset(samples), batch_size=batch_size, shuffle=True, num_workers=1)
    val = DataLoader(demo_dataset(VAL_SAMPLES, train=False), batch_size=256)
    with tempfile.TemporaryDirectory() as root, cpu_only():
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=epochs,
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(ValidatedResNet18(lr=lr), train, val)
    return float(trainer.callback_metrics["val_acc"])
