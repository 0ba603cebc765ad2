"""`AutoBatchSize` in real CPU Trainer runs.

This machine has no GPU, so out-of-memory is simulated where a test says so: the model raises
the real OOM type (`torch.OutOfMemoryError`, or the CPU allocator's own error from a real
allocation that cannot succeed) above a batch size.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_boost import (
    AutoBatchSize,
    AutoMicroBatch,
    BoostedDataModule,
    BoostWarning,
    Severity,
    fingerprints,
)
from lightning_boost._lightning import pytorch_lightning_takes_our_callbacks
from lightning_boost.batch_size.goodput import cross_noise
from lightning_boost.step_probe import RememberedSamples, StepProbe, is_oom, remembered
from lightning_boost.testing import BoringDataModule, BoringModel, RandomDataset, tiny_trainer
from lightning_boost.trainer_reads import TrainerReads
from tests.conftest import script_trials, spawned_ddp_trainer

FAST = {"steps": 1, "tolerance": 0.0}
pytestmark = pytest.mark.usefixtures("long_planned_run")


@pytest.fixture(autouse=True)
def scripted_throughput(monkeypatch: pytest.MonkeyPatch) -> None:
    """Throughput scripted as 1000 samples/s per sample of batch: the steps still run and their
    peaks and OOMs are real, but no search path asserted here hangs on timer noise (with
    `tolerance=0.0` it did: the CPU-budget test failed about 40 % of runs). DDP tests run in
    spawned processes this patch does not reach: there a fixed step time does the same."""
    script_trials(
        monkeypatch,
        lambda size: {"samples_per_s": 1000.0 * size, "grad_sq": None, "half_grad_sq": None, "spread": 0.0},
    )


class OOMModel(BoringModel):
    """Raises the real CUDA OOM type above `limit` samples (simulated: no GPU here), or with
    ``cpu=True`` makes a real allocation the CPU allocator cannot serve."""

    def __init__(self, limit: int = 1_000_000, val_limit: int = 1_000_000, cpu: bool = False) -> None:
        super().__init__()
        self.limit, self.val_limit, self.host = limit, val_limit, cpu

    def _maybe_oom(self, batch: tuple[Tensor, Tensor], limit: int) -> None:
        if batch[0].shape[0] > limit:
            if self.host:
                torch.empty(2**62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated above {limit} samples).")

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self._maybe_oom(batch, self.limit)
        return super().training_step(batch, batch_idx)

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._maybe_oom(batch, self.val_limit)
        super().validation_step(batch, batch_idx)


def fit(
    tmp_path: Path, callback: AutoBatchSize, model: L.LightningModule | None = None, **options: Any
) -> Any:
    datamodule = options.pop("datamodule", None) or BoringDataModule(length=256)
    trainer = tiny_trainer(
        tmp_path, callbacks=[callback], logger=False, enable_checkpointing=False, **options
    )
    trainer.fit(model or BoringModel(), datamodule=datamodule)
    return trainer, datamodule


def sizes(callback: AutoBatchSize) -> dict[int, dict[str, Any]]:
    return {trial["size"]: trial for trial in callback.result["trials"]}


@pytest.mark.parametrize("cpu", [False, True], ids=["cuda-oom-type", "cpu-allocator"])
def test_oom_above_a_size_is_caught_and_the_choice_fits(tmp_path: Path, cpu: bool) -> None:
    callback = AutoBatchSize(steps=2, tolerance=0.0, lr_scaling=None)  # no learning-rate limit
    trainer, datamodule = fit(tmp_path, callback, OOMModel(limit=100, cpu=cpu))
    tried = sizes(callback)
    assert {size for size, trial in tried.items() if trial["oom"]} == {s for s in tried if s > 100}
    assert 128 in tried and tried[128]["oom"]
    assert max(s for s, t in tried.items() if not t["oom"]) == 96  # refined between 64 and 128
    assert trainer.train_dataloader.batch_size == callback.result["batch_size"] <= 100
    assert datamodule.batch_size == 8  # the configured size, put back at the end of the fit
    assert not tried[callback.result["batch_size"]]["oom"]
    assert trainer.state.finished
    (finding,) = callback.findings
    assert finding.area == "batch size"
    assert (
        "out of memory" in finding.detail and f"Batch size {callback.result['batch_size']}" in finding.title
    )
    rows = {int(line.split()[0]): line for line in finding.detail.splitlines()[2:]}  # the table's rows
    trial = callback.decision.trials[0]  # type: ignore[union-attr]
    assert f"{trial.seconds:5.1f} s  " in rows[trial.size]  # what each trial cost, beside its peak


def test_no_size_is_chosen_whose_learning_rates_the_rule_fails_at(tmp_path: Path) -> None:
    """From the configured 8 under the square-root rule (``"auto"``, SGD's too), 32 is x2 the
    learning rates: the search stops there and says why (without the limit it measured up to 256
    here). A global batch the user asks for is theirs: its factor past x2 is a warning whose fix
    names the largest batch within it; so is SGD's linear rule asked for by name."""
    callback = AutoBatchSize(**FAST)
    fit(tmp_path / "capped", callback)
    decision = callback.decision
    assert decision is not None and decision.lr_scaling == "sqrt"
    assert max(t.size for t in decision.trials) == decision.batch_size == 32 and decision.lr_factor == 2.0
    assert "learning rates past x2 under the sqrt rule" in decision.stopped
    assert [f.severity for f in callback.findings] == ["info"]
    asked = AutoBatchSize(**FAST, target_global_batch_size=96)
    fit(tmp_path / "asked", asked)
    assert asked.decision is not None and asked.decision.lr_factor == pytest.approx(12**0.5)
    (lr_warning,) = [f for f in asked.findings if f.severity == "warn"]
    assert "x3.46 for batch 96" in lr_warning.title and "target_global_batch_size=32" in lr_warning.fix
    linear = AutoBatchSize(**FAST, lr_scaling="linear")
    fit(tmp_path / "linear", linear)
    assert (
        linear.decision is not None and linear.decision.batch_size == 16 and linear.decision.lr_factor == 2.0
    )


def test_on_an_accelerator_the_first_trial_reads_the_noise_scale_from_independent_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An accelerator simulated (this machine has none): the first trial alone reads 8 other
    batches' gradients before its steps, and the decision's noise scale is theirs (so its halves
    are not run). On the CPU none is read (the demo's ResNet-18 would spend about 1 s on them
    before its first step)."""
    from lightning_boost.batch_size import callback as module

    on_cpu = AutoBatchSize(**FAST)
    fit(tmp_path / "cpu", on_cpu)
    assert on_cpu.decision is not None and all(t.cross_grad_sq is None for t in on_cpu.decision.trials)
    monkeypatch.setattr(module, "_reads_cross_products", lambda device, parameters, budget: True)
    callback = AutoBatchSize(**FAST, retune=True)  # the same fit: measured again, not the cache's
    fit(tmp_path / "accelerator", callback)
    decision = callback.decision
    assert decision is not None
    (first,) = [t for t in decision.trials if t.cross_grad_sq is not None]
    assert first.size == 8 and first.batch_grad_sq is not None and first.cross_se is not None
    expected = cross_noise(first.size, first.batch_grad_sq, first.cross_grad_sq, first.cross_se)
    assert expected is not None and decision.noise_scale == pytest.approx(expected.value)
    assert first.half_grad_sq is None and first.double_grad_sq is None  # they resolved it: no halves


class FlagRecorder(BoringModel):
    """Records `torch.backends.cudnn.benchmark` at each training step, trials' and the run's, in a
    class attribute (a trial steps a copy of the module, which would copy an instance's list)."""

    flags: ClassVar[list[bool | str]] = []

    @override
    def on_train_start(self) -> None:
        self.flags.append("run")

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.flags.append(torch.backends.cudnn.benchmark)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("samples", "by_hand", "run_flag"),
    [(10_000.0, False, False), (float("inf"), False, True), (10_000.0, True, True)],
    ids=["short-run-off", "long-run-kept", "by-hand-kept"],
)
def test_trials_run_without_autotuning_and_a_short_run_drops_the_presets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, samples: float, by_hand: bool, run_flag: bool
) -> None:
    """cudnn.benchmark is off in every trial step; the run keeps the preset's default only where
    its steps, at the trial's rate, take 100 s or more (scripted 1000 samples/s per sample of batch:
    10,000 samples at 32 take 0.3 s), or where the user passed it. The preset's CUDA default is
    simulated on this CPU by planning it with `cudnn_benchmark` on (the flag is harmless here)."""
    from lightning_boost.batch_size.plan import RunPlan
    from lightning_boost.hardware import HardwareInfo
    from lightning_boost.presets import preset

    monkeypatch.setattr(RunPlan, "samples_planned", lambda self, size: samples)
    on_cpu = HardwareInfo.detect().on_cpu()  # `fit` pins the CPU, on a GPU machine too
    strategy = (
        preset("auto", hardware=on_cpu, cudnn_benchmark=True) if by_hand else preset("auto", hardware=on_cpu)
    )
    if not by_hand:  # the default a CUDA machine's preset plans
        strategy.plan = dataclasses.replace(strategy.plan, cudnn_benchmark=True)
    monkeypatch.setattr(FlagRecorder, "flags", [])
    model, callback = FlagRecorder(), AutoBatchSize(**FAST)
    before = torch.backends.cudnn.benchmark
    fit(tmp_path, callback, model, strategy=strategy)
    start = model.flags.index("run")
    assert start > 0 and not any(model.flags[:start])  # every trial step: off
    assert set(model.flags[start + 1 :]) == {run_flag}
    assert torch.backends.cudnn.benchmark == before  # put back at teardown
    dropped = [f for f in callback.findings if f.title.startswith("cudnn.benchmark off")]
    assert len(dropped) == (not run_flag) and callback.tuned.get("cudnn_benchmark", True) == run_flag
    if dropped:
        assert "cudnn_benchmark=True" in dropped[0].fix and "0.31 s" in dropped[0].title


