"""A predict job alone: ``trainer.predict`` with tuned workers against the user's plain loader.

`SmallCNN` predicts FakeData images through a deterministic evaluation pipeline (resize, centre
crop, blur, normalize: the loading is most of the pass on a CPU), in one process, the order
alternating between repeats: a plain ``DataLoader`` with PyTorch's defaults, `BoostedDataModule`
and `AutoNumWorkers` rebuilding that plain loader, each from a cold cache. The ratio is plain's
wall time of the ``predict`` call over the tuned one's (tuning included; above 1 is sooner); every
tuned run's predictions must equal plain's. Two passes: 256 batches of 32, long enough for the
search on the pass's own batches, and 16 batches of 256, too short to search. Beside the long
pass, plain loaders at each worker count the CPU budget allows, so the row says how far the
tuned pass is from the best count (those keep the model on every thread; the tuned pass gives it
the CPUs its workers leave). `accelerator` and `max_workers` pin the job to a device and a worker
budget (the tests run the 2-CPU path anywhere). Run: ``python -m benchmarks eval_pass``.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision import transforms as T
from torchvision.transforms import functional as TF
from typing_extensions import override

from benchmarks.common import Row
from lightning_boost import AutoNumWorkers, BoostedDataModule
from lightning_boost.demo import SmallCNN
from lightning_boost.hardware import HardwareInfo
from lightning_boost.workers.search import WorkerChoice, WorkerTuning

COMMAND = "python -m benchmarks eval_pass"


class Predictor(SmallCNN):
    """`SmallCNN` whose ``predict_step`` gives each image's class."""

    @override
    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(1)


def images(samples: int, offset: int = 0) -> datasets.FakeData:
    """96x96 FakeData images resized, cropped to 32x32, blurred and normalized (no randomness:
    ``T.GaussianBlur`` would draw its sigma from the global RNG, of the training process when no
    worker loads); `offset` starts them at another image of FakeData's sequence."""
    normalize = T.Normalize((0.5,) * 3, (0.25,) * 3)
    blur = functools.partial(TF.gaussian_blur, kernel_size=[5, 5], sigma=[1.0, 1.0])
    pipeline = T.Compose([T.Resize(48), T.CenterCrop(32), blur, T.ToTensor(), normalize])
    return datasets.FakeData(samples, (3, 96, 96), 10, transform=pipeline, random_offset=offset)


