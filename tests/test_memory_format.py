"""channels_last for a convolutional model, kept only where the model's own step is faster with it.

Which layout is faster is made certain by a model whose step sleeps under one of them (a real
Lightning fit, real NHWC weights: only the cost is planted), since this machine's timing is noise
at these sizes. `EXAMPLES["cpu"]` plans the preset for a CPU without bf16, so no autocast trial
runs beside this one.
"""

import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelPruning
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_boost import BoostReport, preset
from lightning_boost.hardware import EXAMPLES
from lightning_boost.precision import AUTOCAST_WARMUP
from lightning_boost.presets.memory_format import (
    MemoryFormatChoice,
    channels_last_setting,
    decide_channels_last,
)
from lightning_boost.report import Report
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer

CPU = EXAMPLES["cpu"]


def timed(nchw: float, nhwc: float, pairs: int) -> list[float]:
    """Step times as the trial records them when NCHW steps take `nchw` and NHWC ones `nhwc`."""
    return [nhwc if channels_last_setting(step) else nchw for step in range(AUTOCAST_WARMUP + 2 * pairs)]


def test_each_pair_holds_one_step_of_each_layout_in_alternating_order() -> None:
    settings = [channels_last_setting(step) for step in range(AUTOCAST_WARMUP + 8)]
    pairs = [tuple(settings[i : i + 2]) for i in range(AUTOCAST_WARMUP, len(settings), 2)]
    assert sorted(settings[:AUTOCAST_WARMUP]) == [False, True]
    assert pairs == [(True, False), (False, True)] * 2


@pytest.mark.parametrize(
    ("nhwc", "pairs", "expected"),
    [
        (0.07, 2, MemoryFormatChoice(True, 1.429, 2)),  # clearly faster in both orders: NHWC
        (0.098, 1, MemoryFormatChoice(False, 1.02, 1)),  # under 5 % faster in the first pair: NCHW at once
        (0.1, 1, MemoryFormatChoice(False, 1.0, 1)),
        (0.11, 1, MemoryFormatChoice(False, 0.909, 1)),  # slower in the first pair: NCHW at once
    ],
)
def test_channels_last_must_be_measurably_faster(
    nhwc: float, pairs: int, expected: MemoryFormatChoice
) -> None:
    assert decide_channels_last(timed(0.1, nhwc, pairs)) == expected
    assert decide_channels_last(timed(0.1, 0.07, 1)) is None  # a faster NHWC needs both orders


def test_a_trial_out_of_time_before_any_pair_keeps_nchw() -> None:
    choice = decide_channels_last([5.0], final=True)
    assert choice is not None and not choice.channels_last and choice.speedup is None and choice.why_not


