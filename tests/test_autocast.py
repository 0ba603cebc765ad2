"""A CPU's bf16 autocast, kept only where the model's training step is faster with it.

Which setting is faster is made certain here by a model whose step sleeps under one of them (a
real Lightning fit, real autocast: only the cost is planted), since this machine's own timing is
noise at these sizes. `EXAMPLES["cpu-bf16"]` stands for a CPU with bf16 dot products: the plan
must not depend on the machine the tests run on.
"""

import json
import re
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_boost import BoostReport, BoostWarning, preset
from lightning_boost.demo import precision_text
from lightning_boost.hardware import EXAMPLES
from lightning_boost.precision import (
    AUTOCAST_AT_ONCE_MIN_S,
    AUTOCAST_KEEP_AT_ONCE,
    AUTOCAST_MAX_LOSS,
    AUTOCAST_PAIRS,
    AUTOCAST_RECHECK_FIRST,
    AUTOCAST_WARMUP,
    AutocastChoice,
    auto_precision,
    autocast_setting,
    decide_autocast,
    next_recheck,
    recheck_setting,
)
from lightning_boost.presets.autocast import MeasuredAutocast
from lightning_boost.report import Report
from lightning_boost.testing import BoringDataModule, BoringModel, RandomDataset, tiny_trainer
from lightning_boost.trainer_reads import TrainerReads

CPU_BF16 = EXAMPLES["cpu-bf16"]


def timed(fp32: float, bf16: float, pairs: int) -> list[float]:
    """Step times as a trial would record them when fp32 steps take `fp32` and bf16 ones `bf16`."""
    steps = AUTOCAST_WARMUP + 2 * pairs
    return [bf16 if autocast_setting(step) else fp32 for step in range(steps)]


def test_schedule_warms_up_each_setting_then_alternates_pair_order() -> None:
    settings = [autocast_setting(step) for step in range(AUTOCAST_WARMUP + 8)]
    assert settings[:AUTOCAST_WARMUP] == [False, True]
    pairs = [tuple(settings[i : i + 2]) for i in range(AUTOCAST_WARMUP, len(settings), 2)]
    assert pairs == [(False, True), (True, False)] * 2  # each pair one of each, order alternating


@pytest.mark.parametrize("bf16", [0.08, 0.098, 0.100])
def test_a_first_pair_that_bf16_does_not_slow_keeps_it_at_once(bf16: float) -> None:
    """The trial looks for models bf16 slows down: a step it does not slow is no such model, and
    the second pair would only cost the run another two steps before its first."""
    assert 0.100 / bf16 >= AUTOCAST_KEEP_AT_ONCE
    assert decide_autocast(timed(0.100, bf16, 1)) == AutocastChoice(True, round(0.100 / bf16, 3), 1)


def test_a_first_pair_of_short_steps_waits_for_both_orders() -> None:
    """A 1 ms step's pair is cheap to repeat, and its noise can hide a loss: no verdict on one."""
    short = AUTOCAST_AT_ONCE_MIN_S / 2
    assert decide_autocast(timed(short, short * 0.8, 1)) is None
    assert decide_autocast(timed(short, short * 0.8, AUTOCAST_PAIRS[0])) == AutocastChoice(True, 1.25, 2)


@pytest.mark.parametrize("bf16", [0.101, 0.103, 0.14])
def test_a_first_pair_that_bf16_slows_waits_for_both_orders(bf16: float) -> None:
    """Only a verdict that would replace bf16 needs a pair of each order (a trend in the machine's
    speed reads against the later step of a pair): alike steps keep bf16, a clear loss keeps fp32."""
    least = AUTOCAST_PAIRS[0]
    assert decide_autocast(timed(0.100, bf16, 1)) is None
    choice = decide_autocast(timed(0.100, bf16, least))
    assert choice == AutocastChoice(bf16 < 0.105, round(0.100 / bf16, 3), least)
    assert (choice.speedup >= 1 - AUTOCAST_MAX_LOSS) is choice.bf16


