"""A model's batch hooks (``on_before_batch_transfer``, ``on_after_batch_transfer``) and precisions
that cast the input (``"bf16-true"``, ``"64-true"``) under the pack, in real CPU fits: the trials take
each batch as Lightning's loop hands it to the step, and a `BoostedDataModule` leaves the model's own
hook to run.

The trials' throughput is scripted (`fixed_cost_steps`); the steps and their inputs are real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import pytorch_lightning as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from pytorch_lightning.utilities.model_helpers import is_overridden as pl_is_overridden
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

import lightning_boost.pytorch_lightning as boost_pl
from lightning_boost import AutoBatchSize, BoostedDataModule, preset
from tests.test_goodput import MLP, Classes, classes, quiet_trainer

pytestmark = [
    pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps"),
    # Lightning's own note, to anyone whose model has a batch hook and who passes a datamodule
    pytest.mark.filterwarnings("ignore:You have overridden `on_(before|after)_batch_transfer` in"),
]


class Records(Dataset[dict[str, Tensor]]):
    """Dict samples of int16 features (sixteenths), as a dataset read from storage gives them."""

    def __init__(self, samples: int, seed: int = 0) -> None:
        x, y = classes(samples, seed).tensors
        self.x, self.y = (x * 16).round().to(torch.int16), y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


class Hooked(MLP):
    """Takes each dict batch apart before the transfer and scales its features after it."""

    def __init__(self) -> None:
        super().__init__()
        self.scaled = 0

    @override
    def on_before_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> Any:
        return batch["x"], batch["y"]

    @override
    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> Any:
        self.scaled += 1
        return batch[0].float() / 16, batch[1]


class RecordsData(L.LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Records(7168), batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Records(1024, seed=1), batch_size=64)


class BoostedRecords(BoostedDataModule):
    @override
    def setup(self, stage: str) -> None:
        self.train_dataset, self.val_dataset = Records(7168), Records(1024, seed=1)


def test_the_trials_take_batches_through_the_models_transfer_hooks(tmp_path: Path) -> None:
    """The trials moved each sampled batch to the device without ``on_before_batch_transfer``: a
    step written for the hook's tuples got the loader's dicts (``KeyError: 0``) and the fit
    stopped before its first step."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    trainer = quiet_trainer(tmp_path, [tuner])
    trainer.fit(model := Hooked(), datamodule=RecordsData())
    assert tuner.decision is not None and tuner.decision.batch_size > 32
    assert trainer.train_dataloader.batch_size == tuner.decision.batch_size
    assert model.scaled > 0 and torch.isfinite(trainer.callback_metrics["val_loss"])


def test_a_boosted_datamodule_leaves_the_models_after_transfer_hook_to_run(tmp_path: Path) -> None:
    """`BoostedDataModule` always overrode ``on_after_batch_transfer`` (for its device transforms),
    and Lightning runs a datamodule's hook instead of the model's: the model's scaling never ran and
    its first layer got int16 features ("mat1 and mat2 must have the same dtype")."""
    trainer = quiet_trainer(tmp_path, [AutoBatchSize(min_efficiency=0.5)])
    trainer.fit(model := Hooked(), datamodule=BoostedRecords(num_workers=0))
    assert model.scaled > 0 and torch.isfinite(trainer.callback_metrics["val_loss"])


def test_the_hook_counts_as_overridden_only_with_device_transforms() -> None:
    """What Lightning's ``is_overridden`` (each namespace's) sees decides whose hook runs."""
    flip = torch.flip
    assert not is_overridden("on_after_batch_transfer", BoostedRecords())
    assert is_overridden("on_after_batch_transfer", BoostedRecords(device_transforms=flip))
    assert is_overridden("on_after_batch_transfer", BoostedRecords(eval_device_transforms=flip))
    assert not pl_is_overridden("on_after_batch_transfer", boost_pl.BoostedDataModule())
    assert pl_is_overridden("on_after_batch_transfer", boost_pl.BoostedDataModule(device_transforms=flip))
    assert isinstance(boost_pl.BoostedDataModule(), pl.LightningDataModule)


def test_device_transforms_beside_the_models_hook_raise_naming_both(tmp_path: Path) -> None:
    """Lightning would run only the datamodule's hook: the model's scaling would be dropped."""
    trainer = quiet_trainer(tmp_path, [])
    data = BoostedRecords(num_workers=0, device_transforms=lambda batch: batch)
    with pytest.raises(ValueError, match=r"`device_transforms`.*Hooked.on_after_batch_transfer"):
        trainer.fit(model := Hooked(), datamodule=data)
    assert trainer.global_step == 0 and model.scaled == 0


def test_device_transforms_apply_to_the_training_batches(tmp_path: Path) -> None:
    """The datamodule's own transforms still run, on training batches only."""
    seen: list[torch.dtype] = []

    def halved(batch: list[Tensor]) -> list[Tensor]:
        seen.append(batch[0].dtype)
        return [batch[0] / 2, batch[1]]

    trainer = quiet_trainer(tmp_path, [], limit_train_batches=3)
    trainer.fit(MLP(), datamodule=Classes(device_transforms=halved))
    assert seen == [torch.float32] * 3


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_the_trials_cast_their_batches_as_the_precision_plugin_does(precision: str, tmp_path: Path) -> None:
    """``bf16-true`` and ``64-true`` convert the model's weights and each batch's floats
    (``Precision.convert_input``): the trials' batches stayed fp32 ("mat1 and mat2 must have the
    same dtype, but got Float and BFloat16") and the fit stopped before its first step."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    trainer = quiet_trainer(tmp_path, [tuner], precision=precision, limit_val_batches=2)
    trainer.fit(model := MLP(), datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.batch_size > 32
    wanted = torch.bfloat16 if precision == "bf16-true" else torch.float64
    assert model.net[0].weight.dtype == wanted and trainer.global_step > 0


@pytest.mark.parametrize("spelling", ["64-true", "64", 64], ids=["64-true", "str-64", "int-64"])
def test_a_preset_carries_64_true_set_by_hand(spelling: str | int, tmp_path: Path) -> None:
    """`Trainer(precision="64-true")` beside a preset was told to pass it to the preset, which
    then refused it: the preset now carries Lightning's `DoublePrecision`."""
    trainer = quiet_trainer(tmp_path, [], strategy=preset("auto", precision=spelling))
    trainer.fit(model := MLP(), datamodule=Classes())
    assert model.net[0].weight.dtype == torch.float64 and trainer.global_step > 0


def test_fsdp_refuses_64_true_naming_the_preset_that_runs_it() -> None:
    with pytest.raises(ValueError, match=r"'64-true' does not run under FSDP.*fast-ddp"):
        preset("fsdp", precision="64-true")


def test_a_datamodules_own_hook_beside_the_models_runs_as_lightning_picks(tmp_path: Path) -> None:
    """A subclass that writes the hook itself (calling the mixin's for its transforms) is the user's
    choice: Lightning runs it instead of the model's and says so; no error."""
    seen: list[int] = []

    class Scaling(BoostedRecords):
        @override
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            x, y = super().on_after_batch_transfer(batch, dataloader_idx)
            return x.float() / 16, y

    def counted(batch: Any) -> Any:
        seen.append(len(batch[0]))
        return batch

    trainer = quiet_trainer(tmp_path, [], limit_train_batches=3, limit_val_batches=1)
    trainer.fit(model := Hooked(), datamodule=Scaling(num_workers=0, device_transforms=counted))
    assert seen == [32] * 3 and model.scaled == 0 and trainer.global_step == 3
