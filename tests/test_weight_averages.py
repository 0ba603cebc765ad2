"""Averages of the weights counted in optimizer steps (an EMA) keep the configured run's span in
samples when `AutoBatchSize` changes the samples each optimizer step trains."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch import callbacks
from torch import Tensor
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn, get_swa_avg_fn
from typing_extensions import override

from lightning_boost import AutoBatchSize, Severity
from lightning_boost.batch_size.averages import ema_decay
from tests.test_goodput import MLP, Classes, quiet_trainer

#: Lightning's weight-averaging callbacks, from 2.6 on (the oldest set's 2.4 has none).
EMAWeightAveraging: Any = getattr(callbacks, "EMAWeightAveraging", None)
needs_weight_averaging = pytest.mark.skipif(
    EMAWeightAveraging is None, reason="Lightning's WeightAveraging callbacks arrived in 2.6"
)


def fit(
    tmp_path: Path, model: Callable[[], MLP], more: list[L.Callback], tuner: AutoBatchSize | None
) -> tuple[L.Trainer, MLP, float]:
    """A 2-epoch fit of the model `model` builds from seed 0, and its final validation loss (of
    the average, where the module validates its average as `val_loss`)."""
    torch.manual_seed(0)
    module = model()
    trainer = quiet_trainer(tmp_path, [*more, *([tuner] if tuner else [])], max_epochs=2, logger=False)
    datamodule = Classes(samples=16384, batch_size=32)
    trainer.fit(module, datamodule=datamodule)
    (metrics,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    return trainer, module, float(metrics["val_loss"])


@needs_weight_averaging
@pytest.mark.usefixtures("fixed_cost_steps")
def test_an_ema_callback_averages_the_tuned_run_over_the_configured_runs_samples(tmp_path: Path) -> None:
    """`EMAWeightAveraging(decay=0.99)`, which Lightning copies into the model at the end of the
    fit, over a tuned run of 4x fewer steps: at the same decay it spanned 4x more of the run's
    samples, and the average ended at 1.72x the tuned model's own validation loss, where plain's
    average ends at 1.07x plain's model. Its decay is now ``0.99**growth`` for the run, put back
    after it: the average costs the tuned run what it costs plain's."""
    _, _, plain_model = fit(tmp_path / "plain", MLP, [], None)
    _, _, plain = fit(tmp_path / "plain average", MLP, [EMAWeightAveraging(decay=0.99)], None)
    tuner = AutoBatchSize(retune=True, min_efficiency=0.5)
    _, _, tuned_model = fit(tmp_path / "tuned", MLP, [], tuner)
    average = EMAWeightAveraging(decay=0.99)
    tuner = AutoBatchSize(retune=True, min_efficiency=0.5)
    trainer, _, tuned = fit(tmp_path / "tuned average", MLP, [average], tuner)
    decision = tuner.decision
    assert decision is not None and decision.batch_size >= 4 * 32
    growth = decision.batch_size / 32
    assert trainer.global_step == 2 * math.ceil(16384 / decision.batch_size)
    assert tuned / tuned_model < 1.1 * plain / plain_model
    (finding,) = [f for f in tuner.findings if "averages" in f.data]
    assert f"EMAWeightAveraging's decay 0.99 -> {0.99**growth:.6g}" in finding.title
    assert average._average_model is not None
    assert ema_decay(average._average_model.multi_avg_fn or average._average_model.avg_fn) == 0.99


@needs_weight_averaging
@pytest.mark.usefixtures("fixed_cost_steps")
def test_an_ema_start_counted_in_steps_moves_to_the_same_sample(tmp_path: Path) -> None:
    """An average that starts at step 1000 of the configured run's 1024: at the tuned batch the
    run ends before step 1000, the average was never updated, and Lightning copied it (the
    initial weights) into the model at the end of the fit. It now starts at the same sample,
    and the start the user wrote is put back after the fit."""
    average = EMAWeightAveraging(decay=0.9, update_starting_at_step=1000)
    tuner = AutoBatchSize(retune=True, min_efficiency=0.5)
    trainer, _, tuned = fit(tmp_path, MLP, [average], tuner)
    decision = tuner.decision
    assert decision is not None and decision.batch_size > 32
    assert trainer.global_step < 1000
    assert average._average_model is not None
    updates = int(average._average_model.n_averaged)
    assert updates == trainer.global_step - math.ceil(1000 * 32 / decision.batch_size)
    assert tuned < 0.8  # trained: the initial weights score 2.4
    assert average.update_starting_at_step == 1000
    (finding,) = [f for f in tuner.findings if "averages" in f.data]
    assert f"first update at step 1000 -> {math.ceil(1000 * 32 / decision.batch_size)}" in finding.title