class Images(BoostedDataModule):
    """The job's images as the predict set of a `BoostedDataModule`."""

    def __init__(self, samples: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.samples = samples

    @override
    def setup(self, stage: str) -> None:
        self.predict_dataset = images(self.samples)


def _predict(
    model: Predictor, data: DataLoader[Any] | Images, callbacks: list[L.Callback], accelerator: str
) -> tuple[float, Tensor]:
    """Seconds of one ``trainer.predict`` call and its predictions, in order."""
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    if isinstance(data, Images):
        out = trainer.predict(model, datamodule=data)
    else:
        out = trainer.predict(model, data)
    seconds = time.perf_counter() - start
    return seconds, torch.cat(out)  # type: ignore[arg-type]


def _pass(
    samples: int, batch_size: int, repeats: int, root: Path, accelerator: str, tuning: WorkerTuning
) -> tuple[dict[str, list[float]], list[str]]:
    """Seconds per repeat of the plain, `BoostedDataModule` and `AutoNumWorkers` passes, and each
    tuned pass's choice in words."""
    model, seconds, chosen = Predictor(), {"plain": [], "datamodule": [], "callback": []}, []
    kinds = list(seconds)
    for rep in range(repeats):
        reference = None
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            cache = root / f"{kind}-{batch_size}-{rep}"  # a cold cache each time
            plain = DataLoader(images(samples), batch_size=batch_size)
            if kind == "plain":
                took, out = _predict(model, plain, [], accelerator)
            elif kind == "datamodule":
                data = Images(samples, batch_size=batch_size, cache_dir=cache, worker_tuning=tuning)
                took, out = _predict(model, data, [], accelerator)
                chosen.append(_words("BoostedDataModule", data.worker_tuner.choices))
            else:
                callback = AutoNumWorkers(tuning, cache_dir=cache)
                took, out = _predict(model, plain, [callback], accelerator)
                chosen.append(_words("AutoNumWorkers", callback.worker_tuner.choices))
            reference = out if reference is None else reference
            assert torch.equal(out, reference), f"{kind}'s predictions differ from the others'"
            seconds[kind].append(took)
    return seconds, chosen


def _words(who: str, choices: dict[str, WorkerChoice]) -> str:
    (choice,) = choices.values()
    measured = ", ".join(f"{t.num_workers}: {t.samples_per_s:.0f}" for t in choice.trials)
    return f"{who} {choice.num_workers} ({choice.source}{'; samples/s ' + measured if measured else ''})"


def _seconds(times: list[float]) -> str:
    return ", ".join(f"{s:.1f}" for s in times)


def _sweep(samples: int, batch_size: int, most: int, accelerator: str) -> dict[int, float]:
    """Seconds of the pass with a plain loader at each worker count up to `most`."""
    model = Predictor()
    loaders = {n: DataLoader(images(samples), batch_size=batch_size, num_workers=n) for n in range(most + 1)}
    return {n: _predict(model, loader, [], accelerator)[0] for n, loader in loaders.items()}


def run(
    samples: int = 8192,
    batch_size: int = 32,
    short: tuple[int, int] = (4096, 256),
    repeats: int = 3,
    accelerator: str = "auto",
    max_workers: int | None = None,
) -> list[Row]:
    tuning = WorkerTuning(max_workers=max_workers)
    most = HardwareInfo.detect().cpus_per_process if max_workers is None else max_workers
    with tempfile.TemporaryDirectory() as root:
        long, long_chosen = _pass(samples, batch_size, repeats, Path(root), accelerator, tuning)
        sweep = _sweep(samples, batch_size, most, accelerator)
        brief, brief_chosen = _pass(*short, repeats, Path(root), accelerator, tuning)
    median = {kind: statistics.median(times) for kind, times in long.items()}
    swept = ", ".join(f"{n}: {s:.1f}" for n, s in sweep.items())
    best = min(sweep, key=sweep.__getitem__)
    job = f"SmallCNN predicting {samples} FakeData images (resize, crop, blur)"
    rows = []
    for kind, name in (("datamodule", "BoostedDataModule"), ("callback", "AutoNumWorkers")):
        times = ", ".join(f"{p:.1f} / {b:.1f}" for p, b in zip(long["plain"], long[kind], strict=True))
        rows.append(Row(
            f"predict pass, {samples // batch_size} batches: {name} / plain loader",
            median["plain"] / median[kind],
            f"{job} at batch {batch_size}, cold cache, median of {repeats}; seconds plain / tuned per repeat:"
            f" {times}; chosen: {'; '.join(c for c in long_chosen if c.startswith(name))}; predictions"
            " equal plain's",
            COMMAND,
        ))  # fmt: skip
    rows.append(Row(
        f"predict pass, {samples // batch_size} batches: BoostedDataModule / best num_workers of a sweep",
        sweep[best] / median["datamodule"],
        f"the same pass; plain loaders by num_workers (the model on every thread beside them; the tuned"
        f" pass also gives the model the CPUs its workers leave), seconds {{{swept}}}, one each after"
        " the repeats",
        COMMAND,
    ))  # fmt: skip
    short_median = {kind: statistics.median(times) for kind, times in brief.items()}
    rows.append(Row(
        f"predict pass, {short[0] // short[1]} batches: BoostedDataModule / plain loader",
        short_median["plain"] / short_median["datamodule"],
        f"SmallCNN predicting {short[0]} images at batch {short[1]}, too short to search: nothing measured"
        f" (AutoNumWorkers: {short_median['plain'] / short_median['callback']:.2f}x); seconds plain"
        f" {_seconds(brief['plain'])}, tuned {_seconds(brief['datamodule'])}; chosen: {brief_chosen[0]}",
        COMMAND,
    ))  # fmt: skip
    return rows
