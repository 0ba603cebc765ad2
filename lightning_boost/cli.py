"""The ``lightning-boost`` command: parses, calls, prints. Logic lives in the modules it calls."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_boost import __version__

if TYPE_CHECKING:
    from lightning_boost.report import Report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-boost", description="Fast PyTorch Lightning training, measured."
    )
    parser.add_argument("--version", action="version", version=f"lightning-boost {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = commands.add_parser("doctor", help="check this machine before training")
    doctor.add_argument("--json", action="store_true", help="print machine-readable JSON")
    demo = commands.add_parser(
        "demo", help="ResNet-18 trained with plain Lightning, then boosted, side by side"
    )
    demo.add_argument("--samples", type=int, default=8192, help="images per epoch (default 8192)")
    demo.add_argument("--epochs", type=int, default=2, help="epochs per fit (default 2)")
    demo.add_argument("--batch-size", type=int, default=64, help="the plain run's batch size (default 64)")
    demo.add_argument(
        "--data", default=None, help="a directory holding CIFAR-10 (default: learnable images made here)"
    )
    demo.add_argument("--root", default="lightning_logs_demo", help="where logs and the report go")
    plots = commands.add_parser("plots", help="draw a report's plots (a short fit leaves them undrawn)")
    plots.add_argument("dir", help="the directory that holds boost_report.json (the run's log directory)")
    return parser


def _print_report(report: Report, title: str) -> None:
    from lightning_boost.report import Severity, make_console

    console = make_console()
    report.print_to(console, title)
    counts = {s: sum(f.severity is s for f in report.findings) for s in Severity}
    console.print(", ".join(f"{n} {s.label}" for s, n in counts.items()))


def _print_side_by_side(rows: list[tuple[str, str, str]], report: object, note: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("", "plain Lightning", "lightning-boost", title="ResNet-18, same images, same epochs")
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"report: {report} (and boost_report.md beside it)")
    if note is not None:
        console.print(note, markup=False)


def doctor(as_json: bool) -> int:
    """Run the checks on the real machine; exit status 1 when any check FAILs."""
    from lightning_boost.doctor import run_checks, versions
    from lightning_boost.hardware import HardwareInfo
    from lightning_boost.report import Severity

    hardware = HardwareInfo.detect()
    report = run_checks(hardware)
    if as_json:
        print(
            json.dumps({"versions": versions(), "hardware": hardware.to_dict(), **report.to_dict()}, indent=2)
        )
    else:
        _print_report(report, "lightning-boost doctor")
    return 1 if report.worst is Severity.ERROR else 0


DEMO_INSTALL = "pip install 'lightning-boost[demo]'  (or: pip install torchvision)"


def demo(args: argparse.Namespace) -> int:
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        print(f"The demo trains torchvision's ResNet-18, and torchvision is not installed: {DEMO_INSTALL}")
        return 2
    from lightning_boost.demo import kept_plain_settings, run_demo, side_by_side

    plain, boosted = run_demo(  # the boosted fit's report prints its own table first
        samples=args.samples,
        epochs=args.epochs,
        root=args.root,
        batch_size=args.batch_size,
        data_dir=args.data,
    )
    _print_side_by_side(side_by_side(plain, boosted), boosted.report, kept_plain_settings(plain, boosted))
    return 0


def plots(directory: str) -> int:
    """Draw the plots of the report in `directory` beside it; exit status 2 when it cannot."""
    from lightning_boost.report.plots import INSTALL_HINT, redraw

    try:
        drawn = redraw(directory)
    except FileNotFoundError:
        print(f"No boost_report.json in {directory}: pass the directory a BoostReport wrote it to.")
        return 2
    except ModuleNotFoundError:
        print(f"Drawing the plots needs matplotlib: {INSTALL_HINT}")
        return 2
    print("\n".join(str(path) for path in drawn) or f"The report in {directory} has nothing to plot.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        return doctor(args.json)
    if args.command == "plots":
        return plots(args.dir)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
