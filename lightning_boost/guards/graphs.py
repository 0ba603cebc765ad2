"""Autograd graphs a run keeps alive between steps, as plain numbers.

`graph_tensors` walks plain containers (lists, tuples, dicts, deques, sets, dataclasses,
namespaces) to the tensors that still hold an autograd graph, with the path to each
(``self.losses[17]``); `footprint` measures what those graphs keep alive (nodes, and the bytes of
saved tensors such as activations); `census` finds every such tensor alive in the process, for
holders no walk can name; `growth` says whether a series of samples grows with the step count.
No Lightning here: `lightning_boost.callbacks.LossLoggingGuard` drives them.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import math
import types
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

_T = TypeVar("_T")

#: How deep below a root the walk goes, and how many items of one container it looks at (the
#: newest ones: a list that leaks grows at its end).
MAX_DEPTH = 4
MAX_ITEMS = 1000
#: The most autograd nodes one footprint walks (a graph that large is reported as "at least").
MAX_NODES = 50_000


def holds_graph(value: object) -> bool:
    """Whether `value` is a tensor with a ``grad_fn``: it keeps the graph that produced it alive.

    Example:
        >>> import torch
        >>> w = torch.ones(2, requires_grad=True)
        >>> holds_graph(w * 2), holds_graph(w), holds_graph((w * 2).detach())
        (True, False, False)
    """
    return isinstance(value, Tensor) and value.grad_fn is not None


def _children(value: object, max_items: int) -> Iterator[tuple[str, object]]:
    """``(path suffix, item)`` for the items of a plain container; nothing for anything else."""
    if isinstance(value, (list, tuple, deque)):
        fields = getattr(value, "_fields", None)  # a namedtuple names its fields
        for index in range(max(0, len(value) - max_items), len(value)):
            yield (f".{fields[index]}" if fields else f"[{index}]"), value[index]
    elif isinstance(value, Mapping):
        items = list(value.items())[-max_items:]
        for key, item in items:
            yield (f'["{key}"]' if isinstance(key, str) else f"[{key!r}]"), item
    elif isinstance(value, (set, frozenset)):
        for item in list(value)[:max_items]:
            yield "{…}", item
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield f".{f.name}", getattr(value, f.name, None)
    elif isinstance(value, types.SimpleNamespace):
        for name, item in list(vars(value).items())[:max_items]:
            yield f".{name}", item


def graph_tensors(
    roots: Mapping[str, object], *, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS
) -> list[tuple[str, Tensor]]:
    """Every tensor holding a graph reachable from `roots` through plain containers, with its path.

    Modules (and so parameters, buffers and torchmetrics metrics) are not entered; each object is
    visited once; at most `max_items` items of one container (the last ones) and `max_depth` levels
    below a root are looked at.

    Example:
        >>> import torch
        >>> w = torch.ones(1, requires_grad=True)
        >>> found = graph_tensors({"self.losses": [w * 1, (w * 2).detach(), w * 3]})
        >>> [path for path, _ in found]
        ['self.losses[0]', 'self.losses[2]']
    """
    found: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    stack: list[tuple[str, object, int]] = [(path, value, 0) for path, value in reversed(list(roots.items()))]
    while stack:
        path, value, depth = stack.pop()
        if id(value) in seen or isinstance(value, (nn.Module, str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(value))
        if isinstance(value, Tensor):
            if value.grad_fn is not None:
                found.append((path, value))
            continue
        if depth >= max_depth:
            continue
        children = [(path + suffix, item, depth + 1) for suffix, item in _children(value, max_items)]
        stack.extend(reversed(children))
    return found


@dataclass(frozen=True)
class Footprint:
    """What a set of graphs keeps alive.

    Args:
        graphs: how many graph-holding tensors were measured.
        nodes: distinct autograd nodes reachable from them.
        saved_bytes: bytes of the distinct tensors those nodes saved for backward (activations)
            and still hold; a graph that went through ``backward()`` has freed them.
        held_bytes: bytes of the graph-holding tensors themselves.
        truncated: the walk stopped at `MAX_NODES`: the figures are lower bounds.
    """

    graphs: int
    nodes: int
    saved_bytes: int
    held_bytes: int
    truncated: bool = False

    @property
    def total_bytes(self) -> int:
        return self.saved_bytes + self.held_bytes


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_tensors(node: Any) -> Iterator[Tensor]:
    """The tensors an autograd node saved for backward and still holds (freed ones are skipped)."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = tuple(name for name in dir(node) if name.startswith("_saved_"))
        _SAVED_NAMES[type(node)] = names
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # "saved tensors ... have already been freed" after backward()
            continue
        values = value if isinstance(value, (list, tuple)) else (value,)
        yield from (v for v in values if isinstance(v, Tensor))


def _storage(tensor: Tensor) -> tuple[int, int] | None:
    """The data pointer and bytes of `tensor`'s storage; ``None`` for a tensor without one of its
    own: a FakeTensor that ``torch.compile`` keeps alive in its caches, a wrapper subclass (DTensor)."""
    if is_fake(tensor):
        return None
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # "Cannot access data pointer of Tensor (e.g. FakeTensor"
        return None


