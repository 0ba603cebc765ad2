"""AutoBatchSize against Lightning's BatchSizeFinder where batch size matters most: torchvision's
ResNet-50 at 224 px in bf16 with AdamW on a CUDA GPU (issue 32, criterion 6).

Each tuner gets a fit of its own, `steps` optimizer steps after its search, on random images
made per index (nothing held in memory, `workers` DataLoader workers, pinned):
``AutoBatchSize(max_batch_size=...)`` under ``preset("auto")``, and
``BatchSizeFinder(mode="binsearch")`` under ``precision="bf16-mixed"``. Each fit reports the size
chosen, its tuning seconds, its training samples/s after the search (steps after a warm-up) and
its peak allocated memory. The first row's ratio is AutoBatchSize's training samples/s over
BatchSizeFinder's (target >= 1.0); the second, AutoBatchSize's tuning time over BatchSizeFinder's
(target <= 0.2); the third, their goodput: samples/s times the statistical efficiency of each size
against the configured 32 at the gradient noise scale AutoBatchSize measured (what the mission
ranks sizes by: samples the model learns from per second, not samples per second). It flatters
BatchSizeFinder, whose size keeps the configured learning rate: the efficiency assumes a rate fit
for the batch. The process's CUDA start-up is paid before both (`_warm_up`), so neither tuner's
tuning time holds it. Without a CUDA device it measures nothing and says so (a ResNet-50 at 224 px is
not a CPU job); the tests run it at a tiny size on the CPU. Run: ``python -m benchmarks gpu_batch_size``.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import lightning as L
import torch
import torchvision
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from benchmarks.batch_size import TimedFinder
from benchmarks.common import Row
from lightning_boost import AutoBatchSize
from lightning_boost.batch_size.goodput import efficiency
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset

COMMAND = "python -m benchmarks gpu_batch_size"
CONFIGURED = 32  # the batch size the model is written with, where both tuners start
GIB = 1024**3


class RandomImages(Dataset[tuple[Tensor, int]]):
    """`samples` images of `size` px, each made from its index (the same on every read)."""

    def __init__(self, samples: int, size: int, classes: int) -> None:
        self.samples, self.size, self.classes = samples, size, classes

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, self.size, self.size, generator=generator), index % self.classes


class Classifier(L.LightningModule):
    """A torchvision classifier trained with AdamW; ``batch_size`` is what the tuners change."""

    def __init__(self, arch: str, data: Dataset[Any], batch_size: int, workers: int) -> None:
        super().__init__()
        self.net: nn.Module = getattr(torchvision.models, arch)(num_classes=1000)
        self.data, self.batch_size, self.workers = data, batch_size, workers

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            self.data,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.workers > 0,
        )


def run(
    arch: str = "resnet50",
    image: int = 224,
    max_batch_size: int = 4096,
    steps: int = 25,
    workers: int = 8,
    samples: int = 65_536,
    cpu: bool = False,
) -> list[Row]:
    """Both fits on the GPU (`cpu=True`: on the CPU, for tests at a tiny size); no rows without one."""
    if not cpu and not torch.cuda.is_available():
        print("gpu_batch_size: needs a CUDA device; nothing measured")
        return []
    data = RandomImages(samples, image, 1000)
    warm_s = _warm_up(arch, image, torch.device("cpu" if cpu else "cuda"))
    auto = AutoBatchSize(max_batch_size=max_batch_size, retune=True)
    finder = TimedFinder(mode="binsearch", max_trials=25)
    hardware = HardwareInfo.detect()
    # a CPU without bf16 instructions emulates it: its steps ran 300 s on a 2-CPU AMD EPYC at the
    # test's tiny size, where the preset (fp32 there) took seconds; both then train in fp32
    precision = "bf16-mixed" if not cpu or hardware.cpu_supports_bf16 else "32-true"
    with tempfile.TemporaryDirectory() as root:  # BatchSizeFinder writes a checkpoint there
        strategy = preset("auto", hardware=hardware.on_cpu() if cpu else hardware)
        mine = _fit(arch, data, workers, steps, auto, strategy, cpu, root)
        theirs = _fit(arch, data, workers, steps, finder, "auto", cpu, root, precision=precision)
    assert auto.decision is not None  # the fit puts the configured size back at its end
    decision = auto.decision
    mine |= {"batch_size": decision.batch_size, "tuning_s": decision.seconds}
    theirs |= {"batch_size": finder.optimal_batch_size, "tuning_s": finder.seconds}
    device = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 0.0
    where = (
        f"{arch} at {image} px, {precision}, AdamW, {steps} steps after tuning, {workers} workers; the"
        f" process's CUDA start-up before both ({warm_s:.1f} s)"
    )
    noise = "unknown" if decision.noise_scale is None else f"{decision.noise_scale:,.0f}"
    worth = {
        name: fit["samples_per_s"] * _efficiency(decision.noise_scale, fit["batch_size"], CONFIGURED)
        for name, fit in (("mine", mine), ("theirs", theirs))
    }
    tried = ", ".join(f"{t.size}: {t.samples_per_s:.0f}/s in {t.seconds:.1f} s" for t in decision.trials)
    detail = (
        f"AutoBatchSize: batch {mine['batch_size']}, {mine['samples_per_s']:.0f} samples/s, tuning"
        f" {mine['tuning_s']:.1f} s, peak {mine['peak_gib']:.1f} GiB (trials {tried}; noise scale {noise};"
        f" {decision.kept or decision.stopped}); BatchSizeFinder(binsearch): batch"
        f" {theirs['batch_size']}, {theirs['samples_per_s']:.0f} samples/s, tuning"
        f" {theirs['tuning_s']:.1f} s, peak {theirs['peak_gib']:.1f} GiB of {device:.1f} GiB; {where}"
    )
    return [
        Row(
            "batch size on the GPU: AutoBatchSize / BatchSizeFinder, training samples/s (target >= 1.0)",
            mine["samples_per_s"] / max(theirs["samples_per_s"], 1e-9),
            detail,
            COMMAND,
        ),
        Row(
            "batch size on the GPU: AutoBatchSize's tuning time / BatchSizeFinder's (target <= 0.2)",
            mine["tuning_s"] / max(theirs["tuning_s"], 1e-9),
            detail,
            COMMAND,
        ),
        Row(
            "batch size on the GPU: AutoBatchSize / BatchSizeFinder, goodput at the measured noise scale",
            worth["mine"] / max(worth["theirs"], 1e-9),
            f"goodput {worth['mine']:.0f} against {worth['theirs']:.0f} samples/s (samples/s x efficiency"
            f" from {CONFIGURED} at noise scale {noise}); {detail}",
            COMMAND,
        ),
    ]


def _efficiency(noise: float | None, size: int, reference: int) -> float:
    """`size`'s statistical efficiency against `reference` at `noise` (1 when it is unknown)."""
    return 1.0 if noise is None else efficiency(noise, size, reference)