class SlowConv(L.LightningModule):
    """A small CNN whose step sleeps when its weights are laid out as `slow` (``"nhwc"`` or
    ``"nchw"``); records each run step's layout. `view` flattens with ``.view`` (fails on NHWC
    activations) in ``"forward"`` or only in ``"validation"``."""

    def __init__(self, slow: str = "nchw", view: str = "") -> None:
        super().__init__()
        self.slow, self.view = slow, view
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 4)
        self.layouts: list[str] = []
        self.validated = 0

    def layout(self) -> str:
        return "nhwc" if self.conv.weight.is_contiguous(memory_format=torch.channels_last) else "nchw"

    @override
    def forward(self, x: Tensor, view: bool = False) -> Tensor:
        features = torch.relu(self.conv(x))
        flat = features.view(len(x), -1) if view else features.flatten(1)
        return self.head(flat)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.layout() == self.slow:
            time.sleep(0.05)  # dwarfs the step even on a loaded machine
        self.layouts.append(self.layout())
        return nn.functional.cross_entropy(self(batch[0], self.view == "forward"), batch[1])

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.validated += 1
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0], bool(self.view)), batch[1]))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def images(count: int = 64) -> DataLoader[tuple[Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(count, 3, 8, 8, generator=generator), torch.randint(0, 4, (count,)))
    return DataLoader(data, batch_size=8)


def fit(tmp_path: Path, model: L.LightningModule, **preset_options: bool) -> L.Trainer:
    trainer = tiny_trainer(
        tmp_path,
        strategy=preset("auto", hardware=CPU, **preset_options),
        limit_train_batches=8,
        callbacks=[BoostReport(console=False)],
        enable_checkpointing=False,
    )
    trainer.fit(model, images(), images(16))
    return trainer


def report_of(trainer: L.Trainer) -> Report:
    (callback,) = [c for c in trainer.callbacks if isinstance(c, BoostReport)]
    assert callback.report is not None
    return callback.report


def layout_finding(trainer: L.Trainer) -> str:
    (title,) = [f.title for f in report_of(trainer).findings if "channels_last" in f.data]
    return title


@pytest.mark.parametrize(("slow", "kept"), [("nchw", "nhwc"), ("nhwc", "nchw")])
def test_the_faster_layout_holds_for_every_step_of_the_run(tmp_path: Path, slow: str, kept: str) -> None:
    model = SlowConv(slow)
    trainer = fit(tmp_path, model)
    assert model.layouts == [kept] * 8  # timed on copies, before the first step
    choice = trainer.strategy.memory_format  # type: ignore[attr-defined]
    assert choice.channels_last is (kept == "nhwc") and choice.speedup is not None and not choice.why_not
    title = layout_finding(trainer)
    assert title.startswith("channels_last: the convolutions stepped" if kept == "nhwc" else "NCHW kept:")
    assert report_of(trainer).tuned["channels_last"] is (kept == "nhwc")
    assert model.validated > 0 and trainer.global_step == 8


def test_when_nchw_is_kept_the_run_trains_plain_lightnings_model(tmp_path: Path) -> None:
    """The trial's batch, copies and steps leave the run's RNG as it was: with a shuffled loader,
    the weights end bit for bit where plain Lightning's do."""

    def shuffled() -> DataLoader[tuple[Tensor, ...]]:
        return DataLoader(images().dataset, batch_size=8, shuffle=True)

    final = []
    for strategy in (preset("auto", hardware=CPU), "auto"):
        torch.manual_seed(0)
        model = SlowConv("nhwc")
        trainer = tiny_trainer(tmp_path, strategy=strategy, limit_train_batches=8, enable_checkpointing=False)
        trainer.fit(model, shuffled(), images(16))
        final.append(model.conv.weight.detach().clone())
    assert trainer.global_step == 8 and torch.equal(*final)


def test_a_step_that_fails_in_nhwc_keeps_nchw_with_its_error(tmp_path: Path) -> None:
    """``.view`` of an NHWC activation raises: the copy says so, and the run trains in NCHW."""
    model = SlowConv("nchw", view="forward")
    trainer = fit(tmp_path, model)
    choice = trainer.strategy.memory_format  # type: ignore[attr-defined]
    assert not choice.channels_last and "failed on a channels_last copy" in choice.why_not
    assert "view" in choice.why_not and model.layouts == ["nchw"] * 8
    assert layout_finding(trainer) == "NCHW kept: channels_last not timed"


def test_a_validation_step_that_fails_in_nhwc_keeps_nchw(tmp_path: Path) -> None:
    """The training step is faster in NHWC, but ``validation_step`` would raise in it: NCHW, and
    the fit validates."""
    model = SlowConv("nchw", view="validation")
    trainer = fit(tmp_path, model)
    choice = trainer.strategy.memory_format  # type: ignore[attr-defined]
    assert not choice.channels_last and choice.speedup is not None and choice.speedup > 1
    assert "validation_step failed on a channels_last copy" in choice.why_not
    assert model.layouts == ["nchw"] * 8 and model.validated > 0
    (finding,) = [f for f in report_of(trainer).findings if "channels_last" in f.data]
    assert finding.title.endswith("x as fast, but validation_step fails in it")
    assert finding.fix.startswith("flatten activations with `.flatten(1)`")  # the gain it leaves


class ViewsInTest(SlowConv):
    """Trains and validates with ``flatten``, tests with ``.view``."""

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", nn.functional.cross_entropy(self(batch[0], view=True), batch[1]))


def test_a_test_step_of_the_models_own_that_fails_in_nhwc_keeps_nchw(tmp_path: Path) -> None:
    """A model's own ``test_step`` is tried too (after the fit, ``trainer.test`` would raise)."""
    model = ViewsInTest("nchw")
    trainer = fit(tmp_path, model)
    choice = trainer.strategy.memory_format  # type: ignore[attr-defined]
    assert not choice.channels_last and "test_step failed on a channels_last copy" in choice.why_not
    trainer.test(model, images(16))


def test_a_second_fit_keeps_the_layout_and_says_so(tmp_path: Path) -> None:
    model = SlowConv("nchw")
    trainer = fit(tmp_path, model)
    first = trainer.strategy.memory_format  # type: ignore[attr-defined]
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, images(), images(16))
    assert model.layouts == ["nhwc"] * 16 and trainer.strategy.memory_format is first  # type: ignore[attr-defined]
    assert report_of(trainer).tuned["channels_last"] is True


