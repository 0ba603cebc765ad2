"""The contract every public callback keeps (STYLE.md): found here by discovery, so a new one is checked.

Each is built with its defaults, pickled, its ``state_dict`` round-tripped (directly and through a
real checkpoint), used in two fits and a validate on CPU, inside a 2-process DDP fit, and
configured from a LightningCLI YAML file.
"""

import copy
import json
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import pytorch_lightning as pl
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_boost
from lightning_boost import AutoBatchSize, WorkerTuning
from lightning_boost import pytorch_lightning as pl_boost
from lightning_boost._lightning import pytorch_lightning_takes_our_callbacks
from lightning_boost.testing import BoringDataModule, BoringModel, RandomDataset, cpu_only, tiny_trainer

#: AutoBatchSize runs here are a few batches long; its run-length rules are tested in test_goodput.
pytestmark = pytest.mark.usefixtures("long_planned_run")

CALLBACKS: list[type[L.Callback]] = sorted(
    (
        obj
        for name in lightning_boost.__all__
        if isinstance(obj := getattr(lightning_boost, name), type) and issubclass(obj, L.Callback)
    ),
    key=lambda cls: cls.__name__,
)

#: One non-default argument per callback for the LightningCLI check, and how to see it arrived.
CLI_ARGS: dict[str, tuple[dict[str, Any], Callable[[Any], bool]]] = {
    "AutoBatchSize": ({"max_batch_size": 16, "lr_scaling": "sqrt"}, lambda c: c.max_batch_size == 16),
    "AutoMicroBatch": ({"loss_reduction": "sum"}, lambda c: c.loss_reduction == "sum"),
    "AutoNumWorkers": ({"tuning": {"window_s": 0.2}, "retune": True}, lambda c: c.tuning.window_s == 0.2),
    "BoostReport": ({"console": False, "plots": False}, lambda c: not c.console and not c.plots),
    "LossLoggingGuard": ({"mode": "report", "allow": ["hidden"]}, lambda c: c.allow == ("hidden",)),
    "StepTimeMonitor": ({"threshold": 0.25}, lambda c: c.threshold == 0.25),
    "SyncGuard": ({"mode": "report", "allow": ["model.py:12"]}, lambda c: c.allow == ("model.py:12",)),
}


def test_discovery_finds_every_public_callback() -> None:
    assert {cls.__name__ for cls in CALLBACKS} >= {
        "AutoBatchSize",
        "AutoMicroBatch",
        "AutoNumWorkers",
        "BoostReport",
        "LossLoggingGuard",
        "StepTimeMonitor",
        "SyncGuard",
    }
    assert {cls.__name__ for cls in CALLBACKS} == set(CLI_ARGS), "add each new callback to CLI_ARGS"


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda cls: cls.__name__)
def test_constructs_with_defaults_and_pickles(cls: type[L.Callback]) -> None:
    callback = cls()
    clone = pickle.loads(pickle.dumps(callback))
    assert type(clone) is cls
    assert clone.state_key == callback.state_key
    assert clone.state_dict() == callback.state_dict()


def round_trip(cls: type[L.Callback], state: dict[str, Any]) -> None:
    json.dumps(state)  # plain data: nothing a checkpoint cannot hold without pickle
    fresh = cls()
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.state_dict() == state


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda cls: cls.__name__)
def test_fit_twice_then_validate_and_resume(cls: type[L.Callback], tmp_path: Path) -> None:
    callback = cls()
    first = tiny_trainer(tmp_path / "a", callbacks=[callback], enable_checkpointing=False)
    model = BoringModel()
    first.fit(model, datamodule=BoringDataModule())
    checkpoint = tmp_path / "first.ckpt"
    first.save_checkpoint(checkpoint)
    first.validate(model, datamodule=BoringDataModule())
    round_trip(cls, callback.state_dict())
    again = tiny_trainer(tmp_path / "b", callbacks=[callback])  # the same instance, a new run
    again.fit(BoringModel(), datamodule=BoringDataModule())
    assert again.state.finished
    pickle.dumps(callback)
    resumed = tiny_trainer(tmp_path / "c", max_epochs=2, callbacks=[cls()], enable_checkpointing=False)
    resumed.fit(BoringModel(), datamodule=BoringDataModule(), ckpt_path=checkpoint)
    assert resumed.current_epoch == 2


