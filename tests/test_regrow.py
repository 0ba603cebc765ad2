"""The batch grown during the run: the noise scale read from pairs of the run's own steps (pure, on
drawn gradients), the growth decision (pure, on scripted trials), and real CPU Trainer runs that
grow, resume and refuse to grow (trial throughput scripted, gradients and training real)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_boost import AutoBatchSize
from lightning_boost.batch_size.decision import BatchSizeDecision
from lightning_boost.batch_size.regrow import MAX_HELD, MIN_PAIRS, Growth, NoiseMeter, lr_ramp
from lightning_boost.batch_size.watch import WINDOW
from lightning_boost.step_probe import StepProbe
from lightning_boost.testing import tiny_trainer
from lightning_boost.trials import Trial
from tests.test_goodput import MLP, Classes, quiet_trainer


def drawn_gradients(noise: float, batch: int, dims: int = 256, seed: int = 0) -> Callable[[], list[Tensor]]:
    """Mean gradients of `batch` samples around a fixed true gradient (|G|^2 = 1) with per-sample
    variance tr(Σ) = `noise`: each call is the next step's, in two tensors as a model's would be."""
    generator = torch.Generator().manual_seed(seed)
    true = torch.full((dims,), 1 / math.sqrt(dims))

    def step() -> list[Tensor]:
        g = true + torch.randn(dims, generator=generator) * math.sqrt(noise / dims / batch)
        return [g[: dims // 4].reshape(8, -1), g[dims // 4 :]]

    return step


@pytest.mark.parametrize("noise", [30.0, 300.0, 3000.0])
def test_the_meter_recovers_the_noise_scale_of_the_steps(noise: float) -> None:
    meter, step = NoiseMeter(batch=64, every=2), drawn_gradients(noise, 64)
    for index in range(2 * 64):
        meter.observe(index, step())
    estimate = meter.estimate()
    assert meter.pairs == 64 and estimate is not None
    assert noise / 1.5 < estimate.value < noise * 1.5


def test_the_meter_reads_only_its_pairs_and_needs_enough_of_them() -> None:
    meter, step = NoiseMeter(batch=64, every=8), drawn_gradients(300.0, 64)
    for index in range(8 * (MIN_PAIRS - 1)):
        meter.observe(index, step())
    assert meter.estimate() is None and meter.pairs == MIN_PAIRS - 1  # one pair per 8 steps
    for index in range(8 * (MIN_PAIRS - 1), 8 * MIN_PAIRS):
        meter.observe(index, step())
    assert meter.estimate() is not None and meter.pairs == MIN_PAIRS
    meter.reset(128)
    assert meter.estimate() is None and meter.batch == 128


def test_a_non_finite_pair_is_left_out() -> None:
    meter, step = NoiseMeter(batch=64, every=2), drawn_gradients(300.0, 64)
    for index in range(2 * MIN_PAIRS):
        meter.observe(index, step())
    meter.observe(2 * MIN_PAIRS, step())
    meter.observe(2 * MIN_PAIRS + 1, [torch.full((8, 8), math.inf), torch.zeros(192)])  # skipped fp16 step
    assert meter.estimate() is not None and meter.pairs == MIN_PAIRS


def test_a_large_model_holds_a_strided_sample_of_its_gradient() -> None:
    noise, elements = 300.0, 3 * MAX_HELD
    generator = torch.Generator().manual_seed(0)
    meter = NoiseMeter(batch=64, every=2)
    for index in range(2 * MIN_PAIRS):
        grad = 1 / math.sqrt(elements) + torch.randn(elements, generator=generator) * math.sqrt(
            noise / elements / 64
        )
        meter.observe(index, [grad])
        if index % 2 == 0:
            assert meter._held is not None and sum(g.numel() for g in meter._held) <= MAX_HELD
    estimate = meter.estimate()
    assert estimate is not None and noise / 1.5 < estimate.value < noise * 1.5


def start_decision(trials: tuple[Trial, ...] = (Trial(64, 1000.0, 10),)) -> BatchSizeDecision:
    return BatchSizeDecision(
        64,
        effective_batch_size=64,
        configured_batch_size=64,
        reference_batch_size=64,
        lr_scaling="sqrt",
        trials=trials,
        noise_scale=50.0,
        min_efficiency=0.8,
        budget_bytes=100,
    )


def growth_at(noise: float, measured: list[int], cap: int = 4096) -> Growth:
    meter, step = NoiseMeter(batch=64, every=2), drawn_gradients(noise, 64)
    for index in range(2 * 32):
        meter.observe(index, step())

    def measure(size: int) -> Trial:
        measured.append(size)
        return Trial(size, 1000.0 * size / 64 * 0.9, 10, grad_sq=1.0)  # 1.8x at twice the size

    return Growth(meter, cap, 0.05, measure)


def test_a_grown_noise_scale_measures_the_doubling_once_and_grows_the_batch() -> None:
    measured: list[int] = []
    growth = growth_at(3000.0, measured)
    after = growth.epoch_end(start_decision(), epoch=1, step=200, epoch_batches=112)
    assert measured == [128] and after.batch_size == 128 and after.effective_batch_size == 128
    assert after.lr_factor == pytest.approx(math.sqrt(2))  # Adam: the square-root rule
    grew = after.growth[0]
    assert grew["from"] == 64 and grew["to"] == 128 and grew["pairs"] == 32 and grew["epoch"] == 1
    assert grew["speedup"] == pytest.approx(1.8) and grew["goodput"] > 1.05
    assert grew["warmup_steps"] == 5  # a tenth of an epoch at 128
    assert next(t for t in after.trials if t.size == 128).grad_sq is None  # read at other weights
    assert growth.reads == [(1, pytest.approx(grew["noise_scale"]), 32)]
    assert lr_ramp(after, 200) == pytest.approx(1 / math.sqrt(2)) and lr_ramp(after, 205) == 1.0


def test_a_small_noise_scale_measures_nothing_and_keeps_the_batch() -> None:
    measured: list[int] = []
    after = growth_at(30.0, measured).epoch_end(start_decision(), epoch=0, step=100, epoch_batches=112)
    assert measured == [] and after == start_decision()


def test_a_measured_size_that_is_not_faster_is_kept_and_not_measured_again() -> None:
    slow = start_decision((Trial(64, 1000.0, 10), Trial(128, 1010.0, 20)))
    measured: list[int] = []
    after = growth_at(3000.0, measured).epoch_end(slow, epoch=0, step=100, epoch_batches=112)
    assert measured == [] and after.batch_size == 64


def test_the_cap_bounds_the_growth() -> None:
    measured: list[int] = []
    after = growth_at(3000.0, measured, cap=100).epoch_end(start_decision(), 0, 100, 112)
    assert measured == [] and after.batch_size == 64


class Recorded(MLP):
    """Records the batch size of every training step, per epoch, and of the trainer's training
    loader at each epoch's end, where a user's hook reads it (plain Lightning's is never ``None``)."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(lr)
        self.sizes: dict[int, list[int]] = {}
        self.loader_sizes: list[int | None] = []

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.sizes.setdefault(self.current_epoch, []).append(len(batch[0]))
        return super().training_step(batch, batch_idx)

    @override
    def on_train_epoch_end(self) -> None:
        self.loader_sizes.append(self.trainer.train_dataloader.batch_size)


class StepScheduled(MLP):
    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


WHOLE: dict[str, Any] = {"limit_train_batches": 1.0, "limit_val_batches": 1.0}


def grow_callback(tmp_path: Path) -> AutoBatchSize:
    return AutoBatchSize(retune=True, cache_dir=tmp_path / "cache", grow=True)


@pytest.mark.usefixtures("fixed_cost_steps")
def test_a_real_run_grows_its_batch_between_epochs_with_every_sample_once(tmp_path: Path) -> None:
    callback, model, data = grow_callback(tmp_path), Recorded(), Classes(batch_size=64)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=5)
    trainer.fit(model, datamodule=data)
    decision = callback.decision
    assert decision is not None and decision.growth, [f.title for f in callback.findings]
    first = decision.growth[0]
    assert model.sizes[0] == [64] * 112  # the start keeps 64: 128 taught too little at first
    assert set(model.sizes[first["epoch"] + 1][:-1]) == {first["to"]}  # the next epoch at the new size
    assert all(sum(sizes) == 7168 for sizes in model.sizes.values())  # every sample, each epoch
    # at each epoch's end the trainer holds a loader: the next epoch's (built at a growth)
    assert model.loader_sizes == [model.sizes[min(epoch + 1, 4)][0] for epoch in range(5)]
    assert model.loader_sizes[first["epoch"]] == first["to"]
    assert decision.lr_factor == pytest.approx(math.sqrt(decision.batch_size / 64))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * decision.lr_factor)
    titles = [f.title for f in callback.findings]
    assert any(t.startswith("Batch size grown from 64 to") for t in titles)
    assert any(t.startswith("Gradient noise scale re-read during the run") for t in titles)
    assert data.batch_size == 64  # put back for the next fit
    # the divergence watch read the whole run, not from the growth on (where a loss near its
    # lowest, wobbling, read as climbing back the whole way to the watch's first window)
    watch = callback._watch
    batches = sum(len(sizes) for sizes in model.sizes.values())
    assert watch is not None and len(watch.means) == batches // WINDOW