def test_pairs_that_disagree_are_timed_longer_and_a_clear_loss_keeps_fp32() -> None:
    split = [0.2, 0.3, 0.10, 0.12, 0.13, 0.10]  # one pair 0.83x, one 0.77x: agreed, fp32
    assert decide_autocast(split) == AutocastChoice(False, 0.801, 2)
    split = [0.2, 0.3, 0.10, 0.12, 0.10, 0.10]  # one pair 0.83x, one 1.00x: more pairs
    assert decide_autocast(split) is None and decide_autocast(split, final=True) is not None
    assert decide_autocast([*split, 0.10, 0.12, 0.12, 0.10]) is None  # two against one
    longest = [*split, *[0.10, 0.12, 0.12, 0.10] * (AUTOCAST_PAIRS[1] // 2)][
        : AUTOCAST_WARMUP + 2 * AUTOCAST_PAIRS[1]
    ]
    final = decide_autocast(longest)
    assert final is not None and not final.bf16 and final.pairs == AUTOCAST_PAIRS[1]


def test_a_slowing_machine_favours_neither_setting() -> None:
    """Equal steps on a machine slowing 4% a step: a pair's later step is always slower, so a
    fixed order would credit one setting; the alternating order cancels it."""
    seconds = [0.1 * 1.04**step for step in range(AUTOCAST_WARMUP + 2 * AUTOCAST_PAIRS[0])]
    choice = decide_autocast(seconds)  # pairs read 1/1.04 (fp32 first) and 1.04 (bf16 first)
    assert choice is not None and choice.speedup == pytest.approx(1.0, abs=0.001) and choice.bf16


def test_only_a_cpu_with_bf16_dot_products_is_measured() -> None:
    assert auto_precision(CPU_BF16) == "bf16-mixed" and auto_precision(EXAMPLES["cpu"]) == "32-true"
    assert preset("auto", hardware=CPU_BF16).plan.measure_autocast
    assert not preset("auto", hardware=EXAMPLES["cpu"]).plan.measure_autocast
    by_hand = preset("auto", hardware=CPU_BF16, precision="bf16-mixed")
    assert not by_hand.plan.measure_autocast and not isinstance(by_hand.precision_plugin, MeasuredAutocast)
    assert not preset("auto", hardware=EXAMPLES["h100"]).plan.measure_autocast  # CUDA: bf16 by capability
    (title,) = [f.title for f in preset("auto", hardware=CPU_BF16).plan.findings if "precision" in f.title]
    assert title == "precision 'bf16-mixed' or '32-true', whichever this CPU steps faster"  # not yet decided


class SlowUnder(BoringModel):
    """`BoringModel` whose step sleeps under one setting (``"bf16"`` or ``"fp32"``), and records
    whether autocast was on in each training step and the dtype its weights and loss had; with
    `flip_at`, the other setting sleeps from that batch of the run on (a host whose speed changed
    after the trial, whose steps are batch 0's)."""

    def __init__(self, slow: str, manual: bool = False, flip_at: int | None = None) -> None:
        super().__init__()
        self.slow, self.autocast_seen, self.dtypes = slow, [], set()
        self.automatic_optimization = not manual
        self.flip_at, self.flip_until = flip_at, None

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        autocast = torch.is_autocast_enabled("cpu")
        self.autocast_seen.append(autocast)
        flipped = self.flip_at is not None and self.flip_at <= batch_idx < (self.flip_until or batch_idx + 1)
        if autocast == ((self.slow == "bf16") != flipped):
            time.sleep(0.05)  # dwarfs the step even on a loaded machine
        loss = super().training_step(batch, batch_idx)
        self.dtypes |= {self.layer.weight.dtype, self(batch[0]).dtype}
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss


def fit(
    tmp_path: Path, model: SlowUnder, steps: int = 24, **options: Any
) -> tuple[L.Trainer, MeasuredAutocast]:
    strategy = preset("auto", hardware=CPU_BF16)
    trainer = tiny_trainer(
        tmp_path,
        strategy=strategy,
        limit_train_batches=steps,
        callbacks=[BoostReport(console=False)],
        enable_checkpointing=False,
        **options,
    )
    trainer.fit(model, datamodule=BoringDataModule(length=steps * 8))
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MeasuredAutocast)
    return trainer, plugin


def fit_tuned(
    tmp_path: Path, model: L.LightningModule, batch_size: L.Callback, *more: L.Callback
) -> tuple[L.Trainer, MeasuredAutocast]:
    """`fit` with `batch_size` (an `AutoBatchSize`) on 2048 samples: enough steps for its trials."""
    trainer = tiny_trainer(
        tmp_path,
        strategy=preset("auto", hardware=CPU_BF16),
        callbacks=[batch_size, *more],
        limit_train_batches=None,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=BoringDataModule(length=2048))
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MeasuredAutocast)
    return trainer, plugin


