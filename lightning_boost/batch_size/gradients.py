"""Gradients as flat vectors for the noise scale's dot products, dense or sparse alike.

An ``nn.Embedding(sparse=True)`` (or ``EmbeddingBag``) gets a sparse COO gradient: the rows its
batch looked up, with no storage of its own to flatten. Its table may be too large to make dense
(the reason it is sparse), so its products are taken in sparse form, on the same elements a dense
gradient's would be.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def flat_sample(grad: Tensor, stride: int = 1) -> Tensor:
    """Every `stride`-th element of `grad` flattened, in fp32, detached: a dense vector, or for a
    sparse gradient a sparse one of the same length holding the same elements.

    Example:
        >>> dense = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 5.0]])
        >>> flat_sample(dense, 2).tolist()
        [0.0, 2.0, 0.0]
        >>> flat_sample(dense.to_sparse(1), 2).to_dense().tolist()  # rows sparse, as an embedding's
        [0.0, 2.0, 0.0]
    """
    grad = grad.detach()
    if grad.layout == torch.strided:
        return grad.reshape(-1)[::stride].float()
    grad = grad.to_sparse_coo().coalesce()  # COO (an embedding's); duplicate rows summed
    sparse_dims = grad.sparse_dim()
    row_sizes = torch.tensor((*grad.shape[:sparse_dims], 1), device=grad.device)
    strides = row_sizes.flip(0).cumprod(0).flip(0)[1:]  # row-major strides over the sparse dims
    rows = (grad.indices() * strides[:, None]).sum(0)
    per_row = math.prod(grad.shape[sparse_dims:])
    flat = (rows[:, None] * per_row + torch.arange(per_row, device=grad.device)).reshape(-1)
    values = grad.values().reshape(-1).float()
    kept = flat % stride == 0
    length = math.ceil(grad.numel() / stride)
    indices = (flat[kept] // stride)[None]  # sorted and unique: the rows came coalesced
    return torch.sparse_coo_tensor(
        indices, values[kept], (length,), check_invariants=False, is_coalesced=True
    )


def flat_dot(first: Tensor, second: Tensor) -> Tensor:
    """The dot product of two gradients of one shape (flattened), dense or sparse, in fp32.

    Example:
        >>> a = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
        >>> rows, elements = a.to_sparse(1), a.to_sparse()
        >>> float(flat_dot(a, a)), float(flat_dot(rows, a)), float(flat_dot(elements, elements))
        (5.0, 5.0, 5.0)
    """
    if first.layout == torch.strided and second.layout == torch.strided:
        return torch.dot(first.reshape(-1).float(), second.reshape(-1).float())
    sparse, other = (first, second) if first.layout != torch.strided else (second, first)
    return (sparse.float() * other.float()).sum()