@pytest.mark.ddp
@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda cls: cls.__name__)
def test_works_inside_two_process_ddp(cls: type[L.Callback], tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, devices=2, strategy="ddp_spawn", callbacks=[cls()])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert trainer.state.finished
    assert list(tmp_path.rglob("boost_report.json"))  # rank zero wrote the report; nobody hung


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda cls: cls.__name__)
def test_configurable_from_lightning_cli_yaml(
    cls: type[L.Callback], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["train.py"])
    # LightningCLI 2.6.6 itself calls a jsonargparse API that jsonargparse 4.53 deprecates.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    init_args, arrived = CLI_ARGS[cls.__name__]
    trainer = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "logger": False,
        "log_every_n_steps": 1,
        "limit_train_batches": 2,
        "limit_val_batches": 1,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path / "run"),
        "callbacks": [{"class_path": f"lightning_boost.{cls.__name__}", "init_args": init_args}],
    }
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"seed_everything": 0, "trainer": trainer}))  # JSON is YAML
    with cpu_only():  # the config pins the CPU: on a GPU machine Lightning would warn
        cli = LightningCLI(BoringModel, BoringDataModule, args=["fit", "--config", str(config)])
    (callback,) = [c for c in cli.trainer.callbacks if type(c) is cls]  # type: ignore[attr-defined]
    assert arrived(callback)
    assert cli.trainer.state.finished


PL_TAKES_LIGHTNING_CALLBACKS = pytorch_lightning_takes_our_callbacks()
needs_pl_2_6 = pytest.mark.skipif(not PL_TAKES_LIGHTNING_CALLBACKS, reason="pytorch-lightning < 2.6.0")


@needs_pl_2_6
def test_the_callbacks_run_under_the_pytorch_lightning_namespace(tmp_path: Path) -> None:
    # `import pytorch_lightning as pl` (3 of 5 real modules tried): AutoBatchSize crashed in
    # Lightning's is_overridden and AutoNumWorkers handed the model itself over as the loader.
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_boost import AutoBatchSize, AutoNumWorkers, WorkerTuning, boost_callbacks
    from lightning_boost.testing import RandomDataset

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(32, 2)
            self.batch_size = 8

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(RandomDataset(length=256), batch_size=self.batch_size, shuffle=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    tuning = WorkerTuning(window_s=0.2, prefetch_factors=(2,), skip_short_runs=False)
    callbacks = [
        *boost_callbacks(auto_num_workers={"tuning": tuning}),
        AutoBatchSize(max_batch_size=32, steps=1),
    ]
    trainer = tiny_trainer(
        tmp_path, trainer_class=pl.Trainer, logger=False, enable_checkpointing=False, callbacks=callbacks
    )
    model = Model()
    trainer.fit(model)
    (tuner,) = [c for c in callbacks if isinstance(c, AutoBatchSize)]
    assert trainer.state.finished and tuner.result["batch_size"] == trainer.train_dataloader.batch_size
    assert model.batch_size == 8  # the configured size, put back at the end of the fit
    (workers,) = [c for c in callbacks if isinstance(c, AutoNumWorkers)]
    assert workers.worker_tuner.choices  # the loader was measured and rebuilt


class _PlModel(pl.LightningModule):
    """A `pytorch_lightning` module: the Trainer, strategy and datamodule must all be of that namespace."""

    def __init__(self, out: str = "") -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)
        self.batch_size = 8
        self.out = out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_end(self) -> None:
        if self.out:
            record = {"strategy": type(self.trainer.strategy).__name__, "weight": self.layer.weight.tolist()}
            Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))


class _PlData(pl_boost.BoostedDataModule):
    def setup(self, stage: str) -> None:
        self.train_dataset = RandomDataset(length=128)