def report_of(trainer: L.Trainer) -> Report:
    (callback,) = [c for c in trainer.callbacks if isinstance(c, BoostReport)]
    assert callback.report is not None
    return callback.report


@pytest.mark.parametrize(("slow", "keep_bf16"), [("fp32", True), ("bf16", False)])
def test_the_faster_setting_is_kept_for_every_step_of_the_run(
    tmp_path: Path, slow: str, keep_bf16: bool
) -> None:
    model = SlowUnder(slow)
    trainer, plugin = fit(tmp_path, model)
    choice = plugin.choice
    assert choice is not None and choice.bf16 is keep_bf16 and choice.pairs >= 1  # 1 if bf16 faster, else 2
    assert len(plugin.seconds) == AUTOCAST_WARMUP + 2 * choice.pairs  # timed on a copy, before
    assert model.autocast_seen == run_settings(keep_bf16, 24)  # the chosen setting, but for checks of bf16
    assert trainer.precision == ("bf16-mixed" if keep_bf16 else "32-true")
    assert model.dtypes == ({torch.float32, torch.bfloat16} if keep_bf16 else {torch.float32})  # fp32 weights
    assert trainer.global_step == 24
    report = report_of(trainer)
    (finding,) = [f for f in report.findings if "autocast_bf16" in f.data]
    assert finding.data == {
        "autocast_bf16": keep_bf16,
        "speedup": choice.speedup,
        "steps": len(plugin.seconds),
    }
    assert report.tuned["precision"] == trainer.precision
    assert precision_text(trainer).endswith(f"(bf16 step measured {choice.speedup:.2f}x as fast as fp32)")


def run_settings(bf16: bool, steps: int) -> list[bool]:
    """Whether each of a run's steps is under autocast when the trial kept `bf16` and the run's
    own checks confirm it: fp32 has no checks; bf16 runs one fp32 batch in each check pair."""
    if not bf16:
        return [False] * steps
    return schedule([1.25] * steps, steps)


def schedule(ratios: list[float], steps: int) -> list[bool]:
    """The settings of a kept bf16's first `steps` batches when its check pairs read `ratios`
    (fp32's time over bf16's, the warm-up pair's included; the last one for every pair after)
    in turn, up to a switch to fp32, which the run's plugin decides (`recheck_verdict`)."""
    settings, start, pair = [], AUTOCAST_RECHECK_FIRST, 0
    for batch in range(steps):
        setting = recheck_setting(batch, start, pair)
        settings.append(True if setting is None else setting)
        if setting is not None and batch == start + 1:
            pair += 1
            counted = [ratios[i] if i < len(ratios) else ratios[-1] for i in range(1, pair)]
            start = next_recheck(batch, pair, counted)
    return settings


def test_a_kept_bf16_is_checked_on_the_runs_own_steps_at_a_small_cost() -> None:
    """Check pairs are two adjacent batches, one fp32 and one bf16, in alternating order; over a
    long run under 2 % of batches are fp32 (at bf16's usual 1.25x, by arithmetic 0.4 % of the run's
    time)."""
    settings = schedule([1.25] * 10_000, 10_000)
    assert (
        settings[:16]
        == [True] * 4 + [False, True] + [True] * 2 + [True, False] + [True] * 2 + [False, True] + [True] * 2
    )
    assert settings.count(False) / len(settings) < 0.02


def test_a_pair_against_bf16_is_followed_at_once_by_another() -> None:
    """A pair that puts bf16 slower (the second counted one here) gets another at once, in the
    other order; when they disagree, a third decides; with it cleared, the checks go back to
    every 64 batches."""
    settings = schedule([1.25, 1.25, 0.7, 1.25, 1.25], 200)
    assert settings[12:20] == [False, True, True, False, False, True, True, True]  # 12, 14, 16 at once
    assert settings[18:80] == [True] * 62 and settings[80:82] == [True, False]  # then 64 after 16


