"""A TensorDataset loaded one gather a batch: the same batches, the same run, sooner.

Every batch is checked against torch's own per-sample loading (`default_collate`), in worker
processes too, and whole fits against plain Lightning's: the weights end bit for bit equal.
"""

import pickle
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate, random_split
from typing_extensions import override

from lightning_boost import AutoNumWorkers, BoostedDataModule, WorkerTuning
from lightning_boost.step_time.callback import dataset_kind
from lightning_boost.testing import BoringModel, tiny_trainer
from lightning_boost.workers.loaders import measurement_loaders
from lightning_boost.workers.whole_batches import WholeBatches, collate_whole, whole_batches


def regression(length: int = 96, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(length, 32, generator=generator)
    return TensorDataset(inputs, inputs[:, :2] * 0.5 + 0.1 * torch.randn(length, 2, generator=generator))


def batches(dataset: Dataset[Any], collate_fn: Any = None, **loader: Any) -> list[Any]:
    torch.manual_seed(7)  # the sampler's order and the workers' base seed come from here
    return list(DataLoader(dataset, collate_fn=collate_fn, **loader))


def assert_same(gathered: list[Any], stacked: list[Any]) -> None:
    assert len(gathered) == len(stacked)
    for mine, theirs in zip(gathered, stacked, strict=True):
        assert type(mine) is type(theirs)
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


SUBSETS = {
    "tensors": lambda data: data,
    "random_split": lambda data: random_split(data, [0.75, 0.25], torch.Generator().manual_seed(0))[0],
    "nested, negative indices": lambda data: Subset(Subset(data, list(range(-1, -81, -1))), [3, -2, 0, 5, 7]),
    "one tensor of labels": lambda data: TensorDataset(torch.arange(len(data))),
}


@pytest.mark.parametrize("make", SUBSETS.values(), ids=SUBSETS.keys())
@pytest.mark.parametrize("loader", [{"batch_size": 8, "shuffle": True}, {"batch_size": 5, "drop_last": True}])
def test_the_batches_are_the_ones_default_collate_stacks(make: Any, loader: dict[str, Any]) -> None:
    dataset = make(regression())
    whole, collate = whole_batches(dataset, None)
    assert isinstance(whole, WholeBatches) and collate is collate_whole
    assert_same(batches(whole, collate, **loader), batches(dataset, **loader))


def test_the_batches_are_the_same_from_worker_processes() -> None:
    dataset = regression()
    whole, collate = whole_batches(dataset, None)
    loader = {"batch_size": 8, "shuffle": True, "num_workers": 2}
    assert_same(batches(whole, collate, **loader), batches(dataset, **loader))
    assert_same(batches(whole, collate, **loader, persistent_workers=True), batches(dataset, **loader))


def test_one_sample_and_attributes_read_through_to_the_users_dataset() -> None:
    dataset = random_split(regression(), [0.5, 0.5], torch.Generator().manual_seed(0))[1]
    whole, collate = whole_batches(dataset, None)
    assert isinstance(whole, WholeBatches)
    assert whole.dataset is dataset and len(whole) == len(dataset)
    assert whole.indices == dataset.indices  # a Subset's own attribute
    assert all(torch.equal(a, b) for a, b in zip(whole[3], dataset[3], strict=True))
    assert collate([whole[0], whole[1]])[0].shape == (2, 32)  # per sample, as a first batch is read
    again = pickle.loads(pickle.dumps(whole))  # as a spawned worker gets it
    assert_same([collate(again.__getitems__([4, 1]))], [default_collate([dataset[4], dataset[1]])])
    assert whole_batches(whole, collate_whole) == (whole, collate_whole)  # built again: as it is


class Doubled(TensorDataset):
    @override
    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        return tuple(2 * tensor for tensor in super().__getitem__(index))


class Reversed(Subset[Any]):
    @override
    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return self.dataset[self.indices[-1 - index]]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [self[index] for index in indices]


@pytest.mark.parametrize(
    ("dataset", "collate_fn"),
    [
        (Doubled(torch.zeros(4, 2)), None),  # a subclass indexes its own way
        (Reversed(regression(), [0, 1, 2]), None),
        (regression(), lambda samples: samples),  # a collate function of the user's own
        (list(regression()), None),
    ],
    ids=["TensorDataset subclass", "Subset subclass", "own collate_fn", "a list"],
)
def test_anything_else_is_left_as_it_is(dataset: Any, collate_fn: Any) -> None:
    assert whole_batches(dataset, collate_fn) == (dataset, collate_fn)


def test_the_worker_search_times_the_loader_the_run_will_use() -> None:
    make = measurement_loaders(regression(), 8, {"collate_fn": default_collate}, timeout_s=5.0)
    loader = make(0, None)
    assert isinstance(loader.dataset, WholeBatches) and loader.collate_fn is collate_whole
    assert dataset_kind(loader.dataset) == "batched tensors"


class Data(BoostedDataModule):
    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = random_split(regression(), [0.75, 0.25], torch.Generator().manual_seed(0))[0]
        self.val_dataset = regression(32, seed=1)


def fit(tmp_path: Path, name: str, data: Any, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    L.seed_everything(3, verbose=False)
    trainer = tiny_trainer(
        tmp_path / name, max_epochs=2, limit_train_batches=None, limit_val_batches=None,
        callbacks=callbacks or [], logger=False, enable_checkpointing=False,
    )  # fmt: skip
    model = BoringModel()
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, *data)
    return trainer


def plain_loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    train = random_split(regression(), [0.75, 0.25], torch.Generator().manual_seed(0))[0]
    return DataLoader(train, batch_size=8, shuffle=True), DataLoader(regression(32, seed=1), batch_size=8)


def weights(trainer: L.Trainer) -> list[Tensor]:
    module = trainer.lightning_module
    assert module is not None
    return [parameter.detach().clone() for parameter in module.parameters()]


def test_a_boosted_datamodule_trains_the_weights_plain_lightning_trains(tmp_path: Path) -> None:
    """Without workers: workers set by hand give the model the CPUs they leave, and another thread
    count sums in another order (the batches from workers are checked above)."""
    plain = fit(tmp_path, "plain", plain_loaders())
    boosted = fit(tmp_path, "boosted", Data(batch_size=8, num_workers=0))
    assert isinstance(boosted.train_dataloader.dataset, WholeBatches)
    assert isinstance(boosted.val_dataloaders.dataset, WholeBatches)
    assert [f.title for f in boosted.datamodule.findings] == ["TensorDataset loaded one gather a batch"]
    assert all(torch.equal(a, b) for a, b in zip(weights(boosted), weights(plain), strict=True))


def test_auto_num_workers_rebuilds_a_users_loader_to_gather_whole_batches(tmp_path: Path) -> None:
    plain = fit(tmp_path, "plain", plain_loaders())
    tuner = AutoNumWorkers(tuning=WorkerTuning(max_workers=0))
    boosted = fit(tmp_path, "boosted", plain_loaders(), [tuner])
    assert isinstance(boosted.train_dataloader.dataset, WholeBatches)
    assert all(torch.equal(a, b) for a, b in zip(weights(boosted), weights(plain), strict=True))
    assert [f.title for f in tuner.findings].count("TensorDataset loaded one gather a batch") == 1


def test_a_collate_fn_of_the_users_own_keeps_per_sample_loading(tmp_path: Path) -> None:
    trainer = fit(tmp_path, "own", Data(batch_size=8, num_workers=0, collate_fn=default_collate))
    assert isinstance(trainer.train_dataloader.dataset, WholeBatches)  # torch's own: the same batches
    trainer = fit(tmp_path, "stacked", Data(batch_size=8, num_workers=0, collate_fn=stack_pairs))
    assert type(trainer.train_dataloader.dataset) is Subset


def stack_pairs(samples: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    return [torch.stack([sample[0] for sample in samples]), torch.stack([sample[1] for sample in samples])]


class CountsRows(BoringModel):
    """Logs the rows each rank trained on, summed over the ranks, and whether its loader gathers
    whole batches."""

    def __init__(self) -> None:
        super().__init__(features=1)
        self.rows = 0.0
        self.count = 0

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.rows += float(batch[0].sum())
        self.count += len(batch[0])
        return super().training_step(batch, batch_idx)

    @override
    def on_train_epoch_end(self) -> None:
        self.log("rows", self.rows, reduce_fx="sum", sync_dist=True)
        self.log("count", float(self.count), reduce_fx="sum", sync_dist=True)
        whole = float(isinstance(self.trainer.train_dataloader.dataset, WholeBatches))
        self.log("whole", whole, reduce_fx="min", sync_dist=True)


class Counting(BoostedDataModule):
    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = TensorDataset(torch.arange(64.0).view(64, 1), torch.zeros(64, 2))


@pytest.mark.ddp
def test_each_ddp_rank_gathers_its_own_share_of_the_rows(tmp_path: Path) -> None:
    trainer = tiny_trainer(
        tmp_path, devices=2, strategy="ddp_spawn", limit_train_batches=None, limit_val_batches=0,
        logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(CountsRows(), datamodule=Counting(batch_size=8, num_workers=0))
    metrics = trainer.callback_metrics
    assert float(metrics["whole"]) == 1.0
    assert float(metrics["count"]) == 64 and float(metrics["rows"]) == sum(range(64))  # each row once