def test_a_trials_timed_steps_do_not_load_their_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed steps' batches are loaded before the clock starts and moved to the device in
    their step, as the run's loop moves what its workers loaded. Loaded in the step, the H100
    demo's trial at 64 read 1,906 samples/s, 33.6 ms a step, where the model's step alone ran
    14.5 ms (4,402 before the change that loaded there): every size would read near one-process
    loading's rate, and the search would keep 64 whatever the noise scale."""
    loaded: list[int] = []  # one entry per batch the trial's loader gave
    stepped: list[int] = []  # the batches loaded by the time each step started
    moved: list[int] = []  # the steps started by the time each batch was moved

    def loader() -> Any:
        while True:
            loaded.append(1)
            yield (torch.randn(8, 32), torch.randn(8, 2))

    def move(batch: Any) -> Any:
        moved.append(len(stepped))
        return batch

    step = StepProbe._train_step

    def recorded(self: StepProbe, *args: Any, **kwargs: Any) -> None:
        stepped.append(len(loaded))
        step(self, *args, **kwargs)

    monkeypatch.setattr(StepProbe, "_train_step", recorded)
    model = BoringModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = StepProbe(model, [optimizer], 3, torch.enable_grad, torch.no_grad, move=move)
    trial = probe.train((torch.randn(8, 32), torch.randn(8, 2)), 8, loader())
    assert stepped == [0, 3, 3, 3]  # the warm-up at the first batch, then 3 steps loaded beforehand
    assert moved == [1, 2, 3]  # each moved in its own step
    assert trial.samples_per_s is not None and len(trial.losses) == 3


def test_a_searchs_trials_load_each_sample_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trials at doubling sizes draw the same samples first, and they load on the training
    process: each sample (training and validation) is loaded once in the whole search, not once
    per trial that takes it (as without `remembered`, the second fit here)."""
    from lightning_boost.batch_size import callback as module

    loads: collections.Counter[tuple[int, int]] = collections.Counter()
    getitem = RandomDataset.__getitem__

    def counted(self: RandomDataset, index: int) -> tuple[Tensor, Tensor]:
        loads[id(self), index] += 1
        return getitem(self, index)

    monkeypatch.setattr(RandomDataset, "__getitem__", counted)

    def search(root: Path) -> tuple[list[int], collections.Counter[tuple[int, int]]]:
        loads.clear()
        in_search: collections.Counter[tuple[int, int]] = collections.Counter()

        class AfterTheSearch(L.Callback):
            def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                in_search.update(loads)

        callback = AutoBatchSize(**FAST, max_batch_size=64, lr_scaling=None, cache_dir=root)
        trainer = tiny_trainer(root, callbacks=[callback, AfterTheSearch()], logger=False)
        trainer.fit(BoringModel(), datamodule=BoringDataModule(length=256))
        assert callback.decision is not None
        return [t.size for t in callback.decision.trials], in_search

    sizes, once = search(tmp_path / "remembered")
    assert sizes == [8, 16, 32, 64]
    assert len({dataset for dataset, _ in once}) == 2 and max(once.values()) == 1  # train and val
    monkeypatch.setattr(module, "remembered", lambda dataset: dataset)
    sizes_again, each_trial = search(tmp_path / "each trial")
    assert sizes_again == sizes and len(each_trial) == len(once)  # as many samples
    assert max(each_trial.values()) > 1 and each_trial.total() > 1.5 * once.total()


def test_remembered_samples_stop_at_their_byte_limit_and_leave_iterable_datasets_alone() -> None:
    data = RandomDataset(length=8)  # 32 + 2 float32 per sample: 136 bytes
    kept = RememberedSamples(data, max_bytes=3 * 136)
    for index in [0, 1, 2, 3, 0, 3]:
        assert torch.equal(kept[index][0], data[index][0])
    assert sorted(kept.samples) == [0, 1, 2] and kept.bytes == 3 * 136 and len(kept) == 8

    class Stream(IterableDataset[Tensor]):
        def __iter__(self) -> Iterator[Tensor]:
            return iter(torch.zeros(4, 2))

    stream = Stream()
    assert remembered(stream) is stream and isinstance(remembered(data), RememberedSamples)


class BatchOnly(BoringModel):
    """Steps without `batch_idx`, as Lightning allows (its GAN example's signature)."""

    def training_step(self, batch: Any) -> Tensor:  # type: ignore[override]
        return self._loss(batch)

    def validation_step(self, batch: Any) -> None:  # type: ignore[override]
        self.log("val_loss", self._loss(batch))


def test_steps_without_batch_idx_are_tuned(tmp_path: Path) -> None:
    callback = AutoBatchSize(max_batch_size=32, **FAST)
    trainer, _ = fit(tmp_path, callback, BatchOnly())
    assert trainer.train_dataloader.batch_size == callback.result["batch_size"] == 32
    assert trainer.state.finished


def test_is_oom_knows_the_real_error_types() -> None:
    with pytest.raises(RuntimeError) as cpu_error:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom(cpu_error.value)
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB)"))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_model_that_does_not_fit_at_batch_size_one_gets_the_fixes(tmp_path: Path) -> None:
    with pytest.raises(MemoryError, match=r"batch size 1 runs out of memory.*precision.*preset\('fsdp'\)"):
        fit(tmp_path, AutoBatchSize(init_batch_size=4, **FAST), OOMModel(limit=0))