def test_a_bf16_that_slows_down_after_the_trial_is_switched_off_mid_run(tmp_path: Path) -> None:
    """The trial (batch 0's step) times bf16 faster; from batch 8 the run's bf16 steps sleep: the
    check pair at batch 8 (after the warm-up pair at 4) reads it slower, the one it calls at once
    (batch 10) too, and from batch 12 the run trains in fp32, says so, and leaves fp32 in the
    cache for the next run."""
    model = SlowUnder("fp32", flip_at=8)
    trainer, plugin = fit(tmp_path, model, steps=30)
    assert model.autocast_seen == schedule([1.25, 0.02, 0.02], 12) + [False] * 18
    assert plugin.choice is not None and not plugin.choice.bf16 and len(plugin.rechecks) == 2
    assert plugin.switched_at == 12
    assert all(ratio < 1 - AUTOCAST_MAX_LOSS for ratio in plugin.rechecks)
    assert trainer.precision == "32-true"
    assert precision_text(trainer).startswith("32-true from batch 12 (bf16 ran 0.")
    (finding,) = [f for f in report_of(trainer).findings if "autocast_bf16" in f.data]
    assert finding.title.startswith("fp32 from training batch 12 on: bf16 autocast ran 0.")
    assert re.search(r"^the trial before training \(\d pairs?\) read bf16 steps", finding.detail)
    again = SlowUnder("fp32", flip_at=8)
    _, plugin = fit(tmp_path / "again", again, steps=8)
    assert plugin.choice is not None and plugin.choice.cached and not plugin.choice.bf16
    assert again.autocast_seen == [False] * 8


def test_a_deterministic_run_trains_every_batch_at_the_setting_chosen_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `Trainer(deterministic=True)` a kept bf16 is not checked on the run's own steps: its
    pairs train a batch in fp32 now and then, and a switch decided on the host's timing would leave
    the run and its repeat from the cache (in fp32 from its first batch) trained apart. The model
    whose bf16 slows down mid-run (switched off above) trains every batch in bf16."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # Lightning sets it: put back after
    model = SlowUnder("fp32", flip_at=8)
    trainer, plugin = fit(tmp_path, model, steps=30, deterministic=True)
    assert model.autocast_seen == [True] * 30
    assert plugin.choice is not None and plugin.choice.bf16 and plugin.switched_at is None
    assert plugin.pairs == 0 and trainer.precision == "bf16-mixed"


def test_a_resumed_fit_checks_bf16_from_its_own_first_batch(tmp_path: Path) -> None:
    """A fit resumed from a checkpoint at batch 10 counts its pairs from there (warm-up at 14,
    pairs at 18 and 20), not from the run's batch 0, which it never sees. Its bf16 comes from the
    cache the first fit filled, and is slower now: fp32 from batch 22."""
    first, _ = fit(tmp_path / "first", SlowUnder("fp32"), steps=10)
    checkpoint = tmp_path / "first.ckpt"
    first.save_checkpoint(checkpoint)
    resumed = SlowUnder("bf16")
    trainer = tiny_trainer(
        tmp_path / "resumed",
        strategy=preset("auto", hardware=CPU_BF16),
        max_epochs=3,
        limit_train_batches=10,
        enable_checkpointing=False,
    )
    trainer.fit(resumed, datamodule=BoringDataModule(length=80), ckpt_path=checkpoint)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MeasuredAutocast) and plugin.choice is not None
    assert resumed.autocast_seen == schedule([1.25, 0.02, 0.02], 12) + [False] * 8
    assert plugin.switched_at == 22 and trainer.precision == "32-true"


def test_one_pair_against_bf16_switches_nothing(tmp_path: Path) -> None:
    """bf16 slow for the first counted check pair's batches only (a noisy moment): the pair that
    follows at once reads it faster again, a third one too, and the run keeps bf16."""
    model = SlowUnder("fp32", flip_at=8)
    model.flip_until = 10
    trainer, plugin = fit(tmp_path, model, steps=30)
    assert len(plugin.rechecks) == 3 and plugin.rechecks[0] < 1 < min(plugin.rechecks[1:])
    assert model.autocast_seen == schedule([1.25, 0.02, 1.25], 30) and trainer.precision == "bf16-mixed"


def test_when_fp32_is_kept_the_run_trains_plain_lightnings_model(tmp_path: Path) -> None:
    """The trial runs on a copy, with the run's RNG put back: the weights end bit for bit where
    plain Lightning's do."""
    torch.manual_seed(0)
    measured = SlowUnder("bf16")
    fit(tmp_path / "measured", measured)
    torch.manual_seed(0)
    plain = SlowUnder("bf16")
    trainer = tiny_trainer(tmp_path / "plain", limit_train_batches=24, enable_checkpointing=False)
    trainer.fit(plain, datamodule=BoringDataModule(length=24 * 8))
    assert (
        torch.equal(measured.layer.weight, plain.layer.weight)
        and measured.layer.weight.dtype == torch.float32
    )


