"""Findings and the report that renders them: the one place lightning-boost's output goes.

Every boost part returns what it found as `Finding` objects; a `Report` collects them with the
values the run was tuned to and renders them once: a console table, a JSON document with a stable
schema (documented in docs/report.md), and Markdown. The `BoostReport` callback builds one at the end
of each fit. Nothing in the package prints on its own.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import shutil
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from lightning_boost._files import atomic_write_text
from lightning_boost._validation import validated

#: Bumped on any incompatible change to the JSON written by `Report.to_dict`.
SCHEMA_VERSION = 1

#: Report sections, in display order.
Area = Literal[
    "environment",
    "data",
    "batch size",
    "precision and strategy",
    "syncs",
    "retained graphs",
    "step time",
]
AREAS: tuple[str, ...] = get_args(Area)


@runtime_checkable
class ReportsFindings(Protocol):
    """A part of a run the report reads findings from: every boost callback, a `BoostedDataModule`,
    a preset's strategy."""

    @property
    def findings(self) -> Sequence[Finding]: ...


@runtime_checkable
class ReportsTuned(Protocol):
    """A part of a run that set values the run trains with (``batch_size``, a preset's flags, ...)."""

    @property
    def tuned(self) -> Mapping[str, Any]: ...


class BoostWarning(UserWarning):
    """The category of every warning lightning-boost issues (filter it like any other)."""


class Severity(str, Enum):
    """How much a finding matters: ``info`` (all is well, or a fact), ``warn``, ``error``."""

    INFO = "info"
    WARN = "warn"
    ERROR = "error"

    @property
    def label(self) -> str:
        """The status word shown to users: OK, WARN or FAIL."""
        return {"info": "OK", "warn": "WARN", "error": "FAIL"}[self.value]


@validated
@dataclass(frozen=True)
class Finding:
    """One thing a boost part found, with the fix.

    Args:
        source: what found it, e.g. ``"doctor"`` or ``"SyncGuard"``.
        area: the report section, one of `AREAS`.
        severity: a `Severity` or its value (``"info"``, ``"warn"``, ``"error"``).
        title: one line saying what was found.
        detail: the evidence, measured figures included.
        fix: what to do about it; empty when nothing needs doing.
        location: ``file:line`` in the user's code, when there is one.
        data: JSON-ready figures behind the finding; a ``"plot"`` entry made by `plot_data`
            becomes a PNG in the report. A NaN or infinite number is kept as ``None``: JSON has no
            such number, and the report stays valid JSON.
        cost: what it costs or cost to find, where measured (``"41% of step time"``,
            ``"3.1 s tuning"``); empty when not measured.

    Example:
        >>> f = Finding("doctor", "environment", "warn", "/dev/shm is 64 MiB", fix="--ipc=host")
        >>> f.severity.label
        'WARN'
    """

    source: str
    area: Area
    severity: Severity
    title: str
    detail: str = ""
    fix: str = ""
    location: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    cost: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "severity", Severity(self.severity))
        object.__setattr__(self, "data", _json_ready(self.data))

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "area": self.area,
            "severity": self.severity.value,
            "title": self.title,
            "detail": self.detail,
            "fix": self.fix,
            "location": self.location,
            "cost": self.cost,
            "data": dict(self.data),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        return cls(
            source=data["source"],
            area=data["area"],
            severity=Severity(data["severity"]),
            title=data["title"],
            detail=data.get("detail", ""),
            fix=data.get("fix", ""),
            location=data.get("location"),
            data=data.get("data", {}),
            cost=data.get("cost", ""),
        )