class Reloaded(Classes):
    """Records the epoch of each training loader built once training has begun."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.built_at: list[int] = []

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        if self.trainer is not None and self.trainer.global_step:
            self.built_at.append(self.trainer.current_epoch)
        return super().train_dataloader()


@pytest.mark.usefixtures("fixed_cost_steps")
def test_a_run_that_reloads_its_loader_each_epoch_grows_at_lightning_s_reload(tmp_path: Path) -> None:
    callback, model, data = grow_callback(tmp_path), Recorded(), Reloaded(batch_size=64)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=5, reload_dataloaders_every_n_epochs=1)
    trainer.fit(model, datamodule=data)
    decision = callback.decision
    assert decision is not None and decision.growth, [f.title for f in callback.findings]
    first = decision.growth[0]
    assert set(model.sizes[first["epoch"] + 1][:-1]) == {first["to"]}
    assert data.built_at == [1, 2, 3, 4]  # Lightning's reloads, none added for the growth
    assert model.loader_sizes[first["epoch"]] == 64  # the epoch's own loader, till Lightning's reload


class SecondMoments(Recorded):
    """Records Adam's running squared gradients after each epoch's last step, and at its end."""

    def __init__(self) -> None:
        super().__init__()
        self.before: list[Tensor] = []
        self.after: dict[int, list[Tensor]] = {}

    def _squares(self) -> list[Tensor]:
        optimizer = self.trainer.optimizers[0]
        return [optimizer.state[p]["exp_avg_sq"].clone() for p in self.parameters()]

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.before = self._squares()  # the epoch's last is the state before any growth

    @override
    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        after = self._squares()
        self.after[self.current_epoch] = [a / b for a, b in zip(after, self.before, strict=True)]


@pytest.mark.usefixtures("fixed_cost_steps")
def test_a_growth_rescales_adams_running_squared_gradients_to_the_larger_batch(tmp_path: Path) -> None:
    """At a larger batch the gradients are less noisy: Adam's running average of their squares,
    kept from the smaller batch, would divide its steps by the old, larger squares for about
    1 / (1 - beta2) = 1,000 steps, undoing the raised learning rate (a 32 -> 64 -> 128 growth
    ended at val loss 0.31 where the batch of 32 reached 0.29: `second_moment_factor`)."""
    callback, model = grow_callback(tmp_path), SecondMoments()
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=5)
    trainer.fit(model, datamodule=Classes(batch_size=64))
    decision = callback.decision
    assert decision is not None and decision.growth, [f.title for f in callback.findings]
    grew = decision.growth[0]
    expected = (1 + grew["noise_scale"] / grew["to"]) / (1 + grew["noise_scale"] / grew["from"])
    assert grew["second_moment"] == pytest.approx(expected) and expected < 0.9
    for ratio in model.after[grew["epoch"]]:
        assert torch.allclose(ratio, torch.full_like(ratio, expected))
    untouched = [e for e in model.after if e not in {g["epoch"] for g in decision.growth}]
    assert untouched and all(torch.equal(r, torch.ones_like(r)) for e in untouched for r in model.after[e])
    finding = next(f for f in callback.findings if f.title.startswith("Batch size grown"))
    assert f"Adam's running squared gradients x{expected:.2f}" in finding.detail


@pytest.mark.usefixtures("fixed_cost_steps")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # the resumed run's
def test_a_run_resumed_after_a_growth_keeps_the_grown_size(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    callback = grow_callback(tmp_path)
    trainer = tiny_trainer(tmp_path, callbacks=[callback, checkpoints], max_epochs=5, **WHOLE)
    trainer.fit(Recorded(), datamodule=Classes(batch_size=64))
    decision = callback.decision
    assert decision is not None and decision.growth
    grew = decision.growth[0]
    path = next((tmp_path / "ckpt").glob(f"epoch={grew['epoch']}-*.ckpt"))  # saved after the growth
    resumed, model = grow_callback(tmp_path), Recorded()
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    again = tiny_trainer(tmp_path / "again", callbacks=[resumed, saving], max_epochs=5, **WHOLE)
    again.fit(model, datamodule=Classes(batch_size=64), ckpt_path=path)
    assert resumed.decision is not None and resumed.decision.growth[0] == grew
    assert set(model.sizes[grew["epoch"] + 1][:-1]) == {grew["to"]}  # no trial, no growth again
    assert again.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * resumed.decision.lr_factor)


@pytest.mark.usefixtures("fixed_cost_steps")
@pytest.mark.parametrize(
    ("model", "options", "why"),
    [
        (StepScheduled, {}, "steps per optimizer step"),
        (MLP, {"val_check_interval": 50}, "counts training batches"),
    ],
)
def test_a_run_counted_in_steps_or_batches_is_not_grown_and_says_why(
    tmp_path: Path, model: Callable[[], L.LightningModule], options: dict[str, Any], why: str
) -> None:
    callback = grow_callback(tmp_path)
    trainer = quiet_trainer(tmp_path, [callback], **({"max_epochs": 5} | options))
    trainer.fit(model(), datamodule=Classes(batch_size=64))
    assert callback.decision is not None and callback.decision.growth == ()
    titles = [f.title for f in callback.findings]
    assert any(t.startswith("Batch size not grown during the run") and why in t for t in titles)


@pytest.mark.usefixtures("fixed_cost_steps")
def test_a_short_run_and_grow_false_read_nothing(tmp_path: Path) -> None:
    for epochs, grow in ((2, True), (5, False)):
        callback = AutoBatchSize(retune=True, cache_dir=tmp_path / "cache", grow=grow)
        trainer = quiet_trainer(tmp_path / str(epochs), [callback], max_epochs=epochs)
        trainer.fit(MLP(), datamodule=Classes(batch_size=64))
        assert callback.decision is not None and callback.decision.growth == ()
        assert not any("noise scale re-read" in f.title or "not grown" in f.title for f in callback.findings)


class RecordedRanks(Recorded):
    @override
    def on_train_end(self) -> None:
        path = Path(self.trainer.default_root_dir) / f"sizes-{self.global_rank}.txt"
        path.write_text(repr(self.sizes))


class FixedCostProbe(StepProbe):
    """`fixed_cost_steps` for processes `ddp_spawn` starts (a fixture's patch does not reach them):
    the real trial, timed as a 10 ms step plus 1 µs a sample."""

    @override
    def train(self, batch: Any, size: int, *args: Any, **kwargs: Any) -> Any:
        trial = super().train(batch, size, *args, **kwargs)
        rate = size / (0.01 + 1e-6 * size)
        return trial if trial.oom else dataclasses.replace(trial, samples_per_s=rate, spread=0.0)


class FixedCostGrowth(AutoBatchSize):
    """`AutoBatchSize(grow=True)` whose trials in every rank are timed by `FixedCostProbe`."""

    @override
    def _probe(self, trainer: L.Trainer, pl_module: L.LightningModule, unfrozen: list[str]) -> StepProbe:
        probe = super()._probe(trainer, pl_module, unfrozen)
        probe.__class__ = FixedCostProbe
        return probe


def test_ddp_ranks_grow_together(tmp_path: Path) -> None:
    callback = FixedCostGrowth(retune=True, cache_dir=tmp_path / "cache", grow=True)
    trainer = quiet_trainer(
        tmp_path, [callback], max_epochs=9, accelerator="cpu", devices=2, strategy="ddp_spawn"
    )
    trainer.fit(RecordedRanks(), datamodule=Classes(batch_size=32))
    sizes = [eval((tmp_path / f"sizes-{rank}.txt").read_text()) for rank in range(2)]
    assert sizes[0].keys() == sizes[1].keys()
    assert sizes[0] == sizes[1]  # the same batch sizes, epoch by epoch
    assert len({size for epoch in sizes[0].values() for size in epoch}) > 1  # it grew, on both ranks