class BatchNormModel(BoringModel):
    """`BoringModel` with a BatchNorm before its layer: its training step cannot run on one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.BatchNorm1d(32), nn.Linear(32, 2))


def test_a_search_halved_to_a_size_the_step_cannot_run_at_says_nothing_fits(tmp_path: Path) -> None:
    """No size fits the budget (the CPU's estimated peaks, real), so the search halves from 4 to 1,
    where BatchNorm raises: the user is told nothing fits and why the search stopped, with the
    fixes, not that their step failed (it ran at 4 and 2)."""
    callback = AutoBatchSize(init_batch_size=4, memory_budget_gib=1e-9, **FAST)
    with pytest.raises(
        MemoryError,
        match=r"batch size 2 needs .*GiB, over the budget.*stopped: the step failed"
        r" at batch size 1 \(ValueError\('Expected more than 1 value per channel.*precision",
    ):
        fit(tmp_path, callback, BatchNormModel())


class Squares(L.LightningModule):
    """``(x @ W).pow(2).mean()`` without bias and plain SGD: every live tensor of the step is known."""

    def __init__(self, features: int = 64, hidden: int = 64, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.weight = nn.Parameter(torch.randn(features, hidden))

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return (batch @ self.weight).pow(2).mean()

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    @override
    def train_dataloader(self) -> DataLoader[Tensor]:
        return DataLoader(torch.randn(4096, self.hparams["features"]), batch_size=self.hparams["batch_size"])


def test_cpu_peak_estimate_counts_every_live_tensor_of_the_step() -> None:
    model = Squares(features=64, hidden=256)
    probe = StepProbe(
        model, [torch.optim.SGD(model.parameters(), lr=0.01)], 1, torch.enable_grad, torch.no_grad
    )
    batch = torch.randn(32, 64)
    trial = probe.train(batch, 32)
    # weights + their gradient + the batch + `batch @ weight`, which pow() saves for backward
    assert trial.peak_bytes == 4 * (64 * 256 * 2 + 32 * 64 + 32 * 256)
    assert model.weight.grad is None  # the copy took the step


def test_cpu_memory_budget_bounds_the_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: a machine with 256 KiB of available RAM, so the 50 % budget is 128 KiB.
    from lightning_boost.batch_size import callback as auto_batch_size
    from lightning_boost.hardware import HardwareInfo

    small = HardwareInfo.detect().replace(ram_available_bytes=2**18, local_world_size=1)
    monkeypatch.setattr(auto_batch_size, "hardware_for", lambda trainer: small)
    callback = AutoBatchSize(steps=2, tolerance=0.0, lr_scaling=None)  # no learning-rate limit
    model = Squares()
    trainer = tiny_trainer(tmp_path, callbacks=[callback], logger=False, enable_checkpointing=False)
    trainer.fit(model)
    budget = callback.result["budget_bytes"]
    assert budget == 2**17
    tried = sizes(callback)
    # per step: 32 KiB of weights and gradient, 512 bytes per sample (input and saved output)
    assert all(t["peak_bytes"] == 2 * 64 * 64 * 4 + s * 512 for s, t in tried.items())
    fitting = {s for s, t in tried.items() if t["peak_bytes"] <= budget}
    assert max(fitting) == 192  # the budget's edge, projected from the peaks at the smaller sizes
    assert set(tried) == fitting  # so no trial was spent over the budget (before: 256, 224, 208)
    assert trainer.train_dataloader.batch_size == callback.result["batch_size"] in fitting


class Trained(L.LightningModule):
    """Dropout, BatchNorm, Adam with a scheduler, a metric and shuffled data: all that RNG and state touch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 2)
        )
        self.mean_loss = MeanMetric(nan_strategy="disable")

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.mean_loss.update(loss.detach())
        self.log("loss", self.mean_loss, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


def _train(tmp_path: Path, batch_size: int, callbacks: list[L.Callback]) -> dict[str, Tensor]:
    L.seed_everything(7, verbose=False)
    model = Trained()
    datamodule = BoringDataModule(length=256, batch_size=batch_size)
    datamodule.train_dataloader = lambda: DataLoader(  # type: ignore[method-assign]
        RandomDataset(32, 256), batch_size=datamodule.batch_size, shuffle=True, num_workers=2
    )
    trainer = tiny_trainer(
        tmp_path,
        max_epochs=2,
        limit_train_batches=1.0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=datamodule)
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_tuning_leaves_no_trace(tmp_path: Path) -> None:
    callback = AutoBatchSize(init_batch_size=2, max_batch_size=64, lr_scaling=None, **FAST)
    tuned = _train(tmp_path / "tuned", 4, [callback])
    chosen = callback.result["batch_size"]
    assert len(callback.result["trials"]) >= 5 and chosen != 4
    by_hand = _train(tmp_path / "by_hand", chosen, [])
    assert tuned.keys() == by_hand.keys()
    for name in tuned:
        assert torch.equal(tuned[name], by_hand[name]), name


def test_target_global_batch_size_sets_accumulation_and_scales_learning_rates(tmp_path: Path) -> None:
    callback = AutoBatchSize(max_batch_size=16, target_global_batch_size=64, lr_scaling="linear", **FAST)
    model = Trained()
    trainer, _ = fit(tmp_path, callback, model, datamodule=BoringDataModule(length=256, batch_size=8))
    chosen = trainer.train_dataloader.batch_size
    assert chosen <= 16
    assert trainer.accumulate_grad_batches == 64 // chosen
    assert callback.result["effective_batch_size"] == 64
    assert callback.result["reference_batch_size"] == 8  # the configured batch, 1 process, no accumulation
    factor = 64 / 8
    (optimizer,) = trainer.optimizers
    assert optimizer.param_groups[0]["initial_lr"] == pytest.approx(1e-3 * factor)
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(1e-3 * factor)]
    assert "learning rates x8" in callback.findings[0].detail


def test_sqrt_scaling_from_a_given_reference(tmp_path: Path) -> None:
    callback = AutoBatchSize(max_batch_size=64, lr_scaling="sqrt", reference_batch_size=16, **FAST)
    trainer, _ = fit(tmp_path, callback, BoringModel(lr=0.1))
    assert trainer.accumulate_grad_batches == 1
    expected = 0.1 * (trainer.train_dataloader.batch_size / 16) ** 0.5
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected)