def test_the_decision_comes_from_the_cache_on_the_next_run(tmp_path: Path) -> None:
    fit(tmp_path / "first", SlowConv("nchw"))
    model = SlowConv("nchw")
    trainer = fit(tmp_path / "second", model)
    choice = trainer.strategy.memory_format  # type: ignore[attr-defined]
    assert choice.cached and choice.channels_last and model.layouts == ["nhwc"] * 8
    assert "(cache)" in next(f.detail for f in report_of(trainer).findings if "channels_last" in f.data)


@pytest.mark.parametrize("wanted", [True, False])
def test_set_by_hand_it_is_applied_without_a_trial(tmp_path: Path, wanted: bool) -> None:
    model = SlowConv("nhwc" if wanted else "nchw")  # the slower layout: a trial would not pick it
    trainer = fit(tmp_path, model, channels_last=wanted)
    assert model.layouts == ["nhwc" if wanted else "nchw"] * 8
    assert trainer.strategy.memory_format == MemoryFormatChoice(wanted, None, 0, "set by hand")  # type: ignore[attr-defined]


def pruned_fit(tmp_path: Path, model: SlowConv, pruning: ModelPruning, **preset_options: bool) -> L.Trainer:
    """`fit` over 2 epochs with `pruning`, which prunes at each epoch's end."""
    trainer = tiny_trainer(
        tmp_path,
        strategy=preset("auto", hardware=CPU, **preset_options),
        limit_train_batches=8,
        max_epochs=2,
        callbacks=[pruning, BoostReport(console=False)],
        enable_checkpointing=False,
    )
    trainer.fit(model, images(), images(16))
    return trainer


UNSTRUCTURED = {
    "global": lambda: ModelPruning("l1_unstructured", amount=0.5),
    "local": lambda: ModelPruning("random_unstructured", amount=0.5, use_global_unstructured=False),
}


@pytest.mark.parametrize("pruning", UNSTRUCTURED)
def test_unstructured_pruning_keeps_nchw_and_prunes(tmp_path: Path, pruning: str) -> None:
    """torch's unstructured pruning flattens each weight with ``.view(-1)`` (the global one with
    ``parameters_to_vector``), which raises on NHWC weights: at the first epoch's end the fit
    stopped, in NHWC since its steps are faster there. NCHW now, not timed, and the weights pruned."""
    model = SlowConv("nchw")
    trainer = pruned_fit(tmp_path, model, UNSTRUCTURED[pruning]())
    choice = trainer.strategy.memory_format  # type: ignore[attr-defined]
    assert not choice.channels_last and choice.speedup is None and "ModelPruning" in choice.why_not
    assert model.layouts == ["nchw"] * 16 and trainer.current_epoch == 2
    weights = torch.cat([model.conv.weight.flatten(), model.head.weight.flatten()])
    assert float((weights == 0).float().mean()) >= 0.5  # pruned (made permanent at the end)
    (finding,) = [f for f in report_of(trainer).findings if "channels_last" in f.data]
    assert finding.title == "NCHW kept: channels_last not timed" and "ln_structured" in finding.fix


