"""bf16 autocast on a CPU, checked again on the run's own steps: what a wrong verdict costs a fit
without the checks, and what the checks cost a fit whose bf16 is right.

A CPU run keeps bf16 when its trial before training times it faster, and then checks it on its
own steps (`lightning_boost.precision.recheck_setting`). Here the verdict is planted: the run
reads "bf16 ran 1.25x as fast" from the cache, as a trial that fell in another state of a shared
host would leave it (the `demo_cold` repeat of 2026-11-27 read 1.15x on one pair and then trained
1.6x slower than plain fp32). This machine cannot be made to change its speed after a trial on
demand, so the verdict stands in for it; the steps, the checks and the switch are real. On the
demo's images, plain DataLoaders at batch 64, one untimed fit first, the order of the fits
rotating between rounds:

- the demo's ResNet-18, two epochs: the fit without the checks and the fit in fp32 set by hand
  (``precision="32-true"``), each over the fit with the checks. Whether the verdict is wrong is
  the host's to say: in the state this host was in on 2026-11-27 its bf16 step ran 0.67x fp32's
  (timed by hand), in its other state about 1.25x; the check pairs in the detail say which;
- `time_to_quality`'s CNN, two epochs, whose bf16 step runs 1.3x-1.7x fp32's in either state:
  the fit without the checks over the fit with them (their cost, where bf16 is right).

Each fit is timed from its set-up to the end of training, final validation accuracy beside it;
each ratio is the median round's. Run: ``python -m benchmarks autocast_recheck``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import Row, rotated
from lightning_boost import preset
from lightning_boost.cache import CACHE_DIR_ENV
from lightning_boost.demo import (
    ClassImages,
    Throughput,
    ValidatedCNN,
    ValidatedResNet18,
    eval_transform,
    train_transform,
)
from lightning_boost.hardware import HardwareInfo
from lightning_boost.precision import AutocastChoice
from lightning_boost.presets import autocast

COMMAND = "python -m benchmarks autocast_recheck"

#: The planted verdict: bf16 1.25x as fast over 2 pairs, from an earlier run's cache entry.
STALE = AutocastChoice(True, 1.25, 2, cached=True)

#: A fit: "checked" (the pack as it is), "unchecked" (the checks turned off), "fp32" (set by hand).
MODES = ("checked", "unchecked", "fp32")


def run(rounds: int = 3, resnet_samples: int = 4096, cnn_samples: int = 4096) -> list[Row]:
    """The rows; none on a CPU without bf16 instructions, whose runs train in fp32 whatever the
    cache says (bf16 is emulated there: a planted verdict would not be kept, and nothing checked)."""
    if not HardwareInfo.detect().cpu_supports_bf16:
        print("autocast_recheck: this CPU has no bf16 instructions (AVX512-BF16, AMX); nothing measured")
        return []
    images = (lambda: ClassImages(resnet_samples, 0, train_transform()), _val_images)
    resnet = _rounds(ValidatedResNet18, *images, 2, rounds)
    images = (lambda: ClassImages(cnn_samples, 0, train_transform()), _val_images)
    cnn = _rounds(ValidatedCNN, *images, 2, rounds, modes=("checked", "unchecked"))
    setup = f"median of {rounds} rounds, order rotating; planted verdict: bf16 1.25x (cache)"
    name = "bf16 kept on a planted verdict, checked on the run's steps"
    return [
        _row(
            f"{name} (ResNet-18): fit time without the checks / with them",
            resnet,
            "unchecked",
            "checked",
            setup,
        ),
        _row(
            f"{name} (ResNet-18): fit time in fp32 set by hand / with the checks",
            resnet,
            "fp32",
            "checked",
            setup,
        ),
        _row(f"{name} (CNN): fit time without the checks / with them", cnn, "unchecked", "checked", setup),
    ]


def _val_images() -> Dataset[Any]:
    return ClassImages(1024, 1, eval_transform())


Fit = dict[str, Any]


def _rounds(
    model: Callable[[], L.LightningModule],
    train: Callable[[], Dataset[Any]],
    val: Callable[[], Dataset[Any]],
    epochs: int,
    rounds: int,
    modes: tuple[str, ...] = MODES,
) -> list[dict[str, Fit]]:
    data = (train(), val())
    _fit(model, data, epochs, "checked")  # untimed: the process's first fit builds its kernels
    return [
        {mode: _fit(model, data, epochs, mode) for mode in rotated(modes, turn)} for turn in range(rounds)
    ]


def _fit(model: Callable[[], L.LightningModule], data: tuple[Any, Any], epochs: int, mode: str) -> Fit:
    """One fit on the CPU in `mode`, in a cache of its own: its time, precision, checks and accuracy."""
    hardware = HardwareInfo.detect().on_cpu()
    fixed = {"precision": "32-true"} if mode == "fp32" else {}
    strategy = preset("auto", hardware=hardware, **fixed)
    clock = Throughput()
    with tempfile.TemporaryDirectory() as root, _planted(mode, Path(root)):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=epochs,
            strategy=strategy,
            callbacks=[clock],
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        train, val = data
        trainer.fit(model(), DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=256))
    plugin = trainer.precision_plugin
    return {
        "seconds": clock.before_training_s + clock.seconds,
        "precision": str(trainer.precision),
        "rechecks": list(getattr(plugin, "rechecks", [])),
        "switched_at": getattr(plugin, "switched_at", None),
        "accuracy": clock.curve[-1][1] if clock.curve else float("nan"),
    }


@contextlib.contextmanager
def _planted(mode: str, root: Path) -> Iterator[None]:
    """The fit's cache in `root`, the stale verdict read from it, and (unchecked) no checks."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {CACHE_DIR_ENV: str(root / "cache")}))
        stack.enter_context(mock.patch.object(autocast, "_lookup", lambda trainer, batch: ("stale", STALE)))
        if mode == "unchecked":
            stack.enter_context(mock.patch.object(autocast, "recheck_setting", lambda *args: None))
        yield


def _row(name: str, rounds: list[dict[str, Fit]], baseline: str, boosted: str, setup: str) -> Row:
    ratios = [fits[baseline]["seconds"] / fits[boosted]["seconds"] for fits in rounds]
    middle = rounds[ratios.index(statistics.median_low(ratios))]
    detail = f"{setup}; ratios {', '.join(f'{r:.2f}' for r in ratios)}; the median round: " + "; ".join(
        _describe(mode, fit) for mode, fit in middle.items()
    )
    return Row(name, statistics.median(ratios), detail, COMMAND)


def _describe(mode: str, fit: Fit) -> str:
    checks = ", ".join(f"{r:.2f}" for r in fit["rechecks"]) or "none"
    switched = "" if fit["switched_at"] is None else f", fp32 from batch {fit['switched_at']}"
    return (
        f"{mode} {fit['seconds']:.1f} s in {fit['precision']} (check pairs fp32/bf16: {checks}{switched}),"
        f" val accuracy {fit['accuracy']:.4f}"
    )