def footprint(
    tensors: Iterable[Tensor], *, exclude: Iterable[Tensor] = (), max_nodes: int = MAX_NODES
) -> Footprint:
    """Nodes and bytes kept alive by the graphs of `tensors`, each storage counted once.

    Storages of `exclude` (the model's parameters and buffers, which live anyway) are not counted.

    Example:
        >>> import torch
        >>> w = torch.ones(1000, requires_grad=True)
        >>> kept = (w * w).sum()  # never backpropagated: the product kept `w` twice, no copy
        >>> footprint([kept], exclude=[w]).saved_bytes
        0
        >>> side = w.exp().sum()  # exp saved its output: 4000 bytes of activations
        >>> footprint([side], exclude=[w]).saved_bytes
        4000
    """
    excluded = {pointer for pointer, _ in filter(None, map(_storage, exclude))}
    storages: dict[int, int] = {}
    held: dict[int, int] = {}
    nodes: dict[int, Any] = {}  # keeps each node's Python object alive, so its id stays unique
    graphs = 0
    for tensor in tensors:
        graphs += 1
        own = _storage(tensor)
        if own is not None:
            held[own[0]] = own[1]
        stack = [tensor.grad_fn]
        while stack and len(nodes) < max_nodes:
            node = stack.pop()
            if node is None or id(node) in nodes:
                continue
            nodes[id(node)] = node
            for saved in filter(None, map(_storage, _saved_tensors(node))):
                if saved[0] not in excluded:
                    storages[saved[0]] = saved[1]
            stack.extend(next_node for next_node, _ in node.next_functions)
    saved_bytes = sum(size for pointer, size in storages.items() if pointer not in held)
    return Footprint(graphs, len(nodes), saved_bytes, sum(held.values()), truncated=len(nodes) >= max_nodes)


def census() -> list[Tensor]:
    """Every tensor alive in this process that holds an autograd graph (a garbage-collector scan).

    It costs tens of milliseconds in a process with a few hundred thousand objects: callers sample.
    """
    return [obj for obj in gc.get_objects() if issubclass(type(obj), Tensor) and obj.grad_fn is not None]


@dataclass(frozen=True)
class Growth:
    """How a sampled quantity changes with the step count.

    Args:
        samples: how many ``(step, value)`` samples the slope rests on: all of them, less one for
            each stretch after the first (`growth`'s breaks: a stretch's first sample only sets
            its level).
        per_step: least-squares slope, value per step.
        correlation: Pearson correlation of value with step (1 for a straight rising line).
        first: the first sample's value.
        last: the last sample's value (across breaks, the first plus the fitted growth).
    """

    samples: int
    per_step: float
    correlation: float
    first: float
    last: float

    @property
    def steady(self) -> bool:
        """Growth that tracks the step count: enough samples, rising, nearly a straight line."""
        return self.samples >= MIN_GROWTH_SAMPLES and self.last > self.first and self.correlation >= 0.9


#: Fewer samples than this say nothing about a trend.
MIN_GROWTH_SAMPLES = 4


def growth(samples: Sequence[tuple[int, float]], breaks: Iterable[int] = ()) -> Growth:
    """Fit ``value ~ step`` to `samples`.

    `breaks` are steps at or before which a full garbage collection freed objects since the
    sample before: it frees at once graphs that earlier code left in reference cycles (an earlier
    fit's model), which the samples before it counted. Each stretch between breaks then keeps its
    own level and the fit is one slope across them; the last value is the first plus that
    growth, not the level the collection dropped to.

    Example:
        >>> g = growth([(1, 10.0), (2, 12.0), (3, 14.0), (5, 18.0)])
        >>> g.per_step, g.steady
        (2.0, True)
        >>> growth([(1, 10.0), (2, 10.0), (3, 10.0), (4, 10.0)]).steady
        False
        >>> g = growth([(1, 65.0), (2, 68.0), (3, 71.0), (5, 17.0), (6, 20.0)], breaks=[5])
        >>> g.per_step, g.correlation, g.samples, g.last, g.steady
        (3.0, 1.0, 4, 80.0, True)
        >>> growth([(1, 65.0), (2, 68.0), (3, 17.0), (4, 20.0)], breaks=[3, 4]).steady  # 2 rest on it
        False
    """
    n = len(samples)
    if n < 2:
        value = float(samples[0][1]) if samples else 0.0
        return Growth(n, 0.0, 0.0, value, value)
    cuts = sorted(breaks)
    stretches: dict[int, list[tuple[float, float]]] = {}
    for step, value in samples:
        stretches.setdefault(bisect.bisect_right(cuts, step), []).append((float(step), float(value)))
    cov = var_s = var_v = 0.0
    for stretch in stretches.values():
        mean_s = sum(step for step, _ in stretch) / len(stretch)
        mean_v = sum(value for _, value in stretch) / len(stretch)
        cov += sum((s - mean_s) * (v - mean_v) for s, v in stretch)
        var_s += sum((s - mean_s) ** 2 for s, _ in stretch)
        var_v += sum((v - mean_v) ** 2 for _, v in stretch)
    slope = cov / var_s if var_s else 0.0
    correlation = cov / math.sqrt(var_s * var_v) if var_s and var_v else 0.0
    first, last = float(samples[0][1]), float(samples[-1][1])
    if len(stretches) > 1:
        last = first + slope * (samples[-1][0] - samples[0][0])
    return Growth(n - len(stretches) + 1, slope, correlation, first, last)


def thin(samples: list[_T], limit: int = 64) -> list[_T]:
    """Keep a bounded series spanning the whole run: past `limit`, every other sample is dropped.

    Example:
        >>> thin([(i, float(i)) for i in range(10)], limit=8)
        [(0, 0.0), (2, 2.0), (4, 4.0), (6, 6.0), (8, 8.0), (9, 9.0)]
    """
    if len(samples) <= limit:
        return samples
    return samples[:-1:2] + samples[-1:]
