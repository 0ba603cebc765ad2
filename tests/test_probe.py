"""Worker tuning on a CPU weighs the model's step: `model_step_rates` (on a copy, no trace) and
`split_cpus` (the decision), and `BoostedDataModule` using both."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_boost import AutoNumWorkers, BoostedDataModule, WorkerTuning
from lightning_boost.testing import BoringModel, RandomDataset, tiny_trainer
from lightning_boost.workers import model_rates, tuner
from lightning_boost.workers.search import WorkerTrial, split_cpus


class WithBatchNorm(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(32)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(nn.functional.dropout(self.norm(x), 0.5))


def test_step_rates_are_measured_on_a_copy_and_leave_no_trace() -> None:
    model = WithBatchNorm()
    batch = (torch.randn(8, 32), torch.randn(8, 2))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    rates = model_rates.model_step_rates(model, batch, [threads, 1])
    assert set(rates) == {threads, 1} and all(rate > 0 for rate in rates.values())
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads


class BatchOnly(BoringModel):
    """Steps without `batch_idx`, as Lightning allows (its GAN example's signature)."""

    def training_step(self, batch: Any) -> Tensor:  # type: ignore[override]
        return self._loss(batch)

    def validation_step(self, batch: Any) -> None:  # type: ignore[override]
        self.log("val_loss", self._loss(batch))


def test_a_step_without_batch_idx_is_called_as_lightning_calls_it() -> None:
    rates = model_rates.model_step_rates(BatchOnly(), (torch.randn(8, 32), torch.randn(8, 2)), [1])
    assert set(rates) == {1} and rates[1] > 0


class ManualOptimization(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class ReadsTheTrainer(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._loss(batch) * (self.trainer.global_step + 1)


@pytest.mark.parametrize("model", [ManualOptimization(), ReadsTheTrainer()], ids=["manual", "trainer"])
def test_a_step_that_needs_the_fit_gives_no_rates(model: BoringModel) -> None:
    assert model_rates.model_step_rates(model, (torch.randn(8, 32), torch.randn(8, 2)), [1]) == {}


class Evaluates(BoringModel):
    """Records whether each validation or predict step ran with gradients or in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.calls.append(torch.is_grad_enabled() or self.training)
        self.log("val_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.calls.append(torch.is_grad_enabled() or self.training)
        return self.layer(batch[0])


def test_an_evaluation_steps_rates_are_timed_without_gradients_in_eval_mode() -> None:
    model, batch = Evaluates(), (torch.randn(8, 32), torch.randn(8, 2))
    for hook in ("validation_step", "predict_step"):
        rates = model_rates.model_step_rates(model, batch, [1], hook=hook)
        assert set(rates) == {1} and rates[1] > 0
    assert model.training and not model.calls  # a copy's steps, none with gradients or in train mode


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_consumer_rate_of_an_evaluation_loader_is_its_steps(tmp_path: Path, accelerator: str) -> None:
    trainer = tiny_trainer(tmp_path, accelerator=accelerator, precision="bf16-mixed")
    model = Evaluates().to(trainer.strategy.root_device)
    batch = (torch.randn(64, 32, device=model.device), torch.randn(64, 2, device=model.device))
    for hook in ("validation_step", "predict_step"):
        rate = tuner.consumer_rate(trainer, model, batch, 64, hook=hook)
        assert rate is not None and rate > 0
    assert not model.calls  # a copy took the steps


def test_a_fits_validation_loader_is_weighed_against_the_validation_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, timed = tuner.model_step_rates, []

    def recording(module: Any, batch: Any, threads: list[int], **kwargs: Any) -> dict[int, float]:
        rates = real(module, batch, threads, **kwargs)
        timed.append((kwargs.get("hook"), rates))
        return rates

    monkeypatch.setattr(tuner, "model_step_rates", recording)
    monkeypatch.setattr(tuner.HardwareInfo, "detect", lambda: _two_cpus())
    tuning = WorkerTuning(window_s=0.2, max_workers=2, skip_short_runs=False)
    callback = AutoNumWorkers(tuning, cache_dir=tmp_path)
    trainer = tiny_trainer(tmp_path, callbacks=[callback], limit_val_batches=1.0)
    val = DataLoader(SlowSamples(), batch_size=8)  # a set of its own: measured before the fit
    trainer.fit(Evaluates(), DataLoader(RandomDataset(length=64), batch_size=8), val)
    ((hook, rates),) = timed  # the training loader is searched on its own steps, with no probe
    assert hook == "validation_step" and set(rates) == {2, 1}  # the step it feeds, per thread count
    assert trainer.state.finished


@pytest.mark.parametrize(
    ("step_rates", "probed"),
    [({2: 16.0}, [[2]]), ({2: 1600.0, 1: 900.0}, [[2], [2, 1]])],
    ids=["slow step: not worth timing", "fast step: its rates timed"],
)
def test_one_step_prices_a_fits_validation_loader_measurement_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step_rates: dict[int, float], probed: list[list[int]]
) -> None:
    # The model's rates are scripted (real ones would depend on this shared machine's load); the
    # loader is real: 256 samples at about 5 ms each, 1.3 s of loading in the main process, more
    # than the 0.4 s rest_of_measuring estimates. A step of 0.5 s a batch prices timing the
    # model's rates alone at 5 s (2 thread counts x 5 steps): not worth it, decided after one step.
    measured: list[list[int]] = []

    def rates(module: Any, batch: Any, threads: list[int], **kwargs: Any) -> dict[int, float]:
        measured.append(threads)
        return {count: step_rates[count] for count in threads}

    monkeypatch.setattr(tuner, "model_step_rates", rates)
    monkeypatch.setattr(tuner.HardwareInfo, "detect", lambda: _two_cpus())
    callback = AutoNumWorkers(WorkerTuning(window_s=0.2, max_workers=2), cache_dir=tmp_path)
    trainer = tiny_trainer(tmp_path, callbacks=[callback], limit_val_batches=1.0, num_sanity_val_steps=0)
    val = DataLoader(SlowerSamples(), batch_size=8)
    trainer.fit(Evaluates(), DataLoader(RandomDataset(length=64), batch_size=8), val)
    # the validation set's choice: it loads about 190 samples/s (the training set's, thousands)
    choices = callback.worker_tuner.choices.values()
    (choice,) = [c for c in choices if c.trials and c.trials[0].samples_per_s < 500]
    assert measured == probed
    if len(probed) == 1:
        assert choice.source == "short run" and [t.num_workers for t in choice.trials] == [0]
        assert choice.reason.startswith("no workers: the run loads 256 samples from it")
        assert "less than the rest of the measurement takes (~5." in choice.reason
    else:  # 900 samples/s beside a worker could save about 1 s of 1.5: the workers were timed
        assert [t.num_workers for t in choice.trials] == [0, 1, 2] and choice.source != "short run"
    assert trainer.state.finished


class ThreadsSeen(L.Callback):
    """Records torch's intra-op threads at each training and validation batch."""

    def __init__(self) -> None:
        self.seen: dict[str, set[int]] = {"train": set(), "val": set()}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen["train"].add(torch.get_num_threads())

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen["val"].add(torch.get_num_threads())


def test_each_loop_gets_the_threads_its_own_loaders_workers_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The training loader (4 batches: too few to search) loads in the main process; the
    # validation set, slow to load beside a fast step (scripted rates, as above), gets workers.
    # Training keeps both CPUs, validation leaves its workers theirs; teardown puts the count back.
    monkeypatch.setattr(
        tuner, "model_step_rates", lambda module, batch, threads, **kwargs: {2: 1600.0, 1: 900.0}
    )
    monkeypatch.setattr(tuner.HardwareInfo, "detect", lambda: _two_cpus())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spy, callback = (
            ThreadsSeen(),
            AutoNumWorkers(WorkerTuning(window_s=0.2, max_workers=2), cache_dir=tmp_path),
        )
        trainer = tiny_trainer(
            tmp_path, callbacks=[callback, spy], limit_val_batches=1.0, val_check_interval=2
        )
        trainer.fit(
            Evaluates(),
            DataLoader(RandomDataset(length=64), batch_size=8),
            DataLoader(SlowerSamples(), batch_size=8),
        )
        assert trainer.val_dataloaders.num_workers > 0 and trainer.train_dataloader.num_workers == 0
        assert spy.seen == {"train": {2}, "val": {1}}  # validation ran mid-epoch, between training steps
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_split_prefers_fewer_workers_within_tolerance_and_skips_what_it_cannot_predict() -> None:
    trials = [
        WorkerTrial(0, None, 1000.0),
        WorkerTrial(1, 2, 5000.0),
        WorkerTrial(2, 2, 0.0, error="crashed: worker died"),
        WorkerTrial(3, 2, 9000.0),
    ]
    pick = split_cpus(trials, {4: 800.0, 3: 790.0, 1: 300.0}, cpus=4)
    assert pick is not None and pick[0].num_workers == 1 and pick[1] == 790.0  # not 0: it takes turns
    assert split_cpus(trials, {}, cpus=4) is None


class SlowSamples(Dataset[tuple[Tensor, Tensor]]):
    """Each sample takes 0.2 ms without using a CPU: workers load faster than the main process."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        time.sleep(0.0002)
        return torch.full((32,), float(index)), torch.zeros(2)


class SlowerSamples(SlowSamples):
    """Each sample takes about 5 ms without using a CPU."""

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        time.sleep(0.005)
        return super().__getitem__(index)


class InMemoryData(BoostedDataModule):
    """256 samples already in memory: the main process loads tens of thousands a second."""

    def setup(self, stage: str) -> None:
        self.train_dataset = TensorDataset(torch.randn(256, 32), torch.zeros(256, 2))


def test_a_compute_bound_model_keeps_its_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The model's rates are scripted (a compute-bound model on 2 CPUs: 2 threads 1.86x as fast as
    # one, as measured for ResNet-18, at a tenth of its rate): on this shared machine real ones would
    # make the test depend on its load. The loader is real, an in-memory one of tens of thousands of
    # samples a second; no workers beat one worker when it loads more than 91 (1/(1/42 - 1/78)). At
    # ResNet-18's own rates that was 910, and a stall in the 0.3 s window read it under that once,
    # in a full run of the suite on the oldest set; so did a loader sleeping 0.2 ms a sample beside
    # a busy CI run.
    measured: list[list[int]] = []

    def rates(module: Any, batch: Any, threads: list[int], **kwargs: Any) -> dict[int, float]:
        measured.append(threads)
        return {2: 78.0, 1: 42.0}

    monkeypatch.setattr(tuner, "model_step_rates", rates)
    monkeypatch.setattr(tuner.HardwareInfo, "detect", lambda: _two_cpus())
    datamodule = InMemoryData(
        batch_size=8,
        worker_tuning=WorkerTuning(window_s=0.3, max_workers=2, skip_short_runs=False, online=False),
    )
    trainer = tiny_trainer(tmp_path, logger=False, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(BoringModel(), datamodule=datamodule)
    (choice,) = datamodule.worker_tuner.choices.values()
    assert measured == [[2, 1]]  # all CPUs (no workers), then what one worker leaves, before any worker
    # one thread (42) cannot beat no workers beside two (about 1/(1/loader + 1/78)): not timed
    assert [t.num_workers for t in choice.trials] == [0]
    assert choice.num_workers == 0 and choice.reason.startswith("no workers: 1 worker(s) and up")
    assert "cannot beat loading in the main process" in choice.reason
    assert not any("set_num_threads" in f.title for f in datamodule.findings)


def _two_cpus() -> Any:
    from lightning_boost.hardware import HardwareInfo

    return HardwareInfo.example("cpu").replace(cpus_available=2)


def _process_settings() -> tuple[Any, str]:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE), torch.multiprocessing.get_sharing_strategy()


@pytest.mark.parametrize("hard", [1 << 20, 1024], ids=["raise_limit", "file_system"])
def test_process_settings_changed_by_tuning_are_put_back_at_teardown(hard: int) -> None:
    # Simulated: a machine whose open-file limit is 1024 (this one's is higher); the change the
    # plan makes is real, to this process, and must not outlive the run.
    from lightning_boost.hardware import EXAMPLES

    before = _process_settings()
    box = EXAMPLES["cpu"].replace(open_files_limit=1024, open_files_hard_limit=min(hard, before[0][1]))
    worker_tuner = tuner.LoaderTuner("test", WorkerTuning(), None, retune=False)
    worker_tuner.apply_process_settings(box, num_workers=4)
    assert _process_settings() != before and worker_tuner.findings
    worker_tuner.restore()
    assert _process_settings() == before
