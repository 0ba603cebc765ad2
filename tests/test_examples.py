import json
import subprocess
import sys
from pathlib import Path

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
