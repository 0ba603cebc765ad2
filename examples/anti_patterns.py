"""The classic mistakes that make training slow, and what lightning-boost says about each.

`LeakyModule` keeps every loss with its autograd graph, reads the loss with ``.item()`` and
prints it every step, empties the CUDA cache in the step, indexes with a boolean mask and feeds
itself from a ``num_workers=0`` DataLoader that augments every image on the CPU. Trained with
`boost_callbacks()`, the guards warn at each of those lines while it runs (``BoostWarning``, on
stderr) and the report lists them with the fix; `AutoNumWorkers` measures the loader and
replaces its worker count with the fastest it finds. This runs on a CPU: the sync guard reports
what would make the host wait on a GPU. Every mistake is marked ``# mistake:`` below.

python examples/anti_patterns.py --root logs --steps 8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import FakeData

from lightning_boost import BoostReport, Finding, boost_callbacks


class LeakyModule(L.LightningModule):
    """A small CNN on 32x32 images, written the way that costs the most."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(16 * 16, 10),
        )
        self.losses: list[Tensor] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self.net(images)
        loss = nn.functional.cross_entropy(logits, labels)
        self.losses.append(loss)  # mistake: keeps the graph
        print(f"step {batch_idx}: loss {loss.item():.4f}")  # mistake: .item() every step
        print(loss)  # mistake: print a tensor
        torch.cuda.empty_cache()  # mistake: empty_cache in the step
        confident = logits.detach().softmax(-1).amax(-1)
        self.log("confident_logit", logits.detach()[confident > 0.2].mean())  # mistake: mask indexing
        return loss

    def train_dataloader(self) -> DataLoader[Any]:
        augment = T.Compose(
            [
                T.RandomCrop(32, padding=4),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize((0.5,) * 3, (0.5,) * 3),
            ]
        )
        images = FakeData(size=2048, image_size=(3, 32, 32), num_classes=10, transform=augment)
        return DataLoader(images, batch_size=32, shuffle=True, num_workers=0)  # mistake: no workers

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def explain(findings: Sequence[Finding]) -> list[str]:
    """One block per finding the guards and the worker tuner made: where, what, and the fix."""
    lines = []
    for finding in findings:
        if finding.area not in ("syncs", "retained graphs", "data"):
            continue
        where = f"{finding.location}\n    " if finding.location else ""
        lines.append(f"[{finding.severity.label}] {where}{finding.title}")
        if finding.fix:
            lines.append(f"    fix: {finding.fix}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default="lightning_logs", help="where logs and the report go")
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    args = parser.parse_args(argv)

    callbacks = boost_callbacks(boost_report={"console": False})
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        callbacks=callbacks,
        logger=CSVLogger(args.root, name="anti_patterns"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(LeakyModule())
    (report,) = [c for c in callbacks if isinstance(c, BoostReport)]
    assert report.report is not None
    print("\nWhat lightning-boost found:\n")
    print("\n".join(explain(report.report.findings)))
    print(f"\nreport: {report.paths[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
