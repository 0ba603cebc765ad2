"""Check the machine, then train with the precision it fits and the recommended boost callbacks.

The doctor's checks run first so a broken environment stops before it wastes a GPU; the
`BoostReport` that `boost_callbacks()` adds prints its table at the end of the fit and writes
``boost_report.json`` / ``.md`` (and plots, with matplotlib) next to the logs.

python examples/quickstart.py --root logs --steps 20
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lightning_boost import BoostReport, HardwareInfo, Severity, auto_precision, boost_callbacks
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

    callbacks = boost_callbacks()
    trainer = L.Trainer(
        precision=auto_precision(hardware),  # type: ignore[arg-type]
        callbacks=callbacks,
        max_steps=args.steps,
        logger=CSVLogger(args.root, name="quickstart"),
        log_every_n_steps=5,
        enable_progress_bar=False,
    )
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    (boost_report,) = [c for c in callbacks if isinstance(c, BoostReport)]
    print(f"report: {boost_report.paths[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