def test_the_preset_and_datamodule_run_under_the_pytorch_lightning_namespace(tmp_path: Path) -> None:
    # `pl.Trainer` rejects `lightning.pytorch` strategies and datamodules: these are pl's classes
    from lightning_boost.hardware import EXAMPLES

    strategy = pl_boost.preset("auto", hardware=EXAMPLES["cpu"])
    assert isinstance(strategy, pl.strategies.SingleDeviceStrategy)
    assert isinstance(strategy.precision_plugin, pl.plugins.precision.Precision)
    datamodule = _PlData(batch_size=8, worker_tuning=WorkerTuning(window_s=0.2, prefetch_factors=(2,)))
    batch_size = AutoBatchSize(max_batch_size=32, steps=1)
    callbacks = [batch_size] if PL_TAKES_LIGHTNING_CALLBACKS else []
    trainer = tiny_trainer(tmp_path, trainer_class=pl.Trainer, strategy=strategy, callbacks=callbacks)
    trainer.fit(_PlModel(), datamodule=datamodule)
    assert trainer.state.finished and trainer.strategy is strategy
    assert datamodule.worker_tuner.choices  # the loaders were tuned
    assert strategy.saves_in_background and len(list(tmp_path.rglob("*.ckpt"))) == 1  # pl's own IO, wrapped
    assert type(strategy.checkpoint_io) is pl.plugins.TorchCheckpointIO  # put back at teardown
    if not PL_TAKES_LIGHTNING_CALLBACKS:
        return
    assert trainer.train_dataloader.batch_size == batch_size.result["batch_size"]
    assert datamodule.batch_size == 8  # put back after the fit
    report = next(c for c in trainer.callbacks if isinstance(c, lightning_boost.BoostReport)).report
    assert report is not None
    areas = {finding.area for finding in report.findings}
    assert {"precision and strategy", "data", "batch size"} <= areas
    assert (Path(trainer.logger.log_dir) / "boost_report.json").exists()  # the logger's own directory


@pytest.mark.ddp
def test_fast_ddp_runs_two_processes_under_the_pytorch_lightning_namespace(tmp_path: Path) -> None:
    strategy = pl_boost.preset("fast-ddp", start_method="spawn")
    trainer = tiny_trainer(
        tmp_path,
        trainer_class=pl.Trainer,
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(_PlModel(str(tmp_path)), datamodule=_PlData(batch_size=8, num_workers=0))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["strategy"] for r in ranks] == ["PresetDDPStrategy"] * 2
    assert ranks[0]["weight"] == ranks[1]["weight"]


def test_the_pure_cores_import_no_lightning_at_run_time() -> None:
    # `lint-imports` checks the imports as written; this checks what importing each one loads,
    # parent packages included (a package `__init__` that imports Lightning would defeat it).
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    block = pyproject.split("source_modules = [", 1)[1].split("]", 1)[0]
    modules = [line.strip().strip('",') for line in block.splitlines() if line.strip().startswith('"')]
    assert "lightning_boost.workers.search" in modules and len(modules) > 10
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


