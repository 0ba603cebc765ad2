import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import yaml
from lightning.pytorch.loggers import Logger
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_boost import (
    AutoBatchSize,
    AutoNumWorkers,
    BoostedDataModule,
    BoostReport,
    BoostWarning,
    StepTimeMonitor,
    WorkerTuning,
    boost_callbacks,
    preset,
)
from lightning_boost.hardware import EXAMPLES, HardwareInfo
from lightning_boost.report import AREAS, SCHEMA_VERSION, Finding, Report, Severity, plot_data
from lightning_boost.report.callback import attach_report
from lightning_boost.report.plots import INSTALL_HINT, write_plots
from lightning_boost.testing import BoringDataModule, BoringModel, RandomDataset, tiny_trainer

#: AutoBatchSize runs here are a few batches long; its run-length rules are tested in test_goodput.
pytestmark = pytest.mark.usefixtures("long_planned_run")

FAST = WorkerTuning(window_s=0.2, timeout_s=5.0, prefetch_factors=(2,), skip_short_runs=False, online=False)


class Data(BoostedDataModule):
    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = RandomDataset(length=64)
        self.val_dataset = RandomDataset(length=16, seed=1)


def reports(trainer: L.Trainer) -> list[BoostReport]:
    return [c for c in trainer.callbacks if isinstance(c, BoostReport)]  # type: ignore[attr-defined]


def test_boost_callbacks_attach_one_report_per_trainer(tmp_path: Path) -> None:
    callbacks = [AutoNumWorkers(FAST), StepTimeMonitor()]
    trainer = tiny_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=False)
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert len(reports(trainer)) == 1
    trainer.fit_loop.max_epochs = 2
    trainer.fit(BoringModel(), datamodule=BoringDataModule())  # a second fit on the same trainer
    assert len(reports(trainer)) == 1
    own = BoostReport(console=False)
    trainer = tiny_trainer(tmp_path, callbacks=[StepTimeMonitor(), own])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert reports(trainer) == [own]  # the user's own, not a second one


def test_plain_trainer_gets_no_report(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path)
    attach_report(trainer)
    attach_report(trainer)
    assert len(reports(trainer)) == 1
    assert reports(tiny_trainer(tmp_path)) == []


def check_schema(document: dict[str, Any]) -> None:
    """The "Report files" schema of docs/report.md, key by key."""
    assert list(document) == [
        "schema_version",
        "lightning_boost_version",
        "created",
        "tuned",
        "plots",
        "findings",
    ]
    assert document["schema_version"] == SCHEMA_VERSION
    assert isinstance(document["lightning_boost_version"], str)
    assert document["created"].endswith("+00:00")
    assert isinstance(document["tuned"], dict) and isinstance(document["plots"], list)
    for finding in document["findings"]:
        assert list(finding) == [
            "source",
            "area",
            "severity",
            "title",
            "detail",
            "fix",
            "location",
            "cost",
            "data",
        ]
        assert finding["area"] in AREAS and finding["severity"] in ("info", "warn", "error")
        assert all(isinstance(finding[k], str) for k in ("source", "title", "detail", "fix", "cost"))
        assert finding["location"] is None or isinstance(finding["location"], str)
        assert Finding.from_dict(finding).to_dict() == finding


