"""A model with sparse gradients (``nn.EmbeddingBag(sparse=True)``, the recommender and fastText
shape) under `AutoBatchSize`, in real CPU fits: its trials count a sparse gradient's memory and
read its noise in sparse form, as the run's growth meter does.

The trials' throughput is scripted (`fixed_cost_steps`); gradients and memory are the real step's.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from typing_extensions import override

from lightning_boost import AutoBatchSize, BoostedDataModule
from lightning_boost.batch_size import regrow
from lightning_boost.batch_size.regrow import MIN_PAIRS, NoiseMeter
from tests.test_goodput import quiet_trainer

pytestmark = pytest.mark.usefixtures("long_planned_run", "fixed_cost_steps")


def tokens(samples: int, seed: int) -> TensorDataset:
    ids = torch.randint(0, 2000, (samples, 12), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(ids, (ids % 5 == 0).sum(1).clamp(max=3))


class Tokens(BoostedDataModule):
    @override
    def setup(self, stage: str) -> None:
        self.train_dataset, self.val_dataset = tokens(8192, 0), tokens(1024, 1)


class Bag(L.LightningModule):
    """Mean of looked-up rows, then a linear head; SGD takes the sparse gradient as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(2000, 32, sparse=True)
        self.head = nn.Linear(32, 4)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self.head(self.embedding(batch[0])), batch[1])

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self.head(self.embedding(batch[0])), batch[1]))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_a_sparse_gradient_is_measured_and_the_fit_trains_at_the_tuned_size(tmp_path: Path) -> None:
    """The memory estimate read each gradient's storage, which a sparse tensor has none of
    ("Cannot access storage of SparseTensorImpl"): the first trial failed and the fit stopped
    before its first step. Now its indices and values count, and its noise reads."""
    tuner = AutoBatchSize(min_efficiency=0.5)
    trainer = quiet_trainer(tmp_path, [tuner], max_epochs=1)
    trainer.fit(Bag(), datamodule=Tokens(batch_size=32))
    decision = tuner.decision
    assert decision is not None and decision.batch_size > 32 and decision.noise_scale is not None
    assert all(trial.peak_bytes > 0 for trial in decision.trials if not trial.oom)
    assert trainer.train_dataloader.batch_size == decision.batch_size
    assert torch.isfinite(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize("held", [regrow.MAX_HELD, 1000])  # every element, or every 33rd of 33,000
def test_the_growth_meter_reads_a_sparse_gradient_as_its_dense_twin(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The meter flattened each gradient with ``.reshape(-1)``, which a sparse one does not have:
    a growing run failed at its first read pair. The same elements are now read in sparse form."""
    monkeypatch.setattr(regrow, "MAX_HELD", held)
    model = Bag()
    meters = {"sparse": NoiseMeter(batch=32, every=2), "dense": NoiseMeter(batch=32, every=2)}
    data = tokens(32 * 2 * MIN_PAIRS, 2)
    for step in range(2 * MIN_PAIRS):
        model.zero_grad()
        batch = data[step * 32 : (step + 1) * 32]
        nn.functional.cross_entropy(model.head(model.embedding(batch[0])), batch[1]).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads[0].layout == torch.sparse_coo
        meters["sparse"].observe(step, grads)
        meters["dense"].observe(step, [g.to_dense() for g in grads])
    sparse, dense = meters["sparse"].estimate(), meters["dense"].estimate()
    assert sparse is not None and dense is not None
    assert sparse.value == pytest.approx(dense.value, rel=1e-4)
