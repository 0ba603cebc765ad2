import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from lightning_boost.report import AREAS, SCHEMA_VERSION, Finding, Report, Severity


def sample() -> Report:
    report = Report(tuned={"num_workers": 3, "precision": "bf16-mixed"})
    report.add(
        [
            Finding(
                "SyncGuard",
                "syncs",
                "warn",
                "`.item()` in training_step",
                "1 sync per step",
                "log the tensor with self.log",
                location="model.py:42",
                data={"count": 10},
                cost="3% of step time",
            ),
            Finding("doctor", "environment", Severity.INFO, "CUDA in use"),
            Finding("doctor", "data", "error", "a | pipe", fix="line one\nline two"),
        ]
    )
    return report


def test_severity_labels_and_coercion() -> None:
    assert [s.label for s in Severity] == ["OK", "WARN", "FAIL"]
    assert Finding("x", "data", "warn", "t").severity is Severity.WARN


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"area": "dta"}, r"`area` expected one of .*got 'dta'. Did you mean 'data'"),
        ({"severity": "warning"}, r"`severity` expected a Severity or one of 'info', .* got 'warning'"),
    ],
)
def test_bad_finding_raises(kwargs: dict[str, str], match: str) -> None:
    fields = {"source": "x", "area": "data", "severity": "info", "title": "t"} | kwargs
    with pytest.raises(ValueError, match=match):
        Finding(**fields)  # type: ignore[arg-type]


def test_add_drops_duplicates_and_groups_by_area_order() -> None:
    report = sample()
    report.add([Finding("doctor", "environment", "info", "CUDA in use")])
    assert len(report.findings) == 3
    assert [area for area, _ in report.by_area()] == ["environment", "data", "syncs"]
    assert report.worst is Severity.ERROR
    assert Report().worst is None
    assert set(AREAS) >= {area for area, _ in report.by_area()}


def test_json_schema_and_round_trip() -> None:
    data = json.loads(sample().to_json())
    assert set(data) == {"schema_version", "lightning_boost_version", "created", "tuned", "plots", "findings"}
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["tuned"] == {"num_workers": 3, "precision": "bf16-mixed"}
    first = data["findings"][0]
    assert set(first) == {"source", "area", "severity", "title", "detail", "fix", "location", "cost", "data"}
    assert [Finding.from_dict(f) for f in data["findings"]] == sample().findings


def test_markdown_escapes_and_lists_everything() -> None:
    text = sample().to_markdown()
    assert "| num_workers | 3 |" in text
    assert "## Syncs" in text and "at `model.py:42`" in text
    assert (
        "| WARN | `.item()` in training_step (1 sync per step) at `model.py:42` | 3% of step time |" in text
    )
    assert "a \\| pipe" in text and "line one line two" in text


def test_table_renders_every_finding() -> None:
    console = Console(record=True, width=200)
    console.print(sample().table(title="t"))
    text = console.export_text()
    for word in (
        "SyncGuard" and "`.item()` in training_step",
        "CUDA in use",
        "FAIL",
        "WARN",
        "OK",
        "log the tensor with self.log",
        "at model.py:42",
        "3% of step time",
    ):
        assert word in text


def test_table_shows_brackets_in_findings_as_text() -> None:
    report = Report()
    fix = "pip install 'lightning-boost[plots]'"
    title = "plots need matplotlib [dim]"
    report.add([Finding("BoostReport", "environment", "info", title, "x[0] > 1", fix)])
    console = Console(record=True, width=200)
    console.print(report.table())
    text = console.export_text()
    assert fix in text  # rich took `[plots]` for markup and dropped it
    assert "plots need matplotlib [dim]" in text and "x[0] > 1" in text


def test_table_drops_fix_column_when_nothing_to_fix() -> None:
    report = Report()
    report.add([Finding("doctor", "environment", "info", "all good")])
    console = Console(record=True, width=120)
    console.print(report.table())
    assert "fix" not in console.export_text() and "cost" not in console.export_text()


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "logs" / "version_0"
    json_path, md_path = sample().write(target)
    assert json.loads(json_path.read_text())["findings"][0]["location"] == "model.py:42"
    assert md_path.read_text().startswith("# lightning-boost report")
    sample().write(target)  # overwrite in place
    assert sorted(p.name for p in target.iterdir()) == ["boost_report.json", "boost_report.md"]


def test_the_compact_form_fits_80_columns_and_keeps_every_fix() -> None:
    long = "a detail long enough to wrap " * 6
    report = Report(
        [
            Finding("doctor", "environment", "info", "CPU only", detail="not shown in the compact form"),
            Finding("SyncGuard", "syncs", "warn", "loss.item() syncs every step " * 3, long,
                    "log the tensor: self.log('loss', loss)", location="model.py:57", cost="41% of step"),
            Finding("BoostReport", "data", "error", "no plots", fix="pip install 'lightning-boost[plots]'"),
        ]
    )  # fmt: skip
    text = report.to_text(width=80)
    lines = text.splitlines()
    assert lines[0] == "lightning-boost report: 1 FAIL, 1 WARN, 1 OK"
    assert max(len(line) for line in lines) <= 80
    assert "not shown" not in text  # an OK's detail stays in the files
    assert "fix: pip install 'lightning-boost[plots]'" in text  # brackets are not markup here
    assert "at model.py:57" in text and "(41% of step)" in text
    assert [line for line in lines if not line.startswith(" ")] == [lines[0], "environment", "data", "syncs"]


def test_a_narrow_or_piped_console_gets_the_compact_form() -> None:
    report = Report([Finding("doctor", "data", "warn", "slow loader", fix="pip install 'x[plots]'")])
    piped = Console(file=io.StringIO(), width=80)  # not a terminal: a CI log
    report.print_to(piped)
    assert "WARN slow loader" in piped.file.getvalue() and "[plots]" in piped.file.getvalue()
    wide = Console(file=io.StringIO(), width=140, force_terminal=True)
    report.print_to(wide)
    assert "┃" in wide.file.getvalue()  # the table


def test_a_findings_table_keeps_its_columns_and_leaves_the_main_table() -> None:
    block = "    size     samples/s\n      64           527\n     128           563"
    finding = Finding("AutoBatchSize", "batch size", "warn", "Batch size 128", f"Measured 2 sizes.\n{block}")
    report = Report([finding])
    text = report.to_text(width=40)
    assert "       " + block.splitlines()[1] in text.splitlines()  # not re-wrapped at 40 columns
    console = Console(width=120, force_terminal=True, record=True)
    report.print_to(console)
    shown = console.export_text()
    table, after = shown.split("Batch size 128:\n")
    assert "Measured 2 sizes." in table and "samples/s" not in table  # the main table's cell: prose only
    assert block in after
