"""`lightning-boost demo`: the same training job with plain Lightning and with lightning-boost, side by side.

torchvision's ResNet-18 on a CIFAR-sized image task with the usual CPU augmentation pipeline
(torchvision ``FakeData``, since nothing is downloaded; real CIFAR-10 from a directory that holds
it), trained twice in one process on the same images: Lightning's and PyTorch's defaults, then
`BoostedDataModule` + ``preset("auto")`` + `AutoBatchSize` + `boost_callbacks()`. The models and
datasets here are also what the examples and benchmarks train.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
import torchvision
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import datasets, transforms
from typing_extensions import override

from lightning_boost.callbacks import AutoBatchSize, BoostReport, boost_callbacks
from lightning_boost.data import BoostedDataModule
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset
from lightning_boost.report import Finding, Severity

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class SmallCNN(L.LightningModule):
    """Three conv blocks and a linear head for 32x32 RGB images; logs loss and accuracy."""

    def __init__(self, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            _block(3, 32),
            _block(32, 64),
            _block(64, 128),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, num_classes),
        )
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = nn.functional.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


class ResNet18Classifier(SmallCNN):
    """`SmallCNN`'s training with torchvision's ResNet-18 as the network: a compute-bound model on CPU."""

    def __init__(self, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__(num_classes, lr)
        self.net = torchvision.models.resnet18(num_classes=num_classes)


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


def train_transform() -> transforms.Compose:
    """The usual CIFAR augmentation: random crop with padding, flip, tensor, normalize."""
    return transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
        ]
    )


def fake_cifar(samples: int) -> datasets.FakeData:
    """`samples` CIFAR-sized FakeData images (3x32x32, 10 classes) through `train_transform`."""
    return datasets.FakeData(
        size=samples, image_size=(3, 32, 32), num_classes=10, transform=train_transform()
    )


def demo_dataset(samples: int, data_dir: str | None = None) -> Dataset[Any]:
    """The first `samples` images of CIFAR-10's training set under `data_dir` (as
    ``torchvision.datasets.CIFAR10`` stores it), or `fake_cifar` when no directory is given.

    Raises:
        ValueError: when `data_dir` does not hold CIFAR-10.
    """
    if data_dir is None:
        return fake_cifar(samples)
    try:
        cifar = datasets.CIFAR10(data_dir, train=True, transform=train_transform())
    except RuntimeError as error:  # torchvision: "Dataset not found or corrupted"
        raise ValueError(
            f"`data_dir` {data_dir!r} does not hold CIFAR-10 ({error}): fetch it once with"
            f" `torchvision.datasets.CIFAR10({data_dir!r}, download=True)`, or leave it out to use FakeData."
        ) from error
    return Subset(cifar, range(min(samples, len(cifar))))


class FakeCIFAR(BoostedDataModule):
    """The demo's data as a `BoostedDataModule`, whose loader settings are measured: `fake_cifar`,
    or CIFAR-10 from `data_dir` (`demo_dataset`)."""

    def __init__(self, samples: int = 2048, data_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(drop_last=True, **kwargs)
        if samples < self.batch_size:
            raise ValueError(f"`samples` expected at least batch_size={self.batch_size}, got {samples}.")
        self.samples = samples
        self.data_dir = data_dir

    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = demo_dataset(self.samples, self.data_dir)


class Throughput(L.Callback):
    """Training samples per second from the start of training (worker start-up included), and
    the time from the start of the fit to the first step (tuning, for a boosted run)."""

    def __init__(self) -> None:
        self.samples = 0
        self.fit_started = 0.0
        self.started = 0.0
        self.seconds = 0.0

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.fit_started = time.perf_counter()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.samples += len(batch[1])

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.started

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def before_training_s(self) -> float:
        """Seconds from the start of the fit to the start of training."""
        return self.started - self.fit_started


def fit_fake_cifar(
    data: DataLoader[Any] | L.LightningDataModule,
    strategy: Strategy | str,
    epochs: int,
    root: str,
    name: str = "demo",
    callbacks: Sequence[L.Callback] = (),
    model: Callable[[], L.LightningModule] = SmallCNN,
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, float]:
    """Train `model()` (`SmallCNN`) on `data` (a loader or a datamodule) with `strategy`; return
    the trainer and samples/s."""
    trainer, throughput = _fit(data, strategy, epochs, root, name, callbacks, model, **trainer_kwargs)
    return trainer, throughput.samples_per_second


def _fit(
    data: DataLoader[Any] | L.LightningDataModule,
    strategy: Strategy | str,
    epochs: int,
    root: str,
    name: str,
    callbacks: Sequence[L.Callback],
    model: Callable[[], L.LightningModule],
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, Throughput]:
    throughput = Throughput()
    L.seed_everything(0, verbose=False)
    options: dict[str, Any] = dict(
        max_epochs=epochs,
        strategy=strategy,
        logger=CSVLogger(root, name=name),
        default_root_dir=root,
        callbacks=[throughput, *callbacks],
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer = L.Trainer(**(options | trainer_kwargs))
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model(), datamodule=data)
    else:
        trainer.fit(model(), train_dataloaders=data)
    return trainer, throughput


@dataclass
class DemoRun:
    """What one of the demo's two fits trained with and how fast."""

    name: str
    samples_per_s: float
    seconds: float
    before_training_s: float
    settings: dict[str, Any]
    syncs: list[Finding] = field(default_factory=list)
    retained: list[Finding] = field(default_factory=list)
    checked: bool = False
    report: Path | None = None


