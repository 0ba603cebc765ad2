"""Optimizers the trials must copy and step as Lightning does, under the pack in real CPU fits:
LBFGS, whose ``step`` takes the closure Lightning hands it and evaluates it again along its line
search (and whose rate the learning-rate rule leaves alone), and `ZeroRedundancyOptimizer`, whose
process group cannot be copied (2 processes over gloo). And what the DDP preset says at set-up of
LBFGS with a line search, which can hang DDP.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer  # torch 2.5 warns here, whatever the filters
from typing_extensions import override

from lightning_boost import AutoBatchSize, boost_callbacks, preset
from lightning_boost.hardware import EXAMPLES
from lightning_boost.report import Severity
from lightning_boost.step_probe import StepProbe
from lightning_boost.testing import BoringDataModule, BoringModel, RandomDataset, tiny_trainer
from tests.conftest import spawned_ddp_trainer
from tests.test_autocast import report_of
from tests.test_goodput import MLP, Classes, quiet_trainer

pytestmark = pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps")


class LBFGSMLP(MLP):
    """LBFGS with a line search: it calls the closure (so the step) up to ``max_iter`` times per
    optimizer step."""

    def __init__(self) -> None:
        super().__init__(lr=1.0)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.LBFGS(
            self.parameters(), lr=self.hparams["lr"], max_iter=4, line_search_fn="strong_wolfe"
        )


def val_loss(trainer: L.Trainer) -> float:
    return float(trainer.callback_metrics["val_loss"])


def test_an_lbfgs_run_is_tuned_and_trains_as_plain_lightning(tmp_path: Path) -> None:
    """The trials stepped the copy's optimizer without a closure, and its copy had lost the
    parameters LBFGS keeps outside its state ("'LBFGS' object has no attribute '_params'", then
    "missing 1 required positional argument: 'closure'"): `AutoBatchSize` stopped the fit."""
    torch.manual_seed(0)
    plain = quiet_trainer(tmp_path / "plain", [])
    plain.fit(LBFGSMLP(), datamodule=Classes())
    torch.manual_seed(0)
    tuner = AutoBatchSize()
    boosted = quiet_trainer(tmp_path / "boosted", [*boost_callbacks(), tuner], strategy=preset("auto"))
    boosted.fit(LBFGSMLP(), datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.source == "measured" and tuner.decision.trials
    tuners = {"AutoBatchSize", "BoostedDataModule"}  # the datamodule's worker search steps a copy too
    assert [
        f.title for f in report_of(boosted).findings if f.source in tuners and f.severity is not Severity.INFO
    ] == []
    assert val_loss(boosted) <= val_loss(plain) * 1.05


def test_a_trial_steps_lbfgs_as_lightning_does_evaluating_the_step_again() -> None:
    """The copy's LBFGS, stepped with the trials' closure, takes the steps a real closure gives
    (its line search evaluates the step again at each trial point): the same losses step by step;
    a closure that gave back the first loss each time would not."""
    model = BoringModel()
    data = RandomDataset(length=8)
    batch = (data.inputs, data.targets)
    reference = copy.deepcopy(model)
    lbfgs = torch.optim.LBFGS(reference.parameters(), max_iter=4, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        lbfgs.zero_grad()
        loss = reference._loss(batch)
        loss.backward()
        return loss.detach()

    losses = [float(lbfgs.step(closure)) for _ in range(4)]  # a warm-up step, then three timed
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=4, line_search_fn="strong_wolfe")
    torch.optim.lr_scheduler.StepLR(optimizer, 1)  # sets a `step` on the optimizer that steps it
    probe = StepProbe(model, [optimizer], 3, contextlib.nullcontext, contextlib.nullcontext)
    trial = probe.train(batch, 8)
    assert trial.losses == pytest.approx(losses[1:], rel=1e-5)
    assert losses[3] < losses[1] / 2  # LBFGS moved: the check can tell a step from none
    assert not optimizer.state and not getattr(optimizer, "_opt_called", False)  # the model's own: untouched


@pytest.mark.parametrize(("optimizer", "factor"), [("LBFGS", 1.0), ("Adam", 2.0)])
def test_the_rate_of_a_quasi_newton_step_is_kept_when_the_batch_grows(
    tmp_path: Path, optimizer: str, factor: float
) -> None:
    """At 4x the batch, "auto" raised every rate by the square root, LBFGS's too: its ``lr``
    multiplies a step the curvature already sizes."""
    model = LBFGSMLP()
    if optimizer == "Adam":
        model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=1e-3)  # type: ignore[method-assign]
    tuner = AutoBatchSize(target_global_batch_size=128)
    trainer = quiet_trainer(tmp_path, [tuner], max_steps=2)
    trainer.fit(model, datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.effective_batch_size == 128
    assert tuner.decision.lr_factor == pytest.approx(factor)


class ZeroModel(BoringModel):
    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)


@pytest.mark.ddp
def test_a_zero_redundancy_optimizer_is_tuned_over_ddp(tmp_path: Path) -> None:
    """Copying the sharded optimizer for the trials raised ("cannot pickle ... ProcessGroup") and
    the fit stopped on every rank, where plain Lightning trains. The copy is now the optimizer it
    shards (SGD), over every parameter of the model's copy."""
    trainer = spawned_ddp_trainer(tmp_path, [AutoBatchSize(steps=1, min_efficiency=0.01)])
    trainer.fit(ZeroModel(), datamodule=BoringDataModule(length=20480))
    (report,) = tmp_path.rglob("boost_report.json")
    (finding,) = [f for f in json.loads(report.read_text())["findings"] if f["source"] == "AutoBatchSize"]
    assert finding["data"]["trials"] and finding["data"]["world_size"] == 2


class LineSearchRegression(BoringModel):
    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.LBFGS(self.parameters(), max_iter=5, line_search_fn="strong_wolfe")


class WritesPresetFindings(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        titles = [finding.title for finding in getattr(trainer.strategy, "findings", [])]
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(titles))


@pytest.mark.ddp
def test_the_ddp_preset_warns_at_set_up_of_an_lbfgs_line_search(tmp_path: Path) -> None:
    """The ranks' line searches evaluate the step as often as their own losses ask, each backward
    waiting for the others': 2 gloo processes hung past 90 s, with or without the pack, and no
    report comes from a hung fit. The preset says so before the first step, on every rank's
    findings (no step is trained here: it could hang)."""
    strategy = preset("fast-ddp", hardware=EXAMPLES["cpu"], start_method="spawn")
    trainer = tiny_trainer(
        tmp_path,
        devices=2,
        strategy=strategy,
        callbacks=[WritesPresetFindings(tmp_path)],
        limit_train_batches=0,
        limit_val_batches=0,
        enable_checkpointing=False,
    )
    trainer.fit(LineSearchRegression(), datamodule=BoringDataModule(length=64))
    for rank in (0, 1):
        titles = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert any(title.startswith("LBFGS with a line search over 2 processes can hang") for title in titles)
