import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from typing_extensions import override

from lightning_boost.testing import BoringDataModule, BoringModel, RandomDataset, tiny_trainer
from lightning_boost.testing.pytest_plugin import MARKERS, skip_reason


def test_random_dataset_is_seeded() -> None:
    a, b, c = RandomDataset(seed=0), RandomDataset(seed=0), RandomDataset(seed=1)
    assert len(a) == 64 and a[3][0].shape == (32,) and a[3][1].shape == (2,)
    assert torch.equal(a.inputs, b.inputs) and not torch.equal(a.inputs, c.inputs)


def test_boring_model_learns_and_validates(tmp_path: Path) -> None:
    model, data = BoringModel(), BoringDataModule()
    trainer = tiny_trainer(tmp_path, max_epochs=3, limit_train_batches=None, logger=False)
    before = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    trainer.fit(model, datamodule=data)
    after = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    assert after < before
    assert trainer.global_step == 3 * len(data.train_dataloader())
    assert trainer.test(model, datamodule=data, verbose=False)[0]["test_loss"] > 0
    predictions = trainer.predict(model, datamodule=data)
    assert predictions is not None and predictions[0].shape == (8, 2)


def test_batch_size_is_a_writable_attribute() -> None:
    data = BoringDataModule(batch_size=8)
    data.batch_size = 16
    assert data.train_dataloader().batch_size == 16


def test_markers_are_registered(pytestconfig: pytest.Config) -> None:
    registered = " ".join(pytestconfig.getini("markers"))
    assert all(f"{name}:" in registered for name in MARKERS)
    assert skip_reason("ddp") is None  # gloo exists wherever the suite runs
    assert (skip_reason("gpu") is None) == torch.cuda.is_available()


@pytest.mark.gpu
def test_gpu_marker_runs_only_with_cuda() -> None:
    assert torch.cuda.is_available()


class _SaveWeights(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(pl_module.state_dict(), self.directory / f"rank{trainer.global_rank}.pt")


@pytest.mark.ddp
def test_two_process_ddp_fit_keeps_ranks_identical(tmp_path: Path) -> None:
    trainer = tiny_trainer(
        tmp_path,
        devices=2,
        strategy="ddp_spawn",
        logger=False,
        enable_checkpointing=False,
        callbacks=[_SaveWeights(tmp_path)],
    )
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert not torch.equal(rank0["layer.weight"], BoringModel().layer.weight.detach())


def test_tiny_trainer_on_a_gpu_machine_raises_no_gpu_not_used_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulated: CUDA reports itself available (this machine has no GPU); both trainers pin the CPU.
    from lightning.fabric.utilities.warnings import PossibleUserWarning
    from lightning.pytorch.accelerators import CUDAAccelerator

    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    with pytest.warns(PossibleUserWarning, match="GPU available but not used"):
        L.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = tiny_trainer(tmp_path)
    assert trainer.num_devices == 1
