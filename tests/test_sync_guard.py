"""SyncGuard: one LightningModule per sync pattern, on CPU; library and framework syncs; modes; DDP.

Every pattern module marks the line that syncs with a ``# syncs:`` comment; the tests assert the
guard reports exactly that ``file:line``. This machine has no GPU: the CPU run reports what would
sync on one, and the ``gpu``-marked tests check the CUDA path where a GPU is lent.
"""

from __future__ import annotations

import importlib
import json
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor
from torch.distributions import Normal
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAccuracy, MulticlassAccuracy, MulticlassJaccardIndex

from lightning_boost import (
    AutoBatchSize,
    BoostedDataModule,
    BoostReport,
    BoostWarning,
    Finding,
    Severity,
    SyncError,
    SyncGuard,
    boost_callbacks,
    testing,
)
from lightning_boost._lightning import pytorch_lightning_takes_our_callbacks
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer
from tests.conftest import OLD_TORCH_OR_LIGHTNING

#: AutoBatchSize runs here are a few batches long; its run-length rules are tested in test_goodput.
pytestmark = pytest.mark.usefixtures("long_planned_run")

THIS_FILE = str(Path(__file__).resolve())


def marked_line(tag: str) -> str:
    """``file:line`` of the line in this file that ends with ``# syncs: <tag>``."""
    return testing.marked_line(THIS_FILE, f"syncs: {tag}")


def fit(model: BoringModel, tmp_path: Path, guard: SyncGuard | None = None, **trainer: Any) -> SyncGuard:
    guard = guard or SyncGuard(mode="report", every_n_steps=1)
    options: dict[str, Any] = {"limit_train_batches": 3, "limit_val_batches": 0, "logger": False}
    tiny_trainer(tmp_path, callbacks=[guard], **(options | trainer)).fit(model, datamodule=BoringDataModule())
    return guard


def user_syncs(guard: SyncGuard) -> dict[str | None, Finding]:
    """The findings of syncs in the user's code by their line (not Lightning's, not the allocator's)."""
    return {
        f.location: f
        for f in guard.findings
        if not f.data.get("framework") and f.data.get("pattern") not in ALLOCATOR_PATTERNS
    }


def framework_syncs(guard: SyncGuard) -> dict[str, Finding]:
    return {f.data["causes"][0]: f for f in guard.findings if f.data.get("framework")}


