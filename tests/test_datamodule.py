"""`BoostedDataModule` in real Trainer runs on CPU: settings, tuning, failures, order, cache, DDP, CLI."""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_boost import BoostedDataModule, BoostWarning, WorkerTuning
from lightning_boost.data.datamodule import built_by_datamodule
from lightning_boost.testing import BoringModel, RandomDataset, cpu_only, tiny_trainer

#: AutoBatchSize runs here are a few batches long; its run-length rules are tested in test_goodput.
pytestmark = pytest.mark.usefixtures("long_planned_run")

#: The trials timed before the fit (the path of evaluation loaders, streams and `online=False`); the
#: search on the first epoch's own batches is tested in test_online_workers.
FAST = WorkerTuning(window_s=0.2, timeout_s=5.0, prefetch_factors=(2,), skip_short_runs=False, online=False)


class IndexDataset(Dataset[tuple[Tensor, Tensor]]):
    """Sample i is (features, i): a training step can record exactly which samples it saw."""

    def __init__(self, length: int = 64, features: int = 32) -> None:
        self.inputs = torch.randn(length, features, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.inputs[index], torch.tensor(index)


class CrashingInWorkers(IndexDataset):
    """Works in the main process; a worker process dies (a native crash, as far as torch can tell)."""

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if torch.utils.data.get_worker_info() is not None:
            os._exit(1)
        return super().__getitem__(index)


class HangingInWorkers(IndexDataset):
    """Works in the main process; in a worker it never returns (a deadlock after fork)."""

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(3600)
        return super().__getitem__(index)


class Indexed(BoostedDataModule):
    def __init__(self, dataset: Dataset[Any] | None = None, val: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("worker_tuning", FAST)
        super().__init__(**kwargs)
        self.dataset = dataset if dataset is not None else IndexDataset()
        self.with_val = val

    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = self.dataset
        if self.with_val:
            self.val_dataset = IndexDataset(16)


class SeenIndices(BoringModel):
    """Records the sample indices of every training batch, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, indices = batch
        self.seen.append(indices.tolist())
        loss = self.layer(inputs).square().mean()
        self.log("train_loss", loss)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.layer(batch[0]).square().mean())


def _fit(
    tmp_path: Path, datamodule: BoostedDataModule, epochs: int = 1, **trainer_kwargs: Any
) -> SeenIndices:
    L.seed_everything(7, verbose=False)
    model = SeenIndices()
    options = {
        "max_epochs": epochs,
        "limit_train_batches": 1.0,
        "logger": False,
        "enable_checkpointing": False,
    }
    tiny_trainer(tmp_path, **(options | trainer_kwargs)).fit(model, datamodule=datamodule)
    return model


def test_loaders_have_the_promised_settings(tmp_path: Path) -> None:
    datamodule = Indexed(batch_size=8, val=True)
    _fit(tmp_path, datamodule)
    train, val = datamodule.train_dataloader(), datamodule.val_dataloader()
    assert isinstance(val, torch.utils.data.DataLoader)
    choice = next(iter(datamodule.worker_tuner.choices.values()))
    assert choice.source == "measured" and [t.num_workers for t in choice.trials][:2] == [0, 1]
    # validation's 16 samples are 2 batches a pass: no worker past them (a choice of 3 on a loaded
    # 16-CPU host failed here)
    for loader, workers in ((train, choice.num_workers), (val, min(choice.num_workers, 2))):
        assert loader.num_workers == workers
        assert loader.persistent_workers == (workers > 0)
        assert loader.pin_memory is False  # a CPU run
        assert isinstance(loader.worker_init_fn, functools.partial)
        assert loader.worker_init_fn.keywords == {"rank": 0}
    assert isinstance(train.sampler, torch.utils.data.RandomSampler)
    assert isinstance(val.sampler, torch.utils.data.SequentialSampler)
    assert len(datamodule.worker_tuner.choices) == 1  # validation reused the training measurement
    assert datamodule.findings[0].area == "data" and "num_workers=" in datamodule.findings[0].title


def test_from_datasets_builds_the_boosted_loaders(tmp_path: Path) -> None:
    """Lightning's `from_datasets` (inherited) put plain loaders of its own on the instance, with
    the size in a closure: `AutoBatchSize` then failed ("needs a training DataLoader") and nothing
    was tuned. It now sets the datasets, as a subclass's `setup()` would."""
    datamodule = BoostedDataModule.from_datasets(
        train_dataset=IndexDataset(), val_dataset=IndexDataset(16), batch_size=8, worker_tuning=FAST
    )
    assert isinstance(datamodule, BoostedDataModule) and datamodule.num_workers is None  # measured
    model = _fit(tmp_path, datamodule)
    assert sorted(i for batch in model.seen for i in batch) == list(range(len(IndexDataset())))
    assert len(datamodule.val_dataloader()) == 2  # 16 samples, batches of 8
    assert datamodule.worker_tuner.choices  # the workers were searched
    fixed = BoostedDataModule.from_datasets(train_dataset=IndexDataset(), batch_size=4, num_workers=0)
    assert fixed.num_workers == 0 and fixed.batch_size == 4


def test_settings_fixed_by_hand_are_kept_and_not_measured(tmp_path: Path) -> None:
    datamodule = Indexed(batch_size=8, num_workers=1, prefetch_factor=3, persistent_workers=False,
                         loader_kwargs={"timeout": 30.0})  # fmt: skip
    _fit(tmp_path, datamodule)
    loader = datamodule.train_dataloader()
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (1, 3, False)
    assert loader.timeout == 30.0
    assert datamodule.worker_tuner.choices == {}


def test_persistent_workers_are_off_with_pinned_memory_and_reloading(tmp_path: Path) -> None:
    datamodule = Indexed(batch_size=8, num_workers=1, pin_memory=True)
    datamodule.trainer = tiny_trainer(tmp_path, reload_dataloaders_every_n_epochs=1)
    assert datamodule.loader_settings(IndexDataset())["persistent_workers"] is False
    datamodule.trainer = tiny_trainer(tmp_path)
    assert datamodule.loader_settings(IndexDataset())["persistent_workers"] is True


def test_each_sample_is_seen_once_per_epoch_in_the_untuned_order(tmp_path: Path) -> None:
    """Against a run that loads in the main process: tuned workers (`SameOrderDataLoader`) keep
    its order in every epoch, where workers set by hand, persistent, draw their base seed once and
    shuffle the second epoch otherwise (compared with those, this failed wherever the measurement
    chose workers: on a loaded host, ten test processes on 2 CPUs)."""
    tuned = Indexed(batch_size=8, retune=True)
    seen_tuned = _fit(tmp_path, tuned, epochs=2).seen
    untuned = _fit(tmp_path, Indexed(batch_size=8, num_workers=0), epochs=2).seen
    assert seen_tuned == untuned  # same order: tuning drew nothing from the global RNG
    for epoch in (seen_tuned[:8], seen_tuned[8:]):
        assert sorted(i for batch in epoch for i in batch) == list(range(64))


def test_a_gpu_run_holds_the_loader_to_the_steps_own_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulated: the tuner is told it runs on a 16-CPU CUDA machine (this one has no GPU); the
    # loaders, the transfer and the training steps on a copy of the model are real, on the CPU.
    from lightning_boost.hardware import EXAMPLES
    from lightning_boost.workers import tuner

    monkeypatch.setattr(tuner, "hardware_for", lambda trainer: EXAMPLES["h100"])
    tuning = WorkerTuning(
        window_s=0.2, timeout_s=5.0, prefetch_factors=(2,), max_workers=2, skip_short_runs=False, online=False
    )
    tuned = Indexed(batch_size=8, worker_tuning=tuning, retune=True)
    model = _fit(tmp_path, tuned, epochs=2)
    (choice,) = tuned.worker_tuner.choices.values()
    assert choice.consumer_samples_per_s is not None and choice.consumer_samples_per_s > 0
    counts = [t.num_workers for t in choice.trials]
    # top-down, the budget after none; unless loading in the main process takes under 5 % of the
    # step already (a loaded host slows the step on the copy: 172 against 20,152 samples/s, by hand)
    assert counts[:2] == [0, 2] or (counts == [0] and "under 5% of the step" in choice.reason), choice
    assert "step" in choice.reason
    assert choice.seconds >= sum(t.seconds for t in choice.trials)  # the step's timing is counted
    detail = tuned.findings[0].detail
    assert ("Worker start-up (until one batch per worker arrived)" in detail) == (len(counts) > 1)
    assert f"The training step alone: {choice.consumer_samples_per_s:.0f} samples/s" in detail
    # against the main process's order (workers set by hand, persistent, shuffle epoch 2 otherwise)
    by_hand = _fit(tmp_path, Indexed(batch_size=8, num_workers=0), epochs=2)
    assert model.seen == by_hand.seen  # timing the step on a copy left no trace
    assert torch.equal(model.layer.weight, by_hand.layer.weight)


def test_an_evaluation_loader_starts_no_worker_its_pass_cannot_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass hands its batches to the workers in turn from the first, so the validation loader
    gets at most its batches per pass (1 here) of the training loader's 2 workers, and says so;
    every validation sample is still read. Workers set by hand are kept. The training search's
    winner is held to the same cap."""
    # Simulated: the tuner's choice of 2 workers, as on a many-core machine (this one has 2 CPUs,
    # where the tuner keeps a run this small in the main process). The loaders and fits are real.
    from lightning_boost.workers.search import WorkerChoice
    from lightning_boost.workers.segments import apply_setting

    tuned = Indexed(batch_size=16, val=True)
    choice = WorkerChoice(num_workers=2, prefetch_factor=2, reason="simulated", source="measured")
    monkeypatch.setattr(tuned.worker_tuner, "decide", lambda *args: (choice, None))
    seen: list[int] = []

    class CountsValidation(SeenIndices):
        @override
        def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            seen.extend(batch[1].tolist())

    L.seed_everything(7, verbose=False)
    trainer = tiny_trainer(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(CountsValidation(), datamodule=tuned)
    train, val = trainer.train_dataloader, trainer.val_dataloaders
    assert isinstance(train, DataLoader) and isinstance(val, DataLoader)
    assert (train.num_workers, val.num_workers, val.persistent_workers) == (2, 1, True)
    assert sorted(seen[-16:]) == list(range(16))  # the last pass read every sample once
    (capped,) = [f for f in tuned.findings if f.title.startswith("val loader")]
    assert capped.title == "val loader: num_workers=1, not the 2 decided"
    apply_setting(val, WorkerChoice(num_workers=6, prefetch_factor=4, reason="the search's winner"))
    assert (val.num_workers, val.prefetch_factor) == (1, 4)
    by_hand = Indexed(batch_size=16, val=True, num_workers=2)
    tiny_trainer(tmp_path / "by_hand", max_epochs=1, logger=False, enable_checkpointing=False).fit(
        CountsValidation(), datamodule=by_hand
    )
    assert by_hand.val_dataloader().num_workers == 2


@pytest.mark.gpu
def test_on_cuda_the_workers_are_searched_on_the_runs_own_bf16_steps(tmp_path: Path) -> None:
    # at most 2 workers: 10 % of 256 batches makes segments of 8, which time 2 workers (4 batches
    # in flight) but not the 15 of a 16-CPU machine's budget (that run keeps the budget, unsearched)
    tuning = WorkerTuning(max_workers=2, timeout_s=10.0, prefetch_factors=(2,))
    tuned = Indexed(IndexDataset(4096), batch_size=16, worker_tuning=tuning, retune=True)
    model = _fit(tmp_path, tuned, accelerator="cuda", precision="bf16-mixed")  # 256 batches
    (choice,) = tuned.worker_tuner.choices.values()
    assert choice.source == "searched" and len(choice.trials) >= 2
    assert all(trial.samples_per_s > 0 for trial in choice.trials)
    assert "on the run's own steps" in choice.reason  # judged by the run's own steps, not a copy's
    seen = sorted(index for batch in model.seen for index in batch)
    assert seen == list(range(4096))  # each sample once, search segments included
    loader = tuned.train_dataloader()
    assert loader.pin_memory
    inputs, _ = next(iter(loader))
    assert inputs.is_pinned()  # page-locked: the copy to the GPU can be non-blocking


@pytest.mark.parametrize(
    ("dataset", "cause"), [(CrashingInWorkers(), "crashed"), (HangingInWorkers(), "hung")]
)
def test_failing_workers_are_survived_with_a_fallback(
    tmp_path: Path, dataset: Dataset[Any], cause: str
) -> None:
    tuning = WorkerTuning(
        window_s=0.2, timeout_s=2.0, prefetch_factors=(2,), skip_short_runs=False, online=False
    )
    datamodule = Indexed(dataset, batch_size=8, worker_tuning=tuning)
    model = _fit(tmp_path, datamodule)
    assert len(model.seen) == 8  # the epoch ran, in the main process
    assert datamodule.train_dataloader().num_workers == 0
    main, dropped = datamodule.findings[:2]
    assert main.severity.value == "warn" and "fell back" in main.title
    assert dropped.title.startswith("1 worker, prefetch 2 dropped: " + cause)
    assert dropped.fix


def test_the_cache_is_reused_and_retune_measures_again(tmp_path: Path, _private_tuning_cache: Path) -> None:
    first = Indexed(batch_size=8)
    _fit(tmp_path, first)
    stored = json.loads((_private_tuning_cache / "workers.json").read_text())
    assert len(stored["entries"]) == 1
    started = time.perf_counter()
    second = Indexed(batch_size=8)
    second.trainer = tiny_trainer(tmp_path)
    second.trainer.strategy.connect(SeenIndices())  # the same model: on a CPU it is part of the key
    second.setup("fit")
    second.train_dataloader()
    assert time.perf_counter() - started < 1.0  # correctness bound, not a benchmark: no measuring happened
    (choice,) = second.worker_tuner.choices.values()
    assert choice.source == "cache" and "Reused the cached measurement" in second.findings[0].detail
    third = Indexed(batch_size=8, retune=True)
    _fit(tmp_path, third)
    assert next(iter(third.worker_tuner.choices.values())).source == "measured"


def test_a_corrupt_cache_is_ignored_with_a_warning(tmp_path: Path, _private_tuning_cache: Path) -> None:
    _private_tuning_cache.mkdir(parents=True)
    (_private_tuning_cache / "workers.json").write_text("{ truncated")
    datamodule = Indexed(batch_size=8)
    datamodule.trainer = tiny_trainer(tmp_path)
    datamodule.setup("fit")
    with pytest.warns(BoostWarning, match="Ignoring the worker-tuning cache"):
        datamodule.train_dataloader()
    assert next(iter(datamodule.worker_tuner.choices.values())).source == "measured"
    assert json.loads((_private_tuning_cache / "workers.json").read_text())["schema_version"] == 1


def test_a_checkpoint_carries_the_choice(tmp_path: Path) -> None:
    datamodule = Indexed(batch_size=8)
    trainer = tiny_trainer(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(SeenIndices(), datamodule=datamodule)
    checkpoint = tmp_path / "tuned.ckpt"
    trainer.save_checkpoint(checkpoint)
    resumed = Indexed(batch_size=8)
    again = tiny_trainer(tmp_path, max_epochs=2, logger=False, enable_checkpointing=False)
    again.fit(SeenIndices(), datamodule=resumed, ckpt_path=checkpoint)
    assert resumed.worker_tuner.choices == datamodule.worker_tuner.choices  # the saved one, trials and all
    (finding,) = [
        f for f in resumed.findings if re.match(r"train loader at batch \d+: num_workers=", f.title)
    ]
    assert (
        finding.detail.startswith("Restored from the checkpoint") and finding.data["source"] == "checkpoint"
    )


class _Recorder(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.marks: dict[str, set[float]] = {"train": set(), "val": set()}

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.marks["train"].add(float(batch[1].flatten()[0]))
        return super().training_step(batch, batch_idx)

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.marks["val"].add(float(batch[1].flatten()[0]))


class _Regression(BoostedDataModule):
    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = RandomDataset(length=32)
        self.val_dataset = RandomDataset(length=16, seed=1)


def _mark(value: float, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    inputs, targets = batch
    return inputs, torch.full_like(targets, value)


def test_device_transforms_run_on_the_device_batch_per_stage(tmp_path: Path) -> None:
    datamodule = _Regression(batch_size=8, num_workers=0, device_transforms=functools.partial(_mark, 1.0),
                             eval_device_transforms=functools.partial(_mark, 2.0))  # fmt: skip
    model = _Recorder()
    tiny_trainer(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False).fit(
        model, datamodule=datamodule
    )
    assert model.marks == {"train": {1.0}, "val": {2.0}}


class _NoValidationStep(SeenIndices):
    validation_step = None  # type: ignore[assignment]


def test_no_validation_set_means_no_validation(tmp_path: Path) -> None:
    model = _fit(tmp_path, Indexed(batch_size=8, num_workers=0))  # has a validation_step: no warning
    assert len(model.seen) == 8
    L.seed_everything(7, verbose=False)
    tiny_trainer(tmp_path, logger=False).fit(
        _NoValidationStep(), datamodule=Indexed(batch_size=8, num_workers=0)
    )


def test_a_missing_dataset_says_where_to_assign_it(tmp_path: Path) -> None:
    datamodule = Indexed(batch_size=8, num_workers=0)
    with pytest.raises(
        RuntimeError, match=r"`Indexed.test_dataset` is not set: assign `self.test_dataset = ...`"
    ):
        tiny_trainer(tmp_path, logger=False).test(BoringModel(), datamodule=datamodule)


class SeenPerLoader(SeenIndices):
    """Records the sample indices each evaluation loader (`dataloader_idx`) handed its step."""

    def __init__(self) -> None:
        super().__init__()
        self.evaluated: dict[int, list[int]] = {}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluated.setdefault(dataloader_idx, []).extend(batch[1].tolist())
        self.log("val_loss", self.layer(batch[0]).square().mean())

    test_step = validation_step  # Lightning's hook for `trainer.test`, recorded alike (not a pytest test)


class SeveralEvaluationSets(Indexed):
    def __init__(self, container: type, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.container = container

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        sets = {"clean": IndexDataset(16), "noisy": IndexDataset(24)}
        self.val_dataset = self.test_dataset = (
            sets if self.container is dict else self.container(sets.values())
        )


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_several_evaluation_sets_get_a_loader_each(tmp_path: Path, container: type) -> None:
    """`self.val_dataset = [clean, noisy]` (or a dict of them), as a user's `val_dataloader`
    returns several loaders: each set evaluated whole by its own loader (`dataloader_idx`), in a
    fit and in `validate`/`test` run alone. It failed in `default_collate` on the datasets."""
    datamodule = SeveralEvaluationSets(container, batch_size=8, num_workers=None)
    model = SeenPerLoader()
    trainer = tiny_trainer(tmp_path, logger=False, enable_checkpointing=False, limit_val_batches=1.0)
    trainer.fit(model, datamodule=datamodule)
    every = {0: list(range(16)), 1: list(range(24))}
    assert {k: sorted(set(v)) for k, v in model.evaluated.items()} == every
    for run in (trainer.validate, trainer.test):
        model.evaluated = {}
        run(model, datamodule=datamodule, verbose=False)
        assert {k: sorted(v) for k, v in model.evaluated.items()} == every  # one pass each


def test_several_training_sets_are_refused_with_the_fix(tmp_path: Path) -> None:
    model = SeenIndices()
    datamodule = Indexed([IndexDataset(16), IndexDataset(8)], batch_size=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`Indexed.train_dataset` holds several datasets.*ConcatDataset"):
        tiny_trainer(tmp_path, logger=False).fit(model, datamodule=datamodule)
    assert model.seen == []


class _NoLength(Dataset[tuple[Tensor, Tensor]]):
    """Indexable, but with no `__len__`: a sampler cannot draw from it."""

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return torch.zeros(32), torch.tensor(index)


class _Stream(torch.utils.data.IterableDataset[tuple[Tensor, Tensor]]):
    """64 samples in order, as a stream."""

    def __iter__(self) -> Any:
        dataset = IndexDataset()
        return (dataset[i] for i in range(len(dataset)))


def test_a_map_style_dataset_without_length_is_named_before_training(tmp_path: Path) -> None:
    model = SeenIndices()
    with pytest.raises(
        TypeError, match=r"`Indexed.train_dataset` \(_NoLength\) has no `__len__`.*IterableDataset"
    ):
        tiny_trainer(tmp_path, logger=False).fit(model, datamodule=Indexed(_NoLength(), batch_size=8))
    assert model.seen == []  # not a step was taken


def test_an_iterable_dataset_trains_in_its_own_order_with_the_reasons(tmp_path: Path) -> None:
    datamodule = Indexed(_Stream(), batch_size=8)  # shuffle=True, the default
    model = _fit(tmp_path, datamodule)
    assert [i for batch in model.seen for i in batch] == list(range(64))  # the stream's own order
    titles = [f.title for f in datamodule.findings]
    assert "`shuffle` left to _Stream" in titles
    assert any(
        f.title.endswith("num_workers=0: not measured") and "IterableDataset" in f.detail
        for f in datamodule.findings
    )
    assert datamodule.train_dataloader().num_workers == 0  # its sharding across workers is its own


class Weighted(Indexed):
    """An imbalanced set drawn by weight: `setup()` assigns the sampler beside the dataset, as a
    Lightning user builds a `WeightedRandomSampler` from the labels it just loaded."""

    def __init__(self, draws: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.draws = draws

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.train_sampler = _weighted(self.draws)


def _weighted(draws: int) -> torch.utils.data.WeightedRandomSampler:
    weights = torch.linspace(0.1, 1.0, 64)  # the later samples drawn about 10x as often as the first
    return torch.utils.data.WeightedRandomSampler(weights, draws, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tensors", [False, True], ids=["dataset", "tensor_dataset"])
def test_a_sampler_set_in_setup_draws_the_training_batches(tmp_path: Path, tensors: bool) -> None:
    """The batches trained are the sampler's, in its order, epoch after epoch, with the workers
    searched on them (a `TensorDataset` too, loaded one gather a batch); an epoch is the sampler's
    96 draws, not the dataset's 64 samples."""
    dataset: Dataset[Any] = IndexDataset()
    if tensors:
        dataset = torch.utils.data.TensorDataset(IndexDataset().inputs, torch.arange(64))
    datamodule = Weighted(96, dataset=dataset, batch_size=8, retune=True)
    seen = _fit(tmp_path, datamodule, epochs=2).seen
    order = torch.utils.data.BatchSampler(_weighted(96), batch_size=8, drop_last=False)
    assert seen == [*order, *order]  # 12 batches an epoch, the second epoch the sampler's next draws
    assert datamodule.train_dataloader().sampler is datamodule.train_sampler
    assert datamodule.worker_tuner.choices  # searched


def test_a_sampler_that_cannot_draw_the_samples_is_named_with_the_fix() -> None:
    """A `BatchSampler` yields lists of indices: as `train_sampler` each "sample" would be a batch
    (a `TensorDataset` indexed with a list, or an error deep in the dataset's `__getitem__`). A
    stream orders its own samples: torch's own error says only "incompatible"."""
    datamodule = Indexed(batch_size=8)
    datamodule.setup("fit")
    sampler = torch.utils.data.RandomSampler(range(64))
    datamodule.train_sampler = torch.utils.data.BatchSampler(sampler, 8, drop_last=False)  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"`Indexed.train_sampler` is a BatchSampler.*its `sampler`"):
        datamodule.train_dataloader()
    stream = Indexed(_Stream(), batch_size=8)
    stream.setup("fit")
    stream.train_sampler = sampler
    with pytest.raises(TypeError, match=r"`train_dataset` \(_Stream\) is an IterableDataset.*`__iter__`"):
        stream.train_dataloader()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, "`batch_size` expected an int >= 1, got 0"),
        ({"batch_size": None}, TypeError, "`batch_size` expected an int >= 1, got None"),
        ({"num_workers": -1}, ValueError, "`num_workers` expected an int >= 0 or None"),
        ({"num_workers": 0, "prefetch_factor": 2}, ValueError, "`prefetch_factor` expected None with"),
        ({"collate_fn": "stack"}, TypeError, r"`collate_fn` expected a callable or None, got 'stack'"),
        ({"loader_kwargs": {"num_workers": 2}}, ValueError, "pass `num_workers=...` instead"),
        ({"loader_kwargs": {"timeuot": 2}}, ValueError, "Did you mean 'timeout'"),
        (
            {"loader_kwargs": {"sampler": None}},
            ValueError,
            r"assign `self.train_sampler = ...` in `setup\(\)`",
        ),
        (
            {"loader_kwargs": {"dataset": None}},
            ValueError,
            r"assign `self.train_dataset = ...` in `setup\(\)`",
        ),
        (
            {"loader_kwargs": {"batch_sampler": None}},
            ValueError,
            r"batches by `batch_size`.*`AutoNumWorkers`",
        ),
    ],
)
def test_bad_arguments_are_named_with_the_fix(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        BoostedDataModule(**kwargs)


class _SaveChoice(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        assert isinstance(datamodule, BoostedDataModule)
        choices = {key: choice.to_dict() for key, choice in datamodule.worker_tuner.choices.items()}
        workers = trainer.train_dataloader.num_workers  # type: ignore[union-attr]
        payload = {"choices": choices, "num_workers": workers}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


@pytest.mark.ddp
def test_two_ranks_use_one_measurement(tmp_path: Path) -> None:
    options = {"logger": False, "enable_checkpointing": False, "callbacks": [_SaveChoice(tmp_path)]}
    trainer = tiny_trainer(tmp_path, devices=2, strategy="ddp_spawn", **options)
    trainer.fit(SeenIndices(), datamodule=Indexed(batch_size=8))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1  # measured throughputs included: rank 1 received rank 0's, it did not measure
    (choice,) = rank0["choices"].values()
    assert choice["source"] == "measured" and choice["trials"]
    assert rank0["num_workers"] == choice["num_workers"]


class FakeImages(BoostedDataModule):
    """A user's datamodule: its own argument plus the mixin's, passed through."""

    def __init__(self, length: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length = length

    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = RandomDataset(length=self.length)
        self.val_dataset = RandomDataset(length=16, seed=1)


def test_a_subclass_is_configurable_from_lightning_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["train.py"])
    # LightningCLI 2.6.6 itself calls a jsonargparse API that jsonargparse 4.53 deprecates.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    config = tmp_path / "config.yaml"
    config.write_text(
        "seed_everything: 0\ntrainer:\n  max_epochs: 1\n  accelerator: cpu\n  logger: false\n"
        "  enable_checkpointing: false\n"
        f"  default_root_dir: {tmp_path}\n  enable_progress_bar: false\n  enable_model_summary: false\n"
        "data:\n  length: 48\n  batch_size: 12\n  num_workers: 0\n  worker_tuning:\n    window_s: 0.5\n"
    )
    with cpu_only():  # the config pins the CPU: on a GPU machine Lightning would warn
        args = ["fit", "--config", str(config)]
        cli = LightningCLI(BoringModel, FakeImages, args=args, save_config_kwargs={"overwrite": True})
    datamodule = cli.datamodule
    assert isinstance(datamodule, FakeImages)
    assert (datamodule.length, datamodule.batch_size, datamodule.num_workers) == (48, 12, 0)
    assert datamodule.worker_tuner.tuning.window_s == 0.5
    assert cli.trainer.state.finished


@pytest.mark.usefixtures("fixed_cost_steps")
def test_lightning_cli_saves_the_config_the_run_trained_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["train.py"])
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # as above
    run = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"seed_everything: 0\ntrainer:\n  max_epochs: 1\n  accelerator: cpu\n  logger: false\n"
        f"  enable_checkpointing: false\n  default_root_dir: {run}\n  enable_progress_bar: false\n"
        "  callbacks:\n  - class_path: lightning_boost.AutoBatchSize\n    init_args:\n"
        "      max_batch_size: 32\n      lr_scaling: linear\n      min_efficiency: 0.5\n"
        "model:\n  lr: 0.05\n"
        "data:\n  length: 64\n  batch_size: 8\n"
        "  worker_tuning:\n    window_s: 0.2\n    prefetch_factors: [2]\n"
    )
    with cpu_only():
        cli = LightningCLI(BoringModel, FakeImages, args=["fit", "--config", str(config)])
    loader = cli.trainer.train_dataloader
    factor = next(c for c in cli.trainer.callbacks if type(c).__name__ == "AutoBatchSize").result["lr_factor"]
    assert loader.batch_size > 8 and factor == loader.batch_size / 8  # tuned, and the rate scaled with it
    saved = yaml.safe_load((run / "config.tuned.yaml").read_text())
    assert saved["data"]["batch_size"] == loader.batch_size
    assert saved["data"]["num_workers"] == loader.num_workers
    assert saved["model"]["lr"] == pytest.approx(0.05 * factor)
    assert not saved["trainer"]["callbacks"]  # AutoBatchSize's work is in the values now
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["batch_size"] == 8  # as given

    with cpu_only():  # the run repeated from the tuned config trains the same way, without tuning
        args = ["fit", "--config", str(run / "config.tuned.yaml")]
        again = LightningCLI(BoringModel, FakeImages, args=args, save_config_kwargs={"overwrite": True})
    assert again.trainer.train_dataloader.batch_size == loader.batch_size
    assert again.trainer.train_dataloader.num_workers == loader.num_workers
    assert again.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * factor)


