"""LightningCLI: a preset in a config (`Preset`), and the tuned config the report writes.

A strategy *instance* cannot be a LightningCLI default (jsonargparse needs a class and its
arguments), and a preset's own class depends on the machine; `Preset` is the class a config names.
"""

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import pytorch_lightning as pl
from jsonargparse import Namespace, lazy_instance
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from pytorch_lightning.cli import LightningCLI as PlLightningCLI
from torch.utils.data import DataLoader

from lightning_boost import AutoBatchSize, Preset, StepTimeMonitor
from lightning_boost import pytorch_lightning as pl_boost
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import PresetDDPStrategy, PresetSingleDeviceStrategy
from lightning_boost.report.tuned_config import NotWritten, tuned_changes, write_tuned_config
from lightning_boost.testing import BoringDataModule, BoringModel, RandomDataset, cpu_only, tiny_trainer


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI warns when both it and `args` are set
    # LightningCLI 2.6.6 itself calls a jsonargparse API that jsonargparse 4.53 deprecates.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")


def test_building_a_preset_returns_the_presets_own_strategy() -> None:
    strategy = Preset("auto", precision="32-true")
    assert type(strategy) is PresetSingleDeviceStrategy and strategy.plan.precision == "32-true"
    ddp = Preset(name="fast-ddp", static_graph=True, bucket_cap_mb=50)
    assert type(ddp) is PresetDDPStrategy
    assert ddp.plan.options["static_graph"] is True and ddp.plan.options["bucket_cap_mb"] == 50
    with pytest.raises(ValueError, match="Did you mean 'fast-ddp'"):
        Preset("fast-dd")


