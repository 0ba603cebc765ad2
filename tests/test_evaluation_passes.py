"""`trainer.validate()`, `test()` and `predict()` run alone: each loader's workers are searched on its
own pass, against the step that consumes it, with nothing loaded before the loop; every sample is
evaluated once, in the sampler's order, as the user's own loader would give it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, SequentialSampler
from typing_extensions import override

from lightning_boost import AutoNumWorkers, BoostedDataModule, WorkerTuning
from lightning_boost.testing import tiny_trainer
from lightning_boost.workers.search import WorkerChoice
from tests.conftest import worker_bounds
from tests.test_online_workers import TUNING, IndexedData, Recorder

#: 960 samples at batch 4: 240 batches a pass, so a tenth of it holds three segments of 8.
PASS = 960


class _Counted(IndexedData):
    """`IndexedData` that counts the samples loaded in the main process (workers' loads are theirs)."""

    loads = 0

    @override
    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if os.getpid() == self.main_pid:
            type(self).loads += 1
        return super().__getitem__(index)


class Evaluated(Recorder):
    """Records each evaluated batch's sample indices; predicts them."""

    def __init__(self) -> None:
        super().__init__()
        self.evaluated: list[int] = []

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.evaluated += batch[1].tolist()
        self.log("val_loss", self.layer(batch[0]).square().mean())

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.evaluated += batch[1].tolist()
        self.log("test_loss", self.layer(batch[0]).square().mean())

    @override
    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return batch[1]


class _LoadsBeforeTheLoop(L.Callback):
    """What the main process had loaded when the stage's loop started (the tuning's trials)."""

    def __init__(self) -> None:
        self.loads: dict[str, int] = {}

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.loads["validate"] = _Counted.loads

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.loads["test"] = _Counted.loads

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.loads["predict"] = _Counted.loads


class Sets(BoostedDataModule):
    """Assigns every set it is given at each stage, as a datamodule whose ``setup`` ignores the
    stage does (the README's)."""

    def __init__(self, tuning: WorkerTuning = TUNING, **sets: Any) -> None:
        super().__init__(batch_size=4, worker_tuning=tuning)
        self.sets = sets

    @override
    def setup(self, stage: str) -> None:
        for split, dataset in self.sets.items():
            setattr(self, f"{split}_dataset", dataset)


def _trainer(tmp_path: Path, *callbacks: L.Callback, **options: Any) -> L.Trainer:
    defaults = {"logger": False, "enable_checkpointing": False, "limit_val_batches": 1.0}
    return tiny_trainer(tmp_path, callbacks=list(callbacks), **(defaults | options))


def _only(choices: dict[str, WorkerChoice]) -> WorkerChoice:
    (choice,) = choices.values()
    return choice


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_BOOST_CACHE_DIR", str(tmp_path / "cache"))
    _Counted.loads = 0


def test_predict_is_searched_on_its_own_pass_and_predicts_every_sample_once_in_order(tmp_path: Path) -> None:
    # 1 ms a sample: the pass waits for its data, so the search measures worker counts
    data, before = Sets(predict=_Counted(PASS, load_s=0.001)), _LoadsBeforeTheLoop()
    predicted = _trainer(tmp_path, before).predict(Evaluated(), datamodule=data)
    assert torch.cat(predicted).tolist() == list(range(PASS))  # type: ignore[arg-type]
    assert before.loads["predict"] == 0  # nothing timed before the loop: the search is the pass
    choice = _only(data.worker_tuner.choices)
    assert choice.source == "searched" and len(choice.trials) >= 2
    assert {trial.num_workers for trial in choice.trials} >= {0, 1}
    (finding,) = [f for f in data.findings if f.title.startswith("predict loader at batch 4: num_workers=")]
    assert finding.detail.startswith("Searched on the run's own batches and steps")


def test_test_and_predict_loaders_of_auto_num_workers_keep_every_other_setting(tmp_path: Path) -> None:
    callback, before = AutoNumWorkers(TUNING), _LoadsBeforeTheLoop()
    trainer = _trainer(tmp_path, callback, before, limit_test_batches=1.0, limit_predict_batches=1.0)
    model = Evaluated()
    tested = DataLoader(_Counted(PASS, load_s=0.001), batch_size=4, drop_last=True)
    (result,) = trainer.test(model, tested)
    assert model.evaluated == list(range(PASS)) and before.loads["test"] == 0
    loader = trainer.test_dataloaders
    assert isinstance(loader, DataLoader) and loader is not tested and loader.drop_last
    collate = torch.utils.data.default_collate
    predict = DataLoader(_Counted(PASS), batch_size=4, collate_fn=collate)
    predicted = trainer.predict(model, predict)
    assert torch.cat(predicted).tolist() == list(range(PASS))  # type: ignore[arg-type]
    rebuilt = trainer.predict_dataloaders
    assert isinstance(rebuilt, DataLoader) and rebuilt.collate_fn is collate
    assert isinstance(rebuilt.sampler, SequentialSampler)
    searched = [c for c in callback.worker_tuner.choices.values() if c.source == "searched"]
    assert len(searched) == 2  # each pass on its own: alike sets, other steps
    plain = _trainer(tmp_path, limit_test_batches=1.0)
    assert plain.test(model, tested)[0]["test_loss"] == pytest.approx(result["test_loss"])  # the same model


def test_a_pass_too_short_to_search_keeps_the_prior_without_loading_anything_first(tmp_path: Path) -> None:
    # 16 batches: a tenth of the pass cannot time two settings; nothing repays measuring it
    data, before = Sets(predict=_Counted(64)), _LoadsBeforeTheLoop()
    _trainer(tmp_path, before).predict(Evaluated(), datamodule=data)
    choice = _only(data.worker_tuner.choices)
    assert choice.source == "short run" and not choice.trials and choice.num_workers == 0  # a CPU run
    assert "the predict pass has 16 batches" in choice.reason
    assert before.loads["predict"] == 0 and _Counted.loads == 64


def test_a_pass_measured_before_its_loop_tries_no_more_workers_than_it_has_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `online=False` measures a pass before its loop; a worker past the pass's batches never gets
    # one, so none is tried (before 2026-11-28: up to the CPU budget, then capped)
    bounds = worker_bounds(monkeypatch)
    measured = dataclasses.replace(TUNING, window_s=0.2, online=False, skip_short_runs=False)
    # one batch of 4, slow enough to load that a worker is worth trying
    data, model = Sets(measured, val=IndexedData(4, load_s=0.005)), Evaluated()
    _trainer(tmp_path).validate(model, datamodule=data)
    assert bounds == [1] and model.evaluated == [0, 1, 2, 3]
    assert all(trial.num_workers <= 1 for trial in _only(data.worker_tuner.choices).trials)
    assert "val loader: candidates up to 1 worker(s)" in [finding.title for finding in data.findings]


def test_validate_and_test_decide_on_their_own_sets_not_the_training_set(tmp_path: Path) -> None:
    train = _Counted(PASS)
    data = Sets(train=train, val=IndexedData(PASS, load_s=0.001), test=IndexedData(32))
    trainer, model = _trainer(tmp_path, limit_test_batches=1.0), Evaluated()
    trainer.validate(model, datamodule=data)
    trainer.test(model, datamodule=data)
    assert _Counted.loads == 0  # the training set is neither loaded nor measured
    assert model.evaluated == [*range(PASS), *range(32)]
    sources = sorted(choice.source for choice in data.worker_tuner.choices.values())
    assert sources == ["searched", "short run"]  # the validation pass searched, the test pass too short


def test_a_stage_run_alone_is_cached_apart_from_training(tmp_path: Path) -> None:
    dataset = IndexedData(PASS, load_s=0.001)
    first = Sets(train=dataset, predict=dataset)
    trainer = _trainer(tmp_path, limit_train_batches=1.0)
    trainer.fit(Evaluated(), datamodule=first)
    trainer.predict(Evaluated(), datamodule=first)
    assert len(first.worker_tuner.choices) == 2  # the same set and batch, other steps: two decisions
    again = Sets(predict=dataset)
    _trainer(tmp_path).predict(Evaluated(), datamodule=again)
    assert _only(again.worker_tuner.choices).source == "cache"


class _SavePredicted(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.indices: list[int] = []

    @override
    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                             batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self.indices += outputs.tolist()

    @override
    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(trainer.datamodule, BoostedDataModule)
        choices = {k: c.to_dict() for k, c in trainer.datamodule.worker_tuner.choices.items()}
        payload = {"indices": self.indices, "choices": choices}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


@pytest.mark.ddp
def test_two_ranks_search_a_predict_pass_together_each_predicting_its_share_once(tmp_path: Path) -> None:
    # an odd length: Lightning's unrepeated sampler gives the ranks 961 and 960 samples
    data = Sets(predict=IndexedData(2 * PASS + 1, load_s=0.001))
    trainer = _trainer(tmp_path, _SavePredicted(tmp_path), devices=2, strategy="ddp_spawn")
    trainer.predict(Evaluated(), datamodule=data, return_predictions=False)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["choices"] == ranks[1]["choices"]  # rank zero's measurements decided for both
    assert _only(ranks[0]["choices"])["source"] == "searched"
    assert ranks[0]["indices"] == list(range(0, 2 * PASS + 1, 2))
    assert ranks[1]["indices"] == list(range(1, 2 * PASS + 1, 2))
