"""The ``lightning-boost`` command: parses, calls, prints. Logic lives in the modules it calls."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_boost.report import Report, Severity


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-boost", description="Fast PyTorch Lightning training, measured."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = commands.add_parser("doctor", help="check this machine before training")
    doctor.add_argument("--json", action="store_true", help="print machine-readable JSON")
    demo = commands.add_parser("demo", help="a short boosted fit on FakeData and its report")
    demo.add_argument("--samples", type=int, default=2048, help="FakeData images (default 2048)")
    demo.add_argument("--epochs", type=int, default=2, help="epochs to train (default 2)")
    demo.add_argument("--root", default="lightning_logs_demo", help="where logs and the report go")
    return parser


def _print_report(report: Report, title: str) -> None:
    from rich.console import Console

    console = Console()
    console.print(report.table(title=title))
    counts = {s: sum(f.severity is s for f in report.findings) for s in Severity}
    console.print(", ".join(f"{n} {s.label}" for s, n in counts.items()))


def _print_summary(summary: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("setting", "value", title="run")
    for key, value in summary.items():
        table.add_row(key, str(value))
    Console().print(table)


def doctor(as_json: bool) -> int:
    """Run the checks on the real machine; exit status 1 when any check FAILs."""
    from lightning_boost.doctor import run_checks
    from lightning_boost.hardware import HardwareInfo

    hardware = HardwareInfo.detect()
    report = run_checks(hardware)
    if as_json:
        print(json.dumps({"hardware": hardware.to_dict(), **report.to_dict()}, indent=2))
    else:
        _print_report(report, "lightning-boost doctor")
    return 1 if report.worst is Severity.ERROR else 0


def demo(samples: int, epochs: int, root: str) -> int:
    from lightning_boost.demo import run_demo

    _, summary = run_demo(samples=samples, epochs=epochs, root=root)  # the report prints its table
    _print_summary(summary)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        return doctor(args.json)
    return demo(args.samples, args.epochs, args.root)


if __name__ == "__main__":
    sys.exit(main())