def test_resuming_reuses_the_tuned_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    callback = AutoBatchSize(max_batch_size=32, target_global_batch_size=64, lr_scaling="linear", **FAST)
    trainer = tiny_trainer(tmp_path, callbacks=[callback], logger=False, enable_checkpointing=False)
    trainer.fit(BoringModel(), datamodule=BoringDataModule(length=256))
    checkpoint = tmp_path / "tuned.ckpt"
    trainer.save_checkpoint(checkpoint)
    lr = trainer.optimizers[0].param_groups[0]["lr"]

    monkeypatch.setattr(StepProbe, "train", lambda *args, **kwargs: pytest.fail("tuned again after resuming"))
    resumed_callback = AutoBatchSize(
        max_batch_size=32, target_global_batch_size=64, lr_scaling="linear", **FAST
    )
    resumed = tiny_trainer(
        tmp_path, max_epochs=2, callbacks=[resumed_callback], logger=False, enable_checkpointing=False
    )
    datamodule = BoringDataModule(length=256)
    resumed.fit(BoringModel(), datamodule=datamodule, ckpt_path=checkpoint)
    assert resumed.train_dataloader.batch_size == callback.result["batch_size"]
    assert resumed.accumulate_grad_batches == callback.result["accumulate_grad_batches"]
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr)  # scaled once, not twice
    assert resumed_callback.result == callback.result
    assert "from the checkpoint" in resumed_callback.findings[0].title
    assert json.dumps(resumed_callback.state_dict())


def test_a_second_run_reuses_the_cached_result_and_retune_measures_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _private_tuning_cache: Path
) -> None:
    first = AutoBatchSize(max_batch_size=32, lr_scaling="linear", **FAST)
    fit(tmp_path / "first", first, BoringModel(lr=0.1))
    stored = json.loads((_private_tuning_cache / "batch_size.json").read_text())
    assert [entry["result"]["batch_size"] for entry in stored["entries"].values()] == [
        first.result["batch_size"]
    ]

    real = StepProbe.train
    monkeypatch.setattr(StepProbe, "train", lambda *args, **kwargs: pytest.fail("measured despite the cache"))
    again = AutoBatchSize(max_batch_size=32, lr_scaling="linear", **FAST)
    trainer, _ = fit(tmp_path / "again", again, BoringModel(lr=0.1))
    assert trainer.train_dataloader.batch_size == first.result["batch_size"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * first.result["lr_factor"])
    assert again.result["source"] == "cache" and again.findings[0].cost == ""
    assert "Reused the cached measurement" in again.findings[0].detail

    calls: list[int] = []
    monkeypatch.setattr(
        StepProbe,
        "train",
        lambda self, batch, size, *more, **split: (
            calls.append(size) or real(self, batch, size, *more, **split)
        ),
    )
    fit(tmp_path / "retune", AutoBatchSize(max_batch_size=32, lr_scaling="linear", retune=True, **FAST))
    assert calls  # measured again
    other = AutoBatchSize(max_batch_size=16, lr_scaling="linear", **FAST)  # another argument, another key
    fit(tmp_path / "other", other)
    assert other.result["source"] == "measured"
    # a measurement another release made (with the faults it had) is made again after an upgrade
    monkeypatch.setattr(fingerprints, "__version__", "99.0.0")
    upgraded = AutoBatchSize(max_batch_size=32, lr_scaling="linear", **FAST)
    fit(tmp_path / "upgraded", upgraded, BoringModel(lr=0.1))
    assert upgraded.result["source"] == "measured"


def test_a_corrupt_batch_size_cache_is_ignored_with_a_warning(
    tmp_path: Path, _private_tuning_cache: Path
) -> None:
    _private_tuning_cache.mkdir(parents=True)
    (_private_tuning_cache / "batch_size.json").write_text("{not json")
    callback = AutoBatchSize(max_batch_size=16, **FAST)
    with warnings.catch_warnings(record=True) as caught:  # the fit's own warnings are not ours to check
        warnings.simplefilter("always")
        fit(tmp_path, callback)
    ours = [str(w.message) for w in caught if issubclass(w.category, BoostWarning)]
    assert len(ours) == 1 and "Ignoring the batch-size cache, measuring again:" in ours[0]
    assert "not readable JSON" in ours[0]
    assert callback.result["source"] == "measured"
    assert json.loads((_private_tuning_cache / "batch_size.json").read_text())["schema_version"] == 1


def test_validation_that_does_not_fit_steps_the_size_down(tmp_path: Path) -> None:
    callback = AutoBatchSize(max_batch_size=64, **FAST)
    fit(tmp_path, callback, OOMModel(val_limit=20))
    assert callback.result["batch_size"] <= 20
    checks = callback.result["validation"]
    assert checks[0]["oom"] and not checks[-1]["oom"] and checks[-1]["size"] == callback.result["batch_size"]


def test_validation_is_not_checked_again_at_the_size_the_user_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's own validation size is what plain Lightning runs too (its sanity check, before
    the first step): a trial of it on a copy would only delay the run. A size the tuner chose is
    checked (the test above); one that runs out of memory at the user's size is `AutoMicroBatch`'s
    (in `boost_callbacks()`), as in a run without `AutoBatchSize`."""
    script_trials(monkeypatch, lambda size: {"samples_per_s": 1000.0 * min(size, 8), "spread": 0.0})
    callback = AutoBatchSize(max_batch_size=64, **FAST)
    model = OOMModel(val_limit=4)  # validation does not fit at the configured 8
    trainer = tiny_trainer(tmp_path, callbacks=[callback, AutoMicroBatch()], logger=False)
    trainer.fit(model, datamodule=BoringDataModule(length=256))
    assert callback.result["batch_size"] == 8 and callback.result["validation"] == []
    assert trainer.state.finished and trainer.global_step > 0  # validated too: the sanity check at 8


class HparamsModel(BoringModel):
    """Keeps ``batch_size`` in its hparams and builds its own loader from it."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()

    @override
    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(RandomDataset(32, 128), batch_size=self.hparams["batch_size"])

    @override
    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(RandomDataset(32, 32, seed=1), batch_size=self.hparams["batch_size"])


class Boosted(BoostedDataModule):
    @override
    def setup(self, stage: str) -> None:
        self.train_dataset = RandomDataset(32, 128)
        self.val_dataset = RandomDataset(32, 32, seed=1)


def test_finds_batch_size_on_the_model_hparams_and_a_boosted_datamodule(tmp_path: Path) -> None:
    model = HparamsModel()
    callback = AutoBatchSize(max_batch_size=32, **FAST)
    trainer = tiny_trainer(tmp_path / "a", callbacks=[callback], logger=False, enable_checkpointing=False)
    trainer.fit(model)
    assert callback.result["batch_size"] == trainer.train_dataloader.batch_size

    boosted = Boosted(batch_size=4, num_workers=0)
    callback = AutoBatchSize(max_batch_size=32, **FAST)
    trainer, _ = fit(tmp_path / "b", callback, BoringModel(), datamodule=boosted)
    assert trainer.train_dataloader.batch_size == callback.result["batch_size"] != 4
    assert boosted.batch_size == 4  # put back: a second fit scales from the size the user wrote
    assert callback.result["validation"]  # the boosted validation set was checked


def test_no_batch_size_anywhere_trains_as_written_and_says_where_to_add_it(tmp_path: Path) -> None:
    callback = AutoBatchSize()
    trainer = tiny_trainer(tmp_path, callbacks=[callback], logger=False)
    loaders = [DataLoader(RandomDataset(32, 64), batch_size=8) for _ in range(2)]
    trainer.fit(BoringModel(), *loaders)  # loaders passed to `fit`, as Lightning's examples do
    assert trainer.state.finished and trainer.train_dataloader.batch_size == 8
    (finding,) = callback.findings
    assert finding.severity is Severity.WARN and callback.result == {}
    assert re.search(r"no `batch_size`.*as written", finding.detail)
    assert re.search(r"BoostedDataModule.*save_hyperparameters.*pass a datamodule", finding.fix)


