"""AutoMicroBatch: a step that runs out of memory runs again as micro-batches, with the batch's result.

Out-of-memory is simulated on this CPU machine by raising the real exception type
(``torch.OutOfMemoryError``) when a step's batch is larger than a chosen size, inside real
Lightning fits; the `gpu`-marked test drives a real CUDA out-of-memory error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset, default_collate
from typing_extensions import override

from lightning_boost import AutoMicroBatch, boost_callbacks, micro_batches
from lightning_boost._lightning import pytorch_lightning_takes_our_callbacks
from lightning_boost.micro_batch.rounds import NoSampleFits, Shrink, growing_retries, run_rounds
from lightning_boost.micro_batch.split import (
    Logged,
    batch_length,
    bounds,
    combine_logged,
    combine_outputs,
    slice_batch,
)
from lightning_boost.testing import tiny_trainer

SIMULATED = "CUDA out of memory. Tried to allocate 2.00 GiB (simulated on CPU)"


# -- the pure parts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "length"),
    [
        (torch.zeros(5, 2), 5),
        ((torch.zeros(3), torch.zeros(3, 4)), 3),
        ({"ids": ["a", "b"], "x": torch.zeros(2, 7)}, 2),
        ([torch.tensor(1.0), torch.zeros(4)], 4),  # a 0-dim tensor says nothing of the length
        ("text", None),
    ],
)
def test_batch_length(batch: Any, length: int | None) -> None:
    assert batch_length(batch) == length


def test_slices_keep_structure_and_cut_only_per_sample_values() -> None:
    batch = {"x": torch.arange(6).reshape(6, 1), "names": list("abcdef"), "scale": torch.tensor(2.0), "k": 3}
    piece = slice_batch(batch, 1, 3, 6)
    assert piece["x"].flatten().tolist() == [1, 2]
    assert piece["names"] == ["b", "c"]
    assert piece["scale"].item() == 2.0 and piece["k"] == 3
    x, y = slice_batch((torch.arange(4), torch.arange(4) * 10), 2, 4, 4)
    assert (x.tolist(), y.tolist()) == ([2, 3], [20, 30])


@dataclasses.dataclass
class Samples:
    """A batch as a dataclass (Lightning's transfer to the device keeps its type)."""

    x: Tensor
    y: Tensor
    index: Tensor


@dataclasses.dataclass
class CountedSamples(Samples):
    """`count` is made by ``__post_init__``: a slice must be built through the constructor."""

    count: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.count = len(self.x)


def test_a_dataclass_batch_is_measured_sliced_and_combined_field_by_field() -> None:
    batch = CountedSamples(torch.arange(6.0).reshape(6, 1), torch.arange(6.0), torch.arange(6))
    assert batch_length(batch) == 6
    piece = slice_batch(batch, 2, 5, 6)
    assert isinstance(piece, CountedSamples) and piece.index.tolist() == [2, 3, 4] and piece.count == 3
    assert batch.count == 6 and batch.index.tolist() == list(range(6))  # the batch itself is kept
    halves = [slice_batch(batch, 0, 4, 6), slice_batch(batch, 4, 6, 6)]
    combined = combine_outputs(halves, [4, 2])
    assert isinstance(combined, CountedSamples) and combined.index.tolist() == list(range(6))
    assert combined.count == 6


def detection_batch(sizes: list[int]) -> tuple[tuple[Tensor, ...], tuple[dict[str, Tensor], ...]]:
    """torchvision's detection layout (`collate_fn=lambda b: tuple(zip(*b, strict=True))`): a tuple of images
    of their own sizes, (3, H, W) each, and a tuple of one target dict per image."""
    images = tuple(torch.full((3, size, size + 2), float(i)) for i, size in enumerate(sizes))
    targets = tuple(
        {"boxes": torch.full((i + 1, 4), float(i)), "labels": torch.ones(i + 1)} for i in range(len(sizes))
    )
    return images, targets


def test_a_detection_batch_is_cut_per_image_not_per_channel() -> None:
    """Its first tensor's first dimension is an image's 3 channels: taken for the batch's length,
    a micro-batch cut the channels of every image."""
    batch = detection_batch([8, 10, 12, 14])
    assert batch_length(batch) == 4
    images, targets = slice_batch(batch, 1, 3, 4)
    assert [tuple(image.shape) for image in images] == [(3, 10, 12), (3, 12, 14)]
    assert [target["boxes"].shape[0] for target in targets] == [2, 3] and isinstance(images, tuple)
    assert batch_length([{"x": torch.zeros(5)}, {"x": torch.zeros(5)}]) == 2  # `collate_fn=lambda b: b`
    predictions = [[{"boxes": torch.zeros(1, 4)}] * 3, [{"boxes": torch.ones(1, 4)}]]  # one dict an image
    assert len(combine_outputs(predictions, [3, 1])) == 4


def test_bounds_cover_every_sample_once() -> None:
    for length in range(1, 20):
        for size in range(1, 22):
            covered = [i for start, stop in bounds(0, length, size) for i in range(start, stop)]
            assert covered == list(range(length))


@pytest.mark.parametrize(
    ("reduce_fx", "expected"),
    [("mean", (1.0 * 3 + 5.0 * 1) / 4), ("sum", 6.0), ("max", 5.0), ("min", 1.0), (torch.mean, 2.0)],
)
def test_logged_values_combine_by_their_reduce_fx(reduce_fx: Any, expected: float) -> None:
    options = {"reduce_fx": reduce_fx}
    calls = [Logged("m", torch.tensor(1.0), options, 3), Logged("m", torch.tensor(5.0), options, 1)]
    (combined,) = combine_logged(calls)
    assert combined.value.item() == pytest.approx(expected) and combined.samples == 4


def test_outputs_combine_as_the_whole_batch_would() -> None:
    first = {"preds": torch.zeros(3, 2), "n": 3, "tag": "a"}
    outputs = [first, {"preds": torch.ones(1, 2), "n": 1, "tag": "b"}]
    combined = combine_outputs(outputs, [3, 1])
    assert combined["preds"].shape == (4, 2) and combined["n"] == 2.5 and combined["tag"] == "b"
    assert combine_outputs([None, None], [2, 2]) is None


def test_rounds_halve_until_the_pieces_fit_and_run_each_sample_once() -> None:
    ran: list[tuple[int, int]] = []

    def attempt(start: int, stop: int, final: bool) -> bool:
        if stop - start > 3:
            return False
        ran.append((start, stop))
        return True

    rounds = run_rounds(16, 16, attempt)
    assert rounds.size == 2 and [i for a, b in ran for i in range(a, b)] == list(range(16))
    assert [(s.before, s.after) for s in rounds.shrinks] == [(16, 8), (8, 4), (4, 2)]


def test_rounds_follow_another_ranks_failure_without_repeating_their_own_pieces() -> None:
    """This rank's pieces all fit; the other rank fails in round 1 and finishes in round 4: this rank
    halves with it, runs no piece twice, and waits for it (the same number of rounds on both)."""
    ran: list[tuple[int, int]] = []
    rounds_seen = []

    def agree(failed: bool, done: bool, stuck: bool) -> tuple[bool, bool, bool]:
        rounds_seen.append(done)
        return failed or len(rounds_seen) == 1, done and len(rounds_seen) >= 4, stuck

    rounds = run_rounds(8, 4, lambda a, b, final: ran.append((a, b)) is None, agree)
    assert ran == [(0, 4), (4, 6), (6, 8)] and rounds.size == 2
    assert rounds.shrinks == [Shrink(4, 2, None, None)] and len(rounds_seen) == 4


def test_rounds_stop_every_rank_when_one_sample_does_not_fit() -> None:
    with pytest.raises(NoSampleFits, match=r"tried micro-batches of 4, 2, 1"):
        run_rounds(4, 4, lambda a, b, final: False)
    with pytest.raises(NoSampleFits, match="on another rank"):
        run_rounds(4, 4, lambda a, b, final: True, lambda f, d, s: (False, d, True))


def test_allocator_retries_are_pressure_only_when_they_keep_growing() -> None:
    assert growing_retries([(0, 0), (25, 2), (50, 5), (75, 9)]) == [(0, 0), (25, 2), (50, 5), (75, 9)]
    assert growing_retries([(0, 0), (25, 2), (50, 2), (75, 9)]) is None
    assert growing_retries([(25, 2), (50, 5)]) is None


# -- real fits ---------------------------------------------------------------------------------------


class _OOMInBackward(torch.autograd.Function):
    """Identity whose backward runs out of memory: placed between the two layers, the second
    layer's gradients are already complete when it fails (a backward that failed part-way)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise torch.OutOfMemoryError(SIMULATED)


class OOMModel(L.LightningModule):
    """Two layers; a batch of more than `limit` samples runs out of memory in the forward or the
    backward (`where`), on every rank or only on `rank`."""

    def __init__(
        self,
        limit: int | None = None,
        where: str = "forward",
        rank: int | None = None,
        norm: bool = False,
        backward_limit: int | None = None,
    ) -> None:
        super().__init__()
        self.backward_limit = backward_limit
        torch.manual_seed(0)
        self.layer1 = nn.Linear(4, 16)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.layer2 = nn.Linear(16, 1)
        self.limit, self.where, self.rank = limit, where, rank
        self.seen: list[list[int]] = []
        self.val_seen: list[int] = []

    def _fails(self, samples: int, limit: int | None = None) -> bool:
        on_this_rank = self.rank is None or self.global_rank == self.rank
        limit = self.limit if limit is None else limit
        return limit is not None and samples > limit and on_this_rank

    def _loss(self, batch: Any, where: str) -> Tensor:
        x, y, _ = batch
        if self.where == where == "forward" and self._fails(len(x)):
            raise torch.OutOfMemoryError(SIMULATED)
        h = self.norm(torch.tanh(self.layer1(x)))
        in_backward = self.where == "backward" and self._fails(len(x))
        if where == "forward" and (in_backward or self._fails(len(x), self.backward_limit or 10**9)):
            h = _OOMInBackward.apply(h)
        return F.mse_loss(self.layer2(h).squeeze(-1), y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch, "forward")
        self.seen.append(batch[2].tolist())
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self._fails(len(batch[0])) and self.where == "eval":
            raise torch.OutOfMemoryError(SIMULATED)
        self.val_seen.extend(batch[2].tolist())
        self.log("val_loss", F.mse_loss(self.layer2(torch.tanh(self.layer1(batch[0]))).squeeze(-1), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self._fails(len(batch[0])) and self.where == "eval":
            raise torch.OutOfMemoryError(SIMULATED)
        return self.layer2(torch.tanh(self.layer1(batch[0])))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader(samples: int = 64, batch_size: int = 32) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 4, generator=generator)
    data = TensorDataset(x, x.sum(1) + 0.1 * torch.randn(samples, generator=generator), torch.arange(samples))
    return DataLoader(data, batch_size=batch_size)


def fit(tmp_path: Path, model: OOMModel, callbacks: list[L.Callback], **overrides: Any) -> L.Trainer:
    options: dict[str, Any] = {"limit_train_batches": None, "limit_val_batches": None, "max_epochs": 2}
    options.update(overrides)
    trainer = tiny_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=False, **options)
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(batch_size=16))
    return trainer


def weights(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_model(tuned: nn.Module, plain: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for (name, a), b in zip(weights(tuned).items(), weights(plain).values(), strict=True):
        assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{name} differs by {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}, {"plugins": "fp16"}],
    ids=["plain", "accumulate-and-clip", "fp16-grad-scaler"],
)
def test_a_step_that_runs_out_of_memory_trains_the_same_model(
    tmp_path: Path, where: str, overrides: dict[str, Any]
) -> None:
    """The weights after two epochs equal those of a run whose batches all fitted (gradient, optimizer
    step and learning rate as the batch's), with momentum, clipping and accumulation."""
    tolerance = {}
    if overrides.get("plugins") == "fp16":  # on CPU the Trainer flag gives bf16, Lightning's plugin fp16
        # a loss scale that never overflows: a whole batch's larger gradients overflow where a
        # micro-batch's need not, and the dynamic scaler then skips different steps
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        overrides = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler)]}
        tolerance = {"rtol": 1e-3, "atol": 1e-3}  # fp16 rounding of pieces against the whole
    plain = OOMModel()
    plain_trainer = fit(tmp_path / "plain", plain, [], **overrides)
    callback = AutoMicroBatch()
    model = OOMModel(limit=12, where=where)
    trainer = fit(tmp_path / "tuned", model, [callback], **overrides)
    assert_same_model(model, plain, **tolerance)
    assert callback.sizes["train"] == 8  # 32 -> 16 -> 8
    assert [(e["before"], e["after"], e["where"]) for e in callback.events] == [
        (32, 16, where),
        (16, 8, "forward"),  # the later steps ran at 16 first: that failed in the forward or backward
    ] or [(e["before"], e["after"]) for e in callback.events] == [(32, 16), (16, 8)]
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    expected = {k: float(v) for k, v in plain_trainer.callback_metrics.items()}
    assert logged.keys() == expected.keys()
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=tolerance.get("rtol", 1e-5)), key