class OneSync(BoringModel):
    """Makes the sync of `sync` once per training step (a helper of ``training_step``, as in real code)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.sync(loss, batch)
        self.log("train_loss", loss)
        return loss

    def sync(self, loss: Tensor, batch: Any) -> None:
        raise NotImplementedError


# -- one module per pattern --------------------------------------------------------------------


class Item(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = loss.item()  # syncs: item


class Float(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = float(loss.detach())  # syncs: float


class Int(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = int(batch[1].argmax())  # syncs: int


class Branch(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        if loss > 1e9:  # syncs: bool
            raise AssertionError("never")


class Format(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.text = f"loss {loss:.3f}"  # syncs: format


class Print(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        print(loss)  # noqa: T201  # syncs: print


class MoreAtFirst(OneSync):
    """Syncs 3x in its first step, then once a step: a `MetricCollection` before it merges its
    compute groups updates each metric on its own, then the group once."""

    def sync(self, loss: Tensor, batch: Any) -> None:
        self.values = [loss.item() for _ in range(3 if self.global_step == 0 else 1)]  # syncs: first


class Cpu(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = loss.detach().cpu()  # syncs: cpu


class ToCpu(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = loss.detach().to("cpu")  # syncs: to_cpu


class ToList(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = batch[1][:2].tolist()  # syncs: tolist


class Numpy(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = batch[1].numpy()  # syncs: numpy


class Nonzero(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = torch.nonzero(batch[1] > 0)  # syncs: nonzero


class MaskIndex(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = batch[0][batch[0] > 0].sum()  # syncs: mask_index


class MaskAssign(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        clipped = batch[0].clone()
        clipped[clipped < 0] = 0  # syncs: mask_assign


class MaskedSelect(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = torch.masked_select(batch[0], batch[0] > 0)  # syncs: masked_select


class Unique(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = torch.unique((batch[1] > 0).long())  # syncs: unique


class RepeatInterleave(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        counts = (batch[1][:, 0] > 0).long()
        self.value = torch.repeat_interleave(batch[0][:, 0], counts)  # syncs: repeat_interleave


class OneHot(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = F.one_hot((batch[1][:, 0] > 0).long())  # syncs: one_hot


class Equal(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = torch.equal(batch[0], batch[0])  # syncs: equal


class AllClose(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = torch.allclose(batch[0], batch[0] + 1e-9)  # syncs: allclose


class SliceBound(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        offset = (batch[1][0, 0] > 0).long()  # a scalar on the device
        self.value = batch[0][offset : offset + 2]  # syncs: slice_bound


class CtcLengths(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        log_probs = batch[0][:, :5].unsqueeze(0).expand(6, -1, -1).log_softmax(2)  # (T, N, C)
        targets = torch.ones(len(batch[0]), 3, dtype=torch.long, device=self.device)
        lengths = torch.full((len(batch[0]),), 6, dtype=torch.long, device=self.device)
        self.value = F.ctc_loss(log_probs, targets, lengths, lengths // 2)  # syncs: ctc_lengths


class Synchronize(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        torch.cuda.synchronize()  # syncs: synchronize


class EmptyCache(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        torch.cuda.empty_cache()  # syncs: empty_cache


PATTERN_MODULES = [
    (Item, "item", "item"),
    (Float, "float", "float"),
    (Int, "int", "float"),
    (Branch, "bool", "bool"),
    (Format, "format", "format"),
    (Print, "print", "print"),
    (Cpu, "cpu", "cpu"),
    (ToCpu, "to_cpu", "to_cpu"),
    (ToList, "tolist", "tolist"),
    (Numpy, "numpy", "numpy"),
    (Nonzero, "nonzero", "nonzero"),
    (MaskIndex, "mask_index", "mask_index"),
    (MaskAssign, "mask_assign", "mask_assign"),
    (MaskedSelect, "masked_select", "masked_select"),
    (Unique, "unique", "unique"),
    (RepeatInterleave, "repeat_interleave", "repeat_interleave"),
    (OneHot, "one_hot", "one_hot"),
    (Equal, "equal", "equal"),
    (AllClose, "allclose", "equal"),
    (SliceBound, "slice_bound", "slice_bound"),
    (CtcLengths, "ctc_lengths", "ctc_lengths"),
    (Synchronize, "synchronize", "synchronize"),
    (EmptyCache, "empty_cache", "empty_cache"),
]


@pytest.mark.parametrize(
    ("module", "tag", "pattern"), PATTERN_MODULES, ids=[tag for _, tag, _ in PATTERN_MODULES]
)
def test_each_pattern_is_reported_at_its_line(
    module: type[OneSync], tag: str, pattern: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if module is Synchronize:  # no GPU here: stand in for the real call, which needs a driver
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    guard = fit(module(), tmp_path)
    (finding,) = user_syncs(guard).values()
    assert finding.location == marked_line(tag)
    assert finding.severity is Severity.WARN and finding.area == "syncs"
    assert finding.data["syncs"] == {pattern: 3}  # once in each of the 3 checked steps
    assert finding.data["per_step"] == 1 and finding.data["hook"] == "training_step"
    assert finding.data["function"] == "sync"  # the helper the step called
    assert finding.title.startswith(f"`{finding.data['code']}` syncs 1x per training step in training_step")
    assert "on a GPU" in finding.detail and finding.fix


class NotOnAGpu(OneSync):
    """Calls that look like syncs on the CPU but are not on a GPU run, or not syncs at all."""

    def sync(self, loss: Tensor, batch: Any) -> None:
        labels = (batch[1][:, 0] > 0).long()
        self.encoded = F.one_hot(labels, num_classes=2)  # checks its range with .item() on CPU only
        self.moved = batch[0].to(self.device)  # to the GPU on a GPU run
        self.cast = batch[0].to(torch.float64)
        self.masked = torch.where(batch[0] > 0, batch[0], 0)
        self.filled = batch[0].masked_fill(batch[0] < 0, 0)
        self.host = loss.detach().to("cpu", non_blocking=True)
        self.count = len(batch[0])
        host = torch.tensor(2)  # made on the host: a GPU run slices by it without a sync
        self.sliced = batch[0][host : host + 1]
        log_probs = batch[0][:, :5].unsqueeze(0).expand(6, -1, -1).log_softmax(2)
        targets = torch.ones(len(batch[0]), 3, dtype=torch.long, device=self.device)
        on_host = torch.full((len(batch[0]),), 6, dtype=torch.long)  # lengths the GPU run keeps on the host
        self.ctc = F.ctc_loss(log_probs, targets, on_host, on_host // 2)


def test_calls_that_do_not_sync_on_a_gpu_are_not_reported(tmp_path: Path) -> None:
    assert user_syncs(fit(NotOnAGpu(), tmp_path)) == {}


class CopyThenRead(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        host = loss.detach().cpu()  # syncs: copy
        self.values = (host.numpy(), host.tolist(), host.item())  # already on the host: no sync


def test_reads_of_a_host_copy_are_not_reported_again(tmp_path: Path) -> None:
    (finding,) = user_syncs(fit(CopyThenRead(), tmp_path)).values()
    assert finding.location == marked_line("copy") and finding.data["syncs"] == {"cpu": 3}


class ValidationItem(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss)
        self.best = min(getattr(self, "best", 1e9), loss.item())  # syncs: validation


def test_validation_steps_are_checked_and_the_sanity_check_is_not(tmp_path: Path) -> None:
    guard = fit(ValidationItem(), tmp_path, limit_val_batches=2, num_sanity_val_steps=2)
    (finding,) = user_syncs(guard).values()
    assert finding.location == marked_line("validation")
    assert finding.data["phase"] == "validation" and finding.data["hook"] == "validation_step"
    assert finding.data["syncs"] == {"item": 2} and guard.checked_steps == {"training": 3, "validation": 2}


class StepLoggedInValidation(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_step_loss", self._loss(batch), on_step=True)


def test_step_values_logged_in_validation_get_the_fix_that_works_there(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="validation")
    guard = fit(StepLoggedInValidation(), tmp_path, limit_val_batches=4, log_every_n_steps=2, logger=logger)
    (finding,) = framework_syncs(guard).values()
    assert finding.data["causes"] == ["logging"] and finding.data["phase"] == "validation"
    assert finding.data["syncs"] == {"item": 4}  # every validation step, whatever log_every_n_steps is
    assert "on_step=True" in finding.title and "log_every_n_steps=" not in finding.fix
    assert "on_step=False" in finding.fix and "torchmetrics" in finding.fix


class GradNormItem(BoringModel):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norm = torch.linalg.vector_norm(self.layer.weight.grad)
        self.grad_norm = norm.item()  # syncs: grad_norm


def test_hooks_around_backward_and_the_optimizer_step_are_checked(tmp_path: Path) -> None:
    (finding,) = user_syncs(fit(GradNormItem(), tmp_path)).values()
    assert finding.location == marked_line("grad_norm")
    assert finding.data["hook"] == finding.data["function"] == "on_before_optimizer_step"


class EpochEndItem(BoringModel):
    def on_train_epoch_end(self) -> None:
        self.summary = self.layer.weight.sum().item()  # outside the steps: not flagged


def test_syncs_outside_the_steps_are_flagged_only_when_asked(tmp_path: Path) -> None:
    assert user_syncs(fit(EpochEndItem(), tmp_path / "steps")) == {}
    guard = fit(EpochEndItem(), tmp_path / "fit", guard=SyncGuard(mode="report", scope="fit"))
    (finding,) = user_syncs(guard).values()
    assert finding.data["hook"] == "on_train_epoch_end"


# -- libraries ---------------------------------------------------------------------------------


class DefaultMeanMetric(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.mean_loss = MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.mean_loss.update(loss.detach())  # syncs: nan_check
        return loss


def test_a_sync_inside_a_library_is_reported_at_the_calling_line_with_its_setting(tmp_path: Path) -> None:
    (finding,) = user_syncs(fit(DefaultMeanMetric(), tmp_path)).values()
    assert finding.location == marked_line("nan_check")
    assert finding.data["causes"] == ["metric_nan_check"]
    assert finding.data["libraries"] == ["torchmetrics._cast_and_nan_check_input"]
    assert 'nan_strategy="disable"' in finding.fix and "Inside torchmetrics" in finding.detail


class ClassAccuracy(BoringModel):
    """A 2-class accuracy (or another class `metric`) over the outputs' signs, built with
    `options` and fed as `call` says."""

    def __init__(self, call: str = "update", metric: type = MulticlassAccuracy, **options: Any) -> None:
        super().__init__()
        self.call = call
        self.accuracy = metric(2, **options)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        outputs = self(inputs.to(self.device))
        logits, classes = outputs[:, :2], (targets[:, 0] > 0).long()
        if self.call == "update":
            self.accuracy.update(logits, classes)  # syncs: metric_update
        else:
            self.accuracy(logits, classes)  # syncs: metric_forward
        return F.mse_loss(outputs, targets)


@pytest.mark.parametrize("average", ["macro", "micro"])
def test_a_confusion_matrix_metric_is_not_told_that_an_average_removes_its_count(
    tmp_path: Path, average: str
) -> None:
    """`JaccardIndex` (as `ConfusionMatrix`, `CohenKappa`) counts a confusion matrix with
    `torch.bincount` whatever its average: `average="micro"` removes nothing there, and counting
    by comparison (deterministic mode) holds a table of values x classes², too large for masks."""
    model = ClassAccuracy("update", MulticlassJaccardIndex, average=average, validate_args=False)
    findings = [f for f in fit(model, tmp_path).findings if f.source == "SyncGuard"]
    assert len(findings) == 1
    assert findings[0].data["causes"] == ["metric_confusion_matrix"]
    assert "micro" not in findings[0].fix and "segmentation" in findings[0].fix


@pytest.mark.parametrize(
    ("call", "options", "found"),
    [
        # torchmetrics' defaults: a macro average counts per class with `torch.bincount`
        ("update", {}, {"metric_bincount": 'average="micro"'}),
        # what the guard said before (the input checks' fix) left that count, and its finding, in place
        ("update", {"validate_args": False}, {"metric_bincount": 'average="micro"'}),
        ("update", {"average": "micro", "validate_args": False}, {}),
        # called, a metric also computes the batch's macro value, whose weights are set through a mask
        ("forward", {"validate_args": False}, {"metric_bincount": "micro", "metric_forward": ".update("}),
        ("forward", {"average": "micro", "validate_args": False}, {}),
    ],
)
def test_each_torchmetrics_sync_gets_the_fix_that_removes_it(
    tmp_path: Path, call: str, options: dict[str, Any], found: dict[str, str]
) -> None:
    """Every reason a line syncs for is in its one finding, each with its fix."""
    findings = [f for f in fit(ClassAccuracy(call, **options), tmp_path).findings if f.source == "SyncGuard"]
    assert len(findings) == (1 if found else 0)
    for finding in findings:
        assert sorted(finding.data["causes"]) == sorted(found)
        assert all(fix in finding.fix for fix in found.values())
        assert finding.location == marked_line(f"metric_{call}")


class Sentences(L.LightningModule):
    """A GRU over padded token sequences, packed with the lengths a `collate_fn` returns as a
    Python list (on the host in a GPU run too, as torch needs them); `sorted_batches` says whether
    the collate sorts each batch longest first (then ``enforce_sorted=True``)."""

    def __init__(self, sorted_batches: bool) -> None:
        super().__init__()
        self.sorted_batches = sorted_batches
        self.embed, self.rnn = torch.nn.Embedding(20, 8), torch.nn.GRU(8, 8, batch_first=True)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, lengths = batch
        packed = pack_padded_sequence(self.embed(tokens), lengths, True, self.sorted_batches)  # syncs: pack
        outputs, hidden = self.rnn(packed)
        padded, _ = pad_packed_sequence(outputs, batch_first=True)  # syncs: pad
        return padded.sum() + hidden.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        sentences = [torch.randint(1, 20, (n % 7 + 1,)) for n in range(24)]

        def collate(items: list[Tensor]) -> tuple[Tensor, list[int]]:
            items = sorted(items, key=len, reverse=True) if self.sorted_batches else items
            return pad_sequence(items, batch_first=True), [len(item) for item in items]

        return torch.utils.data.DataLoader(sentences, batch_size=6, collate_fn=collate)


@pytest.mark.parametrize("sorted_batches", [False, True])
def test_a_packed_sequence_rnn_syncs_only_to_sort(tmp_path: Path, sorted_batches: bool) -> None:
    """An RNN reading its packed sequence's `batch_sizes` (on the host, as torch makes them) is
    not a sync; `enforce_sorted=False`'s sort order, copied to the GPU and back, is, at both
    lines, with the fix that removes it, and sorting in the `collate_fn` leaves nothing."""
    guard = SyncGuard(mode="report", every_n_steps=1)
    trainer = tiny_trainer(tmp_path, callbacks=[guard], limit_val_batches=0, logger=False)
    trainer.fit(Sentences(sorted_batches))
    found = user_syncs(guard)
    if sorted_batches:
        assert found == {}
        return
    assert found.keys() == {marked_line("pack"), marked_line("pad")}
    for finding in found.values():
        assert finding.data["causes"] == ["packed_sequence"] and "enforce_sorted=True" in finding.fix


class CumulativeNorm(BoringModel):
    """A BatchNorm with `momentum=None` (a cumulative average), as `StochasticWeightAveraging`
    sets it for the epoch that recomputes the averaged weights' statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(32, momentum=None)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        normed = self.norm(batch[0])  # syncs: batchnorm
        return torch.nn.functional.mse_loss(self(normed), batch[1])


