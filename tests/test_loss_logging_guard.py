"""LossLoggingGuard: one LightningModule per leak pattern, the clean patterns, modes, growth, DDP.

Every leak module marks the line that keeps the graph with a ``# keeps:`` comment; the tests
assert the guard reports exactly that ``file:line``.
"""

from __future__ import annotations

import gc
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAccuracy

from lightning_boost import BoostWarning, LossLoggingGuard, RetainedGraphError, Severity, testing
from lightning_boost.guards.graphs import census, footprint
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer

THIS_FILE = str(Path(__file__).resolve())


def marked_line(tag: str) -> str:
    """``file:line`` of the line in this file that ends with ``# keeps: <tag>``."""
    return testing.marked_line(THIS_FILE, f"keeps: {tag}")


def fit(
    model: BoringModel, tmp_path: Path, guard: LossLoggingGuard | None = None, **trainer: Any
) -> LossLoggingGuard:
    guard = guard or LossLoggingGuard(mode="report", every_n_steps=1)
    options: dict[str, Any] = {"limit_train_batches": 6, "limit_val_batches": 0} | trainer
    tiny_trainer(tmp_path, callbacks=[guard], **options).fit(model, datamodule=BoringDataModule())
    return guard


def by_holder(guard: LossLoggingGuard) -> dict[str, Any]:
    return {f.data["holder"]: f for f in guard.findings if "holder" in f.data}


# -- leak patterns ---------------------------------------------------------------------------