class _QuickModel(pl.LightningModule):
    """The README quickstart's `MyModel`, as a `pytorch_lightning` program has it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.skipif(
    not PL_TAKES_LIGHTNING_CALLBACKS, reason="a pytorch_lightning Trainer takes our callbacks from 2.6.0"
)
def test_the_readme_quickstart_runs_as_it_stands_in_a_pytorch_lightning_program(tmp_path: Path) -> None:
    # Lightning said "Expected a parent" (the datamodule) and "invalid strategy name" (the preset)
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "from lightning_boost import" in block and "L.Trainer(" in block
    program = block.replace("import lightning as L", "import pytorch_lightning as pl").replace(
        "L.Trainer(",
        f"pl.Trainer(max_epochs=1, default_root_dir={str(tmp_path)!r}, log_every_n_steps=1, ",
    )  # the namespace, and a short run in this test's directory: nothing else changes
    names: dict[str, Any] = {
        "make_datasets": lambda: (RandomDataset(length=256), RandomDataset(length=64, seed=1)),
        "MyModel": _QuickModel,
    }
    exec(compile(program, "README.md", "exec"), names)
    trainer, datamodule = names["trainer"], names["MyData"]
    assert isinstance(trainer, pl.Trainer) and trainer.state.finished
    assert isinstance(trainer.strategy, pl.strategies.Strategy)  # the preset became pl's own
    assert type(trainer.strategy).__module__ == "lightning_boost.pytorch_lightning"
    assert trainer.datamodule.worker_tuner.choices and isinstance(trainer.datamodule, datamodule)
    assert isinstance(trainer.datamodule, pl.LightningDataModule)
    report = next(c for c in trainer.callbacks if isinstance(c, lightning_boost.BoostReport)).report
    assert report is not None and {"precision and strategy", "data", "batch size"} <= {
        f.area for f in report.findings
    }


class _LightningData(lightning_boost.BoostedDataModule):
    def setup(self, stage: str) -> None:
        self.train_dataset = RandomDataset(length=128)


def test_a_lightning_datamodule_becomes_pytorch_lightnings_own_and_keeps_its_hooks(tmp_path: Path) -> None:
    # `is_overridden` compares code objects: `lightning`'s defaults would look overridden under pl,
    # and pl would then use the datamodule's default `transfer_batch_to_device` over the model's
    moved: list[int] = []

    class _MovingModel(_PlModel):
        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            moved.append(1)
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

    datamodule = _LightningData(batch_size=8, num_workers=0)
    trainer = tiny_trainer(tmp_path, trainer_class=pl.Trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_MovingModel(), datamodule=datamodule)
    assert trainer.state.finished and moved  # the model's own hook ran; Lightning says so, as for any
    assert any("implementation from `LightningModule`" in str(w.message) for w in caught)  # pl datamodule
    assert isinstance(datamodule, pl.LightningDataModule) and isinstance(datamodule, _LightningData)
    datamodule.trainer = None  # as a spawned rank gets it: pickled (its trainer holds a local class)
    again = pickle.loads(pickle.dumps(datamodule))
    assert type(again) is type(datamodule) and again.batch_size == 8


def test_a_preset_takes_the_namespace_of_the_trainer_it_is_given_to(tmp_path: Path) -> None:
    strategy = lightning_boost.preset("auto")
    assert (
        type(pl.Trainer(strategy=strategy, logger=False).strategy).__module__
        == "lightning_boost.pytorch_lightning"
    )
    back = pl_boost.preset("auto")
    assert isinstance(tiny_trainer(tmp_path, strategy=back).strategy, L.pytorch.strategies.Strategy)
    same = lightning_boost.preset("auto")  # under `lightning` nothing changes
    assert same == same and same != lightning_boost.preset("auto") and len({same}) == 1
    assert tiny_trainer(tmp_path, strategy=same).strategy is same
    assert type(back).__module__ == type(same).__module__ == "lightning_boost.presets.strategies"


def test_installing_the_pack_leaves_plain_trainers_alone_and_needs_no_pre() -> None:
    # rich in the environment switches every plain Trainer to rich progress bars and summaries
    from importlib.metadata import requires, version

    required = [r for r in requires("lightning-boost") or [] if "extra ==" not in r]
    assert not any(r.startswith("rich") for r in required)
    (lightning,) = [r for r in required if r.startswith("lightning")]
    assert "!=2.6.2" in lightning and "!=2.6.3" in lightning  # withdrawn: a supply-chain compromise
    assert "dev" not in version("lightning-boost") and lightning_boost.__version__ == version(
        "lightning-boost"
    )


def test_the_report_prints_plain_text_without_rich(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.setitem(sys.modules, name, None)  # `import rich...` raises ImportError
    monkeypatch.setitem(sys.modules, "rich", None)
    trainer = tiny_trainer(tmp_path, callbacks=[lightning_boost.BoostReport()], enable_progress_bar=False)
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    out = capsys.readouterr().out
    assert "lightning-boost report" in out and "environment" in out