def test_a_cumulative_batchnorm_is_named_with_its_momentum(tmp_path: Path) -> None:
    """torch's BatchNorm reads `float(num_batches_tracked)` each training forward when its momentum
    is None: found at the user's line with the momentum as the fix (and SWA's epoch named), where it
    said only "look for a torch setting"."""
    found = user_syncs(fit(CumulativeNorm(), tmp_path))
    assert found.keys() == {marked_line("batchnorm")}
    (finding,) = found.values()
    assert finding.data["causes"] == ["batchnorm_cumulative"]
    assert "momentum=0.1" in finding.fix and "StochasticWeightAveraging" in finding.fix


class NormedModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(32)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return torch.nn.functional.mse_loss(self(self.norm(batch[0])), batch[1])


def test_the_averaging_callbacks_own_batchnorm_epoch_is_its_own(tmp_path: Path) -> None:
    """`StochasticWeightAveraging` sets the BatchNorms' momentum to None for its extra epoch (the
    averaged weights' statistics): those syncs are the callback's, a note, and `mode="error"` does
    not stop the fit's last epoch at the user's forward for them."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    guard = SyncGuard(mode="error", every_n_steps=1)
    averaging = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    options = {"limit_train_batches": 3, "limit_val_batches": 0, "logger": False, "max_epochs": 2}
    trainer = tiny_trainer(tmp_path, callbacks=[guard, averaging], **options)
    trainer.fit(NormedModel(), datamodule=BoringDataModule())
    assert trainer.state.finished and trainer.current_epoch == 3  # with the averaging's extra epoch
    assert user_syncs(guard) == {}
    assert framework_syncs(guard)["batchnorm_cumulative"].severity is Severity.INFO


class GaussianHead(BoringModel):
    """A VAE's or a policy's step: a `Normal` from the model's outputs, sampled and scored.
    `validate` is the distributions' `validate_args` (torch's default: on, as `__debug__`)."""

    def __init__(self, validate: bool) -> None:
        super().__init__()
        self.validate = validate

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        mean, log_std = self(batch[0]).chunk(2, dim=1)
        dist = Normal(mean, log_std.exp(), validate_args=self.validate)  # syncs: normal
        return -dist.log_prob(dist.rsample()).mean()  # syncs: log_prob


@pytest.mark.parametrize("validate", [True, False])
def test_a_distributions_argument_checks_are_named_with_the_setting(tmp_path: Path, validate: bool) -> None:
    """`torch.distributions` checks each parameter (and `log_prob`'s value) against its
    constraint with a Python branch on the GPU's answer: found at the user's lines with
    `validate_args=False` as the fix, where it said only "look for a torch setting"."""
    guard = fit(GaussianHead(validate), tmp_path)
    found = user_syncs(guard)
    if not validate:
        assert found == {}
        return
    assert found.keys() == {marked_line("normal"), marked_line("log_prob")}
    for finding in found.values():
        assert finding.data["causes"] == ["distribution_validation"]
        assert "validate_args=False" in finding.fix and "set_default_validate_args(False)" in finding.fix


class MacroAccuracy(BoringModel):
    """A macro-averaged accuracy updated in each validation step and logged as the metric object:
    Lightning computes it once at the epoch's end (masked weights, a sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.accuracy = MulticlassAccuracy(2, validate_args=False)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        outputs = self(inputs)
        self.accuracy.update(outputs[:, :2], (targets[:, 0] > 0).long())  # syncs: macro_update
        self.log("val_acc", self.accuracy)


@pytest.mark.parametrize("batches", [1, 2])
def test_the_epochs_logged_values_are_not_the_last_validation_steps(tmp_path: Path, batches: int) -> None:
    """Lightning computes the epoch's logged values right after the last validation batch, before
    any callback hook: the last checked step's window took that once-per-epoch compute in, as
    "`sync_dist=True` reduces the value at every logged step" for a run with no `sync_dist`."""
    guard = fit(MacroAccuracy(), tmp_path, limit_val_batches=batches, num_sanity_val_steps=0)
    assert framework_syncs(guard) == {}
    assert user_syncs(guard).keys() == {marked_line("macro_update")}


class Clean(BoringModel):
    """Everything the fixes recommend: logged tensors, metrics on the device, fixed shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_loss = MeanMetric(nan_strategy="disable")
        self.accuracy = BinaryAccuracy(validate_args=False)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        outputs = self(inputs.to(self.device))
        loss = F.mse_loss(outputs, targets)
        positive = targets[:, 0] > 0
        self.mean_loss.update(loss.detach())
        self.accuracy.update(outputs[:, 0] > 0, positive)
        masked = torch.where(positive, outputs[:, 0], 0).sum() / positive.sum().clamp(min=1)
        self.log("train_loss", loss)
        self.log("masked_output", masked)
        self.log("train_acc", self.accuracy, on_step=False, on_epoch=True)
        self.encoded = F.one_hot(positive.long(), num_classes=2)
        return loss


def test_a_clean_module_yields_zero_findings(tmp_path: Path) -> None:
    guard = fit(Clean(), tmp_path, limit_train_batches=4, limit_val_batches=2)
    assert guard.findings == []
    assert guard.checked_steps == {"training": 4, "validation": 2}


class AdamClassifier(L.LightningModule):
    """A clean model trained with Adam, which reads its step counters with `.item()` (kept on the
    host on a GPU too: not a sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = F.cross_entropy(self.net(batch["input"]), batch["label"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.net.parameters(), lr=1e-3)


class DictSamples(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self, length: int) -> None:
        self.inputs = torch.randn(length, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input": self.inputs[index], "label": (self.inputs[index].sum() > 0).long()}


class DictData(BoostedDataModule):
    def setup(self, stage: str) -> None:
        self.train_dataset = DictSamples(4096)


def test_the_quickstarts_callbacks_find_nothing_in_a_clean_adam_fit(tmp_path: Path) -> None:
    """`boost_callbacks()` and `BoostedDataModule` as the README sets them up, on a CPU: the worker
    search times the model on fewer threads on a copy between the run's steps, and the copy's Adam
    read its own step counters in the guard's checked windows, reported as torch's syncs (in 4 of
    4 runs before the probe's steps were left out)."""
    trainer = tiny_trainer(tmp_path, callbacks=boost_callbacks(), max_epochs=3, limit_train_batches=None,
                           limit_val_batches=0, logger=False)  # fmt: skip
    trainer.fit(AdamClassifier(), datamodule=DictData(batch_size=32))
    (guard,) = [c for c in trainer.callbacks if isinstance(c, SyncGuard)]  # type: ignore[attr-defined]
    assert guard.checked_steps["training"] >= 3
    assert guard.findings == []


# -- framework syncs ---------------------------------------------------------------------------


class OnTheProgressBar(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss


def test_framework_syncs_are_reported_apart_with_their_setting(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path))
    guard = fit(OnTheProgressBar(), tmp_path, enable_progress_bar=True, logger=logger, log_every_n_steps=1)
    assert user_syncs(guard) == {}
    framework = framework_syncs(guard)
    assert set(framework) == {"progress_bar", "prog_bar_values", "logging"}
    bar = framework["progress_bar"]
    assert bar.severity is Severity.INFO and bar.location is None
    assert bar.data["syncs"] == {"item": 3} and "refresh_rate" in bar.fix
    # after every batch, and again for the loggers when they log (every step here)
    assert framework["prog_bar_values"].data["syncs"] == {"item": 6}
    assert "on_epoch=True" in framework["prog_bar_values"].fix
    assert "log_every_n_steps" in framework["logging"].fix


def test_prog_bar_values_sync_even_without_a_progress_bar(tmp_path: Path) -> None:
    guard = fit(OnTheProgressBar(), tmp_path, enable_progress_bar=False, log_every_n_steps=50)
    (finding,) = guard.findings  # once per batch: no bar, no logger, no logging step
    assert finding.data["causes"] == ["prog_bar_values"] and finding.data["syncs"] == {"item": 3}


# -- modes -------------------------------------------------------------------------------------


def test_error_mode_raises_at_the_users_line(tmp_path: Path) -> None:
    guard = SyncGuard(mode="error")
    with pytest.raises(SyncError, match=r"SyncGuard: `.item\(\)` copies a value") as raised:
        fit(Item(), tmp_path, guard=guard)
    location = marked_line("item")
    assert f"at {location} in training_step: `self.value = loss.item()`" in str(raised.value)
    file, line = location.rsplit(":", 1)
    assert any(str(entry.path) == file and entry.lineno + 1 == int(line) for entry in raised.traceback)
    assert [f.location for f in guard.findings] == [location]  # the failed run's report has it


def test_error_mode_ignores_framework_syncs_and_allowed_lines(tmp_path: Path) -> None:
    allowed = marked_line("item").rsplit("/", 1)[1]  # "test_sync_guard.py:NN"
    guard = SyncGuard(mode="error", allow=[allowed])
    fit(Item(), tmp_path, guard=guard, logger=CSVLogger(str(tmp_path)), log_every_n_steps=1)
    assert {tuple(f.data["causes"]) for f in guard.findings} == {("logging",)}


def test_warn_mode_warns_once_per_line_at_that_line(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Print(), tmp_path, guard=SyncGuard(), limit_train_batches=5)
    ours = [w for w in caught if issubclass(w.category, BoostWarning)]
    assert len(ours) == 1
    assert f"{ours[0].filename}:{ours[0].lineno}" == marked_line("print")
    # warned at its second step (a line seen at one batch of each epoch alone is a note)
    message = "SyncGuard: `print(loss)` syncs 1x per training step over the 2 checked since it was first seen"
    assert message in str(ours[0].message)


def test_the_warning_counts_the_steps_since_it_was_found_and_the_report_every_step(tmp_path: Path) -> None:
    """The warning comes at the second step a line syncs in, so its count is those steps': it said
    "3x per training step" (the first step's alone), against the report's 1.5x over 4 steps, read
    as a contradiction; it now says over how many steps it counted."""
    guard = SyncGuard(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(MoreAtFirst(), tmp_path, guard=guard, limit_train_batches=4)
    (ours,) = [w for w in caught if issubclass(w.category, BoostWarning)]
    assert "syncs 2x per training step over the 2 checked since it was first seen" in str(ours.message)
    (finding,) = [f for f in guard.findings if f.location == marked_line("first")]
    assert "syncs 1.5x per training step" in finding.title


class SampleImages(BoringModel):
    """Validation logs one sample output per pass, at its first batch (a logger's `add_image`);
    training reads its loss at every step."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.value = loss.item()  # syncs: every_step
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        outputs = self(batch[0])
        if batch_idx == 0:
            self.sample = outputs[0].cpu()  # syncs: first_batch


def test_a_sync_at_one_batch_of_each_pass_is_a_note_not_a_warning(tmp_path: Path) -> None:
    """A sample image logged at the first batch of each validation run is one wait a pass, which
    costs next to nothing: it was a WARN (and a warning) whose fix, "move what you need to the
    host once per epoch", is what it already does. Seen only at one batch index while other
    indices were checked, it is a note; a sync at every step is still warned of."""
    guard = SyncGuard(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(SampleImages(), tmp_path, guard=guard, max_epochs=2, limit_train_batches=4, limit_val_batches=4)
    warned = [f"{w.filename}:{w.lineno}" for w in caught if issubclass(w.category, BoostWarning)]
    assert warned == [marked_line("every_step")]
    found = user_syncs(guard)
    assert found[marked_line("every_step")].severity is Severity.WARN
    once = found[marked_line("first_batch")]
    assert once.severity is Severity.INFO and "only at batch_idx 0" in once.title and not once.fix
    assert once.data["batches"] == [0]


def test_report_mode_is_silent(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = fit(Item(), tmp_path)
    assert not [w for w in caught if issubclass(w.category, BoostWarning)]
    assert len(user_syncs(guard)) == 1


# -- sampling and side effects -----------------------------------------------------------------


def test_default_checks_a_sample_of_steps(tmp_path: Path) -> None:
    guard = fit(Item(), tmp_path, guard=SyncGuard(mode="report"), limit_train_batches=40)
    checked = guard.checked_steps["training"]
    assert 3 <= checked < 40
    (finding,) = user_syncs(guard).values()
    assert finding.data["per_step"] == 1 and finding.data["checked_steps"] == checked


class _SlowFetch(L.Callback):  # `lightning`'s, as the trainer: Lightning 2.4 takes no other
    """The step after the guard's first checks waits 0.3 s beside it, as a step whose loader ran a
    tuner's trial on a copy of the model does: the guard's first plain step to time."""

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int) -> None:
        if i == 3:
            time.sleep(0.3)


def test_one_slow_plain_step_does_not_make_every_later_step_checked(tmp_path: Path) -> None:
    """Against a plain step 0.3 s long, each check reads free; before, checks then came every
    step and no plain step was timed again to correct it (the demo's ResNet-18: 127 of 128 steps
    checked, its loading in the main process 4.7x slower under the guard's mode, timed by hand). Now a check
    that reads free leaves the next step plain, and once those outvote the slow one the budget
    spaces the checks."""
    guard = SyncGuard(mode="report")
    options: dict[str, Any] = {"limit_train_batches": 60, "limit_val_batches": 0, "logger": False}
    trainer = tiny_trainer(tmp_path, callbacks=[guard, _SlowFetch()], **options)
    trainer.fit(Item(), datamodule=BoringDataModule(length=480))  # 60 steps
    assert 3 < guard.checked_steps["training"] <= 30


def test_results_are_the_same_with_and_without_the_guard(tmp_path: Path) -> None:
    weights = []
    for name, callbacks in (("plain", []), ("guarded", [SyncGuard(mode="report", every_n_steps=1)])):
        torch.manual_seed(0)
        model = Item()
        trainer = tiny_trainer(tmp_path / name, callbacks=callbacks, limit_val_batches=2)
        trainer.fit(model, datamodule=BoringDataModule())
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def test_patched_calls_are_restored_after_fit(tmp_path: Path) -> None:
    synchronize, empty_cache = torch.cuda.synchronize, torch.cuda.empty_cache
    all_reduce = torch.distributed.all_reduce
    fit(Item(), tmp_path)
    assert torch.cuda.synchronize is synchronize and torch.cuda.empty_cache is empty_cache
    assert torch.distributed.all_reduce is all_reduce
    assert not torch.overrides._get_current_function_mode_stack()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"mode": "raise"},
            ValueError,
            r"`mode` expected one of 'warn', 'error', 'report', got 'raise'",
        ),
        ({"scope": "epoch"}, ValueError, r"`scope` expected one of 'steps', 'fit', got 'epoch'"),
        (
            {"allow": "model.py:12"},
            TypeError,
            r"`allow` expected a list or tuple, each item a string like 'model.py:57', got 'model.py:12'",
        ),
        ({"allow": ["model.py"]}, ValueError, r"`allow` expected a list or tuple, each item a string like"),
        ({"every_n_steps": 0}, ValueError, r"`every_n_steps` expected an int >= 1 or None, got 0"),
        ({"max_overhead": 2}, ValueError, r"`max_overhead` expected a finite number > 0 and < 1, got 2"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        SyncGuard(**kwargs)


# -- DDP ---------------------------------------------------------------------------------------


class SyncDist(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)  # syncs: sync_dist
        return loss


class HandAveraged(BoringModel):
    """An exponential moving average of the weights kept by hand with torch's `AveragedModel`."""

    def __init__(self) -> None:
        super().__init__()
        self.average = torch.optim.swa_utils.AveragedModel(
            self.layer, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)
        )

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.average.update_parameters(self.layer)  # syncs: average


def test_a_weight_average_updated_every_step_is_named_with_the_setting_that_thins_it(tmp_path: Path) -> None:
    """torch's `AveragedModel.update_parameters` reads its count of updates (a tensor on the
    model's device) twice an update: by hand, at the user's line; by Lightning's
    `EMAWeightAveraging` (Lightning >= 2.6), as Lightning's own, one finding for its two lines."""
    found = user_syncs(fit(HandAveraged(), tmp_path))
    assert list(found) == [marked_line("average")]
    finding = found[marked_line("average")]
    assert finding.data["causes"] == ["weight_averaging"]
    assert finding.data["syncs"]["bool"] >= 6  # 2 reads an update (3 in torch 2.5), 3 steps
    assert "every few steps" in finding.fix
    callbacks = importlib.import_module("lightning.pytorch.callbacks")
    if not hasattr(callbacks, "EMAWeightAveraging"):
        return
    guard = SyncGuard(mode="report", every_n_steps=1)
    averaging = callbacks.EMAWeightAveraging()
    options: dict[str, Any] = {"limit_val_batches": 0, "logger": False}
    tiny_trainer(tmp_path / "lightning", callbacks=[guard, averaging], **options).fit(
        BoringModel(), datamodule=BoringDataModule()
    )
    assert user_syncs(guard) == {}
    [finding] = framework_syncs(guard).values()
    assert finding.data["causes"] == ["weight_averaging"] and "update_every_n_steps" in finding.fix


@pytest.mark.ddp
def test_ddp_framework_syncs_name_sigterm_and_sync_dist(tmp_path: Path) -> None:
    trainer = tiny_trainer(
        tmp_path,
        devices=2,
        strategy="ddp_spawn",
        callbacks=[SyncGuard(mode="report", every_n_steps=1), BoostReport(console=False, files=True)],
        limit_train_batches=3,
        limit_val_batches=0,
        logger=False,
    )
    trainer.fit(SyncDist(), datamodule=BoringDataModule())
    report = json.loads((tmp_path / "boost_report.json").read_text())  # written by rank zero
    found = {f["data"]["causes"][0]: f for f in report["findings"] if f["source"] == "SyncGuard"}
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    broadcasts = hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")  # Lightning >= 2.5.2
    assert set(found) == {"sync_dist"} | ({"sigterm"} if broadcasts else set())
    if broadcasts:
        # the flag is broadcast before each batch's hooks: the check of step k sees step k + 1's,
        # and nothing follows the last step
        assert found["sigterm"]["data"]["syncs"] == {"h2d": 2, "collective": 2, "item": 2}
        assert found["sigterm"]["location"] is None and "no setting" in found["sigterm"]["fix"]
    assert found["sync_dist"]["location"] == marked_line("sync_dist")
    assert "on_epoch=True" in found["sync_dist"]["fix"]


class ItemOnRankOne(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        if self.global_rank == 1 and batch_idx >= 1:
            self.value = loss.item()
        return loss


@pytest.mark.ddp
def test_ddp_error_mode_stops_every_rank_when_one_syncs(tmp_path: Path) -> None:
    trainer = tiny_trainer(
        tmp_path,
        devices=2,
        strategy="ddp_spawn",
        callbacks=[SyncGuard(mode="error")],
        limit_val_batches=0,
    )
    with pytest.raises(Exception, match="SyncGuard"):  # re-raised from the spawned ranks
        trainer.fit(ItemOnRankOne(), datamodule=BoringDataModule())


class MakesAGrid(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        from torchvision.utils import make_grid

        self.grid = make_grid(batch[0].reshape(-1, 1, 4, 8), normalize=True)  # syncs: library


def test_a_library_sync_of_no_known_cause_gets_a_fix_about_the_library(tmp_path: Path) -> None:
    (finding,) = user_syncs(fit(MakesAGrid(), tmp_path)).values()
    assert finding.location == marked_line("library")
    assert finding.data["libraries"][0].startswith("torchvision.") and "Inside torchvision" in finding.detail
    assert "inside torchvision" in finding.fix and "Keep it a tensor" not in finding.fix


class Detector(L.LightningModule):
    """torchvision's Faster R-CNN (a one-layer backbone, 64 px) on its detection batches, as
    torchvision's references train it; `item` also reads a loss on the host, the user's own sync."""

    def __init__(self, item: bool) -> None:
        super().__init__()
        from torchvision.models.detection import FasterRCNN
        from torchvision.models.detection.anchor_utils import AnchorGenerator
        from torchvision.ops import MultiScaleRoIAlign

        backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4, padding=1), torch.nn.ReLU())
        backbone.out_channels = 8
        anchors = AnchorGenerator(((16, 32),), ((0.5, 1.0, 2.0),))
        self.model = FasterRCNN(
            backbone, 3, min_size=64, max_size=64, rpn_anchor_generator=anchors,
            box_roi_pool=MultiScaleRoIAlign(["0"], 7, 2), representation_size=32,
        )  # fmt: skip
        self.item = item

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, targets = batch
        losses = self.model(images, targets)  # syncs: detection
        if self.item:
            self.value = losses["loss_objectness"].item()  # syncs: detection_item
        return sum(losses.values())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        box = {"boxes": torch.tensor([[4.0, 4.0, 30.0, 30.0]]), "labels": torch.tensor([1])}
        items = [(torch.rand(3, 64, 64), box) for _ in range(6)]
        return torch.utils.data.DataLoader(
            items, batch_size=2, collate_fn=lambda b: tuple(zip(*b, strict=True))
        )


@pytest.mark.parametrize("item", [False, True])
def test_a_detection_models_own_syncs_are_told_as_the_models_not_as_the_users_to_fix(
    tmp_path: Path, item: bool
) -> None:
    """A detection model syncs by design (box counts known once computed; NMS): the guard says so
    once, called from the user's line, with nothing to change there (it told the user to "look for a
    torchvision setting ... or make this call less often"); the user's own `.item()` stays a warning."""
    guard = SyncGuard(mode="report", every_n_steps=1)
    tiny_trainer(tmp_path, callbacks=[guard], limit_train_batches=3, logger=False).fit(Detector(item))
    (model,) = framework_syncs(guard).values()
    assert model.data["causes"] == ["detection_model"] and model.severity is Severity.INFO
    assert marked_line("detection") in model.detail and "Nothing" in model.fix
    own = user_syncs(guard)
    assert list(own) == ([marked_line("detection_item")] if item else [])


class Encoder(L.LightningModule):
    """A `nn.TransformerEncoder` over padded token rows with their padding mask, as a text
    classifier runs one; `nested` is its `enable_nested_tensor` (torch's default: True)."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        self.embed = torch.nn.Embedding(20, 8, padding_idx=0)
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=nested)

    def _loss(self, tokens: Tensor) -> Tensor:
        hidden = self.encoder(self.embed(tokens), src_key_padding_mask=tokens == 0)  # syncs: encoder
        return hidden.square().mean()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        return self.val_dataloader()

    def val_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        rows = [torch.randint(1, 20, (6,)) for _ in range(12)]
        return torch.utils.data.DataLoader(pad_sequence([r[: n % 5 + 2] for n, r in enumerate(rows)], True))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # torch, unchecked
@pytest.mark.parametrize("nested", [True, False])
def test_a_transformer_encoders_nested_tensor_path_is_found_in_evaluation(
    tmp_path: Path, nested: bool
) -> None:
    """In evaluation `nn.TransformerEncoder` packs a padded batch as nested tensors, which reads the
    mask from the GPU every forward; the guard's checks run its regular path, so a text model's
    validation was reported free of syncs. The mask's left-alignment check, which runs first, is
    found at the user's line with the setting that removes it."""
    guard = SyncGuard(mode="report", every_n_steps=1)
    trainer = tiny_trainer(
        tmp_path, callbacks=[guard], limit_train_batches=2, limit_val_batches=2, logger=False
    )
    trainer.fit(Encoder(nested))
    found = user_syncs(guard)
    if not nested:
        assert found == {}
        return
    (finding,) = found.values()
    assert finding.location == marked_line("encoder") and finding.data["causes"] == ["nested_tensor"]
    assert "validation" in finding.title and "enable_nested_tensor=False" in finding.fix


class HostToDevice(BoringModel):
    """The three host-to-device copies a GPU run blocks on, each on its marked line."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, _ = batch
        loss = self._loss(batch)
        self.log("lr", 0.05)  # syncs: h2d_log
        ones = torch.ones(inputs.shape[0], 1).type_as(inputs)  # syncs: h2d_type_as
        weights = torch.tensor([1.0, 2.0]).to(inputs.device)  # syncs: h2d_to
        on_device = torch.ones(2, device=inputs.device)  # made there: no copy
        return loss + 0 * (ones.sum() + weights.sum() + on_device.sum())


def test_host_to_device_copies_are_reported_with_their_direction_and_fix(tmp_path: Path) -> None:
    found = user_syncs(fit(HostToDevice(), tmp_path))
    assert set(found) == {marked_line("h2d_log"), marked_line("h2d_type_as"), marked_line("h2d_to")}
    assert all(f.data["syncs"] == {"h2d": 3} for f in found.values())
    assert all("host memory to the GPU" in f.detail for f in found.values())
    assert found[marked_line("h2d_log")].data["causes"] == ["log_number"]
    assert "Log the tensor itself" in found[marked_line("h2d_log")].fix
    for tag in ("h2d_type_as", "h2d_to"):
        fix = found[marked_line(tag)].fix
        assert "device=x.device" in fix and "Keep it a tensor" not in fix


class TwoAdams(BoringModel):
    """Manual optimization with two Adam optimizers, as Lightning's GAN example; a class-weight
    tensor made in ``__init__`` (not a buffer: a GPU run leaves it on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = torch.nn.Linear(32, 2)
        self.class_weights = torch.tensor([1.0, 3.0])

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()  # type: ignore[misc]
        for optimizer, layer in ((first, self.layer), (second, self.other)):
            loss = F.mse_loss(layer(batch[0]), batch[1])
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            self.log("loss", loss)
        self.heavier = self.class_weights.max().item()  # on the host in a GPU run: no sync

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.layer.parameters()), torch.optim.Adam(self.other.parameters())


def test_host_side_tensors_are_not_reported_adam_step_counters_included(tmp_path: Path) -> None:
    # The false finding on Lightning's GAN example: "`opt_g.step()` syncs 16x per training step"
    # (Adam reads its step counters, which stay on the host unless capturable or fused).
    guard = fit(TwoAdams(), tmp_path, limit_train_batches=4, guard=SyncGuard(mode="report", every_n_steps=2))
    assert user_syncs(guard) == {}


class PLProgBar(pl.LightningModule):
    """Written against the standalone namespace (``import pytorch_lightning as pl``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = F.mse_loss(self.layer(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        self.value = loss.item()  # syncs: pl_item
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.skipif(not pytorch_lightning_takes_our_callbacks(), reason="pytorch-lightning < 2.6.0")
def test_pytorch_lightning_namespace_is_told_apart_from_the_users_code(tmp_path: Path) -> None:
    guard = SyncGuard(mode="report", every_n_steps=1)
    trainer = tiny_trainer(tmp_path, trainer_class=pl.Trainer, logger=False, callbacks=[guard])
    trainer.fit(PLProgBar(), train_dataloaders=BoringDataModule().train_dataloader())
    assert set(user_syncs(guard)) == {marked_line("pl_item")}
    assert set(framework_syncs(guard)) == {"prog_bar_values"}  # not "lightning_fabric syncs in to_item"
    assert "Keep it a tensor" not in framework_syncs(guard)["prog_bar_values"].fix


# -- CUDA --------------------------------------------------------------------------------------


class CudaSyncs(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        self.value = loss.item()  # syncs: cuda_item
        self.host_value = torch.ones(1).item()  # a CPU tensor on a GPU run: no sync
        host = torch.empty(1)
        host.copy_(loss.detach().reshape(1))  # syncs: cuda_copy


@pytest.mark.gpu
def test_cuda_syncs_include_what_only_the_debug_mode_sees(tmp_path: Path) -> None:
    guard = fit(CudaSyncs(), tmp_path, accelerator="gpu")
    found = user_syncs(guard)
    assert set(found) == {marked_line("cuda_item"), marked_line("cuda_copy")}
    assert found[marked_line("cuda_item")].data["syncs"] == {"item": 3}
    assert found[marked_line("cuda_copy")].data["syncs"] == {"cuda": 3}
    assert "on a GPU" not in found[marked_line("cuda_item")].detail
    assert torch.cuda.get_sync_debug_mode() == 0


ALLOCATOR_PATTERNS = {"alloc_retry", "sync_all_streams"}


def allocator_findings(guard: SyncGuard) -> dict[str, Finding]:
    return {f.data["pattern"]: f for f in guard.findings if f.data.get("pattern") in ALLOCATOR_PATTERNS}


class CleanResNet(BoringModel):
    """torchvision's ResNet-18 on random 32x32 images: a step with nothing in it that syncs."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(num_classes=2)

    def _loss(self, batch: Any) -> Tensor:
        inputs, targets = batch
        images = inputs.reshape(-1, 2, 4, 4).repeat(1, 2, 8, 8)[:, :3]  # (N, 3, 32, 32)
        return F.cross_entropy(self.net(images), targets.argmax(dim=1))


@pytest.mark.gpu
def test_cuda_clean_bf16_resnet_has_no_findings_in_user_code(tmp_path: Path) -> None:
    guard = fit(CleanResNet(), tmp_path, accelerator="gpu", precision="bf16-mixed", limit_train_batches=6)
    assert user_syncs(guard) == {}
    assert allocator_findings(guard) == {}  # the H100's false WARN: counters read outside the watch
    assert torch.cuda.get_sync_debug_mode() == 0


class EmptiesTheCache(OneSync):
    def sync(self, loss: Tensor, batch: Any) -> None:
        torch.cuda.empty_cache()  # syncs: cuda_empty_cache


@pytest.mark.gpu
def test_cuda_empty_cache_in_the_step_is_reported_once_at_its_line(tmp_path: Path) -> None:
    guard = fit(EmptiesTheCache(), tmp_path, accelerator="gpu")
    found = user_syncs(guard)
    assert set(found) == {marked_line("cuda_empty_cache")}
    assert found[marked_line("cuda_empty_cache")].data["syncs"] == {"empty_cache": 3}
    assert allocator_findings(guard) == {}  # its stream sync is that finding, not another one


class RetriesAllocations(OneSync):
    """Caps the allocator 600 MiB above what it holds, frees a 400 MiB block to the cache, then
    asks for 500 MiB: the cached block cannot serve it and a new one would pass the cap, so the
    allocator syncs every stream, frees its cache and retries `cudaMalloc` (a real retry)."""

    def sync(self, loss: Tensor, batch: Any) -> None:
        mib = 2**20
        total = torch.cuda.get_device_properties(loss.device).total_memory
        cap = torch.cuda.memory_reserved(loss.device) + 600 * mib
        torch.cuda.set_per_process_memory_fraction(cap / total, loss.device)
        try:
            block = torch.empty(400 * mib, dtype=torch.uint8, device=loss.device)
            del block
            bigger = torch.empty(500 * mib, dtype=torch.uint8, device=loss.device)
            del bigger
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, loss.device)


@pytest.mark.gpu
def test_cuda_allocation_retries_in_the_step_are_reported_from_the_counters(tmp_path: Path) -> None:
    guard = fit(RetriesAllocations(), tmp_path, accelerator="gpu")
    assert user_syncs(guard) == {}  # no sync at the Python API: only the allocator's counters know
    found = allocator_findings(guard)
    assert set(found) == {"alloc_retry"}  # the retry's own sync of every stream is that finding
    # the first step's retry leaves a 500 MiB block cached, which serves the later steps (H100, 2026-11-24)
    assert (found["alloc_retry"].data["count"], found["alloc_retry"].data["checked_steps"]) == (1, 3)
    assert found["alloc_retry"].severity is Severity.WARN and found["alloc_retry"].fix


class _Running:
    """Stands in for the watch's TorchFunctionMode (its CUDA debug mode needs a GPU)."""

    def __exit__(self, *args: object) -> None:
        return None


def test_allocator_counters_count_only_while_the_watch_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: the CUDA allocator's counters (no GPU here), already moved before the watch by
    # work outside any step (e.g. AutoBatchSize's `empty_cache` between trials): the H100's false
    # WARN "The caching allocator synchronized every stream" on a clean bf16 ResNet-18 came from
    # reading them at the end of fit with no watch running, i.e. since the process started.
    from lightning_boost.guards import sync_watch

    counters = {"num_alloc_retries": 0, "num_sync_all_streams": 7}
    monkeypatch.setattr(sync_watch, "_allocator_counters", lambda: dict(counters))
    watch = sync_watch.SyncWatch(lambda pattern, frame: None, cuda=True)
    assert watch.stop() == {}  # never started: nothing was the user's
    watch._counters = sync_watch._allocator_counters()  # what `start` reads on CUDA
    watch._mode = _Running()  # type: ignore[assignment]
    counters["num_sync_all_streams"] += 2  # two stream syncs inside the watched step
    assert watch.stop() == {"sync_all_streams": 2}
    assert watch.stop() == {}  # stopped: counts nothing more


def test_a_reported_call_is_not_counted_again_as_the_allocators(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated counters, as above: `empty_cache` syncs every stream (the counter moves), and the
    # watch has already reported the call at the user's line; only the retry outside it counts.
    from lightning_boost.guards import sync_watch

    counters = {"num_alloc_retries": 0, "num_sync_all_streams": 0}
    monkeypatch.setattr(sync_watch, "_allocator_counters", lambda: dict(counters))
    seen: list[str] = []
    watch = sync_watch.SyncWatch(lambda pattern, frame: seen.append(pattern), cuda=True)
    watch._counters = sync_watch._allocator_counters()
    watch._mode = _Running()  # type: ignore[assignment]

    def empty_cache() -> None:
        counters["num_sync_all_streams"] += 1

    watch.report("empty_cache", None, empty_cache, (), {})
    counters["num_alloc_retries"] += 1  # an allocation retry in the step, outside any reported call
    assert seen == ["empty_cache"]
    assert watch.stop() == {"alloc_retry": 1}


def test_a_retrys_own_stream_sync_is_the_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated counters, as above: each retry first syncs every stream (the H100's test of a real
    # retry got both WARNs for it); only the syncs beyond the retries are another finding.
    from lightning_boost.guards import sync_watch

    counters = {"num_alloc_retries": 0, "num_sync_all_streams": 0}
    monkeypatch.setattr(sync_watch, "_allocator_counters", lambda: dict(counters))
    watch = sync_watch.SyncWatch(lambda pattern, frame: None, cuda=True)
    for retries, syncs, moved in [
        (2, 2, {"alloc_retry": 2}),
        (2, 3, {"alloc_retry": 2, "sync_all_streams": 1}),
    ]:
        watch._counters = sync_watch._allocator_counters()
        watch._mode = _Running()  # type: ignore[assignment]
        counters["num_alloc_retries"] += retries
        counters["num_sync_all_streams"] += syncs
        assert watch.stop() == moved


class _Counted:
    """Stands in for a CUDA run's watch: the allocator's stream syncs one checked step saw."""

    def __init__(self, syncs: int) -> None:
        self.syncs = syncs

    def stop(self) -> dict[str, int]:
        return {"sync_all_streams": self.syncs}


@pytest.mark.parametrize("benchmark", [True, False])
def test_cudnn_autotuning_a_new_shape_is_told_apart_from_the_allocators_syncs(
    monkeypatch: pytest.MonkeyPatch, benchmark: bool
) -> None:
    # Simulated counters (no GPU here): on the H100 the demo's warm run, whose first steps cuDNN
    # autotuned under `cudnn.benchmark`, got "The caching allocator synchronized every stream"
    # (32 over 10 checked steps, at 272 MiB of 80 GiB). A stream sync in a step with a shape seen
    # before is still the allocator's WARN.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", benchmark)
    guard = SyncGuard()
    for new_shape, syncs in [(True, 30), (False, 0), (False, 2)]:
        guard._watch = _Counted(syncs)  # type: ignore[assignment]
        guard._stop_watch(new_shape)
    findings = {f.data["pattern"]: f for f in guard._make_findings()}
    if benchmark:
        assert {p: f.data["count"] for p, f in findings.items()} == {
            "cudnn_autotune": 30,
            "sync_all_streams": 2,
        }
        assert (
            findings["cudnn_autotune"].severity is Severity.INFO
            and "pad or bucket" in findings["cudnn_autotune"].fix
        )
    else:
        assert {p: f.data["count"] for p, f in findings.items()} == {"sync_all_streams": 32}
    assert findings["sync_all_streams"].severity is Severity.WARN


def test_a_checked_step_knows_whether_its_input_shape_is_new(tmp_path: Path) -> None:
    seen: list[bool] = []

    class Recording(SyncGuard):
        def _stop_watch(self, new_shape: bool = True) -> None:
            seen.append(new_shape)
            super()._stop_watch(new_shape)

    data = BoringDataModule(length=40)  # batches of 8, 8, 8, 8, 8 (then validation's)
    trainer = tiny_trainer(tmp_path, callbacks=[Recording(every_n_steps=1)], limit_train_batches=5)
    trainer.fit(BoringModel(), datamodule=data)
    assert seen[:5] == [True, False, False, False, False]


class LoggedItem(BoringModel):
    """Logs `loss.item()`: under torch.compile a graph break, run eagerly, where the guard sees it."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss.item())
        return loss


#: Without the pack, a compiled module's `self.log` fails under torch 2.5.1 with Lightning 2.4.0
#: (dynamo: "'_ResultMetric' object has no attribute '_defaults'"); it trains under torch 2.14.1
#: with Lightning 2.6.6. The sets between are not checked.
@pytest.mark.skipif(OLD_TORCH_OR_LIGHTNING, reason="a compiled module's self.log fails without the pack here")
@pytest.mark.parametrize(("model", "found"), [(BoringModel, 0), (LoggedItem, 1)])
@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf"
)  # dynamo's own, plain too
def test_a_compiled_module_trains_and_its_eager_syncs_are_found(
    tmp_path: Path, model: type[BoringModel], found: int
) -> None:
    # backend="eager": dynamo's tracing under the guard's mode is what broke, not code generation
    compiled = torch.compile(model(), backend="eager")
    guard = SyncGuard(mode="report", every_n_steps=1)
    tuner = AutoBatchSize(max_batch_size=16)
    trainer = tiny_trainer(tmp_path, callbacks=[guard, tuner])
    trainer.fit(compiled, datamodule=BoringDataModule())  # crashed: "the tensor must have a single element"
    assert trainer.state.finished and tuner.decision is not None and tuner.decision.trials
    user = [f for f in guard.findings if f.severity == Severity.WARN]
    assert len(user) == found
    assert all("loss.item()" in f.title for f in user)
    assert any("Compiled code" in f.title for f in guard.findings)  # says what it cannot see


class IntegerMath(BoringModel):
    """`int(torch.div(a, b, rounding_mode="floor"))` on Python ints (a popular model zoo's anchor
    count): a CPU scalar in a GPU run too, no device involved. It was reported as an `.item()`."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        stride = int(torch.div(batch[0].shape[1], 4, rounding_mode="floor"))
        return self._loss((batch[0][:, : stride * 4], batch[1])) if stride else self._loss(batch)


def test_math_on_python_numbers_is_not_a_sync(tmp_path: Path) -> None:
    guard = fit(IntegerMath(), tmp_path, limit_train_batches=4, limit_val_batches=0)
    assert [f for f in guard.findings if f.severity == Severity.WARN] == []


class ReadsInALoop(BoringModel):
    """Reads each element of a tensor with `.item()` in a Python loop (916x and 4,130x per step in
    the issue's speech model): the fix is one read before the loop, not "keep it a tensor"."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        lengths = batch[0][:, 0].abs()
        self.total = sum(lengths[i].item() for i in range(lengths.shape[0]))  # syncs: looped
        return loss


def test_a_read_in_a_loop_gets_one_read_before_the_loop_as_its_fix(tmp_path: Path) -> None:
    (finding,) = user_syncs(fit(ReadsInALoop(), tmp_path)).values()
    assert finding.location == marked_line("looped")
    assert "x per training step, as in a loop" in finding.fix and "tolist()" in finding.fix
    (once,) = user_syncs(fit(Item(), tmp_path / "once")).values()  # one read a step: the usual fix
    assert "as in a loop" not in once.fix
