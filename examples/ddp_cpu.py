"""`preset("fast-ddp")` on 2 CPU processes over gloo: the same code runs on 8 GPUs with NCCL and AMP.

    python examples/ddp_cpu.py --devices 2 --steps 8 [--out DIR]

Lightning starts the second process by re-running this script (the preset's ``popen`` start
method), so keep the training under ``if __name__ == "__main__":``. With ``--out``, each rank
writes what the live trainer actually runs with to ``DIR/rank{N}.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch

from lightning_boost import preset
from lightning_boost.testing import BoringDataModule, BoringModel


def live_settings(trainer: L.Trainer) -> dict[str, object]:
    """What the running trainer uses, read from its live objects (not from the preset)."""
    ddp = trainer.strategy.model
    return {
        "strategy": type(trainer.strategy).__name__,
        "precision": trainer.precision,
        "backend": torch.distributed.get_backend(),
        "world_size": trainer.world_size,
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
        "static_graph": ddp.static_graph,
        "batched_grad_copy": getattr(ddp, "batched_grad_copy", None),
    }


class RecordSettings(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = live_settings(trainer)
        record["weights"] = {k: v.tolist() for k, v in pl_module.state_dict().items()}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fast-ddp on CPU processes")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="write each rank's live settings here")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    strategy = preset("fast-ddp")  # DDPStrategy, gloo on CPU, fast flags, 32-true on CPU
    callbacks = [RecordSettings(args.out)] if args.out else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    if trainer.is_global_zero:
        for finding in strategy.findings:
            print(f"{finding.title}: {finding.detail}")


if __name__ == "__main__":
    main()
