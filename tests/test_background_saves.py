"""Checkpoint saves on a worker thread (`lightning_boost.presets.saves`): real fits on the CPU with
Lightning's own `ModelCheckpoint` and `TorchCheckpointIO`; a full disk is simulated (an
``OSError`` from the write), as this machine cannot be made to run out of space for one test."""

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.io import CheckpointIO, TorchCheckpointIO, torch_io
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from lightning_boost import preset
from lightning_boost.hardware import HardwareInfo
from lightning_boost.presets import saves as saves_module
from lightning_boost.presets.saves import BackgroundSaves, file_readers, host_copy
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer


def _preset(**overrides: Any) -> Any:
    return preset("auto", hardware=HardwareInfo.detect().on_cpu(), precision="32-true", **overrides)


def _checkpoints(root: Path) -> list[Path]:
    return sorted(root.rglob("*.ckpt"))


def test_a_fit_saves_in_the_background_and_its_last_checkpoint_holds_the_trained_weights(
    tmp_path: Path,
) -> None:
    strategy = _preset()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    trainer = tiny_trainer(tmp_path, strategy=strategy, callbacks=[checkpoint], limit_train_batches=8)
    model = BoringModel()
    trainer.fit(model, datamodule=BoringDataModule())
    assert strategy.saves_in_background and strategy.tuned["background_saves"] is True
    assert [p.name for p in _checkpoints(tmp_path / "ckpt")] == ["epoch=0-step=8.ckpt"]  # older ones removed
    saved = torch.load(checkpoint.best_model_path, map_location="cpu", weights_only=False)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
    assert saved["global_step"] == 8
    assert type(strategy.checkpoint_io) is TorchCheckpointIO  # put back at teardown: later saves wait
    finding = next(f for f in strategy.findings if "background_saves" in f.data)
    assert finding.title == "checkpoint saves in the background" and finding.data["background_saves"]
    trainer.test(model, datamodule=BoringDataModule(), ckpt_path="best")  # loads the file it wrote


def test_background_saves_false_keeps_lightnings_saves(tmp_path: Path) -> None:
    strategy = _preset(background_saves=False)
    trainer = tiny_trainer(tmp_path, strategy=strategy)
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert not strategy.saves_in_background and len(_checkpoints(tmp_path)) == 1
    assert not any("background_saves" in f.data for f in strategy.findings)


def test_a_failed_save_raises_on_the_training_thread_and_keeps_the_checkpoint_it_would_replace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[str] = []

    def second_write_fails(checkpoint: dict[str, Any], path: Any) -> None:  # a full disk, simulated
        writes.append(str(path))
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        atomic_save(checkpoint, path)

    atomic_save = torch_io._atomic_save
    monkeypatch.setattr(torch_io, "_atomic_save", second_write_fails)
    strategy = _preset()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    trainer = tiny_trainer(tmp_path, strategy=strategy, callbacks=[checkpoint], limit_train_batches=8)
    with pytest.raises(
        RuntimeError, match=r"saving .*step=4.ckpt in the background failed \(OSError: .*No space"
    ):
        trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert [p.name for p in _checkpoints(tmp_path / "ckpt")] == ["epoch=0-step=2.ckpt"]  # not removed
    assert len(writes) == 2  # nothing written after the failure
    assert type(strategy.checkpoint_io) is TorchCheckpointIO  # put back after the failure too


class _ReadsLastAtTrainEnd(Callback):
    """Reads the last checkpoint where users upload or evaluate it: ``on_train_end``, before the
    fit's teardown (a callback's hook, then the module's)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = trainer.checkpoint_callback.last_model_path  # type: ignore[union-attr]
        self.steps.append(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def test_on_train_end_reads_the_fits_last_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow_write(checkpoint: dict[str, Any], path: Any) -> None:  # a slow disk, simulated
        time.sleep(0.3)
        atomic_save(checkpoint, path)

    atomic_save = torch_io._atomic_save
    monkeypatch.setattr(torch_io, "_atomic_save", slow_write)
    strategy, reader = _preset(), _ReadsLastAtTrainEnd()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)
    trainer = tiny_trainer(tmp_path, strategy=strategy, callbacks=[reader, checkpoint], limit_train_batches=8)
    given = list(trainer.callbacks)
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert strategy.saves_in_background
    assert reader.steps == [8]  # the last step's file, not the one before it (nor a missing one)
    assert trainer.callbacks == given  # the wait is not left among the trainer's callbacks


class _SlowIO(CheckpointIO):
    """Records what ran when; each save takes 50 ms."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.threads: set[str] = set()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        time.sleep(0.05)
        self.threads.add(threading.current_thread().name)
        self.log.append(("save", f"{path}={checkpoint['w'].item()}"))

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.log.append(("remove", str(path)))

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Any = None
    ) -> dict[str, Any]:
        self.log.append(("load", str(path)))
        return {}