def test_bf16_asked_of_the_trainer_is_kept_not_timed_away(tmp_path: Path) -> None:
    """`Trainer(precision="bf16-mixed", strategy=preset("auto"))` on a bf16 CPU: the preset agreed
    (no conflict), then timed bf16 against fp32 and trained a model slower under bf16 in fp32,
    against the precision the user wrote. It trains in bf16, and the report says it was set."""
    model = SlowUnder("bf16")
    strategy = preset("auto", hardware=CPU_BF16)
    options: dict[str, object] = {"limit_train_batches": 6, "enable_checkpointing": False}
    trainer = tiny_trainer(tmp_path, strategy=strategy, precision="bf16-mixed", **options)
    trainer.fit(model, datamodule=BoringDataModule(length=48))
    assert model.autocast_seen == [True] * 6 and trainer.precision == "bf16-mixed"
    assert not isinstance(trainer.precision_plugin, MeasuredAutocast)
    (finding,) = [f for f in strategy.findings if f.data.get("precision")]
    assert finding.title == "precision 'bf16-mixed'" and "Trainer(precision='bf16-mixed')" in finding.detail


def test_the_decision_lasts_for_the_next_fit(tmp_path: Path) -> None:
    model = SlowUnder("bf16")
    trainer, plugin = fit(tmp_path, model)
    measured = len(plugin.seconds)
    model.autocast_seen.clear()
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, datamodule=BoringDataModule(length=24 * 8))
    assert model.autocast_seen == [False] * 24 and len(plugin.seconds) == measured  # not measured again


def test_manual_optimization_stays_fp32_with_a_finding(tmp_path: Path) -> None:
    model = SlowUnder("fp32", manual=True)
    trainer, plugin = fit(tmp_path, model, steps=6)
    assert plugin.choice == AutocastChoice(False, None, 0, "manual optimization")
    assert model.autocast_seen == [False] * 6 and trainer.precision == "32-true"
    report = report_of(trainer)
    (finding,) = [f for f in report.findings if "autocast_bf16" in f.data]
    assert "manual optimization" in finding.detail


class DecidesByRank(BoringModel):
    """Each rank settles its own way before the first step (rank 0: bf16, rank 1: fp32), the
    point where a trial settles; the timing itself is tested above (under DDP every rank's step
    waits for the slowest in the gradient all-reduce, so the ranks time the same steps)."""

    @override
    def on_train_start(self) -> None:
        plugin = self.trainer.precision_plugin
        assert isinstance(plugin, MeasuredAutocast)
        plugin._settle(AutocastChoice(self.global_rank == 0, 1.0, AUTOCAST_PAIRS[0]))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        autocast = float(torch.is_autocast_enabled("cpu"))
        self.log("autocast_min", autocast, reduce_fx="min", sync_dist=True)
        self.log("autocast_max", autocast, reduce_fx="max", sync_dist=True)
        return super().training_step(batch, batch_idx)