def test_a_named_attribute_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, callbacks=[AutoBatchSize(attr_name="bsz")], logger=False)
    loaders = [DataLoader(RandomDataset(32, 64), batch_size=8) for _ in range(2)]
    with pytest.raises(AttributeError, match=r"no `bsz`.*BoostedDataModule.*save_hyperparameters"):
        trainer.fit(BoringModel(), *loaders)


def test_a_loader_that_ignores_the_attribute_is_an_error_before_any_measurement(tmp_path: Path) -> None:
    datamodule = BoringDataModule(length=128)
    datamodule.train_dataloader = lambda: DataLoader(RandomDataset(32, 128), batch_size=8)  # type: ignore[method-assign]
    callback = AutoBatchSize(max_batch_size=32, **FAST)
    with pytest.raises(ValueError, match=r"`attr_name` is 'batch_size', but .* batch_size=8.*=self"):
        fit(tmp_path, callback, datamodule=datamodule)
    assert callback.result == {}  # found at the start of fit, before a single trial


class TemplateData(L.LightningDataModule):
    """The most-used project template's shape: the loaders read a per-device size that `setup()`
    derives from the `batch_size` hyperparameter (which is what `AutoBatchSize` finds first)."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.batch_size_per_device = batch_size
        self.data_train: RandomDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        self.batch_size_per_device = self.hparams["batch_size"] // self.trainer.world_size
        if self.data_train is None:
            self.data_train = RandomDataset(32, 256)

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data_train, batch_size=self.batch_size_per_device, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(RandomDataset(32, 64), batch_size=self.batch_size_per_device)


def test_a_templates_per_device_size_derived_in_setup_is_found_and_tuned(tmp_path: Path) -> None:
    datamodule = TemplateData(batch_size=8)
    callback = AutoBatchSize(max_batch_size=32, **FAST)
    trainer, _ = fit(tmp_path, callback, datamodule=datamodule)
    assert callback.attr_name == "batch_size_per_device"
    assert trainer.train_dataloader.batch_size == callback.result["batch_size"] != 8  # it trained tuned
    (adopted,) = [f for f in callback.findings if f.data.get("attr_name") == "batch_size_per_device"]
    assert "does not read `batch_size`" in adopted.detail and adopted.data["configured_attr"] == "batch_size"
    assert datamodule.batch_size_per_device == 8 and datamodule.hparams["batch_size"] == 8  # put back


class PrivateSizeData(L.LightningDataModule):
    """Lightning's own fine-tuning example's shape (`computer_vision_fine_tuning.py`): the datamodule
    keeps its size as ``self._batch_size``, and a CLI link copies it to the model's ``batch_size``."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self._batch_size = batch_size
        self._num_workers = 0

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(RandomDataset(32, 256), batch_size=self._batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(RandomDataset(32, 64, seed=1), batch_size=self._batch_size)


class SizedModel(BoringModel):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size  # what `parser.link_arguments("data.batch_size", ...)` sets


def test_a_private_size_the_loader_reads_is_found_and_tuned(tmp_path: Path) -> None:
    """The model's linked `batch_size` was taken for the size, and the fit stopped with "the
    training DataLoader does not read it": only public attributes were candidates."""
    datamodule = PrivateSizeData(batch_size=8)
    callback = AutoBatchSize(max_batch_size=32, **FAST)
    trainer, _ = fit(tmp_path, callback, SizedModel(batch_size=8), datamodule=datamodule)
    assert callback.attr_name == "_batch_size"
    assert trainer.train_dataloader.batch_size == callback.result["batch_size"] != 8
    assert datamodule._batch_size == 8  # put back


def test_an_attr_name_a_boosted_datamodule_does_not_read_is_an_error(tmp_path: Path) -> None:
    model = BoringModel()
    model.bs = 16  # the model has it, but the datamodule's loaders read `batch_size`
    datamodule = Boosted(batch_size=8, num_workers=0)
    with pytest.raises(ValueError, match=r"`attr_name` is 'bs', but the training DataLoader does not"):
        fit(tmp_path, AutoBatchSize(attr_name="bs", **FAST), model, datamodule=datamodule)


class ManualModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization_trains_as_written_and_says_why(tmp_path: Path) -> None:
    callback = AutoBatchSize(**FAST)
    trainer, _ = fit(tmp_path, callback, ManualModel())
    assert trainer.state.finished and callback.result == {}
    (finding,) = callback.findings
    assert finding.severity is Severity.INFO and "manual optimization" in finding.title


class ReadsTheFit(BoringModel):
    """A step that reads the live fit, as steps in Lightning's docs do: the learning rate logged
    from `self.optimizers()` and `self.lr_schedulers()`, a weight ramped over
    `self.trainer.max_epochs`; and that counts its steps on the trainer."""

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.log("lr", self.optimizers().param_groups[0]["lr"])  # type: ignore[union-attr]
        self.log("scheduled_lr", self.lr_schedulers().get_last_lr()[0])  # type: ignore[union-attr]
        self.trainer.counted = getattr(self.trainer, "counted", 0) + 1  # type: ignore[attr-defined]
        return self._loss(batch) * (1 + self.trainer.current_epoch / self.trainer.max_epochs)  # type: ignore[operator]

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}


def test_a_step_that_reads_the_fit_is_tuned_and_its_copies_change_nothing(tmp_path: Path) -> None:
    """A copy of the model had no trainer: `self.optimizers()` raised "not attached to a
    `Trainer`" in the first trial and the fit stopped, telling the user to set the size by hand.
    Now the copies read the run's trainer and their own optimizers, and what they set or log stays
    theirs: the trainer counted the run's steps alone."""
    callback = AutoBatchSize(**FAST)
    trainer, _ = fit(tmp_path, callback, ReadsTheFit(), datamodule=BoringDataModule(length=2048))
    assert callback.result["trials"] and trainer.state.finished
    assert trainer.counted == trainer.global_step  # type: ignore[attr-defined]
    assert set(trainer.logged_metrics) >= {"lr", "scheduled_lr"}


class StepsItsScheduler(BoringModel):
    """Steps its scheduler in the step too, as programs mixing up Lightning's interval do; records
    the learning rate the run's first step starts at."""

    first_lr: float | None = None

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.first_lr is None and not isinstance(self._trainer, TrainerReads):
            self.first_lr = self.optimizers().param_groups[0]["lr"]  # type: ignore[union-attr]
        self.lr_schedulers().step()  # type: ignore[union-attr]
        return self._loss(batch)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}


def test_a_copys_step_moves_its_own_schedule_not_the_runs(tmp_path: Path) -> None:
    """`self.lr_schedulers()` on a copy gives copies of the run's schedulers, over the copy's
    optimizers: the trials' steps would have halved the run's rate once a step before it began."""
    callback = AutoBatchSize(**FAST)
    model = StepsItsScheduler()
    fit(tmp_path, callback, model, datamodule=BoringDataModule(length=2048))
    assert callback.result["trials"] and model.first_lr == 0.05 * callback.decision.lr_factor  # type: ignore[union-attr]