def test_saves_and_removals_run_in_order_off_the_calling_thread_on_a_copy_of_the_values() -> None:
    inner = _SlowIO()
    saves = BackgroundSaves(inner)
    weight = torch.zeros(())
    start = time.perf_counter()
    saves.save_checkpoint({"w": weight}, "a")
    weight += 1  # the next step changes the weights in place: the save keeps the values it was given
    saves.remove_checkpoint("old")
    returned = time.perf_counter() - start
    saves.save_checkpoint({"w": weight}, "b")  # waits for the save before it: one in flight
    saves.load_checkpoint("b")  # waits for every write
    saves.teardown()
    assert inner.log == [("save", "a=0.0"), ("remove", "old"), ("save", "b=1.0"), ("load", "b")]
    assert returned < 0.04 and inner.threads == {"lightning-boost-saves_0"}


def test_loggers_that_read_saved_files_keep_the_saves_on_the_training_thread(tmp_path: Path) -> None:
    class Uploads(CSVLogger):
        @override
        def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
            assert Path(checkpoint_callback.last_model_path or checkpoint_callback.best_model_path).exists()

    class LogsModels(CSVLogger):  # as WandbLogger(log_model=True) and MLFlowLogger(log_model=True) do
        _log_model = True

    assert file_readers([CSVLogger(tmp_path), Uploads(tmp_path), LogsModels(tmp_path)]) == [
        "Uploads",
        "LogsModels",
    ]
    strategy = _preset()
    trainer = tiny_trainer(tmp_path, strategy=strategy, logger=Uploads(tmp_path))
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert not strategy.saves_in_background
    finding = next(f for f in strategy.findings if "background_saves" in f.data)
    assert finding.title == "checkpoint saves on the training thread: Uploads reads each file saved"


def test_a_checkpoint_io_passed_in_plugins_is_left_as_it_is(tmp_path: Path) -> None:
    class MyIO(TorchCheckpointIO):
        pass

    mine = MyIO()
    strategy = _preset()
    trainer = tiny_trainer(tmp_path, strategy=strategy, plugins=[mine])
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert strategy.checkpoint_io is mine and not strategy.saves_in_background


def test_fsdp_takes_no_background_saves_override() -> None:
    from lightning_boost.hardware import EXAMPLES
    from lightning_boost.presets import plan_preset

    assert plan_preset("fsdp", EXAMPLES["h100x8"]).background_saves is False  # its own sharded saves
    with pytest.raises(ValueError, match="background_saves"):
        plan_preset("fsdp", EXAMPLES["h100x8"], background_saves=True)
    with pytest.raises(TypeError, match="background_saves"):
        preset("auto", hardware=EXAMPLES["cpu"], background_saves="yes")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # the first fit's
def test_a_second_fit_of_the_same_trainer_saves_in_the_background_again(tmp_path: Path) -> None:
    strategy = _preset()
    trainer = tiny_trainer(tmp_path, strategy=strategy)
    model = BoringModel()
    trainer.fit(model, datamodule=BoringDataModule())
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, datamodule=BoringDataModule())
    assert strategy.saves_in_background and trainer.global_step == 8
    assert [p.name for p in _checkpoints(tmp_path)] == ["epoch=1-step=8.ckpt"]
    assert sum("background_saves" in f.data for f in strategy.findings) == 1


class _RankWeights(BoringModel):
    """Writes each rank's checkpoint IO, and rank 0's trained weights, at the end of training."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    @override
    def on_train_end(self) -> None:
        io = type(self.trainer.strategy.checkpoint_io).__name__
        Path(self.out, f"rank{self.global_rank}.io").write_text(io)
        if self.global_rank == 0:
            torch.save(self.state_dict(), Path(self.out, "trained.pt"))


@pytest.mark.ddp
def test_two_gloo_processes_save_in_the_background_on_rank_zero(tmp_path: Path) -> None:
    """Real DDP over gloo (spawned processes): rank 0's worker writes the checkpoint; Lightning's
    spawn launcher then saves the weights it hands back through the IO put back at teardown."""
    strategy = preset(
        "fast-ddp", hardware=HardwareInfo.detect().on_cpu(), precision="32-true", start_method="spawn"
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    trainer = tiny_trainer(tmp_path, devices=2, strategy=strategy, callbacks=[checkpoint], logger=False)
    trainer.fit(_RankWeights(str(tmp_path)), datamodule=BoringDataModule(length=64))
    assert [(tmp_path / f"rank{rank}.io").read_text() for rank in (0, 1)] == ["BackgroundSaves"] * 2
    assert [p.name for p in _checkpoints(tmp_path / "ckpt")] == ["epoch=0-step=4.ckpt"]
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", map_location="cpu", weights_only=False)
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in trained.items())


@pytest.mark.parametrize("save_last", [True, "link"])
def test_last_checkpoint_holds_the_trained_weights(tmp_path: Path, save_last: bool | str) -> None:
    """``save_last`` writes (or, with ``"link"``, links to a file still being written) ``last.ckpt``
    beside the top-k file: after the fit it loads and holds the last step's weights."""
    strategy = _preset()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=save_last)
    trainer = tiny_trainer(tmp_path, strategy=strategy, callbacks=[checkpoint], limit_train_batches=8)
    model = BoringModel()
    trainer.fit(model, datamodule=BoringDataModule())
    assert strategy.saves_in_background
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 8
    assert all(torch.equal(last["state_dict"][k], v) for k, v in model.state_dict().items())