@validated
@dataclass
class Report:
    """Findings from every boost part and the values they tuned, rendered once.

    Args:
        findings: what was found, in the order found.
        tuned: the settings the run used (``batch_size``, ``num_workers``, ``precision`` ...).
        plots: file names of the PNGs written beside the report.

    Example:
        >>> report = Report()
        >>> report.add([Finding("doctor", "environment", "info", "CPU only")])
        >>> report.worst
        <Severity.INFO: 'info'>
    """

    findings: list[Finding] = field(default_factory=list)
    tuned: dict[str, Any] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)

    def add(self, findings: Iterable[Finding]) -> None:
        """Append findings, dropping exact duplicates (the same cause reported twice)."""
        for finding in findings:
            if finding not in self.findings:
                self.findings.append(finding)

    @property
    def worst(self) -> Severity | None:
        order = list(Severity)
        return max((f.severity for f in self.findings), key=order.index, default=None)

    def by_area(self) -> list[tuple[str, list[Finding]]]:
        """Findings grouped by area, in `AREAS` order, empty areas left out."""
        groups = [(area, [f for f in self.findings if f.area == area]) for area in AREAS]
        return [(area, found) for area, found in groups if found]

    def to_dict(self) -> dict[str, Any]:
        """The JSON document; the "Report files" section of docs/report.md documents every key."""
        from lightning_boost import __version__

        return {
            "schema_version": SCHEMA_VERSION,
            "lightning_boost_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "tuned": dict(self.tuned),
            "plots": list(self.plots),
            "findings": [f.to_dict() for f in self.findings],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str)

    def to_markdown(self) -> str:
        lines = ["# lightning-boost report", ""]
        if self.tuned:
            lines += ["## Tuned values", "", "| setting | value |", "| --- | --- |"]
            lines += [f"| {key} | {_md(value)} |" for key, value in self.tuned.items()]
            lines.append("")
        for area, found in self.by_area():
            lines += [
                f"## {area.capitalize()}",
                "",
                "| status | finding | cost | fix |",
                "| --- | --- | --- | --- |",
            ]
            for f in found:
                what = f.title + (f" ({f.detail})" if f.detail else "")
                what += f" at `{f.location}`" if f.location else ""
                lines.append(f"| {f.severity.label} | {_md(what)} | {_md(f.cost)} | {_md(f.fix)} |")
            lines.append("")
        if self.plots:
            lines += ["## Plots", ""] + [f"![{Path(name).stem}]({name})" for name in self.plots] + [""]
        return "\n".join(lines)

    def table(self, title: str = "lightning-boost") -> Any:
        """A `rich.table.Table` of the findings, grouped by area (rich ships with Lightning)."""
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=title, show_lines=False, expand=False)
        table.add_column("area", style="bold")
        table.add_column("status")
        table.add_column("finding", overflow="fold")
        optional = [name for name in ("cost", "fix") if any(getattr(f, name) for f in self.findings)]
        for name in optional:
            table.add_column(name, overflow="fold")
        styles = {Severity.INFO: "green", Severity.WARN: "yellow", Severity.ERROR: "bold red"}
        for area, found in self.by_area():
            for index, f in enumerate(found):
                # the findings' own text is plain: `[plots]` in a fix is not rich markup
                text = _split_detail(f.detail)[0]  # a block (a trial table) prints below the table
                what = escape(f.title) + (f"\n[dim]{escape(text)}[/dim]" if text else "")
                what += f"\n[dim]at {escape(f.location)}[/dim]" if f.location else ""
                label = f"[{styles[f.severity]}]{f.severity.label}[/]"
                texts = [escape(getattr(f, name)) for name in optional]
                cells = [area if index == 0 else "", label, what, *texts]
                table.add_row(*cells)
        return table

    def to_text(self, width: int = 80, title: str = "lightning-boost report") -> str:
        """The compact form, for narrow consoles and CI logs: a line per finding, wrapped to
        `width`; a WARN or FAIL adds its detail, location and fix (the files have everything).

        Example:
            >>> report = Report([Finding("doctor", "data", "warn", "slow loader", fix="pip x[plots]")])
            >>> print(report.to_text())
            lightning-boost report: 1 WARN
            data
              WARN slow loader
                   fix: pip x[plots]
        """
        counts = [(s, sum(f.severity is s for f in self.findings)) for s in reversed(Severity)]
        lines = [f"{title}: " + ", ".join(f"{n} {s.label}" for s, n in counts if n)]
        indent = " " * 7
        for area, found in self.by_area():
            lines.append(area)
            for f in found:
                head = f"{f.severity.label:<4} {f.title}" + (f" ({f.cost})" if f.cost else "")
                lines += textwrap.wrap(head, width, initial_indent="  ", subsequent_indent=indent)
                if f.severity is Severity.INFO:
                    continue
                text, block = _split_detail(f.detail)
                lines += textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent)
                lines += [indent + line for line in block.splitlines()]  # a table keeps its columns
                for extra in (f"at {f.location}" if f.location else "", f"fix: {f.fix}" if f.fix else ""):
                    lines += textwrap.wrap(extra, width, initial_indent=indent, subsequent_indent=indent)
        return "\n".join(lines)

    def print_to(self, console: Any, title: str = "lightning-boost report") -> None:
        """Print on `console` (`make_console`'s): the table on a rich terminal 100 columns wide or
        more, else `to_text`."""
        if not isinstance(console, PlainConsole) and console.is_terminal and console.width >= 100:
            console.print(self.table(title=title))
            for f in self.findings:  # blocks such as the batch-size trials: their own small tables
                block = _split_detail(f.detail)[1]
                if block:
                    console.print(f"{f.title}:\n{block}", markup=False, highlight=False)
        else:
            console.print(self.to_text(console.width, title), markup=False, highlight=False, soft_wrap=True)

    @classmethod
    def read(cls, path: str | Path) -> Report:
        """The report a `write` left in ``boost_report.json`` at `path`."""
        data = json.loads(Path(path).read_text())
        findings = [Finding.from_dict(finding) for finding in data.get("findings", [])]
        return cls(findings, dict(data.get("tuned", {})), list(data.get("plots", [])))

    def write(self, directory: str | Path) -> tuple[Path, Path]:
        """Write ``boost_report.json`` and ``boost_report.md`` atomically into `directory`."""
        directory = Path(directory)
        json_path = atomic_write_text(directory / "boost_report.json", self.to_json() + "\n")
        md_path = atomic_write_text(directory / "boost_report.md", self.to_markdown() + "\n")
        return json_path, md_path