def test_a_copy_in_a_run_on_several_processes_is_refused_the_strategy() -> None:
    """Each rank steps its copies as often as its own clock says: a collective would wait on ranks
    that run none. The step's error stops the tuning instead, as before (simulated 2-process run)."""
    view = TrainerReads(SimpleNamespace(world_size=2, strategy="ddp", max_epochs=3))  # type: ignore[arg-type]
    assert view.max_epochs == 3
    with pytest.raises(RuntimeError, match=r"would wait on collectives \(`self.all_gather`\)"):
        view.strategy  # noqa: B018


class RankOOMModel(BoringModel):
    """Rank 0 'runs out of memory' above 32 samples, rank 1 above 12 (simulated: no GPU here);
    each rank writes the batch size it trains with. A step takes a fixed 20 ms, so throughput
    doubles with the batch size whatever the timer's noise (spawned ranks miss the fixture)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch[0].shape[0] > (32 if dist.get_rank() == 0 else 12):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated).")
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)

    @override
    def on_train_start(self) -> None:
        size = self.trainer.train_dataloader.batch_size  # type: ignore[union-attr]
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(size))


@pytest.mark.ddp
def test_ddp_takes_the_smallest_fit_over_ranks_without_hanging(tmp_path: Path) -> None:
    callback = AutoBatchSize(**FAST, min_efficiency=0.01)  # the search is about memory, not noise
    trainer = spawned_ddp_trainer(tmp_path, [callback])
    trainer.fit(RankOOMModel(str(tmp_path)), datamodule=BoringDataModule(length=20480))
    chosen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert chosen[0] == chosen[1] <= 12
    (report,) = tmp_path.rglob("boost_report.json")
    (finding,) = [f for f in json.loads(report.read_text())["findings"] if f["source"] == "AutoBatchSize"]
    tried = {t["size"]: t for t in finding["data"]["trials"]}
    assert tried[16]["oom"] and not tried[12]["oom"]  # rank 1's OOM is known to rank 0
    assert tried[8]["double_grad_sq"] is not None  # the first trial's third size, from both ranks
    assert finding["data"]["world_size"] == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_batch_size": 0}, "`init_batch_size` expected an int >= 1 or None, got 0"),
        ({"max_batch_size": 2.5}, "`max_batch_size` expected an int >= 1 or None, got 2.5"),
        ({"init_batch_size": 64, "max_batch_size": 32}, "`init_batch_size` (64) expected to be at most"),
        ({"headroom": 1.5}, "`headroom` expected a finite number > 0 and <= 1, got 1.5"),
        ({"cpu_memory_fraction": 0}, "`cpu_memory_fraction` expected a finite number > 0 and <= 1, got 0"),
        ({"memory_budget_gib": 0}, "`memory_budget_gib` expected a finite number of GiB > 0 or None, got 0"),
        ({"tolerance": 1}, "`tolerance` expected a finite number >= 0 and < 1, got 1"),
        ({"time_budget_s": -1}, "`time_budget_s` expected a finite number of seconds > 0, got -1"),
        ({"steps": True}, "`steps` expected an int >= 1 and <= 100, got True (bool)"),
        ({"target_global_batch_size": 0}, "`target_global_batch_size` expected an int >= 1 or None, got 0"),
        (
            {"lr_scaling": "linaer"},
            "`lr_scaling` expected one of 'auto', 'linear', 'sqrt' or None, got 'linaer'."
            " Did you mean 'linear'",
        ),
        (
            {"reference_batch_size": 64, "lr_scaling": None},
            "`reference_batch_size` only applies with `lr_scaling`",
        ),
        ({"min_efficiency": 0}, "`min_efficiency` expected a finite number > 0 and <= 1, got 0"),
        ({"lr_warmup_steps": -1}, "`lr_warmup_steps` expected an int >= 0 or None, got -1"),
        ({"retune": "yes"}, "`retune` expected True or False, got 'yes'"),
        (
            {"cache_dir": 123},
            "`cache_dir` expected a string or a path (not an empty string) or None, got 123 (int)",
        ),
        ({"attr_name": "batch size"}, "`attr_name` expected a string that is an attribute name, got 'batch"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as error:
        AutoBatchSize(**kwargs)
    assert message in str(error.value)


def test_target_conflicts_with_an_accumulation_scheduler(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trainer = tiny_trainer(
        tmp_path,
        callbacks=[AutoBatchSize(target_global_batch_size=64), GradientAccumulationScheduler({0: 2})],
        logger=False,
    )
    with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
        trainer.fit(BoringModel(), datamodule=BoringDataModule())


class TwoTasks(BoringModel):
    """Trains on a dict of two loaders at once (Lightning's `CombinedLoader`), each at
    `batch_size`, and validates on a dict of two."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        losses = []
        for part in batch.values():
            losses.append(super().training_step(part, batch_idx))
        return torch.stack(losses).sum()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", self(batch[0]).sum())

    def train_dataloader(self) -> dict[str, DataLoader[Any]]:
        return {name: DataLoader(RandomDataset(length=64), self.hparams.batch_size) for name in "ab"}

    def val_dataloader(self) -> dict[str, DataLoader[Any]]:
        return {name: DataLoader(RandomDataset(length=16), self.hparams.batch_size) for name in "ab"}


def test_several_training_loaders_train_as_written_with_the_reason(tmp_path: Path) -> None:
    """A dict of training loaders stopped the fit with a TypeError at its start: a trial times one
    loader's batches. The run now trains as written, and the report says why."""
    tuner = AutoBatchSize()
    model = TwoTasks()
    tiny_trainer(tmp_path, callbacks=[tuner], logger=False).fit(model)
    assert model.hparams.batch_size == 8 and tuner.decision is None
    assert [f.title for f in tuner.findings] == [
        "Batch size kept as written: the training loaders are a dict of several"
    ]


class OneTaskTwoEvaluations(TwoTasks):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return BoringModel.training_step(self, batch, batch_idx)

    def train_dataloader(self) -> DataLoader[Any]:  # type: ignore[override]
        return DataLoader(RandomDataset(length=64), self.hparams.batch_size)


def test_a_dict_of_validation_loaders_is_checked_on_its_first(tmp_path: Path) -> None:
    """The validation step at the chosen size takes the first loader of a dict, as of a list (a
    dict raised a TypeError at the fit's start)."""
    tuner = AutoBatchSize(check_validation=True)
    tiny_trainer(tmp_path, callbacks=[tuner], logger=False).fit(OneTaskTwoEvaluations())
    assert tuner.decision is not None


def test_a_second_fit_with_the_same_callback_reports_its_own_findings(tmp_path: Path) -> None:
    """Callbacks built once and handed to each Trainer of a sweep: the second fit's report held
    the first's findings beside its own (every one twice)."""
    tuner = AutoBatchSize()
    reports = []
    for run in range(2):
        trainer = tiny_trainer(tmp_path / str(run), callbacks=[tuner], logger=False)
        trainer.fit(BoringModel(), datamodule=BoringDataModule())
        reports.append([f.title for f in tuner.findings])
    assert reports[1] and len(set(reports[1])) == len(reports[1])
    assert len(reports[1]) == len(reports[0])


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_lightnings_batch_size_finder_beside_it_is_refused_before_training(
    tmp_path: Path, namespace: str
) -> None:
    """Both set `batch_size`: Lightning's finder ran first (its trial fits), set 4096 on a
    3584-sample task, and the model ended at 0.25 accuracy instead of 0.93 (by hand). The other
    namespace's finder beside a `lightning` Trainer: Lightning < 2.6 refuses the mix itself."""
    if namespace == "pytorch_lightning" and not pytorch_lightning_takes_our_callbacks():
        pytest.skip("Lightning < 2.6 refuses a pytorch_lightning callback in a lightning Trainer")
    finder = importlib.import_module(f"{namespace}.callbacks").BatchSizeFinder()
    model = BoringModel()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = tiny_trainer(tmp_path, callbacks=[finder, AutoBatchSize()], logger=False)
    with pytest.raises(ValueError, match=r"BatchSizeFinder.*`batch_size`: keep one"):
        trainer.fit(model, datamodule=BoringDataModule())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # untrained


def test_lightnings_tuner_is_refused_with_it_too(tmp_path: Path) -> None:
    from lightning.pytorch.tuner import Tuner

    trainer = tiny_trainer(tmp_path, callbacks=[AutoBatchSize()], logger=False)
    with pytest.raises(ValueError, match=r"Tuner\.scale_batch_size"):
        Tuner(trainer).scale_batch_size(BoringModel(), datamodule=BoringDataModule())


@pytest.mark.gpu
def test_cuda_steps_are_timed_with_events() -> None:
    from lightning_boost.step_probe import fastest_step

    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    matmuls = fastest_step(lambda: torch.mm(x, x), 3, device)
    nothing = fastest_step(lambda: None, 3, device)
    assert 0 < nothing < matmuls < 1  # the events bracket the queued kernels, not the host's call


class Hungry(BoringModel):
    """Holds `mib_per_sample` MiB of activations per sample on the device for the whole step."""

    def __init__(self, mib_per_sample: int) -> None:
        super().__init__()
        self.mib_per_sample = mib_per_sample

    @override
    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs = batch[0]
        scratch = torch.ones(inputs.shape[0], self.mib_per_sample * 2**18, device=inputs.device)
        return super()._loss(batch) + 0.0 * scratch.mean()


@pytest.fixture
def no_cross_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise scale left unread on a GPU too: `scripted_throughput` scripts the trials' own
    gradient norms away, but a GPU's first trial also reads independent batches' cross products.
    Random targets' noise scale of tens stopped these searches at 8 on an H200 (2026-11-26)."""
    from lightning_boost.batch_size import callback as module

    monkeypatch.setattr(module, "_reads_cross_products", lambda device, parameters, budget: False)


@pytest.mark.gpu
@pytest.mark.usefixtures("no_cross_products")
def test_cuda_peak_is_the_allocators_and_keeps_the_choice_in_the_budget(tmp_path: Path) -> None:
    budget = 2**29  # 0.5 GiB: a step peaks at > 8 MiB x batch size
    callback = AutoBatchSize(memory_budget_gib=0.5, max_batch_size=256, steps=1, tolerance=0.0)
    fit(
        tmp_path,
        callback,
        Hungry(mib_per_sample=8),
        accelerator="gpu",
        datamodule=BoringDataModule(length=1024),
    )
    tried = sizes(callback)
    chosen = callback.result["batch_size"]
    assert not any(trial["oom"] for trial in tried.values())  # the budget binds before the device does
    assert all(trial["peak_bytes"] >= size * 8 * 2**20 for size, trial in tried.items())
    assert tried[chosen]["peak_bytes"] <= budget
    assert 32 <= chosen < 64  # 64 x 8 MiB alone fills the budget; 32 x 8 MiB leaves half of it


@pytest.mark.gpu
@pytest.mark.usefixtures("no_cross_products")
def test_cuda_out_of_memory_is_real_and_survived(tmp_path: Path) -> None:
    # The process may use 1 GiB of the device: a step at 32 MiB per sample runs out above ~30 samples.
    device = torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(2**30 / torch.cuda.get_device_properties(device).total_memory)
    try:
        callback = AutoBatchSize(max_batch_size=256, steps=1, tolerance=0.0)
        trainer, _ = fit(
            tmp_path,
            callback,
            Hungry(mib_per_sample=32),
            accelerator="gpu",
            datamodule=BoringDataModule(length=1024),
        )
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    tried = sizes(callback)
    assert any(trial["oom"] for trial in tried.values())  # torch.OutOfMemoryError, caught
    chosen = trainer.train_dataloader.batch_size
    assert chosen == callback.result["batch_size"] < 32 and not tried[chosen]["oom"]
    assert trainer.state.finished


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """64 samples, streamed: no `len()`, so no size bound is known before a batch comes back short."""

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(0)
        for _ in range(64):
            yield torch.randn(32, generator=generator), torch.randn(2, generator=generator)


@pytest.mark.usefixtures("scripted_throughput")
def test_a_stream_shorter_than_the_batch_bounds_the_size_by_what_came_back(tmp_path: Path) -> None:
    class StreamData(BoostedDataModule):
        def setup(self, stage: str) -> None:
            self.train_dataset = Stream()

    callback = AutoBatchSize(**FAST, lr_scaling=None)  # no learning-rate limit: x4 is 64 here too
    trainer = tiny_trainer(tmp_path, callbacks=[callback], limit_val_batches=0)
    trainer.fit(BoringModel(), datamodule=StreamData(batch_size=16, num_workers=0))
    decision = callback.decision
    assert decision is not None and decision.batch_size <= 64  # it chose 33,554,432
    assert max(t.size for t in decision.trials) == 64
    assert max(t.samples_per_s for t in decision.trials) <= 1000.0 * 64  # rates of the samples held
    assert "held 64 samples" in decision.stopped


@pytest.fixture
def scripted_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation sizes measured as on an accelerator (there only: on a CPU a larger evaluation
    batch is not faster), with validation throughput scripted to grow with the size as training's
    does, at a second a sample at batch 1: the run's validation is always worth more than a trial's
    real seconds (at 1000 samples/s a sample, a pass of 32 took 8 ms, and a trial that took longer
    on a busy machine was judged not to repay itself); OOMs stay real."""
    from lightning_boost.batch_size import measure

    monkeypatch.setattr(measure, "_measures_eval_sizes", lambda device: True)
    real = StepProbe.validate

    def validate(self: StepProbe, batch: Any, size: int, train_size: int | None = None) -> Any:
        trial = real(self, batch, size, train_size)
        return trial if trial.oom else dataclasses.replace(trial, samples_per_s=float(size))

    monkeypatch.setattr(StepProbe, "validate", validate)


@pytest.mark.usefixtures("scripted_validation")
def test_evaluation_loaders_get_a_measured_batch_size_of_their_own(tmp_path: Path) -> None:
    """Validation steps keep no gradients: measured at doubling sizes from the training size, they
    run out of memory above 16 samples here, so the evaluation loaders take 16 (4x the training
    size); the training loader keeps its own size."""
    boosted = Boosted(batch_size=4, num_workers=0)
    callback = AutoBatchSize(max_batch_size=4, **FAST)
    trainer, _ = fit(tmp_path, callback, OOMModel(val_limit=16), datamodule=boosted)
    assert boosted.tuned_eval_batch_size == 16 and boosted.evaluation_batch_size == 16
    assert trainer.val_dataloaders.batch_size == 16 and trainer.train_dataloader.batch_size == 4
    (finding,) = [f for f in callback.findings if f.title.startswith("Evaluation batch size")]
    assert finding.title == "Evaluation batch size 16 (4x the training size)"
    assert "32: out of memory" in finding.detail and "stopped: out of memory at 32" in finding.detail
    assert callback.state_dict()["eval_batch_size"] == 16  # a resumed run applies it without trials


@pytest.mark.usefixtures("scripted_validation")
def test_an_evaluation_batch_leaves_every_loader_worker_a_batch_in_each_pass(tmp_path: Path) -> None:
    """The 32 validation samples over 2 workers: past 16 a pass would wait for one worker loading
    the whole set alone, where without the rule the doublings go on to 32, the set's length (on
    the H100 the demo's 1,024 validation samples went in 2 batches of 512 over 15 workers)."""
    boosted = Boosted(batch_size=4, num_workers=2)
    callback = AutoBatchSize(max_batch_size=4, **FAST)
    trainer, _ = fit(tmp_path, callback, OOMModel(), datamodule=boosted, limit_val_batches=1.0)
    decision = callback.decision
    assert decision is not None and [t.size for t in decision.eval_trials] == [4, 8, 16]
    assert boosted.tuned_eval_batch_size == 16 == trainer.val_dataloaders.batch_size
    assert decision.eval_stopped == (
        "past 16 a pass of 32 samples would leave some of the loader's 2 workers no batch"
    )


@pytest.mark.usefixtures("scripted_validation")
def test_an_evaluation_batch_size_given_by_hand_is_kept(tmp_path: Path) -> None:
    boosted = Boosted(batch_size=4, eval_batch_size=6, num_workers=0)
    callback = AutoBatchSize(max_batch_size=4, **FAST)
    trainer, _ = fit(tmp_path, callback, OOMModel(val_limit=16), datamodule=boosted)
    assert trainer.val_dataloaders.batch_size == 6 and boosted.tuned_eval_batch_size is None
    assert not [f for f in callback.findings if f.title.startswith("Evaluation batch size")]


@pytest.mark.parametrize(("per_sample_s", "chosen"), [(1e-9, 4), (1.0, 16)], ids=["repaid-never", "repaid"])
def test_evaluation_sizes_are_measured_only_while_the_runs_validation_can_repay_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_sample_s: float, chosen: int
) -> None:
    """The fit validates its 32 samples twice (every other epoch of 4). When that takes next to no
    time at the training size, a larger evaluation batch cannot save what its trial costs: the
    training size is kept after its own step. At 1 s a sample, the doublings go on as before
    (to 16: the OOM above it). Evaluation rates are scripted like the other tests' (real steps)."""
    from lightning_boost.batch_size import measure

    monkeypatch.setattr(measure, "_measures_eval_sizes", lambda device: True)
    real = StepProbe.validate

    def validate(self: StepProbe, batch: Any, size: int, train_size: int | None = None) -> Any:
        trial = real(self, batch, size, train_size)
        return trial if trial.oom else dataclasses.replace(trial, samples_per_s=size / per_sample_s)

    monkeypatch.setattr(StepProbe, "validate", validate)
    boosted = Boosted(batch_size=4, num_workers=0)
    callback = AutoBatchSize(max_batch_size=4, **FAST)
    options = {
        "max_epochs": 4,
        "check_val_every_n_epoch": 2,
        "limit_train_batches": 1.0,
        "limit_val_batches": 1.0,
    }
    trainer, _ = fit(tmp_path, callback, OOMModel(val_limit=16), datamodule=boosted, **options)
    assert boosted.tuned_eval_batch_size == chosen == trainer.val_dataloaders.batch_size
    decision = callback.decision
    assert decision is not None
    if chosen == 4:
        assert [t.size for t in decision.eval_trials] == [4]
        assert decision.eval_stopped.startswith("the run evaluates 64 samples")
        assert decision.eval_stopped.endswith("cannot repay itself")
    else:
        assert decision.eval_stopped == "out of memory at 32"


