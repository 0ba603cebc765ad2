import json
import subprocess
import sys
from pathlib import Path

from lightning_boost.testing import marked_line

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_quickstart_trains_and_writes_the_report(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--root", str(tmp_path), "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "OK    precision" in result.stdout
    report = Path(result.stdout.strip().splitlines()[-1].removeprefix("report: "))
    assert report.is_relative_to(tmp_path)
    assert json.loads(report.read_text())["findings"]
    assert (report.parent / "metrics.csv").exists()


def test_anti_patterns_reports_each_mistake_at_its_line(tmp_path: Path) -> None:
    script = EXAMPLES / "anti_patterns.py"
    result = subprocess.run(
        [sys.executable, str(script), "--root", str(tmp_path), "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    found = result.stdout.partition("What lightning-boost found:")[2]
    for mistake in ("keeps the graph", ".item() every step", "print a tensor", "empty_cache in the step"):
        assert marked_line(script, f"mistake: {mistake}") in found, mistake
    assert marked_line(script, "mistake: mask indexing") in found
    assert "num_workers=" in found  # measured; the count depends on the machine
    assert "BoostWarning: SyncGuard" in result.stderr and "BoostWarning: LossLoggingGuard" in result.stderr