def test_worker_trials_never_load_giant_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch tuned to the whole dataset is timed at `MEASURE_BATCH_CAP` samples a batch (each
    trial once loaded it whole: 39-68 s a loader); the model's step is timed on one real batch,
    and the memory budget counts batches of the real size."""
    from lightning_boost.workers import tuner

    sizes: list[int] = []
    real = tuner.measurement_loaders

    def recording(dataset: Any, batch_size: int, *args: Any) -> Any:
        sizes.append(batch_size)
        return real(dataset, batch_size, *args)

    monkeypatch.setattr(tuner, "measurement_loaders", recording)
    monkeypatch.setattr(tuner, "MEASURE_BATCH_CAP", 256)
    data = Indexed(IndexDataset(2048), batch_size=2048)
    _fit(tmp_path, data)
    (choice,) = data.worker_tuner.choices.values()
    assert sizes == [256, 2048]  # the trials' loader, the model step's single batch
    assert choice.trials[0].batch_bytes == 2048 * (32 * 4 + 8)  # float32 features + an int64 index


class HookCallsSuper(Indexed):
    """A training hook that returns the datamodule's own loader (`super()`), as one that wraps or
    logs around it does."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decided: list[bool] = []  # per loader the hook returned: whether workers were decided for it

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        loader = super().train_dataloader()
        self.decided.append(built_by_datamodule(loader))
        return loader


