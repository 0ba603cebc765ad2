"""PNG plots for the report, where a picture beats a table (matplotlib is an optional extra).

A finding asks for a plot by carrying ``data["plot"]`` made with `lightning_boost.report.plot_data`:
throughput vs ``num_workers``, throughput and peak memory vs batch size, the data-wait fraction over
steps. `write_plots` draws each one with matplotlib's object API (no pyplot, so the user's backend
and figures are left alone). Drawing is not free (`drawing_s`): a fit that did not ask for plots
gets them when they cost at most `PLOT_BUDGET` of its wall time (`plots_fit`), and
``lightning-boost plots DIR`` draws them from the report afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning_boost.report import Finding, Report, Severity

#: What the report says when matplotlib is missing.
INSTALL_HINT = "pip install 'lightning-boost[plots]'  (or: pip install matplotlib)"

#: Seconds drawing takes on the 2-CPU development host: matplotlib's import (by hand, in a process
#: without Lightning: ``import lightning`` imports matplotlib through torchmetrics where it is
#: installed, so a fit seldom pays it), and each plot (``python -m benchmarks report_plots``).
IMPORT_S, PLOT_S = 0.5, 0.15
#: The share of a fit's wall time the plots may take when nobody asked for them: 3 plots take
#: 0.45 s, so a 30 s fit (1.5 %) draws none and a 1-minute fit (0.75 %) draws them.
PLOT_BUDGET = 0.01


def drawing_s(count: int) -> float:
    """About how long `count` plots take to draw in this process (the first pays the import)."""
    if not count:
        return 0.0
    return (0.0 if "matplotlib.figure" in sys.modules else IMPORT_S) + PLOT_S * count


def plots_fit(count: int, fit_s: float) -> bool:
    """Whether drawing `count` plots stays within `PLOT_BUDGET` of a fit that took `fit_s` seconds.

    Example:
        >>> plots_fit(2, fit_s=3600.0), plots_fit(0, fit_s=1.0), plots_fit(2, fit_s=10.0)
        (True, True, False)
    """
    return drawing_s(count) <= PLOT_BUDGET * fit_s


def plots_skipped(source: str, count: int, fit_s: float) -> Finding:
    """The finding that stands in for `count` plots left undrawn to keep a `fit_s`-second fit short."""
    cost = drawing_s(count)
    return Finding(
        source,
        "environment",
        Severity.INFO,
        f"Plots skipped: {count} plot(s) would take about {cost:.1f} s, {cost / fit_s:.0%} of this"
        f" {fit_s:.0f} s fit",
        f"Plots nobody asked for are drawn when they take at most {PLOT_BUDGET:.0%} of the fit; the"
        " report's JSON holds their data.",
        "`lightning-boost plots DIR` draws them from the report in DIR;"
        " `BoostReport(plots=True)` draws them on every fit",
        data={"plots": count, "estimated_s": round(cost, 2), "fit_s": round(fit_s, 2)},
    )


def plot_specs(findings: Iterable[Finding]) -> list[Mapping[str, Any]]:
    """The ``data["plot"]`` of each finding that has one, first one per name."""
    specs: dict[str, Mapping[str, Any]] = {}
    for finding in findings:
        spec = finding.data.get("plot")
        if isinstance(spec, Mapping) and spec.get("name") not in specs:
            specs[str(spec["name"])] = spec
    return list(specs.values())


def matplotlib_missing(source: str) -> Finding:
    """The finding that stands in for plots that could not be drawn."""
    return Finding(
        source,
        "environment",
        Severity.INFO,
        "Plots skipped: matplotlib is not installed",
        "The report's figures (throughput vs workers or batch size, data wait over steps) need it.",
        INSTALL_HINT,
    )


def write_plots(findings: Iterable[Finding], directory: str | Path) -> list[Path]:
    """Draw every plot the findings ask for as ``boost_<name>.png`` in `directory`.

    Raises:
        ModuleNotFoundError: when matplotlib is not installed (see `matplotlib_missing`).
    """
    specs = plot_specs(findings)
    if not specs:
        return []
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ModuleNotFoundError("matplotlib is not installed", name="matplotlib") from err
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [_draw(spec, directory / f"boost_{spec['name']}.png") for spec in specs]


def redraw(directory: str | Path) -> list[Path]:
    """Draw the plots of the report in `directory` (``boost_report.json``) beside it and write the
    report again with them, in place of a finding that said they were skipped.

    Raises:
        FileNotFoundError: when `directory` holds no ``boost_report.json``.
        ModuleNotFoundError: when matplotlib is not installed.
    """
    directory = Path(directory)
    report = Report.read(directory / "boost_report.json")
    plots = write_plots(report.findings, directory)
    report.findings = [f for f in report.findings if not f.title.startswith("Plots skipped")]
    report.plots = [path.name for path in plots]
    report.write(directory)
    return plots


def _draw(spec: Mapping[str, Any], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6.4, 3.6), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    left = figure.add_subplot()
    left.set_title(spec["title"])
    left.set_xlabel(spec["x_label"])
    lines = _series(left, spec["x"], spec["left"], "o-", 0)
    if spec["left"]:
        left.set_ylabel(" / ".join(spec["left"]))
    if spec["right"]:
        right = left.twinx()
        lines += _series(right, spec["x"], spec["right"], "s--", len(spec["left"]))
        right.set_ylabel(" / ".join(spec["right"]))
        right.set_ylim(bottom=0)
    if spec.get("chosen") is not None:
        lines.append(left.axvline(spec["chosen"], color="grey", linestyle=":", label="chosen"))
    if spec.get("reference"):
        reference = spec["reference"]
        lines.append(left.axhline(reference["value"], color="C3", linestyle="--", label=reference["label"]))
    if all(isinstance(x, int) for x in spec["x"]):
        left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    if len(lines) > 1:
        left.legend(handles=lines, loc="best", fontsize="small")
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, format="png")
    tmp.replace(path)
    return path


def _series(
    axes: Any, x: list[float], series: Mapping[str, list[float]], style: str, color: int
) -> list[Any]:
    handles = []
    for offset, (label, values) in enumerate(series.items()):
        (line,) = axes.plot(x, values, style, color=f"C{color + offset}", label=label)
        handles.append(line)
    return handles