def test_evaluation_sizes_are_not_measured_on_a_cpu(tmp_path: Path) -> None:
    boosted = Boosted(batch_size=4, num_workers=0)
    callback = AutoBatchSize(max_batch_size=4, **FAST)
    trainer, _ = fit(tmp_path, callback, datamodule=boosted)
    assert trainer.val_dataloaders.batch_size == 4
    (finding,) = [f for f in callback.findings if f.title.startswith("Evaluation batch size")]
    assert finding.title.endswith("not measured on a CPU, where a larger batch is not faster")


class Detector(L.LightningModule):
    """A box regressor on torchvision's detection batches: a tuple of (3, H, W) images of their
    own sizes and a tuple of one target dict per image."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, targets = batch
        boxes = torch.stack([self.net(image[None])[0] for image in images])
        return nn.functional.mse_loss(boxes, torch.stack([target["boxes"][0] for target in targets]))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_detection_batch_counts_its_images_not_the_first_images_channels(tmp_path: Path) -> None:
    """Counted as Lightning counts a batch (the first tensor's first dimension: an image's 3
    channels), a batch of 8 images "held 3 samples": the search stopped there, chose 3 and scaled
    the learning rate down."""
    generator = torch.Generator().manual_seed(0)
    data = [
        (torch.rand(3, 8 + i % 3, 10, generator=generator), {"boxes": torch.rand(1, 4, generator=generator)})
        for i in range(512)
    ]

    class Boxes(BoostedDataModule):
        def setup(self, stage: str) -> None:
            self.train_dataset = data

    callback = AutoBatchSize(**FAST, max_batch_size=16)
    trainer = tiny_trainer(tmp_path, callbacks=[callback], limit_val_batches=0, limit_train_batches=None)
    datamodule = Boxes(batch_size=8, num_workers=0, collate_fn=lambda b: tuple(zip(*b, strict=True)))
    trainer.fit(Detector(), datamodule=datamodule)
    decision = callback.decision
    assert decision is not None and {t.size for t in decision.trials} >= {8, 16}
    assert decision.batch_size == 16 and "held" not in decision.stopped


class Normed(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(32)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self(self.norm(batch[0])), batch[1])


@pytest.mark.ddp
def test_a_trials_copy_of_a_sync_batchnorm_model_normalizes_on_its_own_rank(tmp_path: Path) -> None:
    """`Trainer(sync_batchnorm=True)` makes each BatchNorm a SyncBatchNorm, whose training forward
    all-gathers the batch's statistics from every rank of the process group. A trial's copy ran
    that: on GPUs each rank's trials (as many steps as its own clock says) wait on ranks that run
    none; outside CUDA it raises, as here in a gloo group of one process (this machine has no
    GPU: "SyncBatchNorm expected input tensor to be on GPU"). The copy normalizes with plain batch
    norm over the same statistics; the model keeps its SyncBatchNorm, its statistics untouched."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(Normed())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        probe = StepProbe(model, [optimizer], 2, torch.enable_grad, torch.no_grad)
        trial = probe.train((torch.randn(8, 32), torch.randn(8, 2)), 8)
        assert trial.samples_per_s is not None and len(trial.losses) == 2
        assert isinstance(model.norm, nn.SyncBatchNorm) and int(model.norm.num_batches_tracked) == 0
    finally:
        dist.destroy_process_group()
