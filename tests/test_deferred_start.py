"""A training loader built while `AutoBatchSize` may still change its batch size starts its workers
only once that size is known: never for a loader thrown away at the new size, at the decision for
a kept one, with the random draws of a run without the callback."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator
from test_goodput import Classes, OneCycleMLP, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
from typing_extensions import override

from lightning_boost import AutoBatchSize
from lightning_boost.workers.loaders import SameOrderDataLoader, start_deferred_workers


def shuffled(loader_class: type[DataLoader[Any]] = DataLoader, **options: Any) -> DataLoader[Any]:
    data = TensorDataset(torch.arange(64.0))
    return loader_class(data, batch_size=8, shuffle=True, num_workers=1, **options)


def workers() -> set[int | None]:
    """The pids of this process's live children (DataLoader workers are multiprocessing's)."""
    return {child.pid for child in multiprocessing.active_children()}


def test_a_deferred_loader_starts_its_workers_at_its_first_batch_with_a_plain_loaders_draws() -> None:
    torch.manual_seed(0)
    expected, after = list(shuffled()), torch.rand(1)
    loader = shuffled(SameOrderDataLoader)
    loader.defer_start = True
    torch.manual_seed(0)
    before, state = workers(), torch.get_rng_state()
    iterator = iter(loader)
    assert not workers() - before and torch.equal(torch.get_rng_state(), state)  # no fork, no draw yet
    batches = list(iterator)
    assert [b[0].tolist() for b in batches] == [b[0].tolist() for b in expected]
    assert torch.equal(torch.rand(1), after)
    assert not loader.defer_start  # the next epoch's iterator is a plain one


def test_a_deferred_loader_started_early_loads_as_if_iterated_then() -> None:
    torch.manual_seed(0)
    plain_loader = shuffled(persistent_workers=True)
    plain = iter(plain_loader)
    after = torch.rand(1)
    loader = shuffled(SameOrderDataLoader, persistent_workers=True)
    loader.defer_start = True
    torch.manual_seed(0)
    before = workers()
    iterator = iter(loader)
    start_deferred_workers(loader)  # the batch size stays: start them now
    started = workers() - before
    assert len(started) == 1
    assert torch.equal(torch.rand(1), after)  # the draws iter() makes, at the start
    assert [b[0].tolist() for b in iterator] == [b[0].tolist() for b in plain]
    start_deferred_workers(loader)  # started once; nothing more
    assert workers() - before == started  # its persistent worker, and no other
    # the persistent workers end here, as a fit's end ends them: an iterator with live workers left
    # to the cyclic garbage collector costs 5 s a worker (its queues close before its `__del__` asks
    # the workers to stop); in the full suite a later test's batch-size trial paid them and kept 32
    for ended in (loader, plain_loader):
        _shutdown_workers_and_reset_iterator(ended)
    assert not workers() - before


class Workers(Classes):
    """`Classes` with one worker set by hand, so its training loader forks one."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_workers = 1


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each multiprocess iterator made, as (the split, the loader's batch size): the training set has
    more than 1,024 samples. `Sanity` adds the sanity check's start. A spy on torch's own iterator."""
    events: list[tuple[str, int]] = []
    real = _MultiProcessingDataLoaderIter.__init__

    def spy(self: _MultiProcessingDataLoaderIter, loader: DataLoader[Any]) -> None:
        split = "train" if len(loader.dataset) > 1024 else "val"  # type: ignore[arg-type]
        events.append((split, loader.batch_size or 0))
        real(self, loader)

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "__init__", spy)
    return events


class Sanity(L.Callback):
    def __init__(self, events: list[tuple[str, int]]) -> None:
        self.events = events

    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.events.append(("sanity", 0))


@pytest.mark.usefixtures("fixed_cost_steps", "long_planned_run")
def test_a_loader_built_early_and_thrown_away_at_the_tuned_size_never_starts_its_workers(
    tmp_path: Path, started: list[tuple[str, int]]
) -> None:
    callback = AutoBatchSize(retune=True, cache_dir=tmp_path / "cache", min_efficiency=0.5)
    model = OneCycleMLP()  # `estimated_stepping_batches` builds the batch-32 loader before the fit
    # the run-length rules lifted: this test is about the loader (twice a CI run's first trial took
    # 5.1 s, the garbage workers of the test above, and the 3-epoch run kept 32)
    trainer = quiet_trainer(tmp_path, [callback, Sanity(started)], max_epochs=3)
    trainer.fit(model, datamodule=Workers(samples=16384, batch_size=32))
    decision = callback.decision
    assert decision is not None and decision.batch_size > 32
    assert [event for event in started if event[0] == "train"] == [("train", decision.batch_size)]


def test_a_loader_built_early_at_a_kept_size_starts_at_the_decision_with_a_plain_runs_draws(
    tmp_path: Path, started: list[tuple[str, int]]
) -> None:
    def fit(callbacks: list[L.Callback]) -> dict[str, torch.Tensor]:
        L.seed_everything(0)
        model = OneCycleMLP()
        trainer = quiet_trainer(tmp_path, [*callbacks, Sanity(started)], max_steps=20)  # too short to tune
        trainer.fit(model, datamodule=Workers(samples=4096, batch_size=32))
        return model.state_dict()

    plain = fit([])
    plain_events = list(started)
    started.clear()
    callback = AutoBatchSize(retune=True, cache_dir=tmp_path / "cache")
    boosted = fit([callback])
    assert callback.decision is not None and callback.decision.kept
    assert plain_events[:2] == started[:2] == [("train", 32), ("sanity", 0)]  # before the sanity check
    assert all(torch.equal(plain[name], boosted[name]) for name in plain)  # the same batches, in order