class OwnAverage(MLP):
    """An EMA of the weights the module keeps itself (decay 0.99), updated after each optimizer
    step and validated as `val_loss` (the model itself as `model_loss`); its decay at each epoch's
    first step."""

    def __init__(self, multi: bool) -> None:
        super().__init__()
        function = get_ema_multi_avg_fn(0.99) if multi else get_ema_avg_fn(0.99)
        self.ema = AveragedModel(self.net, **{"multi_avg_fn" if multi else "avg_fn": function})
        self.written = function
        self.decays: dict[int, float | None] = {}
        self.model_loss = 0.0

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.current_epoch not in self.decays:
            self.decays[self.current_epoch] = ema_decay(self.ema.multi_avg_fn or self.ema.avg_fn)
        self.ema.update_parameters(self.net)

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.cross_entropy(self.ema(batch[0]), batch[1]))
        self.log("model_loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

    @override
    def on_validation_epoch_end(self) -> None:
        self.model_loss = float(self.trainer.callback_metrics["model_loss"])


@pytest.mark.usefixtures("fixed_cost_steps")
@pytest.mark.parametrize("multi", [True, False], ids=["get_ema_multi_avg_fn", "get_ema_avg_fn"])
def test_an_ema_the_module_holds_itself_spans_the_configured_runs_samples(
    tmp_path: Path, multi: bool
) -> None:
    """torch's `AveragedModel` with its EMA function, kept by the LightningModule: the run's
    decay is ``0.99**growth``, the module holds its own function again after the fit, and the
    average costs the tuned run what it costs plain's."""
    _, plain_model, plain = fit(tmp_path / "plain", lambda: OwnAverage(multi), [], None)
    tuner = AutoBatchSize(retune=True, min_efficiency=0.5)
    _, model, tuned = fit(tmp_path / "tuned", lambda: OwnAverage(multi), [], tuner)
    assert isinstance(model, OwnAverage) and isinstance(plain_model, OwnAverage)
    decision = tuner.decision
    assert decision is not None and decision.batch_size >= 4 * 32
    assert model.decays == {0: pytest.approx(0.99 ** (decision.batch_size / 32)), 1: model.decays[0]}
    assert (model.ema.multi_avg_fn if multi else model.ema.avg_fn) is model.written
    assert tuned / model.model_loss < 1.1 * plain / plain_model.model_loss


def test_only_torchs_ema_functions_have_a_decay_to_read() -> None:
    """An equal-weight average (SWA) counts no decay; a function of the user's own is not read."""
    assert ema_decay(get_ema_avg_fn(0.99)) == 0.99
    assert ema_decay(get_swa_avg_fn()) is None
    assert ema_decay(lambda averaged, current, count: 0.99 * averaged + 0.01 * current) is None
    assert ema_decay(None) is None


@pytest.mark.usefixtures("fixed_cost_steps")
def test_an_emas_decay_follows_the_batch_grown_between_epochs(tmp_path: Path) -> None:
    """`AutoBatchSize(grow=True)` grows the batch from 64 between epochs: each epoch's steps
    average at the decay for its own samples per step."""
    torch.manual_seed(0)
    model = OwnAverage(multi=True)
    tuner = AutoBatchSize(retune=True, grow=True)
    trainer = quiet_trainer(tmp_path, [tuner], max_epochs=5, logger=False)
    trainer.fit(model, datamodule=Classes(batch_size=64))
    decision = tuner.decision
    assert decision is not None and decision.growth, [f.title for f in tuner.findings]
    grown = decision.growth[0]
    assert model.decays[0] == pytest.approx(0.99)  # the start keeps 64
    assert model.decays[grown["epoch"] + 1] == pytest.approx(0.99 ** (grown["to"] / 64))
    assert model.ema.multi_avg_fn is model.written


class ShadowWeights(torch.nn.Module):
    """An EMA of the program's own (as diffusion programs keep one): shadow copies of the
    weights, updated at each step with the decay in a buffer, which its checkpoints save."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        super().__init__()
        self.register_buffer("decay", torch.tensor(decay))
        self.shadows = torch.nn.ParameterList(
            [torch.nn.Parameter(p.detach().clone(), requires_grad=False) for p in model.parameters()]
        )

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for shadow, p in zip(self.shadows, model.parameters(), strict=True):
            shadow.lerp_(p, 1 - float(self.decay))


class ShadowEma(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.ema = ShadowWeights(self.net, 0.995)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.update(self.net)


@pytest.mark.usefixtures("fixed_cost_steps")
def test_an_ema_of_the_programs_own_class_is_named_with_the_decay_for_the_tuned_run(tmp_path: Path) -> None:
    """Its decay may be saved with its checkpoints and read back (a resumed fit would raise it
    twice), so it is left as written, with a WARN that gives the decay for the tuned run."""
    tuner = AutoBatchSize(retune=True, min_efficiency=0.5)
    _, model, _ = fit(tmp_path, ShadowEma, [], tuner)
    decision = tuner.decision
    assert decision is not None and decision.batch_size > 32
    growth = decision.batch_size / 32
    (finding,) = [f for f in tuner.findings if "averages" in f.data]
    assert finding.severity is Severity.WARN and finding.data["averages"] == ["ema"]
    assert "`ema` (ShadowWeights, decay 0.995)" in finding.title
    assert finding.fix is not None and f"decay {0.995**growth:.6g} for this run" in finding.fix
    assert isinstance(model, ShadowEma) and float(model.ema.decay) == pytest.approx(0.995)
