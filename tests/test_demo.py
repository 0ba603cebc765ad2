import json
from pathlib import Path

import pytest

from lightning_boost import cli
from lightning_boost.demo import run_demo


def test_demo_trains_and_writes_the_report(tmp_path: Path) -> None:
    report, summary = run_demo(samples=64, epochs=1, root=str(tmp_path), batch_size=32)
    assert summary["samples/s"] > 0
    written = json.loads(Path(summary["report"]).read_text())
    assert written["tuned"]["batch_size"] == 32
    assert written["tuned"]["precision"] == summary["precision"]
    assert Path(summary["report"]).is_relative_to(tmp_path)
    assert Path(summary["report"]).with_suffix(".md").exists()
    (workers,) = [f for f in report.findings if f.source == "FakeCIFAR" and "num_workers=" in f.title]
    assert workers.data["trials"]  # measured, not guessed
    assert written["tuned"]["num_workers"] == workers.data["num_workers"]


def test_demo_rejects_fewer_samples_than_a_batch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`samples` expected at least batch_size=64, got 10"):
        run_demo(samples=10, root=str(tmp_path))


def test_cli_demo_prints_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["demo", "--samples", "64", "--epochs", "1", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and "num_workers" in out and "boost_report.json" in out