class FineTuned(OOMModel):
    """`OOMModel` whose first layer is the backbone Lightning's `BackboneFinetuning` freezes before
    the fit and unfreezes at epoch 1 (its optimizer built over the parameters that train then)."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__(limit)
        self.backbone = self.layer1

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def test_a_backbone_unfrozen_during_the_fit_gets_every_pieces_gradient(tmp_path: Path) -> None:
    """The trainable parameters were read once, at the start of training: a backbone that
    `BackboneFinetuning` unfroze later lost the earlier pieces' gradients to Lightning's
    `zero_grad` and trained on the last piece's alone (its weights were 0.103 off after 3 epochs)."""
    plain = FineTuned()
    fit(tmp_path / "plain", plain, [BackboneFinetuning(unfreeze_backbone_at_epoch=1)], max_epochs=3)
    model = FineTuned(limit=12)
    callback = AutoMicroBatch()
    fit(tmp_path / "tuned", model, [callback, BackboneFinetuning(unfreeze_backbone_at_epoch=1)], max_epochs=3)
    assert callback.sizes["train"] == 8
    assert_same_model(model, plain)


def test_every_sample_is_run_once_and_in_order(tmp_path: Path) -> None:
    model = OOMModel(limit=12)
    fit(tmp_path, model, [AutoMicroBatch()], max_epochs=1)
    assert [i for piece in model.seen for i in piece] == list(range(64))
    assert {len(piece) for piece in model.seen} == {8}