def _split_detail(detail: str) -> tuple[str, str]:
    """A finding's detail as its prose and the preformatted block after its first line break."""
    text, _, block = detail.partition("\n")
    return text, block


class PlainConsole:
    """What the report prints on without rich: plain lines on stdout, as wide as the terminal."""

    def __init__(self) -> None:
        self.is_terminal = sys.stdout.isatty()
        self.width = shutil.get_terminal_size().columns

    def print(self, text: object = "", **_: Any) -> None:
        print(text)  # noqa: T201 - the console report is this class's whole job


def make_console() -> Any:
    """A rich ``Console`` when rich is installed (Lightning's `extra`, or `pip install rich`), else a
    `PlainConsole`: the pack does not depend on rich, because installing rich switches every
    plain ``Trainer`` in the environment to rich progress bars and summaries."""
    try:
        from rich.console import Console
    except ImportError:
        return PlainConsole()
    return Console()


def plot_data(
    name: str,
    title: str,
    x_label: str,
    x: Sequence[float],
    left: Mapping[str, Sequence[float]],
    right: Mapping[str, Sequence[float]] | None = None,
    chosen: float | None = None,
    reference: tuple[str, float] | None = None,
) -> dict[str, Any]:
    """A finding's ``data["plot"]``: the report draws it as ``boost_<name>.png``.

    Args:
        name: the file stem, letters, digits, ``_`` and ``-`` only.
        title: the plot's title.
        x_label: what the x axis is.
        x: the x values.
        left: series drawn against the left axis, by label; each as long as `x`.
        right: series drawn against a second axis on the right (e.g. peak memory).
        chosen: the x value that was chosen, marked with a vertical line.
        reference: ``(label, y)`` of a horizontal line on the left axis (e.g. a threshold).

    Raises:
        ValueError: for a bad `name` or a series whose length differs from `x`'s.

    Example:
        >>> plot_data("workers", "Throughput", "num_workers", [0, 1], {"samples/s": [10, 19]})["x"]
        [0, 1]
    """
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"`name` expected letters, digits, '_' or '-', got {name!r}.")
    series = {**left, **(right or {})}
    for label, values in series.items():
        if len(values) != len(x):
            raise ValueError(f"series {label!r} has {len(values)} values for {len(x)} x values.")
    return {
        "name": name,
        "title": title,
        "x_label": x_label,
        "x": list(x),
        "left": {label: list(values) for label, values in left.items()},
        "right": {label: list(values) for label, values in (right or {}).items()},
        "chosen": chosen,
        "reference": None if reference is None else {"label": reference[0], "value": reference[1]},
    }


def _md(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _json_ready(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf) replaced by ``None``, through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_json_ready(item) for item in value) if not hasattr(value, "_fields") else value
    return value