def test_a_hook_returning_the_datamodules_loader_is_tuned_once_and_said_once(tmp_path: Path) -> None:
    """The hook is overridden, so the pack could not know the loader was the datamodule's:
    `AutoNumWorkers` warned that it could not tune a `SameOrderDataLoader` (the datamodule had),
    and `AutoBatchSize`'s probe of the attribute the hook reads (built at the configured size + 1)
    made the datamodule decide a loader at batch 9 that never trained, with a finding for it; and
    its read of the loader's data decided workers for a loader no batch was loaded from (with
    `preset("auto")` on ResNet-18, a second finding beside the run's loader's)."""
    from lightning_boost import AutoBatchSize, AutoNumWorkers, preset

    datamodule = HookCallsSuper(batch_size=8)
    workers = AutoNumWorkers()
    tuner = AutoBatchSize(min_efficiency=0.5, max_batch_size=8)  # keeps 8: the probe is the point
    _fit(tmp_path, datamodule, callbacks=[workers, tuner], strategy=preset("auto"))
    assert len(datamodule.decided) == 3 and datamodule.decided.count(True) == 1  # the run's loader alone
    assert not workers.findings, [finding.title for finding in workers.findings]
    titles = [finding.title for finding in datamodule.findings if "loader at batch" in finding.title]
    assert len(titles) == 1 and titles[0].startswith("train loader at batch 8: "), titles
