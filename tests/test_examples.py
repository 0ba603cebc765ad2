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


def test_image_classifier_trains_offline_with_the_recommended_setup(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "image_classifier.py"),
            "--fake-data",
            "--steps",
            "3",
            "--batch-size",
            "32",
            "--root",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(Path(result.stdout.strip().splitlines()[-1].removeprefix("report: ")).read_text())
    sources = {f["source"] for f in report["findings"]}
    assert {"CIFAR10Data", "preset", "LossLoggingGuard", "StepTimeMonitor"} <= sources
    # the recommended way: no sync, its own or Lightning's; on a GPU, cuDNN's autotuner trying its
    # algorithms on the first shapes (an INFO, once) is all SyncGuard may say
    syncs = [f for f in report["findings"] if f["source"] == "SyncGuard"]
    assert all(f["data"].get("pattern") == "cudnn_autotune" and f["severity"] == "info" for f in syncs)
    assert report["tuned"]["batch_size"] == 32


def test_image_classifier_names_the_missing_dataset(tmp_path: Path) -> None:
    script = str(EXAMPLES / "image_classifier.py")
    result = subprocess.run(
        [sys.executable, script, "--data", str(tmp_path / "none"), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 2
    assert (
        "`--data` expected a directory holding CIFAR-10" in result.stderr and "--fake-data" in result.stderr
    )


def test_cli_turns_the_callbacks_on_from_yaml(tmp_path: Path) -> None:
    cli = EXAMPLES / "cli"
    result = subprocess.run(
        [
            sys.executable,
            str(cli / "train.py"),
            "fit",
            "--config",
            str(cli / "config.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.limit_train_batches=3",
            "--trainer.enable_progress_bar=false",
            "--data.samples=256",
            "--data.num_workers=0",  # BoostedDataModule's own arguments reach the CLI too
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.glob("lightning_logs/version_0/boost_report.json")
    report = json.loads(path.read_text())
    sources = {f["source"] for f in report["findings"]}
    assert {"StepTimeMonitor", "LossLoggingGuard"} <= sources
    assert report["tuned"]["num_workers"] == 0 and report["tuned"]["batch_size"] == 64
    assert report["tuned"]["strategy"] == "PresetSingleDeviceStrategy"  # `Preset` from the YAML