def test_a_link_that_windows_would_copy_keeps_the_saves_on_the_training_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows simulated (`os.name`, in the module only): Lightning links ``last.ckpt`` with a copy
    there, which needs the saved file at once."""
    import os
    import types

    from lightning_boost.presets import saves

    link, plain = ModelCheckpoint(save_last="link"), ModelCheckpoint(save_last=True)
    assert not saves.copies_saved_files([link])  # a link needs no file yet: the directory is made first
    monkeypatch.setattr(saves, "os", types.SimpleNamespace(name="nt", path=os.path))
    assert saves.copies_saved_files([plain, link]) and not saves.copies_saved_files([plain])


@pytest.mark.gpu
def test_a_cuda_tensors_copy_is_queued_and_holds_its_value_at_the_call() -> None:
    weights = torch.zeros(4096, 4096, device="cuda")
    torch.cuda._sleep(1_000_000_000)  # work queued ahead of the copy: the GPU spins for a while
    weights.fill_(1.0)  # queued behind that work, as the step's last update is
    # the call must not wait for the device: under the debug mode's "error" any synchronizing call
    # torch makes raises. (Whether the work is still running when the call returns is not asserted:
    # in the whole suite, 14 processes on one H100, 0.2 s and 2 s of queued work were both done by
    # then, 2026-11-26 and 11-27, where the test alone passed.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        try:
            torch.cuda.set_sync_debug_mode("error")
            snapshot, landed = host_copy({"state_dict": {"w": weights}, "step": torch.tensor(3)})
        finally:
            torch.cuda.set_sync_debug_mode(0)
    weights.add_(1)  # the next step's in-place update, queued behind the copy
    landed()
    assert snapshot["state_dict"]["w"].is_pinned() and snapshot["state_dict"]["w"].device.type == "cpu"
    assert torch.equal(snapshot["state_dict"]["w"], torch.ones(4096, 4096))
    assert snapshot["step"] == 3 and torch.equal(weights.cpu(), torch.full((4096, 4096), 2.0))


@pytest.mark.gpu
def test_a_cuda_fit_saves_in_the_background_and_its_last_checkpoint_holds_the_trained_weights(
    tmp_path: Path,
) -> None:
    strategy = preset("auto", hardware=HardwareInfo.detect(), precision="32-true")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)
    trainer = tiny_trainer(
        tmp_path, strategy=strategy, callbacks=[checkpoint], limit_train_batches=8, accelerator="gpu"
    )
    model = BoringModel()
    trainer.fit(model, datamodule=BoringDataModule())
    assert strategy.saves_in_background
    saved = torch.load(checkpoint.best_model_path, weights_only=False)
    weights = {k: v.cpu() for k, v in model.state_dict().items()}
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in weights.items())
    assert saved["global_step"] == 8


def test_a_save_that_cannot_pin_memory_copies_as_before_for_the_rest_of_the_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tries = []

    def refused(checkpoint: dict[str, Any], pin: bool = True) -> Any:
        tries.append(pin)
        if pin:
            raise RuntimeError("CUDA error: out of memory (pinned host memory)")  # simulated: no GPU here
        return real(checkpoint, pin=False)

    real = saves_module.host_copy
    monkeypatch.setattr(saves_module, "host_copy", refused)
    inner = _SlowIO()
    saves = BackgroundSaves(inner)
    saves.save_checkpoint({"w": torch.zeros(())}, "a")
    saves.save_checkpoint({"w": torch.ones(())}, "b")
    saves.teardown()
    assert inner.log == [("save", "a=0.0"), ("save", "b=1.0")] and tries == [True, False, False]