def test_the_shrink_is_reported_and_logged(tmp_path: Path) -> None:
    trainer = fit(tmp_path, OOMModel(limit=12), [AutoMicroBatch()], max_epochs=1)
    (report,) = tmp_path.rglob("boost_report.json")
    findings = [f for f in json.loads(report.read_text())["findings"] if f["source"] == "AutoMicroBatch"]
    titles = [f["title"] for f in findings]
    assert "Training ran out of memory: batches of 32 now run as micro-batches of 8" in titles
    assert "How micro-batched steps combine their losses" in titles
    (combined,) = [f for f in findings if f["title"] == "How micro-batched steps combine their losses"]
    assert "in-batch negatives" in combined["detail"]  # a contrastive loss is neither a mean nor a sum
    (shrunk,) = [f for f in findings if f["title"].startswith("Training")]
    assert shrunk["severity"] == "warn" and "step 0: 32 → 16 (forward, this rank)" in shrunk["detail"]
    (metrics,) = Path(trainer.logger.log_dir).glob("metrics.csv")  # type: ignore[union-attr]
    assert "boost/micro_batch_size/train" in metrics.read_text().splitlines()[0]


def test_the_micro_batch_is_kept_in_the_checkpoint(tmp_path: Path) -> None:
    callback = AutoMicroBatch()
    fit(tmp_path, OOMModel(limit=12), [callback], max_epochs=1)
    resumed = AutoMicroBatch()
    resumed.load_state_dict(callback.state_dict())
    assert resumed.sizes["train"] == 8 and len(resumed.findings) == 1