def test_structured_pruning_keeps_the_timed_layout(tmp_path: Path) -> None:
    """Structured pruning masks whole channels without flattening: NHWC, timed faster, is kept."""
    model = SlowConv("nchw")
    pruning = ModelPruning(
        "ln_structured",
        parameter_names=["weight"],  # a bias has no channels to prune
        amount=0.5,
        pruning_dim=0,
        pruning_norm=2,
        use_global_unstructured=False,
    )
    trainer = pruned_fit(tmp_path, model, pruning)
    assert trainer.strategy.memory_format.channels_last  # type: ignore[attr-defined]
    # the first epoch in NHWC; torch 2.5's pruned weight (original x mask) comes out NCHW after it
    assert model.layouts[:8] == ["nhwc"] * 8 and trainer.current_epoch == 2
    assert int((model.conv.weight.abs().sum((1, 2, 3)) == 0).sum()) >= 4  # 4 of 8 channels pruned


def test_channels_last_by_hand_with_unstructured_pruning_stops_before_the_first_step(tmp_path: Path) -> None:
    model = SlowConv("nchw")
    with pytest.raises(ValueError, match=r"channels_last=True.*ModelPruning.*channels_last=False"):
        pruned_fit(tmp_path, model, UNSTRUCTURED["global"](), channels_last=True)
    assert model.layouts == []


def test_a_model_laid_out_by_hand_or_without_convolutions_is_left_as_it_is(tmp_path: Path) -> None:
    model = SlowConv("nhwc").to(memory_format=torch.channels_last)
    trainer = fit(tmp_path / "nhwc", model)
    assert model.layouts == ["nhwc"] * 8 and trainer.strategy.memory_format is None  # type: ignore[attr-defined]
    mlp = BoringModel()
    trainer = tiny_trainer(
        tmp_path / "mlp", strategy=preset("auto", hardware=CPU), enable_checkpointing=False
    )
    trainer.fit(mlp, datamodule=BoringDataModule())
    assert trainer.strategy.memory_format is None  # type: ignore[attr-defined]


def test_a_gpu_preset_times_nothing_unless_asked() -> None:
    """On a GPU the layout is not timed yet (no measurement there): left as built, no finding."""
    plan = preset("auto", hardware=EXAMPLES["h100"]).plan
    assert plan.channels_last is None and plan.accelerator == "cuda"
    assert preset("auto", hardware=EXAMPLES["h100"], channels_last=True).plan.channels_last is True


class LogsLayout(SlowConv):
    """`SlowConv` (no planted cost) that logs, across the ranks, whether its weights are NHWC and
    their sum (DDP keeps the ranks' weights equal)."""

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        nhwc = float(self.layout() == "nhwc")
        total = float(self.conv.weight.detach().sum())
        for name, value in (("nhwc", nhwc), ("weights", total)):
            self.log(f"{name}_min", value, reduce_fx="min", sync_dist=True)
            self.log(f"{name}_max", value, reduce_fx="max", sync_dist=True)
        return super().training_step(batch, batch_idx)


@pytest.mark.ddp
def test_ddp_set_by_hand_lays_out_every_rank_before_it_wraps_the_model(tmp_path: Path) -> None:
    strategy = preset("fast-ddp", hardware=CPU, channels_last=True, start_method="spawn")
    trainer = tiny_trainer(tmp_path, devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    trainer.fit(LogsLayout("none"), images(), images(16))
    metrics = trainer.callback_metrics
    assert float(metrics["nhwc_min"]) == float(metrics["nhwc_max"]) == 1.0
    assert float(metrics["weights_min"]) == float(metrics["weights_max"])  # gradients reduced as ever


def test_ddp_measures_nothing() -> None:
    """DDP lays its buckets out when it wraps the model, before a trial could run: by hand only."""
    assert preset("fast-ddp", hardware=CPU).plan.channels_last is None