def cli(tmp_path: Path, args: list[str], **kwargs: object) -> LightningCLI:
    return LightningCLI(
        BoringModel,
        BoringDataModule,
        run=False,
        seed_everything_default=0,
        args=[f"--trainer.default_root_dir={tmp_path}", *args],
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_config_file_names_the_preset(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  strategy:\n"
        "    class_path: lightning_boost.Preset\n"
        "    init_args:\n"
        "      name: fast-ddp\n"
        "      precision: 32-true\n"
        "      static_graph: true\n"
    )
    strategy = cli(tmp_path, ["--config", str(config)]).trainer.strategy
    assert type(strategy) is PresetDDPStrategy
    assert strategy.plan.precision == "32-true" and strategy.plan.options["static_graph"] is True


def test_trainer_defaults_take_a_lazy_preset_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    defaults = {"strategy": lazy_instance(Preset, name="auto"), "accelerator": "cpu"}
    strategy = cli(tmp_path, [], trainer_defaults=defaults).trainer.strategy
    assert type(strategy) is PresetSingleDeviceStrategy
    overridden = cli(tmp_path, ["--trainer.strategy.precision=32-true"], trainer_defaults=defaults)
    assert overridden.trainer.strategy.plan.precision == "32-true"
    by_class_path = cli(tmp_path, ["--trainer.strategy.class_path=lightning_boost.Preset"])
    assert type(by_class_path.trainer.strategy) is PresetSingleDeviceStrategy


def test_a_misspelt_preset_name_fails_at_parse_time(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        cli(tmp_path, ["--trainer.strategy.class_path=lightning_boost.Preset", "--trainer.strategy.name=ddp"])


class _PlModel(BoringModel, pl.LightningModule):  # type: ignore[misc]
    pass


def test_pytorch_lightning_cli_takes_its_own_namespaces_preset(tmp_path: Path) -> None:
    args = [f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu"]
    args += ["--trainer.strategy.class_path=lightning_boost.pytorch_lightning.Preset"]
    result = PlLightningCLI(pl.LightningModule, run=False, args=args, seed_everything_default=0)
    assert type(result.trainer.strategy) is pl_boost.PresetSingleDeviceStrategy


def cli_run(root: Path, callbacks: list[Any], run: bool = True) -> LightningCLI:
    """A LightningCLI fit of `BoringModel`, with `callbacks` in its `args`."""
    trainer = {
        "accelerator": "cpu", "max_epochs": 1, "default_root_dir": str(root), "enable_progress_bar": False,
        "enable_checkpointing": False, "enable_model_summary": False, "log_every_n_steps": 1,
        "callbacks": callbacks,
    }  # fmt: skip
    args: dict[str, Any] = {"seed_everything": 0, "trainer": trainer}
    if not run:
        made = LightningCLI(BoringModel, BoringDataModule, run=False, args=args)
        made.trainer.fit(made.model, datamodule=made.datamodule)
        return made
    return LightningCLI(BoringModel, BoringDataModule, args={"fit": args})


def test_a_cli_built_with_run_false_is_told_to_repeat_without_a_subcommand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli_run(tmp_path, [{"class_path": "lightning_boost.BoostReport"}], run=False)
    (tuned,) = tmp_path.rglob("config.tuned.yaml")
    assert f"Repeat this run as it trained: --config {tuned}\n" in capsys.readouterr().out
    again = LightningCLI(BoringModel, BoringDataModule, run=False, args=["--config", str(tuned)])
    again.trainer.fit(again.model, datamodule=again.datamodule)  # the line works as printed
    assert again.trainer.state.finished


def test_with_subcommands_the_line_says_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli_run(tmp_path, [{"class_path": "lightning_boost.BoostReport"}])
    (tuned,) = tmp_path.rglob("config.tuned.yaml")
    assert f"Repeat this run as it trained: fit --config {tuned}\n" in capsys.readouterr().out


def test_tuner_instances_are_left_out_of_the_tuned_config() -> None:
    kept = Namespace(class_path="lightning_boost.BoostReport")
    workers = Namespace(class_path="lightning_boost.AutoNumWorkers")
    flat = {"trainer.callbacks": [AutoBatchSize(), kept, workers], "data.num_workers": 0}
    boosted = {"num_workers": 2, "prefetch_factor": 4}  # a BoostedDataModule's, its arguments
    assert tuned_changes(flat, loader=boosted) == {"trainer.callbacks": [kept], "data.num_workers": 2}
    # loaders the config cannot set: AutoNumWorkers stays, and its cache repeats the choice
    assert tuned_changes(flat) == {"trainer.callbacks": [kept, workers]}


def test_the_tuned_config_of_plain_loaders_keeps_their_worker_tuning(tmp_path: Path) -> None:
    """A plain datamodule's loaders were tuned by `AutoNumWorkers`, which the config cannot
    replace: dropping it left the repeat loading at the loaders' own `num_workers`. It stays,
    and the repeat takes the cached choice without measuring again."""
    cli_run(tmp_path / "run", [{"class_path": "lightning_boost.AutoNumWorkers"}])
    (tuned,) = (tmp_path / "run").rglob("config.tuned.yaml")
    assert "lightning_boost.AutoNumWorkers" in tuned.read_text()


def test_other_instances_get_no_tuned_config_and_a_reason(tmp_path: Path) -> None:
    """jsonargparse 4.53 refuses instances in a parsed config, but a program may build the
    config itself: the tuned config is then not written, and the report's last line says why."""
    parser = LightningArgumentParser()
    parser.add_lightning_class_args(L.Trainer, "trainer")
    config = parser.parse_object({"trainer": {"max_epochs": 1}})
    config["trainer.callbacks"] = [StepTimeMonitor(), AutoBatchSize()]
    saver = SaveConfigCallback(parser, config)
    trainer = tiny_trainer(tmp_path, callbacks=[saver])
    with pytest.raises(NotWritten, match=r"holds instances \(StepTimeMonitor\).*class_path"):
        write_tuned_config(trainer, {})


def test_the_readmes_lightning_cli_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run on the CPU (`--trainer.accelerator=cpu`): on a GPU machine the preset must plan for the
    CPU too, so the machine is seen as its CPU side (`HardwareInfo.on_cpu`)."""
    detect = HardwareInfo.detect
    monkeypatch.setattr(HardwareInfo, "detect", classmethod(lambda cls: detect().on_cpu()))
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("With LightningCLI, the same in the config", 1)[1].split("```yaml\n", 1)[1]
    config = tmp_path / "config.yaml"
    config.write_text(block.split("```", 1)[0])
    args = ["--config", str(config), f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=1"]
    args += [
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1",
    ]
    with cpu_only():
        made = LightningCLI(BoringModel, BoringDataModule, run=False, args=args, seed_everything_default=0)
    made.trainer.fit(made.model, datamodule=made.datamodule)
    assert type(made.trainer.strategy) is PresetSingleDeviceStrategy and made.trainer.state.finished
    names = {type(c).__name__ for c in made.trainer.callbacks}
    assert {"AutoBatchSize", "SyncGuard", "LossLoggingGuard", "StepTimeMonitor", "BoostReport"} <= names


def test_a_size_derived_from_a_config_entry_is_written_to_that_entry() -> None:
    """The loader read `batch_size_per_device` (or Lightning's fine-tuning example's
    `self._batch_size`), which no config entry holds: the tuned size was not written and
    AutoBatchSize was dropped, so "Repeat this run as it trained" trained at the configured size."""
    flat = {"data.batch_size": 16}
    per_device = tuned_changes(
        flat, batch_size=16, attr_name="batch_size_per_device", derived_from=("batch_size", 2)
    )
    assert per_device == {"data.batch_size": 32}  # two devices
    copied = tuned_changes(flat, batch_size=32, attr_name="_batch_size", derived_from=("batch_size", 1))
    assert copied == {"data.batch_size": 32}
    assert tuned_changes(flat, batch_size=8, attr_name="size", configured_batch_size=8) == {}  # kept
    with pytest.raises(NotWritten, match=r"batch size 32 \(configured 8\).*no config entry holds `size`"):
        tuned_changes(flat, batch_size=32, attr_name="size", configured_batch_size=8)


class PrivateSizeData(BoringDataModule):
    """Lightning's fine-tuning example's datamodule: its `batch_size` argument kept as `self._batch_size`."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(length=256)
        del self.batch_size
        self._batch_size = batch_size

    def _loader(self, seed: int, shuffle: bool = False) -> Any:
        return DataLoader(RandomDataset(self.features, self.length, seed), self._batch_size, shuffle=shuffle)


class SizedModel(BoringModel):
    def __init__(self, batch_size: int = 8, lr: float = 0.05) -> None:
        super().__init__(lr=lr)  # its hyperparameters: this frame's arguments
        self.batch_size = batch_size


class LinkedCLI(LightningCLI):
    """The example's CLI: the model's `batch_size` is a link to the datamodule's."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.batch_size", "model.batch_size")


@pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps")
def test_the_tuned_config_of_a_private_size_repeats_the_run(tmp_path: Path) -> None:
    trainer = {
        "accelerator": "cpu", "max_epochs": 1, "default_root_dir": str(tmp_path), "limit_train_batches": 2,
        "log_every_n_steps": 1, "enable_progress_bar": False, "enable_checkpointing": False,
        "callbacks": [{"class_path": "lightning_boost.BoostReport"},
                      {"class_path": "lightning_boost.AutoBatchSize",
                       "init_args": {"retune": True, "max_batch_size": 32, "min_efficiency": 0.1}}],
    }  # fmt: skip
    made = LinkedCLI(SizedModel, PrivateSizeData, args={"fit": {"seed_everything": 0, "trainer": trainer}})
    tuner = next(c for c in made.trainer.callbacks if isinstance(c, AutoBatchSize))
    tuned_size = tuner.result["batch_size"]
    assert tuner.attr_name == "_batch_size" and tuned_size != 8
    (tuned,) = tmp_path.rglob("config.tuned.yaml")
    again = LinkedCLI(SizedModel, PrivateSizeData, args=["fit", "--config", str(tuned)])
    assert again.trainer.train_dataloader.batch_size == tuned_size  # the rerun trains at the tuned size
    assert not [c for c in again.trainer.callbacks if isinstance(c, AutoBatchSize)]