def test_batch_norm_is_reported_as_what_changes(tmp_path: Path) -> None:
    callback = AutoMicroBatch()
    fit(tmp_path, OOMModel(limit=12, norm=True), [callback], max_epochs=1)
    (changes,) = [f for f in callback.findings if "BatchNorm1d" in f.title]
    assert changes.severity.label == "WARN" and "own mean and variance" in changes.detail


def test_an_error_that_is_not_out_of_memory_is_raised_as_it_is(tmp_path: Path) -> None:
    class Broken(OOMModel):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes do not match"):
        fit(tmp_path, Broken(), [AutoMicroBatch()])


class SamplesModel(OOMModel):
    """`OOMModel` whose loaders give `Samples` batches."""

    @override
    def training_step(self, batch: Samples, batch_idx: int) -> Tensor:  # type: ignore[override]
        return super().training_step((batch.x, batch.y, batch.index), batch_idx)

    @override
    def validation_step(self, batch: Samples, batch_idx: int) -> None:  # type: ignore[override]
        super().validation_step((batch.x, batch.y, batch.index), batch_idx)


def as_samples(items: list[tuple[Tensor, Tensor, Tensor]]) -> Samples:
    return Samples(*default_collate(items))


def test_a_step_on_a_dataclass_batch_that_runs_out_of_memory_trains_the_same_model(tmp_path: Path) -> None:
    def samples_fit(root: Path, model: OOMModel, callbacks: list[L.Callback]) -> None:
        train, val = loader(), loader(batch_size=16)
        trainer = tiny_trainer(root, callbacks=callbacks, enable_checkpointing=False, max_epochs=2,
                               limit_train_batches=None, limit_val_batches=None)  # fmt: skip
        trainer.fit(
            model,
            DataLoader(train.dataset, batch_size=32, collate_fn=as_samples),
            DataLoader(val.dataset, batch_size=16, collate_fn=as_samples),
        )

    plain, model, callback = SamplesModel(), SamplesModel(limit=12), AutoMicroBatch()
    samples_fit(tmp_path / "plain", plain, [])
    samples_fit(tmp_path / "tuned", model, [callback])
    assert_same_model(model, plain)
    assert callback.sizes["train"] == 8
    assert [i for piece in model.seen[-8:] for i in piece] == list(range(64))  # the last epoch's


