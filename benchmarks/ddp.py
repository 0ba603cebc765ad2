"""``preset("fast-ddp")`` against the DDP a Lightning user writes first: time to the same model.

Two CPU processes over gloo train the same MLP (32 -> 1024 -> 1024 -> 10, 1.1 M parameters, so
each step all-reduces 4.4 MB of gradients; Adam) on `time_to_quality`'s classification task
(labels from a noisy linear teacher) with the same DataLoaders: plain Lightning's
``Trainer(strategy="ddp_spawn")`` and ``preset("fast-ddp", start_method="spawn")`` (the preset
starts its processes with ``popen`` by default, which re-runs the calling script; spawn lets one
process run every fit), the order rotating between rounds. Each fit's time is rank zero's,
from its set-up to the end of training: what the preset measures before the first step counts,
the processes' start (the same for both) does not. A second row holds the preset at fp32: its
DDP flags alone, which leave the arithmetic as it is (the same weights as plain's, checked by
hand), where the preset's own precision is bf16 autocast wherever its CPU trial times it faster.
Each ratio is the median round's plain time over the preset's (above 1: the preset trains
sooner), beside both final validation accuracies: a speed-up counts only at plain's accuracy.
Run: ``python -m benchmarks ddp``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks.common import Row, rotated
from benchmarks.time_to_quality import MLP, classes
from lightning_boost import preset
from lightning_boost.hardware import HardwareInfo
from lightning_boost.testing import cpu_only

COMMAND = "python -m benchmarks ddp"


class WideMLP(MLP):
    """`time_to_quality`'s MLP, wider: its gradients are large next to its compute, so DDP's
    all-reduce is a real share of the step."""

    def __init__(self) -> None:
        super().__init__()
        width = 1024
        self.net = nn.Sequential(
            nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )


class _TrainingTime(L.Callback):
    """Rank zero's seconds from its set-up (its process started, the preset's trials to come) to
    the end of training, and the precision it trained in (the preset's CPU trial decides it in
    the processes, not in the one that made the trainer), into `path` as JSON."""

    def __init__(self, path: Path) -> None:
        self.path, self.started = path, 0.0

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.started = time.perf_counter()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            seconds = time.perf_counter() - self.started
            self.path.write_text(json.dumps({"seconds": seconds, "precision": str(trainer.precision)}))


#: The fits of a round: Lightning's DDP, the preset, and the preset held at fp32 (its DDP flags alone).
KINDS = ("plain", "preset", "preset at 32-true")


def _strategy(kind: str) -> Any:
    if kind == "plain":
        return "ddp_spawn"
    fixed = {"precision": "32-true"} if kind == "preset at 32-true" else {}
    hardware = HardwareInfo.detect().on_cpu()  # the run's CPU processes, on a GPU machine too
    return preset("fast-ddp", hardware=hardware, start_method="spawn", **fixed)


def _fit(kind: str, samples: int, epochs: int, root: Path) -> tuple[float, float, str]:
    """Rank zero's seconds from set-up to the end of training, the final validation accuracy, and
    the strategy in words."""
    timing = root / f"seconds-{time.monotonic_ns()}"
    L.seed_everything(0, verbose=False)
    with cpu_only():
        trainer = _trainer(kind, epochs, root, timing)
    train = DataLoader(classes(samples, seed=0), batch_size=64, shuffle=True)
    val = DataLoader(classes(2048, seed=1), batch_size=256)
    trainer.fit(WideMLP(), train, val)
    rank_zero = json.loads(timing.read_text())
    kwargs = getattr(trainer.strategy, "_ddp_kwargs", {})
    flags = ", ".join(f"{key}={value}" for key, value in sorted(kwargs.items())) or "DDP's defaults"
    described = f"{rank_zero['precision']}, {flags}"
    return rank_zero["seconds"], float(trainer.callback_metrics["val_acc"]), described


def _trainer(kind: str, epochs: int, root: Path, timing: Path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy(kind),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[_TrainingTime(timing)],
        default_root_dir=str(root),
    )


def run(samples: int = 16384, epochs: int = 2, rounds: int = 3) -> list[Row]:
    """One row for the preset and one for its DDP flags alone, each against plain Lightning's DDP
    in the same rounds (the order of a round's three fits rotating)."""
    fits: dict[str, list[tuple[float, float, str]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as root:
        for turn in range(rounds):
            for kind in rotated(KINDS, turn):
                fits[kind].append(_fit(kind, samples, epochs, Path(root)))
    return [_row(kind, fits["plain"], fits[kind], samples, epochs) for kind in KINDS[1:]]


def _row(
    kind: str,
    plain: list[tuple[float, float, str]],
    tuned: list[tuple[float, float, str]],
    samples: int,
    epochs: int,
) -> Row:
    ratios = [p[0] / t[0] for p, t in zip(plain, tuned, strict=True)]
    median = sorted(range(len(ratios)), key=lambda i: ratios[i])[len(ratios) // 2]
    finals = ", ".join(f"{p[1]:.4f} / {t[1]:.4f}" for p, t in zip(plain, tuned, strict=True))
    name = "preset('fast-ddp')" if kind == "preset" else "preset('fast-ddp', precision='32-true')"
    return Row(
        f"{name} / Lightning's ddp_spawn, 2 CPU processes: fit time (both val accuracies in the detail)",
        ratios[median],
        f"median of {len(ratios)} rounds (ratios {', '.join(f'{r:.2f}' for r in ratios)}); the median"
        f" round trained in {plain[median][0]:.1f} s plain, {tuned[median][0]:.1f} s with the preset; val"
        f" accuracy plain / preset per round: {finals}; {samples} samples x {epochs} epochs, batch 64 a"
        f" process, Adam; plain ran {plain[0][2]}; the preset ran {tuned[0][2]}",
        COMMAND,
    )
