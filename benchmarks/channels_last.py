"""channels_last (NHWC) as the preset decides it, against the step time each layout really gives.

For each convolutional model (torchvision's ResNet-18, MobileNetV3-Small and EfficientNet-B0 at
32 px, the demo's small CNN; AdamW, batch 32 on a CPU and 256 on a GPU; fp32 on a CPU so the
layout alone differs, bf16 on a GPU, where NHWC's tensor-core kernels are the point), one fit with
``preset("auto")`` from a cold cache makes the decision (its trial's NCHW/NHWC ratio and pairs;
on a GPU the preset does not time it: on an H100 no model here read above 1 under bf16),
then `repeats` pairs of fits with the layout set by hand (``channels_last=False`` and ``True``,
which goes first alternating) time `steps` training steps each after 3 untimed ones: the row's
ratio is the median pair's NCHW step time over NHWC's, the speed the run gets from NHWC. The
decision is right when the preset kept NHWC for a model whose ratio is clearly above 1, and NCHW
for one near or below it.

Run: ``python -m benchmarks channels_last``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torchvision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from benchmarks.common import Row
from lightning_boost import preset
from lightning_boost.demo import SmallCNN
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets.memory_format import MemoryFormatChoice

COMMAND = "python -m benchmarks channels_last"

MODELS: dict[str, Callable[[], nn.Module]] = {
    "ResNet-18": lambda: torchvision.models.resnet18(num_classes=10),
    "MobileNetV3-Small": lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
    "EfficientNet-B0": lambda: torchvision.models.efficientnet_b0(num_classes=10),
    "demo's small CNN": lambda: SmallCNN().net,
}


class Classifier(L.LightningModule):
    """`net` trained with cross-entropy and AdamW; times its training steps after `warmup`."""

    def __init__(self, net: nn.Module, warmup: int = 3) -> None:
        super().__init__()
        self.net, self.warmup = net, warmup
        self.started = 0.0
        self.seconds = 0.0

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            _synchronize(self.device)
            self.started = time.perf_counter()

    @override
    def on_train_end(self) -> None:
        _synchronize(self.device)
        self.seconds = time.perf_counter() - self.started

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _setting(hardware: HardwareInfo) -> tuple[int, str]:
    """The batch size and precision of the fits: 256 and bf16 on a GPU, 32 and fp32 on a CPU."""
    if hardware.is_cuda:
        return 256, "bf16-mixed" if hardware.supports_bf16 else "16-mixed"
    return 32, "32-true"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fit(make: Callable[[], nn.Module], steps: int, root: str, **layout: bool) -> tuple[float, Any]:
    """Seconds per step after the warm-up of one fit, and the strategy it trained with."""
    torch.manual_seed(0)
    hardware = HardwareInfo.detect()
    batch, precision = _setting(hardware)
    generator = torch.Generator().manual_seed(0)
    count = (steps + 3) * batch
    data = TensorDataset(torch.randn(count, 3, 32, 32, generator=generator), torch.randint(0, 10, (count,)))
    trainer = L.Trainer(
        devices=1,
        max_epochs=1,
        strategy=preset("auto", hardware=hardware, precision=precision, **layout),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    model = Classifier(make())
    trainer.fit(model, DataLoader(data, batch_size=batch, pin_memory=hardware.is_cuda))
    return model.seconds / steps, trainer.strategy


def _row(name: str, make: Callable[[], nn.Module], steps: int, repeats: int) -> Row:
    with tempfile.TemporaryDirectory() as root:
        before = os.environ.get("LIGHTNING_BOOST_CACHE_DIR")
        os.environ["LIGHTNING_BOOST_CACHE_DIR"] = f"{root}/cache"
        try:
            _, strategy = _fit(make, 2, root)  # the preset's own decision, from a cold cache
        finally:
            if before is None:
                del os.environ["LIGHTNING_BOOST_CACHE_DIR"]
            else:
                os.environ["LIGHTNING_BOOST_CACHE_DIR"] = before
        choice: MemoryFormatChoice | None = strategy.memory_format
        ratios = []
        for repeat in range(repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            per_step = {nhwc: _fit(make, steps, root, channels_last=nhwc)[0] for nhwc in order}
            ratios.append(per_step[False] / per_step[True])
    hardware = HardwareInfo.detect()
    batch, precision = _setting(hardware)
    where = " on a GPU" if hardware.accelerator == "cuda" else ""  # rows of their own beside the CPU's
    if choice is None:
        decided = "the preset does not time it on this device (NCHW)"
    else:
        kept = "NHWC" if choice.channels_last else "NCHW"
        timed = choice.speedup is not None
        trial = f"{choice.speedup:.2f} over {choice.pairs} pair(s)" if timed else choice.why_not
        decided = f"the preset's trial kept {kept} (NCHW/NHWC {trial})"
    return Row(
        f"channels_last{where}, {name}: NCHW step time / NHWC",
        statistics.median(ratios),
        f"median of {repeats} pairs of fits with the layout set by hand"
        f" ({', '.join(f'{r:.2f}' for r in ratios)}); {steps} steps at batch {batch}, 32 px,"
        f" {precision}, AdamW; {decided}",
        COMMAND,
    )


def run(steps: int = 20, repeats: int = 3) -> list[Row]:
    """One row per model."""
    return [_row(name, make, steps, repeats) for name, make in MODELS.items()]