def test_a_list_of_variable_length_sequences_beside_the_labels_is_cut_per_sample() -> None:
    """`collate_fn` returning the sequences as a list (for `pack_sequence`) and the labels stacked:
    the first sequence's length was taken for the batch's, its tokens cut and the labels kept whole."""
    sequences = [torch.arange(n) for n in (5, 3, 7, 2)]
    batch = (sequences, torch.tensor([0, 1, 0, 1]))
    assert batch_length(batch) == 4
    pieces, labels = slice_batch(batch, 1, 3, 4)
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [0, 1, 2, 3, 4, 5, 6]] and labels.tolist() == [1, 0]
    fields = (torch.zeros(6, 2), torch.zeros(6), torch.ones(3))  # a class-weight tensor rides along
    assert batch_length(fields) == 6
    x, y, weights = slice_batch(fields, 0, 2, 6)
    assert x.shape == (2, 2) and y.shape == (2,) and weights.shape == (3,)
    targets = (torch.zeros(2, 8), (torch.zeros(2), torch.zeros(2, 4)))  # (x, (class, box)) at batch 2
    assert batch_length(targets) == 2
    x, (classes, boxes) = slice_batch(targets, 1, 2, 2)
    assert x.shape == (1, 8) and classes.shape == (1,) and boxes.shape == (1, 4)


