"""Whole batches from tensors in memory: one gather per batch instead of one ``__getitem__`` a sample.

A ``DataLoader`` over a `TensorDataset` fetches each sample on its own (a tuple of rows) and
``default_collate`` stacks them again: 454 µs a batch of 64 on this project's 2-CPU host, against
84 µs for one ``index_select`` per tensor (``python -m benchmarks whole_batches``). Torch
hands a dataset that has ``__getitems__`` the batch's indices at once; `WholeBatches` gives a
`TensorDataset` (or a `Subset` of one, as ``random_split`` makes) that method, and `collate_whole`
passes its rows on as ``default_collate`` would have built them: the same list of tensors, equal
element for element, from the same indices, so the sampler, the run's random draws and every
batch stay what they were.

Plain functions over `torch.utils.data`; no Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate, get_worker_info

from lightning_boost.report import Finding, Severity


class Rows(tuple[Tensor, ...]):
    """A batch's rows of each tensor, as `WholeBatches.__getitems__` gathers them."""

    __slots__ = ()


class WholeBatches(Dataset[tuple[Tensor, ...]]):
    """`dataset` (a `TensorDataset`, or `Subset`\\ s of one) with batched ``__getitems__``.

    Indexing one sample, its length and its attributes are `dataset`'s (``.tensors`` and
    ``.indices`` read through); `dataset` itself is ``.dataset``, as a `Subset`'s is.
    """

    def __init__(self, dataset: Dataset[Any], tensors: tuple[Tensor, ...], rows: Tensor | None) -> None:
        self.dataset = dataset
        self.tensors = tensors
        self.rows = rows  # a Subset's rows of the tensors, composed through every Subset; None: all

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Rows:
        index = torch.as_tensor(indices, dtype=torch.long)
        if self.rows is not None:
            index = self.rows[index]
        index = torch.where(index < 0, index + len(self.tensors[0]), index)  # as `tensor[-1]` reads
        return Rows(_gather(tensor, index) for tensor in self.tensors)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "tensors", "rows"):  # while unpickling
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _gather(tensor: Tensor, index: Tensor) -> Tensor:
    """`tensor`'s rows at `index`; in a loader's worker, into shared memory, as ``default_collate``
    stacks there (the batch then crosses to the main process without another copy)."""
    if get_worker_info() is None or tensor.device.type != "cpu":
        return tensor.index_select(0, index.to(tensor.device))
    shape = (len(index), *tensor.shape[1:])
    storage = tensor._typed_storage()._new_shared(math.prod(shape), device=tensor.device)
    out = tensor.new(storage).resize_(shape)
    return torch.index_select(tensor, 0, index, out=out)


def collate_whole(batch: Any) -> Any:
    """``default_collate``, which gets `WholeBatches`' gathered rows as the list of tensors it
    would have stacked from their samples.

    Example:
        >>> tensors = TensorDataset(torch.arange(6).view(3, 2), torch.tensor([0, 1, 0]))
        >>> whole, collate = whole_batches(tensors, None)
        >>> gathered = collate(whole.__getitems__([2, 0]))
        >>> stacked = default_collate([tensors[2], tensors[0]])
        >>> [torch.equal(a, b) for a, b in zip(gathered, stacked)]
        [True, True]
    """
    if isinstance(batch, Rows):
        return list(batch)
    return default_collate(batch)


def whole_batches(
    dataset: Dataset[Any], collate_fn: Callable[[Any], Any] | None
) -> tuple[Dataset[Any], Callable[[Any], Any] | None]:
    """`dataset` and `collate_fn` for a loader that gathers whole batches where that changes
    nothing but speed: a `TensorDataset` or `Subset`\\ s of one, collated by ``default_collate``.
    Any other dataset or collate function (a subclass may index its own way) comes back as it is.

    Example:
        >>> tensors = TensorDataset(torch.zeros(4, 2))
        >>> type(whole_batches(tensors, None)[0]).__name__
        'WholeBatches'
        >>> whole_batches(tensors, lambda samples: samples)[0] is tensors
        True
    """
    if collate_fn not in (None, default_collate, collate_whole):
        return dataset, collate_fn
    if isinstance(dataset, WholeBatches):
        return dataset, collate_whole
    rows: Tensor | None = None
    source = dataset
    while type(source) is Subset:
        index = torch.as_tensor(source.indices, dtype=torch.long)
        rows = index if rows is None else index[rows]
        source = source.dataset
    if type(source) is not TensorDataset or not source.tensors:
        return dataset, collate_fn
    return WholeBatches(dataset, source.tensors, rows), collate_whole


def whole_batches_finding(source: str) -> Finding:
    """What the report says where `source` loads a `TensorDataset` through `WholeBatches`."""
    return Finding(
        source,
        "data",
        Severity.INFO,
        "TensorDataset loaded one gather a batch",
        "torch fetches each sample on its own and `default_collate` stacks them again; one"
        " `index_select` per tensor gathers the same batch, element for element, from the same"
        " sampler (5x-14x faster loading in `python -m benchmarks whole_batches`). A `collate_fn`"
        " of your own keeps per-sample loading",
    )
