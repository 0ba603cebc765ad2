"""Five of Lightning's own example programs, run with lightning-boost added the README's way.

The programs in ``upstream/`` are Lightning's (github.com/Lightning-AI/pytorch-lightning,
``examples/pytorch`` at commit 7f0c3436cd3f, Apache License 2.0, their headers kept), copied as
they are. Only their data is made here, in the formats their own loading code reads (nothing is
downloaded): MNIST's IDX files for torchvision's ``MNIST``, a text file for ``WikiText2``, PNG
folders for ``ImageFolder``. The three LightningCLI programs get the pack and their run length
from the command line (``--trainer.callbacks+=lightning_boost.AutoBatchSize`` and the guards); the
two that build their ``Trainer`` in code have that line changed, marked
``# lightning-boost corpus``: ``callbacks=[*boost_callbacks(), AutoBatchSize()]``, and the run's
length (the transformer 2 epochs for 20, the GAN 200 steps on ``accelerator="cpu"`` for ``"gpu"``).
The tests run them; ruff leaves them as upstream wrote them.

`run` runs one in a directory of its own (its relative data paths resolve there) and returns the
trainers it fitted, whose reports hold the findings `tests/test_public_programs.py` checks.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from PIL import Image

UPSTREAM = Path(__file__).parent / "upstream"

#: The pack on a LightningCLI command line: `boost_callbacks()`'s guards and monitor, and `AutoBatchSize`.
PACK_ARGS = tuple(
    f"--trainer.callbacks+=lightning_boost.{name}"
    for name in ("AutoBatchSize", "SyncGuard", "LossLoggingGuard", "StepTimeMonitor")
)


@dataclass(frozen=True)
class Program:
    """One upstream program: its file, where Lightning's tree has it, its arguments and its data."""

    name: str
    folder: str
    args: tuple[str, ...]
    data: Callable[[Path], None]


def write_mnist(folder: Path, train: int = 60_000, test: int = 10_000) -> None:
    """MNIST's four IDX files (as torchvision's ``MNIST`` reads them from ``MNIST/raw``): 28x28
    digits made of one blurred pattern per class plus noise, so a model has something to learn."""
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    patterns = torch.nn.functional.interpolate(torch.rand(10, 1, 7, 7, generator=generator), size=28)[:, 0]
    for prefix, count in (("train", train), ("t10k", test)):
        labels = torch.randint(10, (count,), generator=generator)
        images = patterns[labels] * 200 + torch.rand(count, 28, 28, generator=generator) * 55
        _idx(raw / f"{prefix}-images-idx3-ubyte", 2051, images.to(torch.uint8))
        _idx(raw / f"{prefix}-labels-idx1-ubyte", 2049, labels.to(torch.uint8))


def _idx(path: Path, magic: int, values: torch.Tensor) -> None:
    header = struct.pack(f">{1 + values.dim()}i", magic, *values.shape)
    path.write_bytes(header + values.numpy().tobytes())


def write_wikitext(folder: Path, blocks: int = 4_110, block_size: int = 35) -> None:
    """``wikitext-2.txt`` as ``WikiText2`` reads it: lines of words from a 64-word vocabulary in
    which each word mostly follows from the one before (a language model can learn it); enough
    words for the program's fixed 2,000-block validation and test splits and 110 training blocks."""
    generator = torch.Generator().manual_seed(0)
    following = torch.randint(64, (64, 3), generator=generator)
    words, word = [], 0
    for _ in range(blocks * block_size):
        word = int(following[word, int(torch.randint(3, (), generator=generator))])
        words.append(f"w{word}")
    lines = [" ".join(words[start : start + 20]) for start in range(0, len(words), 20)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wikitext-2.txt").write_text("\n".join(lines) + "\n", encoding="utf8")


def write_image_folders(folder: Path, train: int = 16, val: int = 8) -> None:
    """``train/`` and ``val/`` folders of two classes of 64x64 PNGs, for ``ImageFolder``."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", train), ("val", val)):
        for label, colour in enumerate(("red", "blue")):
            classes = folder / split / colour
            classes.mkdir(parents=True, exist_ok=True)
            for k in range(count // 2):
                pixels = torch.rand(64, 64, 3, generator=generator) * 80
                pixels[..., 0 if label == 0 else 2] += 150
                Image.fromarray(pixels.to(torch.uint8).numpy()).save(classes / f"{k}.png")


def _mnist_both(root: Path) -> None:
    # Lightning's `MNIST` helper first opens torchvision's at "./data", then the program's own path
    for folder in (root / "data", root / "examples" / "Datasets"):
        write_mnist(folder)


ON_CPU = ("--trainer.accelerator=cpu", "--trainer.devices=1")

PROGRAMS: dict[str, Program] = {
    program.name: program
    for program in (
        Program("autoencoder", "basics", (*ON_CPU, "--trainer.max_epochs=1", *PACK_ARGS), _mnist_both),
        Program(
            "backbone_image_classifier",
            "basics",
            (*ON_CPU, "--trainer.max_epochs=1", *PACK_ARGS),
            _mnist_both,
        ),
        Program("transformer", "basics", (), lambda root: write_wikitext(root / "data")),
        Program(
            "generative_adversarial_net", "domain_templates", (), lambda root: write_mnist(root / "data")
        ),
        Program(
            "imagenet",
            "domain_templates",
            (
                "fit",
                *ON_CPU,
                "--trainer.max_epochs=1",
                "--model.data_path=imagenet",
                "--model.batch_size=4",
                "--model.workers=0",
                *PACK_ARGS,
            ),
            lambda root: write_image_folders(root / "imagenet"),
        ),
    )
}


def run(name: str, root: Path) -> list[L.Trainer]:
    """Run program `name` as ``python <program> <args>`` would, in `root` (which it fills with its
    copy, its data and its outputs); return every trainer it fitted, in order."""
    program = PROGRAMS[name]
    source = UPSTREAM / f"{name}.py"
    place = root / "examples" / "pytorch" / program.folder
    place.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, place / source.name)
    program.data(root)
    with _inside(root, [str(place / source.name), *program.args]), _fitted() as trainers:
        runpy.run_path(str(place / source.name), run_name="__main__")
    return trainers


@contextlib.contextmanager
def _inside(root: Path, argv: list[str]) -> Iterator[None]:
    before, cwd = sys.argv, Path.cwd()
    os.chdir(root)
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = before
        os.chdir(cwd)


@contextlib.contextmanager
def _fitted() -> Iterator[list[L.Trainer]]:
    """Record each trainer whose `fit` the program calls (the call itself unchanged)."""
    trainers: list[L.Trainer] = []
    original = L.Trainer.fit

    def fit(self: L.Trainer, *args: Any, **kwargs: Any) -> None:
        trainers.append(self)
        original(self, *args, **kwargs)

    L.Trainer.fit = fit  # type: ignore[method-assign]
    try:
        yield trainers
    finally:
        L.Trainer.fit = original  # type: ignore[method-assign]