def run_demo(
    samples: int = 8192,
    epochs: int = 2,
    root: str = "lightning_logs_demo",
    batch_size: int = 64,
    data_dir: str | None = None,
    max_batch_size: int = 256,
    say: Callable[[str], None] = print,
    quiet: bool = False,
    plain_first: bool = True,
) -> tuple[DemoRun, DemoRun]:
    """Train torchvision's ResNet-18 on the demo data twice: plain Lightning, then boosted.

    The plain fit is what a user writes first: a shuffled ``DataLoader`` with PyTorch's defaults
    and ``Trainer()`` with Lightning's. The boosted fit trains the same model on the same data
    through `FakeCIFAR` (a `BoostedDataModule`: measured workers, pinned memory on CUDA),
    ``preset("auto")``, `AutoBatchSize` (up to `max_batch_size`, learning rate scaled linearly)
    and `boost_callbacks()`. Both see ``samples x epochs`` images. `say` reports progress; `quiet`
    turns off the progress bars and the report's console table (the report files are written);
    `plain_first=False` trains the boosted fit first (benchmarks alternate the order).

    Raises:
        ValueError: when `samples` is smaller than one batch, or `data_dir` holds no CIFAR-10.
    """
    boosted_data = FakeCIFAR(samples, data_dir, batch_size=batch_size)
    largest = max(batch_size, max_batch_size)
    options = {"enable_progress_bar": not quiet, "log_every_n_steps": max(1, min(10, samples // largest))}

    def plain() -> DemoRun:
        say(f"[{step()}/2] plain Lightning: {samples} images x {epochs} epoch(s), batch {batch_size}")
        loader = DataLoader(demo_dataset(samples, data_dir), batch_size=batch_size, shuffle=True)
        trainer, throughput = _fit(loader, "auto", epochs, root, "plain", (), ResNet18Classifier, **options)
        return _run("plain Lightning", trainer, throughput)

    def boosted() -> DemoRun:
        say(f"[{step()}/2] lightning-boost: the same model and data, tuned first (workers, batch size)")
        boost = boost_callbacks(boost_report={"console": not quiet})
        (report,) = [c for c in boost if isinstance(c, BoostReport)]
        callbacks = [AutoBatchSize(max_batch_size=max_batch_size, lr_scaling="linear"), *boost]
        strategy = preset("auto", hardware=HardwareInfo.detect())
        trainer, throughput = _fit(
            boosted_data, strategy, epochs, root, "boosted", callbacks, ResNet18Classifier, **options
        )
        run = _run("lightning-boost", trainer, throughput)
        assert report.report is not None  # written at the end of every fit
        run.checked, run.report = True, report.paths[0]
        run.syncs = [f for f in report.report.findings if f.source == "SyncGuard"]
        run.retained = [f for f in report.report.findings if f.source == "LossLoggingGuard"]
        return run

    done: list[int] = []

    def step() -> int:
        done.append(1)
        return len(done)

    if plain_first:
        first = plain()
        return first, boosted()
    second = boosted()
    return plain(), second


def _run(name: str, trainer: L.Trainer, throughput: Throughput) -> DemoRun:
    loader = trainer.train_dataloader
    assert isinstance(loader, DataLoader)
    settings = {
        "batch size": f"{loader.batch_size} x {trainer.accumulate_grad_batches} accumulated",
        "learning rate": f"{trainer.optimizers[0].param_groups[0]['lr']:g}",
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "precision": trainer.precision,
        "strategy": type(trainer.strategy).__name__,
        "accelerator": type(trainer.accelerator).__name__.removesuffix("Accelerator"),
    }
    return DemoRun(
        name,
        throughput.samples_per_second,
        throughput.seconds + throughput.before_training_s,
        throughput.before_training_s,
        settings,
    )


def side_by_side(plain: DemoRun, boosted: DemoRun) -> list[tuple[str, str, str]]:
    """The demo's table: one ``(what, plain, boosted)`` row per setting and figure."""
    rows = [(key, str(plain.settings[key]), str(boosted.settings[key])) for key in plain.settings]
    rows += [
        ("syncs found", _syncs(plain), _syncs(boosted)),
        ("retained graphs found", _retained(plain), _retained(boosted)),
        (
            "before training (tuning)",
            f"{plain.before_training_s:.1f} s",
            f"{boosted.before_training_s:.1f} s",
        ),
        ("training samples/s", f"{plain.samples_per_s:,.0f}", f"{boosted.samples_per_s:,.0f}"),
        ("speed-up (training)", "1.00x", f"{boosted.samples_per_s / plain.samples_per_s:.2f}x"),
        ("wall time (fit)", f"{plain.seconds:.1f} s", f"{boosted.seconds:.1f} s"),
        ("speed-up (wall time, tuning included)", "1.00x", f"{plain.seconds / boosted.seconds:.2f}x"),
    ]
    return rows


def _syncs(run: DemoRun) -> str:
    """SyncGuard warns about the user's lines; Lightning's own syncs are its INFO findings."""
    if not run.checked:
        return "not checked"
    yours = sum(f.severity is not Severity.INFO for f in run.syncs)
    return f"{yours} in your code, {len(run.syncs) - yours} in Lightning's"


def _retained(run: DemoRun) -> str:
    """LossLoggingGuard's INFO finding says none was kept; each WARN/ERROR is one that was."""
    if not run.checked:
        return "not checked"
    return str(sum(f.severity is not Severity.INFO for f in run.retained))