def _warm_up(arch: str, image: int, device: torch.device, steps: int = 3) -> float:
    """A few bf16 training passes of the model at batch 8, before either fit: the process's CUDA,
    cuDNN and cuBLAS start-up (and a fresh machine's first kernel loads) would otherwise be the cost
    of whichever tuner runs first, and is neither's. cudnn.benchmark is left as it is (off): no
    kernel is tuned for a shape either fit runs. Its seconds."""
    start = time.perf_counter()
    net = getattr(torchvision.models, arch)(num_classes=1000).to(device)
    images = torch.randn(8, 3, image, image, device=device)
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            net(images).float().logsumexp(1).mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        del net, images
        torch.cuda.empty_cache()
    return time.perf_counter() - start


class AfterTuning(L.Callback):
    """The end time of each training batch after the tuners' ``on_fit_start`` (their searches run
    there, inner fits included); stops the fit after `steps` such batches."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.ends: list[float] = []

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ends = []

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.ends.append(time.perf_counter())
        trainer.should_stop = len(self.ends) >= self.steps

    def samples_per_s(self, batch_size: int, warmup: int) -> float:
        timed = self.ends[warmup:]
        return batch_size * (len(timed) - 1) / max(timed[-1] - timed[0], 1e-9)


def _fit(
    arch: str,
    data: Dataset[Any],
    workers: int,
    steps: int,
    tuner: L.Callback,
    strategy: Any,
    cpu: bool,
    root: str,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """A long run cut after `steps` batches past `tuner`'s search (so the tuner plans for a real
    run): its samples/s after a warm-up, at the size its loader trained with, and peak memory."""
    L.seed_everything(0, verbose=False)
    timer = AfterTuning(steps)
    model = Classifier(arch, data, batch_size=CONFIGURED, workers=workers)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator="cpu" if cpu else "gpu",
        devices=1,
        strategy=strategy,
        max_epochs=-1,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tuner, timer],
        **trainer_kwargs,
    )
    trainer.fit(model)
    loader = trainer.train_dataloader
    assert isinstance(loader, DataLoader) and loader.batch_size is not None
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    return {"samples_per_s": timer.samples_per_s(loader.batch_size, min(3, steps - 2)), "peak_gib": peak}
