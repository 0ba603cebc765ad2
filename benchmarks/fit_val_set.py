"""A fit's own validation set under `AutoNumWorkers`: the fit's wall time against plain Lightning.

torchvision's ResNet-18 trains on 640 FakeData images an epoch (10 batches of 64, too few to
search) and validates after each epoch on a set of its own (`eval_pass`'s images: resize, centre
crop, blur), with the user's plain DataLoaders passed to ``fit``: plain, then with
`AutoNumWorkers` from a cold cache, the order alternating between repeats. A fit's validation
loader is measured before the fit, so that measurement must cost less than it saves. Two fits:
1,024 images validated once (a few seconds of loading: a measurement that must stay cheap) and
4,096 validated after each of 3 epochs. The ratio is plain's median fit time over the tuned
one's (above 1 is sooner); the tuned fit's validation loss must equal plain's. Run: ``python -m
benchmarks fit_val_set``.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torchvision
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks.common import Row
from benchmarks.eval_pass import images
from lightning_boost import AutoNumWorkers

COMMAND = "python -m benchmarks fit_val_set"


class ResNet(L.LightningModule):
    """torchvision's ResNet-18 for 10 classes, SGD; logs ``val_loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torchvision.models.resnet18(num_classes=10)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(val_samples: int, epochs: int, cache: Path | None) -> tuple[float, float, str]:
    """Seconds of one fit, its final validation loss, and the validation loader's choice in words."""
    tuner = None if cache is None else AutoNumWorkers(cache_dir=cache)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_epochs=epochs,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tuner] if tuner is not None else [],
        default_root_dir=str(cache or tempfile.gettempdir()),
    )
    train = DataLoader(images(640), batch_size=64, shuffle=True)
    val = DataLoader(images(val_samples, offset=640), batch_size=64)
    start = time.perf_counter()
    trainer.fit(ResNet(), train, val)
    seconds = time.perf_counter() - start
    return seconds, float(trainer.callback_metrics["val_loss"]), _chosen(tuner)


def _chosen(tuner: AutoNumWorkers | None) -> str:
    if tuner is None:
        return ""
    (finding,) = [f for f in tuner.findings if f.title.startswith("val loader")]
    return finding.title.removeprefix("val loader at batch 64: ")


def run(fits: tuple[tuple[int, int], ...] = ((1024, 1), (4096, 3)), repeats: int = 3) -> list[Row]:
    """`fits`: (validation images, epochs) each."""
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size, epochs in fits:
            plain: list[tuple[float, float]] = []
            tuned: list[tuple[float, float]] = []
            chosen: list[str] = []
            for rep in range(repeats):
                for boosted in (False, True) if rep % 2 == 0 else (True, False):
                    cache = Path(root) / f"{size}-{epochs}-{rep}" if boosted else None
                    seconds, loss, words = _fit(size, epochs, cache)
                    (tuned if boosted else plain).append((seconds, loss))
                    chosen += [words] if boosted else []
            losses = {round(loss, 4) for _, loss in plain + tuned}
            assert all(math.isclose(loss, plain[0][1], rel_tol=1e-4) for _, loss in tuned), losses
            times = ", ".join(f"{p:.1f} / {t:.1f}" for (p, _), (t, _) in zip(plain, tuned, strict=True))
            rows.append(Row(
                f"a fit's own validation set, {size} images x {epochs} epoch(s): AutoNumWorkers / plain,"
                " fit wall time",
                statistics.median(p for p, _ in plain) / statistics.median(t for t, _ in tuned),
                f"ResNet-18, 640 training images, validated after each epoch; seconds plain / tuned:"
                f" {times}; val loss {plain[0][1]:.4f} both; the validation loader: {chosen[0]}",
                COMMAND,
            ))  # fmt: skip
    return rows
