"""Run the benchmarks and rewrite the table in benchmarks/RESULTS.md.

Usage: ``python -m benchmarks [NAME ...]`` (all when no name is given; ``make bench``).
Rows of benchmarks not run this time are kept as they were.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
from pathlib import Path

from benchmarks.common import Row, machine
from lightning_boost._validation import unknown_choice_error
from lightning_boost.hardware import HardwareInfo

BENCHMARKS = (
    "time_to_quality",
    "demo_cold",
    "fast_dev_run",
    "demo_workload",
    "compute_bound",
    "data_bound",
    "eval_pass",
    "worker_replay",
    "checked_steps",
    "batch_size",
    "gpu_batch_size",
    "cudnn_autotune",
    "checkpoint_saves",
    "noise_scale",
    "batch_quality",
    "monitor_overhead",
    "guard_overhead",
    "micro_batch",
    "diagnosis",
    "arguments",
)
RESULTS = Path(__file__).with_name("RESULTS.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADER = "| benchmark | ratio | detail | command | machine | date |\n| --- | --- | --- | --- | --- | --- |"


def _format(row: Row, where: str, when: str) -> str:
    return f"| {row.benchmark} | {row.ratio:.2f}x | {row.detail} | `{row.command}` | {where} | {when} |"


def update_results(text: str, new_rows: dict[str, str]) -> str:
    """Replace the rows of the benchmarks just run (matched by name) inside the markers."""
    head, _, rest = text.partition(BEGIN)
    old_table, _, tail = rest.partition(END)
    lines = [line for line in old_table.splitlines() if line.startswith("| ") and line not in HEADER]
    rows = {line.split("|")[1].strip(): line for line in lines}
    rows.update(new_rows)
    body = "\n".join([HEADER, *rows.values()])
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(BENCHMARKS)}")
    names = parser.parse_args().names or list(BENCHMARKS)
    for name in names:
        if name not in BENCHMARKS:
            raise unknown_choice_error("NAME", name, BENCHMARKS)
    where = machine(HardwareInfo.detect())
    when = dt.date.today().isoformat()
    new_rows: dict[str, str] = {}
    for name in names:
        for row in importlib.import_module(f"benchmarks.{name}").run():
            print(f"{row.benchmark}: {row.ratio:.2f}x ({row.detail})")
            new_rows[row.benchmark] = _format(row, where, when)
    RESULTS.write_text(update_results(RESULTS.read_text(), new_rows))
    print(f"updated {RESULTS}")


if __name__ == "__main__":
    main()
