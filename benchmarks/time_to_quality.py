"""Time to quality: wall time to the plain run's final validation metric, plain against boosted.

Three learnable workloads and three variants, each trained in one process from the same seed of
model and data: plain Lightning (PyTorch's ``DataLoader`` defaults, ``Trainer()``'s) against the
README's set-up (`BoostedDataModule`, ``preset("auto")``, ``boost_callbacks()``,
``AutoBatchSize()``), each boosted fit from a cold cache, in `pairs` (3) pairs, which of the two
goes first alternating; plain once more from a second seed, so the row states the run-to-run noise
of the final metric. Every fit validates four times an epoch. A pair's ratio is the plain fit's
wall time to its own final metric over the boosted fit's wall time to reach that metric (tuning
included; above 1 is sooner; 0 when never reached), and the row gives the median pair: on this
shared host one pair's ratio moves by 10-20 % from run to run.

- ``cnn``: the demo's images (`ClassImages`, with its augmentation) and its small CNN, SGD.
- ``mlp``: a 32-input classifier with Adam on 7,168 samples, the issue's quickstart trial.
- ``autoencoder``: a 64-16-64 autoencoder with Adam on data with 8 latent factors (val MSE).
- ``mlp (12 epochs)``: the MLP trained long enough for ``AutoBatchSize(grow=True)`` to grow its
  batch during the run; boosted once more without growing, so the row shows what growing adds.
- ``cnn (own DataLoaders)``, ``mlp (own DataLoaders)``: the fits with the user's own DataLoaders
  passed to ``fit``, as plain's: boosted by ``boost_callbacks()`` (`AutoNumWorkers` rebuilds
  them) and ``preset("auto")`` alone, the set-up for a program without `BoostedDataModule`.

Each boosted fit has a cache directory of its own (``LIGHTNING_BOOST_CACHE_DIR`` too, where the
precision's measurement is cached), so every one starts cold.

Run: ``python -m benchmarks time_to_quality`` (one workload: ``'time_to_quality:only=mlp (12 epochs)'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override

from benchmarks.common import Row
from lightning_boost import AutoBatchSize, BoostedDataModule, WorkerTuning, boost_callbacks, preset
from lightning_boost._validation import unknown_choice_error
from lightning_boost.batch_size.decision import BatchSizeDecision
from lightning_boost.demo import (
    ClassImages,
    Throughput,
    ValidatedCNN,
    eval_transform,
    memory_format_text,
    precision_text,
    train_transform,
)
from lightning_boost.hardware import HardwareInfo

COMMAND = "python -m benchmarks time_to_quality"


class MLP(L.LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_acc(self.net(batch[0]), batch[1])
        self.log("val_acc", self.val_acc)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


class AutoEncoder(L.LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
        self.decoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))

    def _loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        return nn.functional.mse_loss(self.decoder(self.encoder(batch[0])), batch[0])

    @override
    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self.log("val_acc", -self._loss(batch))  # higher is better, as for the classifiers

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


def classes(samples: int, seed: int) -> TensorDataset:
    weights = torch.randn(32, 10, generator=torch.Generator().manual_seed(123))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=generator)
    return TensorDataset(x, (x @ weights + 0.5 * torch.randn(samples, 10, generator=generator)).argmax(1))


def factors(samples: int, seed: int) -> TensorDataset:
    mixing = torch.randn(8, 64, generator=torch.Generator().manual_seed(321))
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(samples, 8, generator=generator)
    return TensorDataset(torch.tanh(latent @ mixing) + 0.05 * torch.randn(samples, 64, generator=generator))


@dataclass(frozen=True)
class Workload:
    name: str
    model: Callable[[], L.LightningModule]
    train: Callable[[], Dataset[Any]]
    val: Callable[[], Dataset[Any]]
    epochs: int
    metric: str
    grows: bool = False  # boosted with AutoBatchSize(grow=True), and once more without
    own_loaders: bool = False  # boosted with the plain DataLoaders, boost_callbacks() and the preset


_CNN = Workload(
    "cnn",
    ValidatedCNN,
    lambda: ClassImages(4096, 0, train_transform()),
    lambda: ClassImages(1024, 1, eval_transform()),
    2,
    "val accuracy",
)
_MLP = Workload("mlp", MLP, lambda: classes(7168, 0), lambda: classes(2048, 1), 3, "val accuracy")

WORKLOADS = (
    _CNN,
    _MLP,
    Workload("autoencoder", AutoEncoder, lambda: factors(16384, 0), lambda: factors(2048, 1), 3, "val -MSE"),
    dataclasses.replace(_MLP, name="mlp (12 epochs)", epochs=12, grows=True),
    dataclasses.replace(_CNN, name="cnn (own DataLoaders)", own_loaders=True),
    dataclasses.replace(_MLP, name="mlp (own DataLoaders)", own_loaders=True),
)


class Data(BoostedDataModule):
    def __init__(self, workload: Workload, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.workload = workload

    @override
    def setup(self, stage: str) -> None:
        self.train_dataset, self.val_dataset = self.workload.train(), self.workload.val()


def _fit(
    workload: Workload,
    root: Path,
    seed: int,
    boosted: bool,
    cache: Path,
    grow: bool = False,
    datamodules: list[Data] | None = None,
    accelerator: str = "auto",
    max_workers: int | None = None,
) -> tuple[Throughput, AutoBatchSize | None, str]:
    """One fit; a boosted one's datamodule goes to `datamodules` when given. `accelerator` and
    `max_workers` pin the device and the worker budget (a benchmark's 2-CPU path, run anywhere)."""
    with _cold(cache):
        pin = _Pin(accelerator, WorkerTuning(max_workers=max_workers))
        return _fit_in(workload, root, seed, boosted, cache, grow, datamodules, pin)


@dataclass(frozen=True)
class _Pin:
    """The device and the worker budget a fit is held to ("auto" and the CPU budget: none)."""

    accelerator: str = "auto"
    tuning: WorkerTuning = dataclasses.field(default_factory=WorkerTuning)

    def hardware(self) -> HardwareInfo:
        detected = HardwareInfo.detect()
        return detected.on_cpu() if self.accelerator == "cpu" and detected.is_cuda else detected


@contextlib.contextmanager
def _cold(cache: Path) -> Iterator[None]:
    """Every cached measurement of the fit (the precision's too) under `cache`."""
    before = os.environ.get("LIGHTNING_BOOST_CACHE_DIR")
    os.environ["LIGHTNING_BOOST_CACHE_DIR"] = str(cache)
    try:
        yield
    finally:
        if before is None:
            del os.environ["LIGHTNING_BOOST_CACHE_DIR"]
        else:
            os.environ["LIGHTNING_BOOST_CACHE_DIR"] = before


def _fit_in(
    workload: Workload,
    root: Path,
    seed: int,
    boosted: bool,
    cache: Path,
    grow: bool,
    datamodules: list[Data] | None = None,
    pin: _Pin = _Pin(),
) -> tuple[Throughput, AutoBatchSize | None, str]:
    clock = Throughput()
    tuner = AutoBatchSize(cache_dir=cache, grow=grow) if boosted and not workload.own_loaders else None
    callbacks: list[L.Callback] = [clock]
    if boosted:
        workers = {"cache_dir": cache, "tuning": pin.tuning}
        callbacks += boost_callbacks(boost_report={"console": False}, auto_num_workers=workers)
    if tuner is not None:
        callbacks.append(tuner)
    L.seed_everything(seed, verbose=False)
    trainer = L.Trainer(
        max_epochs=workload.epochs,
        accelerator=pin.accelerator,
        strategy=preset("auto", hardware=pin.hardware()) if boosted else "auto",
        callbacks=callbacks,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=0.25,
        num_sanity_val_steps=0,
    )
    if boosted and not workload.own_loaders:
        data = Data(workload, batch_size=64, cache_dir=cache, worker_tuning=pin.tuning)
        if datamodules is not None:
            datamodules.append(data)
        trainer.fit(workload.model(), datamodule=data)
    else:
        train = DataLoader(workload.train(), batch_size=64, shuffle=True)
        trainer.fit(workload.model(), train, DataLoader(workload.val(), batch_size=64))
    return clock, tuner, f"{precision_text(trainer)}; memory format {memory_format_text(trainer)}"


def _reach(clock: Throughput, target: float) -> float | None:
    return next((seconds for seconds, value in clock.curve if value >= target), None)


def _batch(tuner: AutoBatchSize | None) -> str:
    if tuner is None:
        return "batch 64 (the user's DataLoaders: no AutoBatchSize)"
    decision = tuner.decision
    assert decision is not None
    return (
        f"batch {decision.batch_size}, lr x{decision.lr_factor:.2f}"
        f" ({decision.kept or decision.stopped}){_growth(decision)}"
    )


def _growth(decision: BatchSizeDecision) -> str:
    steps = ", ".join(f"{g['from']} to {g['to']} after epoch {g['epoch']}" for g in decision.growth)
    return f"; grown during the run: {steps}" if steps else ""


def _without_growth(fixed: Throughput | None, target: float) -> str:
    if fixed is None:
        return ""
    reached = _reach(fixed, target)
    when = f"at {reached:.1f} s" if reached is not None else "never"
    return f" With grow=False: final {fixed.curve[-1][1]:.4g}, plain's final reached {when}."


@dataclass(frozen=True)
class _Pair:
    """A plain fit and a boosted one from the same seed, run one after the other."""

    plain: Throughput
    boosted: Throughput
    tuner: AutoBatchSize | None
    precision: str

    @property
    def target(self) -> float:
        return self.plain.curve[-1][1]

    @property
    def plain_s(self) -> float:
        reached = _reach(self.plain, self.target)
        assert reached is not None  # its own final
        return reached

    @property
    def boosted_s(self) -> float | None:
        return _reach(self.boosted, self.target)

    @property
    def ratio(self) -> float:
        boosted_s = self.boosted_s
        return self.plain_s / boosted_s if boosted_s else 0.0


def run(pairs: int = 3, only: str = "") -> list[Row]:
    """One row per workload (the one named `only`, when given): the median of `pairs` alternating
    plain/boosted pairs."""
    names = [workload.name for workload in WORKLOADS]
    if only and only not in names:
        raise unknown_choice_error("only", only, names)
    return [_row(workload, pairs) for workload in WORKLOADS if only in ("", workload.name)]


def _row(workload: Workload, pairs: int) -> Row:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        again, _, _ = _fit(workload, root / "again", 1, False, root / "cache")
        runs = []
        for i in range(pairs):  # each boosted fit from a cold cache of its own; who goes first alternates
            if i % 2 == 0:
                plain, _, _ = _fit(workload, root / f"plain{i}", 0, False, root / "cache")
            boosted, tuner, precision = _fit(
                workload, root / f"boosted{i}", 0, True, root / f"cache{i}", workload.grows
            )
            if i % 2 == 1:
                plain, _, _ = _fit(workload, root / f"plain{i}", 0, False, root / "cache")
            runs.append(_Pair(plain, boosted, tuner, precision))
        fixed = None
        if workload.grows:  # a cold cache again: the same start decision, measured
            fixed, _, _ = _fit(workload, root / "fixed", 0, True, root / "cache-fixed")
    ordered = sorted(runs, key=lambda pair: pair.ratio)
    middle = ordered[len(ordered) // 2]
    target = middle.target
    reached = f"{middle.boosted_s:.1f} s" if middle.boosted_s is not None else "never"
    finals = [pair.boosted.curve[-1][1] for pair in runs]
    return Row(
        f"time to quality ({workload.name})",
        middle.ratio,
        f"median of {pairs} alternating pairs (ratios {', '.join(f'{p.ratio:.2f}' for p in ordered)});"
        f" {workload.metric}: plain {target:.4g} (second seed {again.curve[-1][1]:.4g}, noise"
        f" {abs(again.curve[-1][1] - target):.2g}), boosted {_finals(finals)}; the median pair reached"
        f" plain's final at {middle.plain_s:.1f} s plain, {reached} boosted (tuning"
        f" {middle.boosted.before_training_s:.1f} s); {_batch(middle.tuner)}; precision"
        f" {middle.precision}.{_without_growth(fixed, target)}",
        COMMAND,
    )


def _finals(finals: list[float]) -> str:
    """The boosted fits' final metrics: one figure when they agree."""
    if len(set(finals)) == 1:
        return f"{finals[0]:.4g}" + (f" (all {len(finals)})" if len(finals) > 1 else "")
    return ", ".join(f"{final:.4g}" for final in finals)
