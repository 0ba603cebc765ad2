"""A batch's slices, and what the slices' steps return and log combined into the batch's (pure).

A batch is any nesting of tensors, mappings, sequences, dataclasses and per-sample lists (e.g. file
names, or torchvision's detection batch: a tuple of images and a tuple of target dicts): every
tensor whose first dimension is the batch's length, and every list or tuple of plain values (or of
one mapping or image per sample) of that length, is sliced; everything else (a scalar, a tensor of
another shape) is passed whole. A dataclass is rebuilt through its constructor from its ``init``
fields, so fields its ``__post_init__`` derives are derived from the slice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def batch_length(batch: Any) -> int | None:
    """The number of samples in `batch`: the length of its list of samples (`listed_length`), else
    the first dimension of its first tensor (``None`` when it has neither). A detection batch's
    first tensor is an image, and a list of sequences' first is a sequence: their first dimension
    (channels, tokens) is not the batch's.

    Example:
        >>> batch_length({"x": torch.zeros(8, 3), "y": torch.zeros(8)}), batch_length([1.0, 2.0])
        (8, None)
        >>> images, targets = (torch.zeros(3, 9, 9), torch.zeros(3, 7, 7)), ({"y": 1}, {"y": 0})
        >>> batch_length((images, targets)), batch_length(([torch.zeros(5), torch.zeros(3)], torch.ones(2)))
        (2, 2)
    """
    listed = listed_length(batch)
    return listed if listed is not None else _first_length(batch)


def _first_length(batch: Any) -> int | None:
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    for item in _items(batch):
        length = _first_length(item)
        if length is not None:
            return length
    return None


def listed_length(batch: Any) -> int | None:
    """The length of `batch`'s list of samples, if it has one (then lists of that length are
    lists of samples): a list or tuple of one mapping per sample (torchvision's detection
    targets), else one of tensors of different shapes (images of their own sizes, sequences of
    their own lengths: they could not be stacked) as long as the first dimension of a tensor beside
    it (the labels). The fields of a batch, `(x, y)`, differ in shape too, but nothing beside them
    says they are samples, and fields nested beside another, `(x, (classes, boxes))`, are each as
    long as the batch (a batch of 3 RGB images listed without target dicts reads as fields).

    Example:
        >>> listed_length(((torch.zeros(3, 9, 9),), ({"boxes": torch.zeros(1, 4)},))), listed_length([1, 2])
        (1, None)
        >>> listed_length((torch.zeros(4, 2), torch.zeros(4)))  # the fields x and y
    """
    sequences = list(_sequences(batch))
    mappings = next((s for s in sequences if _per_sample_mappings(s)), None)
    if mappings is not None:
        return len(mappings)
    for ragged in (s for s in sequences if _ragged(s)):
        if len(ragged) in _first_dims(batch, besides=ragged):
            return len(ragged)
    return None


def _sequences(value: Any) -> Iterator[list[Any] | tuple[Any, ...]]:
    """Every non-empty list and tuple in `value`, outermost first."""
    if isinstance(value, list | tuple) and value:
        yield value
    for item in _items(value):
        if not isinstance(item, _LEAVES):  # a per-sample list of names is not walked name by name
            yield from _sequences(item)


def _ragged(items: list[Any] | tuple[Any, ...]) -> bool:
    """Two or more tensors, not all of one shape, and not all as long as the list: fields of a
    batch of 2, `(classes, boxes)`, are each 2 long."""
    if len(items) < 2 or not all(isinstance(item, Tensor) and item.dim() > 0 for item in items):
        return False
    fields = all(item.shape[0] == len(items) for item in items)
    return len({item.shape for item in items}) > 1 and not fields


def _first_dims(value: Any, besides: object) -> set[int]:
    """The first dimensions of the tensors in `value` outside the sequence `besides`."""
    if value is besides:
        return set()
    if isinstance(value, Tensor):
        return {value.shape[0]} if value.dim() > 0 else set()
    return {dim for item in _items(value) for dim in _first_dims(item, besides)}


def _per_sample_mappings(value: Any) -> bool:
    return isinstance(value, list | tuple) and len(value) > 0 and all(isinstance(v, Mapping) for v in value)


#: What holds nothing to walk into (checked first: most of a batch is tensors).
_LEAVES = (Tensor, str, bytes, int, float, bool, type(None))


def _items(value: Any) -> Iterable[Any]:
    """What a mapping, a sequence or a dataclass holds (nothing, for anything else)."""
    if isinstance(value, _LEAVES):
        return ()
    if isinstance(value, list | tuple):
        return value
    if isinstance(value, Mapping):
        return value.values()
    if isinstance(value, Sequence):
        return value
    if _dataclass(value):
        return [getattr(value, f.name) for f in dataclasses.fields(value)]
    return ()


def slice_batch(batch: Any, start: int, stop: int, length: int) -> Any:
    """Samples ``start:stop`` of `batch` (whose length is `length`), with its structure and types.
    Where the length is that of a list of samples (`listed_length`), lists and tuples of that
    length that hold tensors or mappings are lists of samples too (a detection batch's images).

    Example:
        >>> x, names = slice_batch((torch.arange(6), ["a", "b", "c", "d", "e", "f"]), 2, 4, 6)
        >>> x.tolist(), names
        ([2, 3], ['c', 'd'])
    """
    return _slice(batch, start, stop, length, listed=listed_length(batch) == length)


def _slice(batch: Any, start: int, stop: int, length: int, listed: bool) -> Any:
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == length else batch
    if isinstance(batch, Mapping):
        content = {key: _slice(value, start, stop, length, listed) for key, value in batch.items()}
        return _rebuilt(batch, content)
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        samples = listed and all(isinstance(item, Tensor | Mapping) for item in batch)
        if len(batch) == length and (samples or not any(_holds_tensors(item) for item in batch)):
            return _rebuilt(batch, list(batch[start:stop]))  # one value per sample
        return _rebuilt(batch, [_slice(item, start, stop, length, listed) for item in batch])
    if _dataclass(batch):
        return _replaced(batch, lambda name: _slice(getattr(batch, name), start, stop, length, listed))
    return batch


def bounds(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """``start:stop`` cut into consecutive pieces of `size` (the last may be shorter).

    Example:
        >>> bounds(0, 10, 4)
        [(0, 4), (4, 8), (8, 10)]
    """
    return [(begin, min(begin + size, stop)) for begin in range(start, stop, size)]


@dataclass
class Logged:
    """One ``self.log(name, value, **options)`` call a slice's step made, and the slice's length."""

    name: str
    value: Any
    options: dict[str, Any] = field(default_factory=dict)
    samples: int = 1


def combine_logged(calls: Sequence[Logged]) -> list[Logged]:
    """The slices' ``self.log`` calls as the whole batch's: one call per name, in first-logged order.

    A number or a one-element tensor is combined by its ``reduce_fx`` (``"mean"``, the default:
    the mean weighted by each slice's samples, which is the batch's value for a mean over samples;
    ``"sum"``, ``"max"``, ``"min"``). Anything else (a torchmetrics ``Metric``, which has counted
    every slice itself) is logged as its last call logged it.

    Example:
        >>> calls = [Logged("loss", torch.tensor(1.0), samples=3), Logged("loss", torch.tensor(3.0))]
        >>> [(c.name, c.value.item(), c.samples) for c in combine_logged(calls)]
        [('loss', 1.5, 4)]
    """
    names: dict[str, list[Logged]] = {}
    for call in calls:
        names.setdefault(call.name, []).append(call)
    return [_combined(group) for group in names.values()]


def _combined(group: list[Logged]) -> Logged:
    last = group[-1]
    samples = sum(call.samples for call in group)
    if not all(_scalar(call.value) for call in group):
        return Logged(last.name, last.value, last.options, samples)
    values = [torch.as_tensor(call.value).detach().reshape(()).double() for call in group]
    reduce = _reduce_name(last.options.get("reduce_fx", "mean"))
    if reduce == "sum":
        value = torch.stack(values).sum()
    elif reduce in ("max", "min"):
        value = getattr(torch.stack(values), reduce)()
    else:
        value = torch.stack([v * call.samples for v, call in zip(values, group, strict=True)]).sum() / samples
    dtype = last.value.dtype if isinstance(last.value, Tensor) else torch.get_default_dtype()
    device = last.value.device if isinstance(last.value, Tensor) else None
    return Logged(last.name, value.to(dtype=dtype, device=device), last.options, samples)


def _reduce_name(reduce: Any) -> str:
    """``reduce_fx`` as a name: Lightning takes ``"mean"``, ``"sum"``, ``"max"``, ``"min"`` or the
    torch function."""
    return getattr(reduce, "__name__", str(reduce)).lower()


def combine_outputs(outputs: Sequence[Any], samples: Sequence[int]) -> Any:
    """What the slices' steps returned, as the whole batch's step would have: per-sample tensors
    (first dimension the slice's length) concatenated, one-element tensors and numbers averaged by
    samples, mappings and sequences combined per entry, anything else the last slice's.

    Example:
        >>> outputs = [{"preds": torch.zeros(3), "acc": 1.0}, {"preds": torch.ones(1), "acc": 0.0}]
        >>> out = combine_outputs(outputs, [3, 1])
        >>> out["preds"].tolist(), out["acc"]
        ([0.0, 0.0, 0.0, 1.0], 0.75)
    """
    first, last = outputs[0], outputs[-1]
    if len(outputs) == 1:
        return first
    if isinstance(first, Tensor) and all(isinstance(o, Tensor) for o in outputs):
        if all(o.dim() > 0 and o.shape[0] == n for o, n in zip(outputs, samples, strict=True)):
            return torch.cat(list(outputs))
        if all(o.numel() == 1 for o in outputs):
            return sum(o.detach() * n for o, n in zip(outputs, samples, strict=True)) / sum(samples)
        return last
    if isinstance(first, int | float) and not isinstance(first, bool) and all(_number(o) for o in outputs):
        return sum(o * n for o, n in zip(outputs, samples, strict=True)) / sum(samples)
    if isinstance(first, Mapping) and all(
        isinstance(o, Mapping) and o.keys() == first.keys() for o in outputs
    ):
        return _rebuilt(first, {key: combine_outputs([o[key] for o in outputs], samples) for key in first})
    if all(_per_sample_mappings(o) and len(o) == n for o, n in zip(outputs, samples, strict=True)):
        return _rebuilt(first, [item for output in outputs for item in output])  # one mapping a sample
    if _structure(first) and all(_structure(o) and len(o) == len(first) for o in outputs):
        return _rebuilt(first, [combine_outputs([o[i] for o in outputs], samples) for i in range(len(first))])
    if _dataclass(first) and all(type(o) is type(first) for o in outputs):
        return _replaced(first, lambda name: combine_outputs([getattr(o, name) for o in outputs], samples))
    return last


def _structure(value: Any) -> bool:
    return isinstance(value, list | tuple)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _scalar(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1
    return _number(value)


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensors(v) for v in value)
    return False


def _dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _replaced(instance: Any, content: Callable[[str], Any]) -> Any:
    """The dataclass `instance` built again through its constructor, each ``init`` field given
    ``content(name)`` (the others are left to ``__post_init__``)."""
    fields = dataclasses.fields(instance)
    return dataclasses.replace(instance, **{f.name: content(f.name) for f in fields if f.init})


def _rebuilt(original: Any, content: Any) -> Any:
    """`content` (a dict or a list) in `original`'s type where it can be rebuilt (a namedtuple, a
    dict subclass), else as it is."""
    kind = type(original)
    if isinstance(content, dict):
        try:
            return content if kind is dict else kind(content)
        except TypeError:
            return content
    if hasattr(original, "_fields"):  # a namedtuple
        return kind(*content)
    try:
        return kind(content)
    except TypeError:
        return content