class Detector(L.LightningModule):
    """A box regressor on torchvision's detection batches; more than `limit` images run out of memory."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))
        self.limit = limit

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, targets = batch
        if self.limit is not None and len(images) > self.limit:
            raise torch.OutOfMemoryError(SIMULATED)
        boxes = torch.stack([self.net(image[None])[0] for image in images])
        loss = F.mse_loss(boxes, torch.stack([target["boxes"][0] for target in targets]))
        self.log("train_loss", loss, batch_size=len(images))
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def test_a_detection_step_that_runs_out_of_memory_trains_the_same_model(tmp_path: Path) -> None:
    samples = [detection_batch([8 + 2 * (i % 3)] * 1) for i in range(16)]
    data = [(images[0], targets[0]) for images, targets in samples]

    def detection_fit(root: Path, model: Detector, callbacks: list[L.Callback]) -> None:
        trainer = tiny_trainer(root, callbacks=callbacks, enable_checkpointing=False, max_epochs=2,
                               limit_train_batches=None, limit_val_batches=0)  # fmt: skip
        trainer.fit(model, DataLoader(data, batch_size=4, collate_fn=lambda b: tuple(zip(*b, strict=True))))

    plain, model, callback = Detector(), Detector(limit=2), AutoMicroBatch()
    detection_fit(tmp_path / "plain", plain, [])
    detection_fit(tmp_path / "tuned", model, [callback])
    assert_same_model(model, plain)
    assert callback.sizes["train"] == 2


def test_out_of_memory_on_a_batch_it_cannot_split_says_why_it_was_not_retried(tmp_path: Path) -> None:
    class Graph:  # a batch type of its own (a graph library's batch): no per-sample structure to cut
        def __init__(self, x: Tensor) -> None:
            self.x = x

    class OnGraphs(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        @override
        def training_step(self, batch: Graph, batch_idx: int) -> Tensor:  # type: ignore[override]
            raise torch.OutOfMemoryError(SIMULATED)

        @override
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    train = DataLoader(
        TensorDataset(torch.randn(64, 4)),
        batch_size=32,
        collate_fn=lambda items: Graph(torch.stack([i[0] for i in items])),
    )
    trainer = tiny_trainer(tmp_path, callbacks=[AutoMicroBatch()], enable_checkpointing=False, max_epochs=1)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        trainer.fit(OnGraphs(), train)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "AutoMicroBatch" in notes and "`Graph`" in notes and "dataclass" in notes


def test_a_sample_that_does_not_fit_says_so_with_every_size_tried(tmp_path: Path) -> None:
    with pytest.raises(NoSampleFits, match=r"tried micro-batches of 32, 16, 8, 4, 2, 1"):
        fit(tmp_path, OOMModel(limit=0), [AutoMicroBatch()])


def test_evaluation_steps_are_retried_with_their_own_size(tmp_path: Path) -> None:
    callback = AutoMicroBatch()
    plain = OOMModel()
    plain_trainer = fit(tmp_path / "plain", plain, [], max_epochs=1)
    model = OOMModel(limit=4, where="eval")
    trainer = fit(tmp_path / "tuned", model, [callback], max_epochs=1)
    assert callback.sizes == {"train": None, "validate": 4, "test": None, "predict": None}
    assert model.val_seen == plain.val_seen
    expected = float(plain_trainer.callback_metrics["val_loss"])
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(expected)
    predictions = trainer.predict(model, loader(batch_size=16))
    assert predictions is not None and [p.shape for p in predictions] == [(16, 1)] * 4  # type: ignore[union-attr]
    assert callback.sizes["predict"] == 4


def test_manual_optimization_is_left_alone_with_a_finding(tmp_path: Path) -> None:
    class Manual(OOMModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(self._loss(batch, "forward"))
            optimizer.step()  # type: ignore[union-attr]

    callback = AutoMicroBatch()
    fit(tmp_path, Manual(), [callback], max_epochs=1)
    (finding,) = callback.findings
    assert finding.title == "Training steps are not retried under manual optimization"


def test_it_is_in_the_recommended_set() -> None:
    assert any(isinstance(c, AutoMicroBatch) for c in boost_callbacks())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_reduction": "max"}, "`loss_reduction` expected one of"),
        ({"pressure_every_n_steps": 0}, "`pressure_every_n_steps` expected an int >= 1"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        AutoMicroBatch(**kwargs)


def test_a_backward_that_failed_part_way_adds_no_gradient_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulated backward fails after the second layer's gradients are complete: those are
    frozen while the pieces run again (else the model would differ from the plain run's)."""
    import lightning_boost.micro_batch.callback as module

    touched: list[int] = []
    changed = module._changed
    monkeypatch.setattr(module, "_changed", lambda *a: touched.append(len(out := changed(*a))) or out)
    plain = OOMModel()
    fit(tmp_path / "plain", plain, [], max_epochs=1, accumulate_grad_batches=2)
    model = OOMModel(limit=12, where="backward")
    fit(tmp_path / "tuned", model, [AutoMicroBatch()], max_epochs=1, accumulate_grad_batches=2)
    assert touched[0] == 2  # layer2's weight and bias
    assert_same_model(model, plain)


class RankModel(OOMModel):
    """Writes its weights, per rank, when training ends (the spawned ranks' models are not ours)."""

    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out

    def on_train_end(self) -> None:
        torch.save(weights(self), Path(self.out, f"rank{self.global_rank}.pt"))
        Path(self.out, f"seen{self.global_rank}.json").write_text(json.dumps(self.seen))


