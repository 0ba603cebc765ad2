"""Run the benchmarks and rewrite the table in benchmarks/RESULTS.md.

Usage: ``python -m benchmarks [NAME[:KEY=VALUE...] ...]`` (all when no name is given; ``make
bench``). ``KEY=VALUE`` pairs after a name are keyword arguments of that benchmark's ``run`` (a
Python literal, or else a string): ``python -m benchmarks data_bound:samples=8192:repeats=1``; its
rows then name that command. Rows of benchmarks not run this time are kept as they were.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime as dt
import importlib
import inspect
from pathlib import Path
from typing import Any

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
    "fit_val_set",
    "ddp",
    "autocast_recheck",
    "worker_replay",
    "checked_steps",
    "batch_size",
    "gpu_batch_size",
    "cudnn_autotune",
    "channels_last",
    "whole_batches",
    "checkpoint_saves",
    "noise_scale",
    "growth_moments",
    "grown_workers",
    "batch_quality",
    "monitor_overhead",
    "report_plots",
    "guard_overhead",
    "micro_batch",
    "stack_overhead",
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


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:KEY=VALUE...]`` as the benchmark's name and keyword arguments for its ``run``,
    checked against its signature before anything runs.

    Example:
        >>> parse_spec("data_bound:samples=8192:repeats=1")
        ('data_bound', {'samples': 8192, 'repeats': 1})
    """
    name, *pairs = spec.split(":")
    if name not in BENCHMARKS:
        raise unknown_choice_error("NAME", name, BENCHMARKS)
    kwargs = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or not key:
            raise ValueError(f"`{spec}`: write each argument after the name as KEY=VALUE: `{name}:KEY=VALUE`")
        kwargs[key] = _literal(text)
    accepted = inspect.signature(importlib.import_module(f"benchmarks.{name}").run).parameters
    for key in kwargs:
        if key not in accepted:
            raise unknown_choice_error(f"{name}'s argument", key, accepted)
    return name, kwargs


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument(
        "specs", nargs="*", metavar="NAME[:KEY=VALUE...]", help=f"any of {', '.join(BENCHMARKS)}"
    )
    specs = parser.parse_args().specs or list(BENCHMARKS)
    runs = [(spec, *parse_spec(spec)) for spec in specs]
    where = machine(HardwareInfo.detect())
    when = dt.date.today().isoformat()
    new_rows: dict[str, str] = {}
    for spec, name, kwargs in runs:
        module = importlib.import_module(f"benchmarks.{name}")
        for row in module.run(**kwargs):
            if kwargs and row.command == module.COMMAND:
                row = dataclasses.replace(row, command=f"python -m benchmarks {spec}")
            print(f"{row.benchmark}: {row.ratio:.2f}x ({row.detail})")
            new_rows[row.benchmark] = _format(row, where, when)
    RESULTS.write_text(update_results(RESULTS.read_text(), new_rows))
    print(f"updated {RESULTS}")


if __name__ == "__main__":
    main()
