"""Models a copy cannot train as the run does, under the pack in real CPU fits: lazy modules
(``nn.LazyLinear``, ``nn.LazyConv2d``: their parameters are shaped by the first forward), whose
parameters nothing reads before they have a shape, and TorchScript modules, whose copies take no
gradients. `AutoBatchSize` keeps the size with a finding that says how to have it tuned.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_boost import AutoBatchSize, boost_callbacks, preset
from lightning_boost.fingerprints import describe_model
from lightning_boost.presets.plans import model_parameter_count
from tests.test_goodput import MLP, Classes, quiet_trainer

pytestmark = pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps")


class LazyMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 10))


def test_a_lazy_model_trains_at_its_size_with_the_dry_run_named(tmp_path: Path) -> None:
    """Counting the model's parameters for the trials' cache key raised ("Attempted to use an
    uninitialized parameter in numel") and the fit stopped before its first step."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    trainer = quiet_trainer(tmp_path, [*boost_callbacks(), tuner], strategy=preset("auto"))
    trainer.fit(model := LazyMLP(), datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.batch_size == 32
    assert "`net.0` (LazyLinear) is a lazy module" in tuner.decision.kept
    assert "dry run" in tuner.decision.kept
    assert model.net[0].weight.shape == (64, 32) and trainer.global_step == 7168 // 32


def test_after_a_dry_run_the_size_is_tuned(tmp_path: Path) -> None:
    tuner = AutoBatchSize(min_efficiency=0.5)
    model = LazyMLP()
    model.net(torch.zeros(1, 32))  # PyTorch's advice for lazy modules
    quiet_trainer(tmp_path, [tuner]).fit(model, datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.batch_size > 32


def test_a_lazy_models_size_is_unknown_and_its_description_counts_what_has_a_shape() -> None:
    model = LazyMLP()
    assert model_parameter_count(model) is None
    assert describe_model(model) == f"{LazyMLP.__module__}.LazyMLP: 650 parameters, 2 uninitialized"
    model.net(torch.zeros(1, 32))
    assert model_parameter_count(model) == 32 * 64 + 64 + 650


class ScriptedMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():  # deprecated (torch 2.14), still in models' code
            warnings.simplefilter("ignore", FutureWarning)
            self.net = torch.jit.script(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))


def test_a_torchscript_module_keeps_the_size_and_trains(tmp_path: Path) -> None:
    """A copy of a TorchScript module holds parameters that are not graph leaves: the trials'
    steps trained none of them (and read their gradients with a warning), so the noise scale and
    the step's cost were a copy's that trains nothing."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    trainer = quiet_trainer(tmp_path, [tuner])
    model = ScriptedMLP()
    before = [param.detach().clone() for param in model.parameters()]
    trainer.fit(model, datamodule=Classes())
    assert tuner.decision is not None and tuner.decision.batch_size == 32
    assert "`net` is a TorchScript module" in tuner.decision.kept and tuner.decision.trials == ()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