@pytest.mark.ddp
@pytest.mark.parametrize(
    ("oom", "options"),
    [
        ({"limit": 12, "rank": 1}, {}),
        ({"limit": 24, "backward_limit": 12, "rank": 1}, {}),
        ({"backward_limit": 12, "rank": 1}, {"retry_ddp_backward": True}),
    ],
    ids=["forward", "forward-then-backward", "backward-first"],
)
def test_under_ddp_an_oom_on_one_rank_shrinks_every_rank_in_the_same_step(
    tmp_path: Path, oom: dict[str, Any], options: dict[str, Any]
) -> None:
    """Rank 1 alone runs out of memory above 12 samples: in the forward; or above 24 in the forward
    and above 12 in the backward, which a split step runs within itself under DDP; or in the
    backward of the first, whole batch, with `retry_ddp_backward`. Both ranks switch to
    micro-batches in that step, neither hangs, and the model equals a 2-rank run whose batches all
    fitted."""
    runs = {}
    for name, kwargs in {"plain": {}, "tuned": oom}.items():
        out = tmp_path / name
        out.mkdir()
        callbacks: list[L.Callback] = [AutoMicroBatch(**options)] if kwargs else []
        trainer = tiny_trainer(
            out, devices=2, strategy="ddp_spawn", callbacks=callbacks, enable_checkpointing=False,
            limit_train_batches=None, limit_val_batches=None, max_epochs=1,
        )  # fmt: skip
        trainer.fit(RankModel(str(out), **kwargs), train_dataloaders=loader(128))
        runs[name] = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    for rank in (0, 1):
        for key, value in runs["plain"][rank].items():
            torch.testing.assert_close(runs["tuned"][rank][key], value, rtol=1e-5, atol=1e-6)
    seen = [json.loads((tmp_path / "tuned" / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    assert len(seen[1][-1]) == 8  # rank 1's last pieces
    if "backward_limit" not in oom:  # (a piece whose backward failed ran its forward twice)
        assert {len(piece) for piece in seen[1]} == {8}
        assert sorted(i for rank in seen for piece in rank for i in piece) == list(range(128))


def test_growing_allocator_retries_are_a_finding_and_can_shrink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's allocator statistics are simulated (no GPU here): retries grow at every check."""
    callback = AutoMicroBatch(shrink_on_pressure=True)
    trainer = fit(tmp_path, OOMModel(), [callback], max_epochs=1)
    retries = iter([0, 3, 7, 12])
    stats = lambda device: {"num_alloc_retries": next(retries), "allocated_bytes.all.peak": 3 * 2**30}  # noqa: E731
    monkeypatch.setattr(torch.cuda, "memory_stats", stats)
    callback.sizes["train"] = 32
    for step in (25, 50, 75, 100):
        callback._trainer = trainer
        callback._check_pressure(trainer, torch.device("cpu"), step, None)
    assert callback.sizes["train"] == 16
    assert callback.events[-1] | {"step": 0} == {
        "stage": "train", "step": 0, "before": 32, "after": 16, "where": "pressure", "rank": "every rank"
    }  # fmt: skip
    (pressure,) = [f for f in callback.findings if "close to running out" in f.title]
    assert "step 25: 0, step 50: 3, step 75: 7, step 100: 12" in pressure.detail
    assert "peak allocated 3.00 GiB" in pressure.detail and "was halved" in pressure.detail


class _OnCuda(L.Callback):
    """After `AutoMicroBatch` read the module's device at the start of training, has it read CUDA:
    this machine has no GPU."""

    def __init__(self, callback: AutoMicroBatch) -> None:
        self.callback = callback

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.callback._on_cuda = True


@pytest.mark.parametrize("cuda", [False, True])
def test_allocator_pressure_is_read_on_cuda_only_every_n_optimizer_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: bool
) -> None:
    callback = AutoMicroBatch(pressure_every_n_steps=2)
    checked: list[int] = []

    def check(trainer: L.Trainer, device: torch.device, step: int, current: Any) -> None:
        checked.append(step)
        callback._pressure.append((step, 0))  # what a real check records

    monkeypatch.setattr(callback, "_check_pressure", check)
    extra = [_OnCuda(callback)] if cuda else []
    fit(tmp_path, OOMModel(), [callback, *extra], max_epochs=4, accumulate_grad_batches=2)
    # 8 batches, an optimizer step every 2: global steps 0, 1, 1, 2, 2, 3, 3, 4 at the batches' ends
    assert checked == ([0, 2, 4] if cuda else [])


class CudaOOMModel(OOMModel):
    """Each step holds a buffer of `per_sample` bytes per sample on the GPU: a real CUDA
    out-of-memory error above some batch size."""

    def __init__(self, per_sample: int = 0) -> None:
        super().__init__()
        self.per_sample = per_sample

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        held = torch.empty(len(batch[0]) * self.per_sample, dtype=torch.uint8, device=self.device)
        loss = super().training_step(batch, batch_idx)
        del held
        return loss


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_error_is_retried(tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    total = torch.cuda.get_device_properties(0).total_memory
    options = {"accelerator": "gpu", "devices": 1}
    plain = CudaOOMModel()
    fit(tmp_path / "plain", plain, [], **options)
    callback = AutoMicroBatch()
    model = CudaOOMModel(per_sample=total // 24)  # 32 samples: 1.3x the GPU; 8 fit
    fit(tmp_path / "tuned", model, [callback], **options)
    assert callback.sizes["train"] is not None and callback.sizes["train"] < 32
    assert_same_model(model.cpu(), plain.cpu(), rtol=1e-4, atol=1e-5)


class ManualMicroBatches(OOMModel):
    """Manual optimization that opts into the retry with `micro_batches`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        loss = micro_batches(self, batch, lambda piece: self._loss(piece, "forward"))
        optimizer.step()  # type: ignore[union-attr]
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_manual_optimization_opts_in_with_micro_batches(tmp_path: Path, where: str) -> None:
    plain = ManualMicroBatches()
    plain_trainer = fit(tmp_path / "plain", plain, [])  # no AutoMicroBatch: the batch runs whole
    callback = AutoMicroBatch()
    model = ManualMicroBatches(limit=12, where=where)
    trainer = fit(tmp_path / "tuned", model, [callback])
    assert_same_model(model, plain)
    assert callback.sizes["train"] == 8
    assert not [f for f in callback.findings if "not retried" in f.title]
    expected = float(plain_trainer.callback_metrics["train_loss"])
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(expected, rel=1e-5)


def test_with_nothing_out_of_memory_the_run_is_untouched(tmp_path: Path) -> None:
    """Bit for bit the plain run's model and logged values, with accumulation, when no step fails."""
    plain, tuned = OOMModel(), OOMModel()
    plain_trainer = fit(tmp_path / "plain", plain, [], accumulate_grad_batches=2)
    trainer = fit(tmp_path / "tuned", tuned, [AutoMicroBatch()], accumulate_grad_batches=2)
    assert all(torch.equal(a, b) for a, b in zip(tuned.parameters(), plain.parameters(), strict=True))
    assert {k: float(v) for k, v in trainer.callback_metrics.items()} == {
        k: float(v) for k, v in plain_trainer.callback_metrics.items()
    }


@pytest.mark.skipif(not pytorch_lightning_takes_our_callbacks(), reason="pytorch-lightning < 2.6.0")
def test_micro_batches_in_a_pytorch_lightning_program(tmp_path: Path) -> None:
    import pytorch_lightning as pl

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.automatic_optimization = False

        def loss(self, piece: Any) -> Tensor:
            if len(piece[0]) > 12:
                raise torch.OutOfMemoryError(SIMULATED)
            return F.mse_loss(self.layer(piece[0]).squeeze(-1), piece[1])

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()  # type: ignore[union-attr]
            micro_batches(self, batch, self.loss)
            optimizer.step()  # type: ignore[union-attr]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = AutoMicroBatch()
    trainer = tiny_trainer(
        tmp_path, trainer_class=pl.Trainer, callbacks=[callback], enable_checkpointing=False,
        limit_train_batches=None,
    )  # fmt: skip
    trainer.fit(Manual(), train_dataloaders=loader())
    assert trainer.state.finished and callback.sizes["train"] == 8
