"""Check the machine, then train with the precision it fits and keep the report with the logs.

python examples/quickstart.py --root logs --steps 20
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lightning_boost import HardwareInfo, Severity, auto_precision
from lightning_boost.doctor import run_checks
from lightning_boost.testing import BoringDataModule, BoringModel


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default="lightning_logs", help="where logs and the report go")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    args = parser.parse_args(argv)

    hardware = HardwareInfo.detect()
    report = run_checks(hardware)
    for finding in report.findings:
        print(
            f"{finding.severity.label:4}  {finding.title}" + (f"  ->  {finding.fix}" if finding.fix else "")
        )
    if report.worst is Severity.ERROR:
        return 1  # fix the environment first: training now would waste the GPU

    trainer = L.Trainer(
        precision=auto_precision(hardware),  # type: ignore[arg-type]
        max_steps=args.steps,
        logger=CSVLogger(args.root, name="quickstart"),
        log_every_n_steps=5,
        enable_progress_bar=False,
    )
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    json_path, _ = report.write(trainer.log_dir or args.root)
    print(f"report: {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
