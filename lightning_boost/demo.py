"""`lightning-boost demo`: the same training job with plain Lightning and with lightning-boost, side by side.

torchvision's ResNet-18 on a learnable CIFAR-sized image task with the usual CPU augmentation
pipeline (`ClassImages`, made here since nothing is downloaded; real CIFAR-10 from a directory
that holds it), trained twice in one process on the same images: Lightning's and PyTorch's
defaults, then `BoostedDataModule` + ``preset("auto")`` + `AutoBatchSize` + `boost_callbacks()`.
Both validate four times an epoch, so the table shows the model each reached and when: the final
validation accuracy of both and the wall time each took to reach the plain fit's final accuracy.
The models and datasets here are also what the examples and benchmarks train.
"""

from __future__ import annotations

import math
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
from PIL import Image
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import datasets, transforms
from typing_extensions import override

from lightning_boost.callbacks import AutoBatchSize, BoostReport, boost_callbacks
from lightning_boost.data import BoostedDataModule
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import preset
from lightning_boost.presets.memory_format import is_channels_last
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
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

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


class ValidatedCNN(SmallCNN):
    """`SmallCNN` that also validates (accuracy logged as ``val_acc``) and is trained to a final
    accuracy: SGD under the one-cycle schedule of fast CIFAR training (Smith & Topin, 2019), up to
    `lr` over the first 30% of the steps and down to near zero at the end, so the last validation
    is the model's accuracy and not the noise of a high learning rate's last steps."""

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)
        steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(steps):  # no end to the run: no schedule to fit in it
            return optimizer
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, self.hparams["lr"], total_steps=int(steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.val_acc(self(images), labels)
        self.log("val_acc", self.val_acc, prog_bar=True)


class ResNet18Classifier(SmallCNN):
    """`SmallCNN`'s training with torchvision's ResNet-18 as the network: a compute-bound model on CPU."""

    def __init__(self, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__(num_classes, lr)
        self.net = torchvision.models.resnet18(num_classes=num_classes)


class ValidatedResNet18(ValidatedCNN):
    """`ResNet18Classifier` that also validates (the demo's model)."""

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


class ClassImages(Dataset[tuple[Any, int]]):
    """CIFAR-sized images a model can learn, made here (nothing is downloaded): each of the 10
    classes is a smooth colour pattern (random 4x4 colours, upsampled to 32x32); an image is its
    class's pattern blended at a random strength with another class's pattern and pixel noise, so
    telling the classes apart takes a few epochs and the augmentation matters. The same `seed`
    gives the same images; the patterns are shared by every seed, so a validation set of another
    seed tests the same classes. Items are PIL images through `transform`, as CIFAR-10's are.
    """

    def __init__(
        self, samples: int, seed: int = 0, transform: Callable[[Any], Any] | None = None, noise: float = 0.35
    ) -> None:
        patterns = torch.rand(10, 3, 4, 4, generator=torch.Generator().manual_seed(1234))
        patterns = nn.functional.interpolate(patterns, size=32, mode="bicubic", align_corners=False)
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(10, (samples,), generator=generator)
        other = torch.randint(10, (samples,), generator=generator)
        strength = 0.55 + 0.35 * torch.rand(samples, 1, 1, 1, generator=generator)
        images = strength * patterns[self.labels] + (1 - strength) * patterns[other]
        images = images + noise * torch.randn(images.shape, generator=generator)
        self.images = (images.clamp(0, 1) * 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = Image.fromarray(self.images[index])
        return (self.transform(image) if self.transform else image), int(self.labels[index])


def eval_transform() -> transforms.Compose:
    """Validation images: tensor and normalize, no augmentation."""
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])


#: Validation images of the demo: CIFAR-10's test split is 10,000; the made-up set is this many.
VAL_SAMPLES = 1024


def demo_dataset(samples: int, data_dir: str | None = None, train: bool = True) -> Dataset[Any]:
    """The first `samples` images of CIFAR-10's training (or test) set under `data_dir` (as
    ``torchvision.datasets.CIFAR10`` stores it), or `ClassImages` when no directory is given;
    training images augmented (`train_transform`), validation ones not (`eval_transform`).

    Raises:
        ValueError: when `data_dir` does not hold CIFAR-10.
    """
    transform = train_transform() if train else eval_transform()
    if data_dir is None:
        return ClassImages(samples, seed=0 if train else 1, transform=transform)
    try:
        cifar = datasets.CIFAR10(data_dir, train=train, transform=transform)
    except RuntimeError as error:  # torchvision: "Dataset not found or corrupted"
        raise ValueError(
            f"`data_dir` {data_dir!r} does not hold CIFAR-10 ({error}): fetch it once with"
            f" `torchvision.datasets.CIFAR10({data_dir!r}, download=True)`, or leave it out to use"
            " the demo's own images."
        ) from error
    return Subset(cifar, range(min(samples, len(cifar))))


class FakeCIFAR(BoostedDataModule):
    """The demo's data as a `BoostedDataModule`, whose loader settings are measured: `ClassImages`,
    or CIFAR-10 from `data_dir` (`demo_dataset`); with `validate`, a validation set too."""

    def __init__(
        self, samples: int = 2048, data_dir: str | None = None, validate: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(drop_last=True, **kwargs)
        if samples < self.batch_size:
            raise ValueError(f"`samples` expected at least batch_size={self.batch_size}, got {samples}.")
        self.samples = samples
        self.data_dir = data_dir
        self.validate = validate

    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = demo_dataset(self.samples, self.data_dir)
        if self.validate:
            self.val_dataset = demo_dataset(VAL_SAMPLES, self.data_dir, train=False)


class Throughput(L.Callback):
    """Training samples per second from the first training batch (worker start-up included), the
    time from the start of the fit to that batch (tuning, for a boosted run: batch-size and
    precision trials, whichever hook ran them), and each validation's accuracy with the seconds
    since the start of the fit (`curve`, read after it: each accuracy stays on its device until
    then, so taking it does not wait for the GPU), and torch's intra-op thread counts its training
    steps ran on, in order (`threads`: a CPU run's worker search may leave the model fewer).
    `ended` is set by whoever called ``fit`` when it returned: the fit-end hooks (a report's
    files), the wait for a checkpoint save still being written and the teardown come after
    training, and count toward the fit's wall time."""

    def __init__(self) -> None:
        self.samples = 0
        self.threads: list[int] = []
        self.fit_started = 0.0
        self.started = 0.0
        self.seconds = 0.0
        self.ended = 0.0
        self._readings: list[tuple[float, Tensor]] = []

    @property
    def curve(self) -> list[tuple[float, float]]:
        return [(seconds, float(accuracy)) for seconds, accuracy in self._readings]

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        accuracy = trainer.callback_metrics.get("val_acc")
        if not trainer.sanity_checking and accuracy is not None:
            self._readings.append((time.perf_counter() - self.fit_started, accuracy.detach().clone()))

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.fit_started = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.samples:  # the first batch: what ran before it was spent before training
            self.started = time.perf_counter()
        self.samples += len(batch[0])
        if not self.threads or self.threads[-1] != torch.get_num_threads():
            self.threads.append(torch.get_num_threads())

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.started

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def before_training_s(self) -> float:
        """Seconds from the start of the fit to its first training batch."""
        return self.started - self.fit_started

    @property
    def after_training_s(self) -> float:
        """Seconds from the end of training to the return of ``fit`` (0 until `ended` is set)."""
        return max(0.0, self.ended - self.started - self.seconds) if self.ended else 0.0


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
    val_data: DataLoader[Any] | None = None,
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
        trainer.fit(model(), train_dataloaders=data, val_dataloaders=val_data)
    throughput.ended = time.perf_counter()
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
    curve: list[tuple[float, float]] = field(default_factory=list)
    after_training_s: float = 0.0

    @property
    def final_accuracy(self) -> float | None:
        return self.curve[-1][1] if self.curve else None

    def seconds_to(self, accuracy: float) -> float | None:
        """Wall seconds from the start of the fit to the first validation at `accuracy` or above."""
        return next((seconds for seconds, reached in self.curve if reached >= accuracy), None)


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
    ``preset("auto")``, `AutoBatchSize` (up to `max_batch_size`, learning rate by the optimizer's
    rule) and `boost_callbacks()`. Both see ``samples x epochs`` images and validate on the same
    images four times an epoch. `say` reports progress; `quiet`
    turns off the progress bars and the report's console table (the report files are written);
    `plain_first=False` trains the boosted fit first (benchmarks alternate the order).

    Raises:
        ValueError: when `samples` is smaller than one batch, or `data_dir` holds no CIFAR-10.
    """
    boosted_data = FakeCIFAR(samples, data_dir, validate=True, batch_size=batch_size)
    largest = max(batch_size, max_batch_size)
    options: dict[str, Any] = {
        "enable_progress_bar": not quiet,
        "log_every_n_steps": max(1, min(10, samples // largest)),
        "val_check_interval": 0.25,
    }

    def plain() -> DemoRun:
        say(f"[{step()}/2] plain Lightning: {samples} images x {epochs} epoch(s), batch {batch_size}")
        loader = DataLoader(demo_dataset(samples, data_dir), batch_size=batch_size, shuffle=True)
        val = DataLoader(demo_dataset(VAL_SAMPLES, data_dir, train=False), batch_size=batch_size)
        trainer, throughput = _fit(
            loader, "auto", epochs, root, "plain", (), ValidatedResNet18, val_data=val, **options
        )
        return _run("plain Lightning", trainer, throughput)

    def boosted() -> DemoRun:
        say(f"[{step()}/2] lightning-boost: the same model and data, tuned first (workers, batch size)")
        boost = boost_callbacks(boost_report={"console": not quiet})
        (report,) = [c for c in boost if isinstance(c, BoostReport)]
        callbacks = [AutoBatchSize(max_batch_size=max_batch_size), *boost]
        strategy = preset("auto", hardware=HardwareInfo.detect())
        trainer, throughput = _fit(
            boosted_data, strategy, epochs, root, "boosted", callbacks, ValidatedResNet18, **options
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
        "learning rate (peak)": f"{_peak_lr(trainer.optimizers[0].param_groups[0]):g}",
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "precision": precision_text(trainer),
        "memory format": memory_format_text(trainer),
        "strategy": type(trainer.strategy).__name__,
        "accelerator": type(trainer.accelerator).__name__.removesuffix("Accelerator"),
    }
    if settings["accelerator"] == "CPU":
        settings["model threads"] = " then ".join(str(count) for count in throughput.threads) or "-"
    return DemoRun(
        name,
        throughput.samples_per_second,
        throughput.before_training_s + throughput.seconds + throughput.after_training_s,
        throughput.before_training_s,
        settings,
        curve=throughput.curve,
        after_training_s=throughput.after_training_s,
    )


def precision_text(trainer: L.Trainer) -> str:
    """The run's precision, with the step-time ratio behind it where a CPU's bf16 was measured,
    and the batch it changed at where the run's own checks switched bf16 off."""
    plugin = trainer.precision_plugin
    speedup = getattr(getattr(plugin, "choice", None), "speedup", None)
    if speedup is None:
        return str(trainer.precision)
    switched = getattr(plugin, "switched_at", None)
    if switched is not None:
        return f"{trainer.precision} from batch {switched} (bf16 ran {speedup:.2f}x as fast in its steps)"
    return f"{trainer.precision} (bf16 step measured {speedup:.2f}x as fast as fp32)"


def memory_format_text(trainer: L.Trainer) -> str:
    """The layout of the run's convolution weights, with the step-time ratio behind it where the
    preset timed channels_last (`presets.memory_format`)."""
    choice = getattr(trainer.strategy, "memory_format", None)
    layout = "channels_last" if is_channels_last(trainer.lightning_module) else "NCHW"
    if choice is None or choice.speedup is None:
        return layout
    return f"{layout} (NHWC step measured {choice.speedup:.2f}x as fast as NCHW)"


def _peak_lr(group: dict[str, Any]) -> float:
    """The learning rate a schedule peaks at (one-cycle's ``max_lr``), else the current one."""
    return float(group.get("max_lr", group["lr"]))


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
        (
            "after training (fit-end hooks, last saves)",
            f"{plain.after_training_s:.1f} s",
            f"{boosted.after_training_s:.1f} s",
        ),
        ("speed-up (training)", "1.00x", f"{boosted.samples_per_s / plain.samples_per_s:.2f}x"),
        ("wall time (fit)", f"{plain.seconds:.1f} s", f"{boosted.seconds:.1f} s"),
        ("speed-up (wall time, tuning included)", "1.00x", f"{plain.seconds / boosted.seconds:.2f}x"),
        ("final validation accuracy", _accuracy(plain.final_accuracy), _accuracy(boosted.final_accuracy)),
    ]
    target = plain.final_accuracy
    if target is not None:
        rows.append(
            (
                f"time to plain's final accuracy ({target:.1%})",
                _seconds(plain.seconds_to(target)),
                _seconds(boosted.seconds_to(target)),
            )
        )
    if target is not None and boosted.final_accuracy is not None:
        rows.append(("final accuracy, boosted - plain", "", difference(target, boosted.final_accuracy)))
    return rows


#: The settings that change how fast a step runs or how many run: where the boosted fit kept
#: plain's for every one, the two fits differ only by the tuning's time and the host's noise.
SPEED_SETTINGS = ("batch size", "num_workers", "pin_memory", "precision", "memory format", "model threads")


def kept_plain_settings(plain: DemoRun, boosted: DemoRun) -> str | None:
    """A sentence for a boosted fit that decided its way back to plain's settings (2 CPUs: bf16
    and NHWC timed slower, a larger batch less efficient per sample, workers no faster), else
    ``None``: there its speed-up rows read the tuning's cost and the host's noise.

    Example:
        >>> same = {"batch size": "64 x 1 accumulated", "num_workers": 0, "pin_memory": False,
        ...         "precision": "32-true", "memory format": "NCHW"}
        >>> plain = DemoRun("plain Lightning", 300.0, 54.0, 0.2, same)
        >>> tuned = same | {"precision": "32-true (bf16 step measured 0.67x as fast as fp32)"}
        >>> print(kept_plain_settings(plain, DemoRun("lightning-boost", 290.0, 56.0, 2.4, tuned)))
        lightning-boost kept plain's settings on this machine (batch size 64 x 1 accumulated,
        num_workers 0, pin_memory False, precision 32-true, memory format NCHW): none of the
        changes it weighed would reach the model sooner here (its report says why, for each), so
        the two fits differ by its 2.4 s before training and the noise between two runs on this
        host.
        >>> workers = DemoRun("lightning-boost", 900.0, 20.0, 1.0, same | {"num_workers": 1})
        >>> kept_plain_settings(plain, workers) is None
        True
        >>> switched = same | {"precision": "32-true from batch 12 (bf16 ran 0.70x as fast in its steps)"}
        >>> kept_plain_settings(plain, DemoRun("lightning-boost", 290.0, 56.0, 2.4, switched)) is None
        True
        >>> fewer = same | {"model threads": "2 then 1"}  # the worker search found 1 thread faster
        >>> kept_plain_settings(plain, DemoRun("lightning-boost", 290.0, 56.0, 2.4, fewer)) is None
        True
    """

    def setting(run: DemoRun, key: str) -> str:
        return str(run.settings.get(key, "")).split(" (", 1)[0]  # without the measurement behind it

    if any(setting(plain, key) != setting(boosted, key) for key in SPEED_SETTINGS):
        return None
    kept = ", ".join(f"{key} {setting(plain, key)}" for key in SPEED_SETTINGS if key in plain.settings)
    return (
        f"lightning-boost kept plain's settings on this machine ({kept}): none of the changes it"
        " weighed would reach the model sooner here (its report says why, for each), so the two fits"
        f" differ by its {boosted.before_training_s:.1f} s before training and the noise between two"
        " runs on this host."
    )


def difference(plain: float, boosted: float, images: int = VAL_SAMPLES) -> str:
    """Boosted minus plain final accuracy in points, beside what `images` validation images tell
    apart: the 95 % margin of a difference of two accuracies, each a binomial proportion. On the
    H200 at 99.7 % and 99.3 % it is 0.6 points: 3 and 7 of 1,024 images missed.

    Example:
        >>> difference(0.997, 0.993)
        '-0.4 points (within ±0.6 at 95 % over 1,024 images)'
        >>> difference(0.90, 0.80)
        '-10.0 points (beyond ±3.1 at 95 % over 1,024 images)'
    """
    margin = 1.96 * math.sqrt((plain * (1 - plain) + boosted * (1 - boosted)) / images)
    where = "within" if abs(boosted - plain) <= margin else "beyond"
    return (
        f"{(boosted - plain) * 100:+.1f} points ({where} ±{margin * 100:.1f} at 95 % over {images:,} images)"
    )


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


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
