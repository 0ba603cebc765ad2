import json
from pathlib import Path

import pytest

from lightning_boost import cli
from lightning_boost.demo import demo_dataset, run_demo, side_by_side

#: The plain fit is Lightning with PyTorch's defaults, so Lightning warns about its loader, as it would.
PLAIN_WARNS = pytest.mark.filterwarnings("ignore:The 'train_dataloader' does not have many workers")


@PLAIN_WARNS
def test_demo_trains_plain_then_boosted_and_writes_the_report(tmp_path: Path) -> None:
    said: list[str] = []
    plain, boosted = run_demo(
        samples=128,
        epochs=1,
        root=str(tmp_path),
        batch_size=16,
        max_batch_size=32,
        say=said.append,
        quiet=True,
    )
    assert [line[:5] for line in said] == ["[1/2]", "[2/2]"]
    assert plain.samples_per_s > 0 and boosted.samples_per_s > 0
    assert plain.settings["batch size"] == "16 x 1 accumulated" and plain.settings["num_workers"] == 0
    written = json.loads(Path(str(boosted.report)).read_text())
    tuned = written["tuned"]
    assert boosted.settings["batch size"] == f"{tuned['batch_size']} x 1 accumulated"
    assert tuned["batch_size"] <= 32 and tuned["num_workers"] == boosted.settings["num_workers"]
    assert float(boosted.settings["learning rate (peak)"]) == pytest.approx(0.05 * tuned["lr_factor"])
    assert {f["source"] for f in written["findings"]} >= {"AutoBatchSize", "FakeCIFAR", "SyncGuard"}
    assert Path(str(boosted.report)).is_relative_to(tmp_path / "boosted")

    rows = {what: (a, b) for what, a, b in side_by_side(plain, boosted)}
    assert rows["syncs found"][0] == "not checked"
    assert rows["syncs found"][1].startswith("0 in your code")  # prog_bar values are Lightning's
    assert rows["retained graphs found"] == ("not checked", "0")
    assert rows["speed-up (training)"][1].endswith("x")
    wall = float(rows["speed-up (wall time, tuning included)"][1].removesuffix("x"))
    assert wall == pytest.approx(plain.seconds / boosted.seconds, abs=0.006)
    assert boosted.seconds > boosted.before_training_s + boosted.after_training_s > 0  # its report's files
    assert plain.final_accuracy is not None and boosted.final_accuracy is not None
    assert rows["final validation accuracy"] == (
        f"{plain.final_accuracy:.1%}",
        f"{boosted.final_accuracy:.1%}",
    )
    (reach,) = [what for what in rows if what.startswith("time to plain's final accuracy")]
    assert rows[reach][0].endswith(" s")  # the plain fit reaches its own final accuracy
    points = (boosted.final_accuracy - plain.final_accuracy) * 100
    assert rows["final accuracy, boosted - plain"][1].startswith(f"{points:+.1f} points (")
    assert len(plain.curve) == len(boosted.curve) == 4  # four validations an epoch
    assert set(rows) >= {
        "precision",
        "memory format",
        "strategy",
        "num_workers",
        "before training (tuning)",
        "training samples/s",
    }


def test_demo_rejects_fewer_samples_than_a_batch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`samples` expected at least batch_size=64, got 10"):
        run_demo(samples=10, root=str(tmp_path))


def test_demo_data_dir_without_cifar_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not hold CIFAR-10.*download=True.*the demo's own images"):
        demo_dataset(64, str(tmp_path))


@PLAIN_WARNS
def test_cli_demo_prints_the_side_by_side_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["demo", "--samples", "64", "--epochs", "1", "--batch-size", "16", "--root", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "[1/2] plain Lightning" in out and "[2/2] lightning-boost" in out
    assert "plain Lightning" in out and "speed-up (training)" in out and "boost_report.json" in out


def test_throughput_reads_each_accuracy_after_the_fit_not_at_its_validation() -> None:
    """On a GPU, `float()` of the metric at each validation's end waits for the device (SyncGuard
    found it there, in the demo's own callback, 2026-11-27): the curve keeps the tensors and reads
    them when asked."""
    import types

    import torch

    from lightning_boost.demo import Throughput

    class Reads(torch.Tensor):
        count = 0

        def __float__(self) -> float:
            Reads.count += 1
            return super().__float__()

    accuracy = torch.tensor(0.5).as_subclass(Reads)
    trainer = types.SimpleNamespace(callback_metrics={"val_acc": accuracy}, sanity_checking=False)
    clock = Throughput()
    clock.on_validation_epoch_end(trainer, None)  # type: ignore[arg-type]
    accuracy.fill_(0.75)  # the next validation's value, written into the same tensor
    assert Reads.count == 0
    ((_, read),) = clock.curve
    assert read == 0.5 and Reads.count == 1


@PLAIN_WARNS
def test_demo_wall_time_runs_to_the_return_of_fit(tmp_path: Path) -> None:
    """What runs after training counts: the fit-end hooks (the report's files and plots) and the
    wait for the last checkpoint save (a background save's, under a preset). Before 2026-11-28 the
    demo stopped its clock at the end of training, which left both out of the boosted fit's wall
    time, while plain Lightning pays for its last save inside training."""
    import time

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_boost.demo import SmallCNN, _fit

    class SlowFitEnd(L.Callback):
        def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            time.sleep(0.3)

    images = TensorDataset(torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))
    options = {"enable_progress_bar": False, "enable_checkpointing": False, "log_every_n_steps": 1}
    _, throughput = _fit(
        DataLoader(images, batch_size=16), "auto", 1, str(tmp_path), "x", [SlowFitEnd()], SmallCNN, **options
    )
    assert throughput.after_training_s >= 0.3
    whole = throughput.before_training_s + throughput.seconds + throughput.after_training_s
    assert whole == pytest.approx(throughput.ended - throughput.fit_started)


def test_cli_demo_says_when_the_boosted_fit_kept_plain_s_settings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fits made up (the real ones decide by measurement): the sentence follows the table."""
    from lightning_boost import demo

    same = {"batch size": "64 x 1 accumulated", "num_workers": 0, "pin_memory": False}
    same |= {"precision": "32-true", "memory format": "NCHW"}
    plain = demo.DemoRun("plain Lightning", 300.0, 54.0, 0.2, same)
    boosted = demo.DemoRun("lightning-boost", 280.0, 57.0, 2.4, same | {"precision": "32-true (bf16 0.7x)"})
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: (plain, boosted))
    monkeypatch.setenv("COLUMNS", "400")  # one line: rich wraps at the terminal's width
    assert cli.main(["demo", "--samples", "64"]) == 0
    out = capsys.readouterr().out
    assert "kept plain's settings on this machine" in out and "its 2.4 s before training" in out