class ListAppend(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.losses.append(loss)  # keeps: list
        return loss


class Accumulate(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.total: Tensor | float = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.total += loss  # keeps: accumulate
        return loss


class SideMetric(BoringModel):
    """A metric computed with grad enabled and kept: its activations stay alive."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, Tensor] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        self.stats["l1"] = (self(inputs).exp() - targets).abs().mean()  # keeps: dict
        return self._loss(batch)


class Window(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.window: deque[Tensor] = deque(maxlen=3)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.window.append(loss)  # keeps: deque
        return loss


@dataclass
class History:
    train: list[Tensor] = field(default_factory=list)


class NestedDataclass(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.history = {"run": History()}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.history["run"].train.append(loss * 2)  # keeps: dataclass
        return loss


class ReturnsExtra(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        inputs, targets = batch
        preds = self(inputs)
        return {"loss": nn.functional.mse_loss(preds, targets), "preds": preds}  # keeps: output


class CallsLogger(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.logger.log_metrics({"raw_loss": loss}, step=self.global_step)  # keeps: logger
        return loss


LEAKS = [
    # module, holder, path, tag, graphs grow per step
    (ListAppend, "self.losses", "self.losses[5]", "list", True),
    (Window, "self.window", "self.window[2]", "deque", False),
    (NestedDataclass, "self.history", 'self.history["run"].train[5]', "dataclass", True),
    (SideMetric, "self.stats", 'self.stats["l1"]', "dict", False),
    (ReturnsExtra, 'training_step()["preds"]', 'training_step()["preds"]', "output", False),
    (CallsLogger, 'CSVLogger.log_metrics("raw_loss")', 'CSVLogger.log_metrics("raw_loss")', "logger", False),
]


@pytest.mark.parametrize(
    ("cls", "holder", "path", "tag", "grows"), LEAKS, ids=lambda v: getattr(v, "__name__", None)
)
def test_each_leak_is_reported_at_its_holder_and_line(
    cls: type[BoringModel], holder: str, path: str, tag: str, grows: bool, tmp_path: Path
) -> None:
    guard = fit(cls(), tmp_path)
    (finding,) = guard.findings
    assert finding.severity is Severity.WARN
    assert finding.area == "retained graphs"
    assert finding.data["holder"] == holder
    assert path in finding.data["paths"]
    assert finding.location == marked_line(tag)
    assert finding.data["sites"][0]["code"].endswith(f"# keeps: {tag}")
    assert (finding.data["graphs_per_step"] == 1.0) is grows
    assert ("+1 per step" in finding.title) is grows
    assert finding.fix


def test_accumulated_loss_is_one_tensor_whose_graph_grows_every_step(tmp_path: Path) -> None:
    guard = fit(Accumulate(), tmp_path)
    (finding,) = guard.findings
    assert finding.data["holder"] == "self.total" and finding.location == marked_line("accumulate")
    assert finding.data["graphs"] == 1 and finding.data["graphs_per_step"] == 0
    assert finding.data["nodes_per_step"] > 0
    assert "growing by" in finding.title and "autograd nodes per step" in finding.title


def test_side_metric_reports_the_activations_it_keeps(tmp_path: Path) -> None:
    finding = fit(SideMetric(), tmp_path).findings[0]
    # exp() saved its output: 8 samples x 2 outputs x 4 bytes, never freed by a backward pass
    assert finding.data["saved_bytes"] >= 8 * 2 * 4
    assert finding.fix.startswith("Compute values that are not part of the loss under `torch.no_grad()`")


def test_scalar_fixes_prefer_sync_free_ways_over_item(tmp_path: Path) -> None:
    fix = fit(ListAppend(), tmp_path).findings[0].fix
    assert "self.log(" in fix and ".detach()" in fix
    assert 'MeanMetric(nan_strategy="disable")' in fix
    assert 'allow=["losses"]' in fix


def test_output_fix_names_lightning_detaching_only_the_loss(tmp_path: Path) -> None:
    fix = fit(ReturnsExtra(), tmp_path).findings[0].fix
    assert "detaches only the `loss`" in fix and "logits.detach()" in fix


# -- what must not be flagged ----------------------------------------------------------------


class CleanPatterns(BoringModel):
    """Everything the guides recommend, at once."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[Tensor] = []
        self.epoch_means: list[float] = []
        self.mean_loss = MeanMetric(nan_strategy="disable")
        self.accuracy = BinaryAccuracy()
        self.metrics = {"acc": BinaryAccuracy()}  # a metric in a plain dict is still a module
        self.last_preds: Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        preds = self(inputs)
        loss = nn.functional.mse_loss(preds, targets)
        self.log("train_loss", loss)
        self.losses.append(loss.detach())
        self.mean_loss.update(loss)
        self.accuracy.update(preds[:, 0] > 0, targets[:, 0] > 0)
        self.metrics["acc"].update(preds[:, 0] > 0, targets[:, 0] > 0)
        with torch.no_grad():
            self.last_preds = self(inputs)
        return {"loss": loss, "preds": preds.detach()}

    def on_train_epoch_end(self) -> None:
        self.epoch_means.append(torch.stack(self.losses).mean().item())
        self.losses.clear()
        self.log("mean_loss", self.mean_loss.compute())
        self.mean_loss.reset()


class TruncatedBPTT(BoringModel):
    """Carries its hidden state's graph to the next step on purpose, detaching every 3 steps."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        if self.hidden is None or batch_idx % 3 == 0:
            self.hidden = torch.zeros_like(targets)
        out = self(inputs) + 0.5 * self.hidden[: len(inputs)]
        self.hidden = out
        return nn.functional.mse_loss(out, targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(retain_graph=True)


def test_recommended_patterns_yield_no_finding(tmp_path: Path) -> None:
    guard = fit(CleanPatterns(), tmp_path, max_epochs=2)
    (finding,) = guard.findings
    assert finding.severity is Severity.INFO
    assert finding.title == "No autograd graph kept between training steps"
    assert finding.data["checks"] == finding.data["steps"] == 12


def test_marked_truncated_bptt_is_allowed_and_unmarked_is_reported(tmp_path: Path) -> None:
    allowed = fit(
        TruncatedBPTT(), tmp_path / "a", LossLoggingGuard(mode="report", allow=["hidden"], every_n_steps=1)
    )
    assert [f.severity for f in allowed.findings] == [Severity.INFO]
    unmarked = fit(TruncatedBPTT(), tmp_path / "b")
    assert by_holder(unmarked)["self.hidden"].severity is Severity.WARN


def test_boring_model_is_clean_with_default_sampling(tmp_path: Path) -> None:
    guard = fit(BoringModel(), tmp_path, guard=LossLoggingGuard(), limit_train_batches=8, max_epochs=4)
    (finding,) = guard.findings
    assert finding.severity is Severity.INFO
    # the first 3 steps, then as the budget allows: a check costs far more than 0.25 % of a step
    assert 3 <= finding.data["checks"] < finding.data["steps"] == 32


def test_default_sampling_still_reports_the_state_at_the_end(tmp_path: Path) -> None:
    guard = fit(ListAppend(), tmp_path, LossLoggingGuard(mode="report"), limit_train_batches=8, max_epochs=4)
    (finding,) = guard.findings
    assert finding.data["graphs"] == finding.data["last_step"] == 32  # a last check at the end of training
    assert finding.title == "`self.losses` keeps 32 autograd graphs alive, +1 per step"


# -- modes -----------------------------------------------------------------------------------


def test_warn_mode_warns_once_per_holder_at_the_storing_line(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(ListAppend(), tmp_path, LossLoggingGuard(every_n_steps=1))
    ours = [w for w in caught if issubclass(w.category, BoostWarning)]
    assert len(ours) == 1
    assert f"{ours[0].filename}:{ours[0].lineno}" == marked_line("list")
    assert "`self.losses` keeps 1 autograd graph alive" in str(ours[0].message)


def test_error_mode_raises_at_the_first_retained_graph(tmp_path: Path) -> None:
    guard = LossLoggingGuard(mode="error")
    with pytest.raises(
        RetainedGraphError, match=r"self\.losses.*stored at .*test_loss_logging_guard\.py:\d+"
    ):
        fit(ListAppend(), tmp_path, guard)
    assert guard.findings[0].location == marked_line("list")  # the report of the failed run has it
    assert list(tmp_path.rglob("boost_report.json"))


def test_report_mode_is_silent(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(ListAppend(), tmp_path)
    assert not [w for w in caught if issubclass(w.category, BoostWarning)]


# -- growth watch ----------------------------------------------------------------------------

LEAKED: list[Tensor] = []


class LeaksOutsideTheModule(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        LEAKED.append(loss)  # a module-level list: no attribute walk can name it
        return loss


def test_growth_without_a_named_holder_is_a_probable_leak(tmp_path: Path) -> None:
    LEAKED.clear()
    # a fresh process's state: what earlier tests left in reference cycles is freed now, not by a
    # collection during the fit (that case: the test below). Under `pytest -n 4` on Python 3.12 a
    # collection freed it mid-fit, and the finding was missed (2026-11-28).
    gc.collect()
    try:
        # a loaded machine must not starve the growth scans of their budget: this test is about findings
        guard = fit(
            LeaksOutsideTheModule(),
            tmp_path,
            LossLoggingGuard(mode="report", every_n_steps=2, max_overhead=0.9),
        )
    finally:
        LEAKED.clear()
    (finding,) = guard.findings
    assert finding.severity is Severity.WARN
    assert finding.title.startswith("Autograd nodes alive grow by") and "probable leak" in finding.title
    assert finding.data["correlation"] > 0.99 and finding.data["per_step"] > 0
    assert "outside the LightningModule" in finding.fix
    assert finding.data["plot"]["name"] == "retained_growth"


class _CollectAtStep(L.Callback):
    """A full garbage collection after training step `step`, as the interpreter may run one."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            gc.collect()


def test_a_leak_is_found_across_a_collection_that_frees_earlier_garbage(tmp_path: Path) -> None:
    # 200 graph nodes left in a reference cycle before the fit, as an earlier fit's model that kept
    # its losses leaves them (found so: an earlier test's model). Counted alive until a full
    # collection frees them at step 4; the samples dropped there and hid the leak's 3 nodes a step.
    graph = torch.ones(3, requires_grad=True)
    for _ in range(200):
        graph = graph * 1.01
    cycle: dict[str, Any] = {"loss": graph}
    cycle["self"] = cycle
    del graph, cycle
    LEAKED.clear()
    guard = LossLoggingGuard(mode="report", every_n_steps=1, max_overhead=0.9)
    options = {"limit_train_batches": 8, "limit_val_batches": 0}
    gc.disable()  # the collection comes at step 4, no sooner
    try:
        trainer = tiny_trainer(tmp_path, callbacks=[guard, _CollectAtStep(4)], **options)
        trainer.fit(LeaksOutsideTheModule(), datamodule=BoringDataModule())
    finally:
        gc.enable()
        LEAKED.clear()
    (finding,) = guard.findings
    assert finding.severity is Severity.WARN and "probable leak" in finding.title
    assert finding.data["per_step"] == pytest.approx(3.0) and finding.data["correlation"] > 0.99
    assert "fitted across 1 full garbage collection(s)" in finding.detail
    values = finding.data["plot"]["left"]["autograd nodes alive"]
    assert values[3] - values[4] > 150  # the drop is there, in the plot as measured


def test_growth_explained_by_a_named_holder_is_not_reported_twice(tmp_path: Path) -> None:
    guard = fit(ListAppend(), tmp_path)
    assert [f.data.get("holder") for f in guard.findings] == ["self.losses"]


# -- arguments and state ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"mode": "warning"},
            ValueError,
            r"`mode` expected one of 'warn', 'error', 'report', got 'warning'.*'warn'",
        ),
        (
            {"allow": "hidden"},
            TypeError,
            r"`allow` expected a list or tuple, each item a string like 'hidden', got 'hidden' \(str\)",
        ),
        ({"allow": [1]}, TypeError, r"`allow` expected a list or tuple, each item a string like 'hidden'"),
        ({"allow": ["a b"]}, ValueError, r"got \['a b'\]"),
        ({"every_n_steps": 0}, ValueError, r"`every_n_steps` expected an int >= 1 or None, got 0"),
        ({"every_n_steps": True}, TypeError, r"`every_n_steps` expected"),
        ({"max_overhead": 1.5}, ValueError, r"`max_overhead` expected a finite number > 0 and < 1, got 1.5"),
        ({"max_overhead": 0}, ValueError, r"`max_overhead` expected"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        LossLoggingGuard(**kwargs)


def test_loggers_are_restored_after_fit(tmp_path: Path) -> None:
    guard = LossLoggingGuard(mode="report")
    trainer = tiny_trainer(tmp_path, callbacks=[guard], limit_val_batches=0)
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert "log_metrics" not in vars(trainer.logger)


@pytest.mark.ddp
def test_ddp_error_mode_stops_every_rank_when_one_finds_a_graph(tmp_path: Path) -> None:
    trainer = tiny_trainer(
        tmp_path,
        devices=2,
        strategy="ddp_spawn",
        callbacks=[LossLoggingGuard(mode="error")],
        limit_val_batches=0,
    )
    with pytest.raises(Exception, match="autograd graph"):  # re-raised from the spawned ranks
        trainer.fit(LeaksOnRankOne(), datamodule=BoringDataModule())


class LeaksOnRankOne(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        if self.global_rank == 1 and batch_idx >= 1:
            self.kept.append(loss)
        return loss


@pytest.mark.gpu
def test_cuda_growth_watch_reads_the_allocator(tmp_path: Path) -> None:
    LEAKED.clear()
    try:
        guard = LossLoggingGuard(mode="report", every_n_steps=1)
        trainer = tiny_trainer(
            tmp_path,
            accelerator="gpu",
            devices=1,
            callbacks=[guard],
            limit_train_batches=8,
            limit_val_batches=0,
        )
        trainer.fit(LeaksOutsideTheModule(), datamodule=BoringDataModule())
    finally:
        LEAKED.clear()
    (finding,) = guard.findings
    assert (
        finding.title.startswith("Allocated GPU memory grows by")
        and finding.data["unit"] == "allocated bytes"
    )


def test_a_fake_tensor_left_by_torch_compile_does_not_stop_the_census(tmp_path: Path) -> None:
    """``torch.compile`` keeps FakeTensors (no storage of their own) with graphs alive in its
    caches, which the census finds: a compiled fit earlier in the process crashed this guard's
    first scan ("Cannot access data pointer of Tensor"). Made here by FakeTensorMode directly."""
    with FakeTensorMode():
        weight = torch.ones(3, requires_grad=True)
        fake = (weight * 2).sum()
    assert fake in census()
    assert footprint([fake]).nodes == 3  # its graph walked (sum, mul, the leaf): no crash
    guard = fit(ListAppend(), tmp_path)
    assert [finding.data["holder"] for finding in guard.findings] == ["self.losses"]