def test_files_land_in_log_dir_with_schema_plots_and_hparams(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = tiny_trainer(tmp_path, strategy=preset("auto", hardware=EXAMPLES["cpu"]), limit_train_batches=8,
                           callbacks=boost_callbacks(auto_num_workers={"tuning": FAST},
                                                     boost_report={"plots": True}))  # fmt: skip
    trainer.fit(BoringModel(), datamodule=Data(batch_size=8, worker_tuning=FAST))
    log_dir = Path(trainer.log_dir or "")
    document = json.loads((log_dir / "boost_report.json").read_text())
    check_schema(document)
    areas = {f["area"] for f in document["findings"]}
    assert {"environment", "data", "precision and strategy", "step time"} <= areas
    assert sorted(document["plots"]) == ["boost_data_wait.png", "boost_workers.png"]
    for name in document["plots"]:
        assert (log_dir / name).read_bytes().startswith(b"\x89PNG")
    markdown = (log_dir / "boost_report.md").read_text()
    assert "## Step time" in markdown and "![boost_data_wait](boost_data_wait.png)" in markdown
    tuned = document["tuned"]
    assert tuned["batch_size"] == 8 and tuned["preset"] == "single" and tuned["precision"] == "32-true"
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert hparams["boost/num_workers"] == tuned["num_workers"]
    assert hparams["boost/batch_size"] == 8 and hparams["lr"] == 0.05  # the model's own, kept
    out = capsys.readouterr().out
    assert "lightning-boost report" in out and "step time" in out
    assert f"Report files: {log_dir}/boost_report." in out


def test_options_turn_parts_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = BoostReport(console=False, files=False, log_hyperparams=False)
    trainer = tiny_trainer(tmp_path, callbacks=[StepTimeMonitor(), report])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert report.report is not None and report.paths == []
    assert not list(tmp_path.rglob("boost_report.json"))
    assert "boost/" not in (Path(trainer.log_dir or "") / "hparams.yaml").read_text()
    assert "lightning-boost report" not in capsys.readouterr().out


def test_dirpath_and_no_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # where a run without a logger used to leave its files
    target = tmp_path / "reports"
    trainer = tiny_trainer(tmp_path, logger=False, callbacks=[BoostReport(console=False, dirpath=target)])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert (target / "boost_report.json").exists() and (target / "boost_report.md").exists()
    quiet = BoostReport(console=False)
    trainer = tiny_trainer(tmp_path / "quiet", logger=False, callbacks=[quiet])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert quiet.report is not None and quiet.paths == []  # no logger, not asked: no file anywhere
    assert not list(tmp_path.glob("quiet/**/boost_*")) and not list(Path.cwd().iterdir())
    asked = BoostReport(console=False, files=True)
    trainer = tiny_trainer(tmp_path / "root", logger=False, callbacks=[asked])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert (tmp_path / "root" / "boost_report.json").exists()  # default_root_dir without a logger


def test_without_matplotlib_the_report_says_how_to_get_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    report = BoostReport(console=False, plots=True)
    trainer = tiny_trainer(tmp_path, limit_train_batches=6, callbacks=[StepTimeMonitor(), report])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert report.report is not None and report.report.plots == []
    (skipped,) = [f for f in report.report.findings if f.title.startswith("Plots skipped")]
    assert skipped.fix == INSTALL_HINT and "[plots]" in skipped.fix
    assert not list(Path(trainer.log_dir or "").glob("*.png"))
    assert (
        "Plots skipped: matplotlib is not installed"
        in (Path(trainer.log_dir or "") / "boost_report.md").read_text()
    )


def test_a_short_fit_leaves_its_plots_to_the_plots_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drawing costs about 0.15 s a plot (2 CPUs): a fit of a few seconds that did not ask for
    plots is not made 10 % longer by them."""
    from lightning_boost import cli
    from lightning_boost.report import plots

    monkeypatch.setattr(plots, "PLOT_S", 1.0)  # over budget below 100 s, however loaded the host
    report = BoostReport(console=False)
    trainer = tiny_trainer(tmp_path, limit_train_batches=6, callbacks=[StepTimeMonitor(), report])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    log_dir = Path(trainer.log_dir or "")
    assert report.report is not None and report.report.plots == [] and not list(log_dir.glob("*.png"))
    (skipped,) = [f for f in report.report.findings if f.title.startswith("Plots skipped")]
    assert (
        skipped.title.startswith("Plots skipped: 1 plot(s) would take about") and "% of this" in skipped.title
    )
    assert "`lightning-boost plots DIR`" in skipped.fix and "plots=True" in skipped.fix
    assert skipped.data["fit_s"] * 0.01 < skipped.data["estimated_s"]

    assert cli.main(["plots", str(log_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(log_dir / "boost_data_wait.png")
    assert (log_dir / "boost_data_wait.png").read_bytes().startswith(b"\x89PNG")
    document = json.loads((log_dir / "boost_report.json").read_text())
    check_schema(document)
    assert document["plots"] == ["boost_data_wait.png"]
    assert not [f for f in document["findings"] if f["title"].startswith("Plots skipped")]
    assert "![boost_data_wait](boost_data_wait.png)" in (log_dir / "boost_report.md").read_text()


def test_plots_command_says_what_it_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_boost import cli

    assert cli.main(["plots", str(tmp_path)]) == 2
    assert f"No boost_report.json in {tmp_path}" in capsys.readouterr().out
    Report([Finding("x", "data", "info", "nothing to plot")]).write(tmp_path)
    assert cli.main(["plots", str(tmp_path)]) == 0
    assert "has nothing to plot" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    spec = plot_data("data_wait", "Data wait", "step", [1, 2], {"wait": [0.1, 0.2]})
    Report([Finding("x", "data", "info", "a plot", data={"plot": spec})]).write(tmp_path)
    assert cli.main(["plots", str(tmp_path)]) == 2
    assert INSTALL_HINT in capsys.readouterr().out


def test_plots_are_drawn_from_plot_data(tmp_path: Path) -> None:
    spec = plot_data(
        "batch_size", "Throughput and memory", "batch size", [8, 16, 32],
        {"samples/s": [100.0, 180.0, 190.0]}, right={"peak memory (MiB)": [10.0, 20.0, 40.0]}, chosen=16,
    )  # fmt: skip
    finding = Finding("AutoBatchSize", "batch size", "info", "batch_size=16", data={"plot": spec})
    duplicate = Finding("AutoBatchSize", "batch size", "info", "again", data={"plot": spec})
    (path,) = write_plots([finding, duplicate, Finding("x", "data", "info", "no plot")], tmp_path)
    assert path.name == "boost_batch_size.png" and path.read_bytes().startswith(b"\x89PNG")
    assert write_plots([], tmp_path) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "a/b"}, r"`name` expected letters, digits, '_' or '-', got 'a/b'"),
        ({"left": {"y": [1.0]}}, r"series 'y' has 1 values for 2 x values"),
        ({"right": {"mem": [1.0, 2.0, 3.0]}}, r"series 'mem' has 3 values for 2 x values"),
    ],
)
def test_bad_plot_data(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"name": "p", "title": "t", "x_label": "x", "x": [1, 2], "left": {"y": [1, 2]}}
    with pytest.raises(ValueError, match=match):
        plot_data(**(args | kwargs))


class FailsAtStep(BoringModel):
    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_a_failed_fit_still_writes_what_was_found(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, callbacks=[AutoNumWorkers(FAST)])
    loader = DataLoader(RandomDataset(length=64), batch_size=8)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(FailsAtStep(), train_dataloaders=loader, val_dataloaders=loader)
    document = json.loads((Path(trainer.log_dir or "") / "boost_report.json").read_text())
    assert any(f["source"] == "AutoNumWorkers" for f in document["findings"])


def test_a_report_that_cannot_be_written_after_a_failure_warns_and_keeps_the_error(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    trainer = tiny_trainer(tmp_path, callbacks=[BoostReport(console=False, dirpath=blocker / "sub")])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="boom"):
        warnings.simplefilter("always")
        trainer.fit(FailsAtStep(), datamodule=BoringDataModule())
    (warned,) = [w for w in caught if issubclass(w.category, BoostWarning)]
    assert "BoostReport could not write the report of the failed run" in str(warned.message)


def test_report_collects_strategy_datamodule_and_callbacks_once(tmp_path: Path) -> None:
    report = BoostReport(console=False)
    strategy = preset("auto", hardware=EXAMPLES["cpu"])
    trainer = tiny_trainer(tmp_path, strategy=strategy, callbacks=[AutoNumWorkers(FAST), report])
    datamodule = Data(batch_size=8, worker_tuning=FAST)
    trainer.fit(BoringModel(), datamodule=datamodule)
    assert report.report is not None
    sources = {f.source for f in report.report.findings}
    assert {"doctor", "Data"} <= sources
    found = report.report.findings
    assert all(f in found for f in [*strategy.findings, *datamodule.findings])
    assert all(found.count(f) == 1 for f in found)
    assert not [f for f in report.report.findings if f.source == "AutoNumWorkers"]  # left to the datamodule
    assert report.report.worst in (Severity.INFO, Severity.WARN)


class OwnFlags(L.Callback):
    """A user's callback whose attributes share the names the report reads from the pack's parts."""

    def __init__(self) -> None:
        self.tuned = True  # its own flag, not a mapping of tuned values
        self.findings = 3  # a count of its own, not a list of findings


def test_a_callbacks_own_tuned_and_findings_attributes_are_not_read(tmp_path: Path) -> None:
    """The report read any part's `tuned` and `findings` by name: a user's callback with a `tuned`
    flag stopped the fit at its end ("cannot convert dictionary update sequence element")."""
    report = BoostReport(console=False)
    tiny_trainer(tmp_path, callbacks=[OwnFlags(), AutoNumWorkers(FAST), report]).fit(
        BoringModel(), datamodule=BoringDataModule(length=64)
    )
    assert report.report is not None and report.report.tuned["batch_size"] == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"console": "yes"}, TypeError, "`console` expected True or False, got 'yes'"),
        ({"plots": 1}, TypeError, "`plots` expected True or False or None, got 1"),
        (
            {"dirpath": 3},
            TypeError,
            r"`dirpath` expected a string or a path \(not an empty string\) or None, got 3 \(int\)",
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BoostReport(**kwargs)


def _hparams_sessions(log_dir: Path) -> list[dict[str, Any]]:
    """The hyperparameter sessions TensorBoard's HPARAMS tab reads from the event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    sessions = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "hparams":
                    continue
                data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                if data.HasField("session_start_info"):
                    hparams = data.session_start_info.hparams
                    sessions.append(
                        {key: getattr(hparams[key], hparams[key].WhichOneof("kind")) for key in hparams}
                    )
    return sessions


@pytest.mark.usefixtures("fixed_cost_steps")
def test_tensorboard_gets_one_hyperparameter_session_with_the_tuned_values(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="tb")
    # 8 -> 16 keeps >= 0.5 efficiency and twice the samples a fixed-cost step: 16 wins, any noise
    callbacks = [AutoBatchSize(max_batch_size=16, min_efficiency=0.5), BoostReport(console=False)]
    trainer = tiny_trainer(tmp_path, logger=logger, callbacks=callbacks)
    trainer.fit(BoringModel(), datamodule=Data(batch_size=8, num_workers=0))
    tuned = trainer.train_dataloader.batch_size
    assert tuned != 8  # the run trained at the tuned size, not the configured one
    (session,) = _hparams_sessions(Path(logger.log_dir))  # one session: the model's and the tuned values
    assert session["lr"] == 0.05 and session["boost/batch_size"] == tuned
    assert session["boost/precision"] == "32-true"
    hparams = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
    assert hparams["lr"] == 0.05 and hparams["boost/batch_size"] == tuned
    assert trainer.lightning_module._log_hyperparams  # Lightning's own switch is put back


class _RunLogger(Logger):
    """A logger that keeps every run under one `save_dir`, as MLflow's ``mlruns`` and W&B do."""

    def __init__(self, save_dir: Path, run: str) -> None:
        super().__init__()
        self._save_dir, self._run = str(save_dir), run

    @property
    def name(self) -> str:
        return "experiment"

    @property
    def version(self) -> str:
        return self._run

    @property
    def save_dir(self) -> str:
        return self._save_dir

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_a_logger_shared_between_runs_gets_one_folder_per_run(tmp_path: Path) -> None:
    shared = tmp_path / "mlruns"
    for run in ("run-a", "run-b"):
        trainer = tiny_trainer(
            tmp_path, logger=_RunLogger(shared, run), callbacks=[BoostReport(console=False)]
        )
        trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert not (shared / "boost_report.json").exists()  # the shared folder is no run's own
    assert (shared / "experiment" / "run-a" / "boost_report.json").exists()
    assert (shared / "experiment" / "run-b" / "boost_report.json").exists()


def test_the_precision_is_reported_once_when_a_preset_says_why(tmp_path: Path) -> None:
    report = BoostReport(console=False)
    strategy = preset("auto", hardware=HardwareInfo.detect().on_cpu())  # the CPU `tiny_trainer` pins
    trainer = tiny_trainer(tmp_path, strategy=strategy, callbacks=[report])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert report.report is not None
    precision = [f for f in report.report.findings if "precision" in f.data]
    assert [f.source for f in precision] == ["preset"]  # the doctor's line said the same without why