@pytest.mark.ddp
def test_every_rank_keeps_rank_zeros_choice(tmp_path: Path) -> None:
    strategy = preset("fast-ddp", hardware=CPU_BF16, start_method="spawn")
    trainer = tiny_trainer(tmp_path, devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    trainer.fit(DecidesByRank(), datamodule=BoringDataModule())
    metrics = trainer.callback_metrics
    assert float(metrics["autocast_min"]) == float(metrics["autocast_max"]) == 1.0  # rank 0's bf16


class SlowsUnderBF16Later(DecidesByRank):
    """Every rank keeps bf16 (rank zero's), and from batch 8 its bf16 steps sleep on every rank."""

    @override
    def on_train_start(self) -> None:
        plugin = self.trainer.precision_plugin
        assert isinstance(plugin, MeasuredAutocast)
        plugin._settle(AutocastChoice(True, 1.25, AUTOCAST_PAIRS[0]))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if torch.is_autocast_enabled("cpu") and batch_idx >= 8:
            time.sleep(0.05)
        return super().training_step(batch, batch_idx)


@pytest.mark.ddp
def test_under_ddp_every_rank_switches_a_slowed_bf16_off_at_the_same_batch(tmp_path: Path) -> None:
    """2 processes over gloo: rank zero's verdict on its check pairs is broadcast at the pair's
    end, so both ranks train the last batches in fp32 (their steps wait for each other in the
    gradient all-reduce, so a rank on its own could not settle it another way for long)."""
    strategy = preset("fast-ddp", hardware=CPU_BF16, start_method="spawn")
    trainer = tiny_trainer(
        tmp_path,
        devices=2,
        strategy=strategy,
        limit_train_batches=30,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(SlowsUnderBF16Later(), datamodule=BoringDataModule(length=2 * 30 * 8))
    metrics = trainer.callback_metrics
    assert float(metrics["autocast_min"]) == float(metrics["autocast_max"]) == 0.0  # both in fp32


def test_batch_size_trials_run_at_the_precision_the_run_trains_at(tmp_path: Path) -> None:
    """With `AutoBatchSize`, the autocast trial comes first, on the start size's batch, and the
    batch-size trials then time the step under the setting kept (they came first before, in fp32)."""
    from lightning_boost import AutoBatchSize

    model = SlowUnder("fp32")
    model.batch_size = 8
    batch_size = AutoBatchSize(max_batch_size=16, steps=1, cache_dir=tmp_path / "cache")
    _, plugin = fit_tuned(tmp_path, model, batch_size)
    assert plugin.choice is not None and plugin.choice.bf16
    assert batch_size.decision is not None and not batch_size.decision.kept  # it measured
    # a step under fp32 sleeps 50 ms: no batch-size trial was timed at it
    assert all(trial.samples_per_s > trial.size / 0.05 for trial in batch_size.decision.trials)


def test_the_first_batch_size_trial_times_the_autocast_trial_in_its_own_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _private_tuning_cache: Path
) -> None:
    """One trial before the first step, not two: the autocast pairs are the first batch-size
    trial's timed steps (its warm-up is the fp32 warm-up); no copy is timed for autocast alone."""
    from lightning_boost import AutoBatchSize
    from lightning_boost.step_probe import StepProbe

    monkeypatch.setattr(StepProbe, "time_steps", lambda *args: pytest.fail("a separate autocast trial ran"))
    model = SlowUnder("fp32")
    model.batch_size = 8
    batch_size = AutoBatchSize(max_batch_size=16, steps=1, cache_dir=tmp_path / "cache")
    trainer, plugin = fit_tuned(tmp_path, model, batch_size, BoostReport(console=False))
    assert plugin.choice is not None and plugin.choice.bf16
    assert batch_size.decision is not None
    # timed nowhere else (`time_steps` fails): the pairs were the trial's steps, at the kept setting
    assert len(plugin.seconds) == AUTOCAST_WARMUP + 2 * plugin.choice.pairs
    assert all(trial.samples_per_s > trial.size / 0.05 for trial in batch_size.decision.trials)
    seen = model.autocast_seen
    assert seen == run_settings(True, len(seen))  # the run's steps: bf16 from the first, but its checks'
    (finding,) = [f for f in report_of(trainer).findings if "autocast_bf16" in f.data]
    assert finding.data["steps"] == len(plugin.seconds)
    document = json.loads((_private_tuning_cache / "autocast.json").read_text())  # for the next run
    assert [entry["result"]["bf16"] for entry in document["entries"].values()] == [True]


class SlowAndShort(SlowUnder):
    """`SlowUnder("fp32")` whose steps run out of memory above 8 samples (simulated, as a CPU
    allocator's error would say it: this machine cannot be made to run out)."""

    def __init__(self) -> None:
        super().__init__("fp32")

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if len(batch[0]) > 8:
            raise RuntimeError("DefaultCPUAllocator: not enough memory (simulated above 8 samples)")
        return super().training_step(batch, batch_idx)


def test_a_first_trial_out_of_memory_hands_the_autocast_trial_to_the_next_size(tmp_path: Path) -> None:
    """The start size runs out of memory in its warm-up: the autocast pairs are timed in the next
    trial, at the size that fits, before any size is timed at a setting the run will not use."""
    from lightning_boost import AutoBatchSize

    model = SlowAndShort()
    batch_size = AutoBatchSize(init_batch_size=16, max_batch_size=16, steps=1, cache_dir=tmp_path / "cache")
    _, plugin = fit_tuned(tmp_path, model, batch_size)
    assert plugin.choice is not None and plugin.choice.bf16
    assert batch_size.decision is not None and batch_size.decision.batch_size == 8
    trials = {trial.size: trial for trial in batch_size.decision.trials}
    assert trials[16].oom
    assert len(trials[8].losses) == len(plugin.seconds) - 1  # the pairs were its steps
    assert all(t.samples_per_s > t.size / 0.05 for t in batch_size.decision.trials if not t.oom)
    assert model.autocast_seen == run_settings(True, len(model.autocast_seen))


class SlowByRank(BoringModel):
    """On a trial's copy, rank 0's step sleeps under fp32 and rank 1's under bf16: each rank's own
    trial would keep another setting. The run's steps before its first check of bf16 log whether
    autocast was on, as min and max over the ranks (the checks then find this tiny model's bf16
    slower on the run's own steps, which it is, and switch it off)."""

    batch_size = 8

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        autocast = torch.is_autocast_enabled("cpu")
        if isinstance(self._trainer, TrainerReads):  # a trial's copy, reading the run's trainer
            if autocast == (torch.distributed.get_rank() == 1):
                time.sleep(0.05)
        elif batch_idx < AUTOCAST_RECHECK_FIRST:
            self.log("autocast_min", float(autocast), reduce_fx="min", sync_dist=True)
            self.log("autocast_max", float(autocast), reduce_fx="max", sync_dist=True)
        return super().training_step(batch, batch_idx)


@pytest.mark.ddp
def test_under_ddp_the_batch_size_trial_settles_autocast_as_rank_zero_measured(tmp_path: Path) -> None:
    """2 processes over gloo: each rank's first batch-size trial times the autocast pairs; every
    rank then trains under rank zero's choice (bf16 here), and no rank waits on another."""
    from lightning_boost import AutoBatchSize

    strategy = preset("fast-ddp", hardware=CPU_BF16, start_method="spawn")
    batch_size = AutoBatchSize(max_batch_size=16, steps=1, cache_dir=tmp_path / "cache")
    trainer = tiny_trainer(
        tmp_path,
        devices=2,
        strategy=strategy,
        callbacks=[batch_size],
        limit_train_batches=None,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(SlowByRank(), datamodule=BoringDataModule(length=2048))
    metrics = trainer.callback_metrics
    assert float(metrics["autocast_min"]) == float(metrics["autocast_max"]) == 1.0  # rank 0's bf16


class ShuffledData(L.LightningDataModule):
    """A shuffled loader: its order comes from the run's random generator."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    @override
    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(RandomDataset(length=1024), batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(RandomDataset(length=16, seed=1), batch_size=self.batch_size)


def test_the_precision_trial_before_batch_size_trials_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    """fp32 kept: the same weights, bit for bit, as the run with fp32 set by hand (the trial's
    batch came from a DataLoader whose iterator drew a seed from the run's generator)."""
    from lightning_boost import AutoBatchSize

    weights = []
    for name, strategy in (
        ("measured", preset("auto", hardware=CPU_BF16)),
        ("by hand", preset("auto", hardware=CPU_BF16, precision="32-true")),
    ):
        torch.manual_seed(0)
        model = SlowUnder("bf16")
        model.batch_size = 8
        batch_size = AutoBatchSize(max_batch_size=8, steps=1, cache_dir=tmp_path / name)
        trainer = tiny_trainer(
            tmp_path / name, strategy=strategy, callbacks=[batch_size], limit_train_batches=None
        )
        trainer.fit(model, datamodule=ShuffledData(batch_size=8))  # the order: RNG
        weights.append(model.layer.weight.detach().clone())
    assert not isinstance(trainer.precision_plugin, MeasuredAutocast)  # the second: by hand
    assert batch_size.decision is not None and not batch_size.decision.kept  # trials ran, after it
    assert torch.equal(weights[0], weights[1])


def test_a_warm_run_takes_the_decision_from_the_cache_without_a_trial(tmp_path: Path) -> None:
    _, first = fit(tmp_path / "cold", SlowUnder("fp32"))
    assert first.choice is not None and first.choice.bf16 and not first.choice.cached and first.seconds
    model = SlowUnder("fp32")
    trainer, warm = fit(tmp_path / "warm", model)
    assert warm.choice is not None and warm.choice.cached and warm.choice.bf16
    assert warm.seconds == [] and model.autocast_seen == run_settings(True, 24)  # no trial, bf16 but checks
    (finding,) = [f for f in report_of(trainer).findings if "autocast_bf16" in f.data]
    assert finding.data["source"] == "cache" and "an earlier run measured" in finding.title


def test_an_unreadable_cache_entry_is_measured_again_with_a_warning(
    tmp_path: Path, _private_tuning_cache: Path
) -> None:
    fit(tmp_path / "cold", SlowUnder("fp32"))
    path = _private_tuning_cache / "autocast.json"
    document = json.loads(path.read_text())
    for entry in document["entries"].values():
        entry["result"]["bf16"] = "yes"  # not a bool: written by something else
    path.write_text(json.dumps(document))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, plugin = fit(tmp_path / "again", SlowUnder("fp32"))
    assert plugin.choice is not None and not plugin.choice.cached and plugin.seconds
    said = [str(w.message) for w in caught if issubclass(w.category, BoostWarning)]
    assert any(re.search(r"Ignoring the autocast cache, measuring again: .*malformed", text) for text in said)


class SlowEverywhere(SlowUnder):
    """A step too slow for the trial to time one pair in its second (`AUTOCAST_BUDGET`)."""

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        time.sleep(0.4)
        return super().training_step(batch, batch_idx)


def test_a_trial_too_slow_to_time_a_pair_is_not_cached_and_the_next_run_does_not_warn(
    tmp_path: Path, _private_tuning_cache: Path
) -> None:
    # it was stored with no speedup, which the next run read back as a malformed entry, with a
    # warning, and measured again
    _, first = fit(tmp_path / "cold", SlowEverywhere("fp32"), steps=2)
    assert first.choice is not None and first.choice.why_not.startswith("steps too slow")
    path = _private_tuning_cache / "autocast.json"
    assert not path.exists() or not json.loads(path.read_text())["entries"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, again = fit(tmp_path / "again", SlowEverywhere("fp32"), steps=2)
    assert again.choice is not None and not again.choice.cached
    assert not [w for w in caught if issubclass(w.category, BoostWarning)]


class PaddedEncoder(SlowUnder):
    """`SlowUnder("fp32")` (bf16 times faster) whose validation runs an `nn.TransformerEncoder`
    given a padding mask: in eval mode torch's fast path runs it as nested tensors, which fail
    under a CPU's bf16 autocast ("expected scalar type Float but found BFloat16"); its training
    steps do not take that path."""

    def __init__(self) -> None:
        super().__init__("fp32")
        self.encoder = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 1
        )

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens = batch[0].unsqueeze(1).expand(-1, 3, -1)
        padding = torch.zeros(len(tokens), 3, dtype=torch.bool, device=tokens.device)
        padding[:, 2] = True
        self.log("val_loss", self.encoder(tokens, src_key_padding_mask=padding).sum())


@pytest.mark.parametrize("tuned", [False, True], ids=["own trial", "in the batch-size trial"])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's, at each fp32 validation
def test_bf16_that_an_evaluation_step_cannot_run_in_is_not_kept(tmp_path: Path, tuned: bool) -> None:
    """Timed on training steps alone, bf16 was kept and the fit stopped at its sanity check. An
    evaluation step on a copy runs in fp32 and fails in bf16: fp32 is kept, the report says why
    and how to run it in bf16, and the fit trains and validates; a second fit, whose timing comes
    from the cache, is checked the same way."""
    from lightning_boost import AutoBatchSize

    for run in range(2):
        model = PaddedEncoder()
        if tuned:
            model.batch_size = 8
            tuner = AutoBatchSize(max_batch_size=16, steps=1, cache_dir=tmp_path / "cache")
            trainer, plugin = fit_tuned(tmp_path / str(run), model, tuner, BoostReport(console=False))
        else:
            trainer, plugin = fit(tmp_path / str(run), model, limit_val_batches=2)
        choice = plugin.choice
        assert choice is not None and not choice.bf16 and choice.speedup is not None and choice.speedup > 1
        assert choice.cached is (run == 1)
        assert choice.why_not.startswith("validation_step failed under bf16 autocast")
        assert "expected scalar type Float but found BFloat16" in choice.why_not
        assert trainer.state.finished and "val_loss" in trainer.callback_metrics
        (finding,) = [f for f in report_of(trainer).findings if "autocast_bf16" in f.data]
        assert finding.title == "fp32 kept on this CPU: validation_step failed under bf16 autocast"
        assert finding.fix is not None and "enable_nested_tensor=False" in finding.fix
