"""`SyncWatch`: while active, every host-device sync is reported with its stack frame.

Three sources, each switched on by `start` and off by `stop`:

- a `TorchFunctionMode` that sees tensor calls at the Python API (``.item()``, ``print``,
  ``x[mask]``, ``.tolist()``, ...) and names them with `classify`. It sees the call, not the
  kernels behind it, so it works the same on CPU tensors ("would sync on a GPU");
- wrappers around the calls that sync without a tensor: ``torch.cuda.synchronize``,
  ``empty_cache``, ``Event``/``Stream.synchronize`` and the blocking ``torch.distributed``
  collectives;
- on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` for syncs inside kernels the API does not
  show, and the caching allocator's retry and stream-sync counters.

A sync the mode or a wrapper already reported is not reported again by the debug mode. While a
DataLoader makes a batch on the watched thread nothing is watched: loading runs on the host by
design; nor while the pack runs its own steps there (`instrumented.own_steps`). No Lightning here.
"""

from __future__ import annotations

import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import torch
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode

from lightning_boost import instrumented
from lightning_boost.guards.syncs import classify, host_copy, made_on_host, subject

#: ``(pattern, frame of the call)``; may raise to stop at the sync (error mode).
OnSync = Callable[[str, FrameType | None], None]

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
)
#: What `torch.cuda.set_sync_debug_mode("warn")` says in each of its warnings.
_DEBUG_TEXT = "called a synchronizing CUDA operation"
#: The start of what torch warns when the debug mode is switched on.
_PROTOTYPE_TEXT = "Synchronization debug mode is a prototype feature"
#: Patterns whose result is a real host tensor, on a GPU run too: reading it later does not sync.
HOST_COPIES = frozenset({"cpu", "to_cpu"})
#: torch ops with an output torch always makes on the host (the output's index): a packed
#: sequence's `batch_sizes` and the lengths padded back from it (torch requires them on the CPU).
HOST_OUTPUTS = {torch._pack_padded_sequence: 1, torch._pad_packed_sequence: 1}
ALLOCATOR_COUNTERS = {"num_alloc_retries": "alloc_retry", "num_sync_all_streams": "sync_all_streams"}


class _Mode(TorchFunctionMode):
    def __init__(self, watch: SyncWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        watch = self.watch
        if watch.paused or torch.compiler.is_compiling():  # compile: its graph must be the plain one
            return func(*args, **kwargs)
        pattern = classify(func, args, kwargs, watch.cuda)
        if pattern is not None and watch.on_host(subject(pattern, args, kwargs)):
            pattern = None  # a read of a tensor the GPU run keeps on the host: no sync
        if pattern is None:
            pattern = host_copy(func, args, kwargs, watch.cuda, watch.on_host)
        if pattern is None:
            result = func(*args, **kwargs)
        else:
            result = watch.report(pattern, sys._getframe(1), func, args, kwargs)
        if pattern in HOST_COPIES:
            watch.mark_host(result)
        elif pattern == "h2d":
            watch.mark_device(result)  # on a CPU run `.to(device)` may return the very same tensor
        elif pattern is None:
            watch.follow(func, args, kwargs, result)
        return result


class SyncWatch:
    """Reports each host-device sync made while it is active to `on_sync`.

    Args:
        on_sync: called with the `PATTERNS` name and the caller's frame of each sync.
        cuda: the run is on CUDA: only syncs involving CUDA tensors count, and the debug mode and
            allocator counters are read. ``False`` models a GPU run on CPU tensors: a tensor is on
            the GPU unless it was made on the host while watched (a factory told no device, or
            ``"cpu"``; ops on such tensors alone; ``.cpu()`` copies) or marked with `mark_host`.

    Example:
        >>> import torch
        >>> seen = []
        >>> watch = SyncWatch(lambda pattern, frame: seen.append(pattern), cuda=False)
        >>> batch = torch.ones(2)  # made before: as a batch, on the GPU in a GPU run
        >>> watch.start()
        >>> loss = batch.sum()
        >>> value = loss.item()
        >>> count = torch.zeros(()).add(1).item()  # made on the host in the step: no sync
        >>> weights = torch.tensor([0.5, 2.0]).to(batch.device)  # copied to the GPU: a sync
        >>> watch.stop()
        {}
        >>> seen
        ['item', 'h2d']
    """

    def __init__(self, on_sync: OnSync, cuda: bool) -> None:
        self.on_sync = on_sync
        self.cuda = cuda
        self._mode: _Mode | None = None
        self._undo: list[Callable[[], None]] = []
        self._quiet = 0
        self.loading = 0  # a DataLoader is making a batch on the watched thread (`_pause_while_loading`)
        self._counters: dict[str, int] = {}
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}

    @property
    def active(self) -> bool:
        return self._mode is not None

    @property
    def paused(self) -> bool:
        """Nothing is reported now: a DataLoader makes a batch on the watched thread, or the pack
        runs its own steps there (`instrumented.own_steps`: a probe's, on a copy of the model)."""
        return bool(self.loading) or instrumented.in_own_steps()

    def mark_host(self, tensor: object) -> None:
        """Note that `tensor` stays on the host in a GPU run (on a CPU run, where devices cannot
        tell): reading it does not sync, copying it to the device does. Marks last as long as the
        tensor, across checked steps."""
        if not self.cuda and isinstance(tensor, torch.Tensor):
            key = id(tensor)
            self._host[key] = weakref.ref(tensor, lambda _: self._host.pop(key, None))

    def mark_device(self, tensor: object) -> None:
        """Note that `tensor` is on the device now (copied there)."""
        self._host.pop(id(tensor), None)

    def on_host(self, value: object) -> bool:
        ref = self._host.get(id(value))
        return ref is not None and ref() is value

    def follow(self, func: Any, args: Any, kwargs: dict[str, Any], result: object) -> None:
        """Model where `result` lives in a GPU run (CPU runs): a factory told no device makes it
        on the host, as does an op on Python numbers alone (``torch.div(a, b)`` of two ints), an
        op on host tensors alone keeps it there, and `HOST_OUTPUTS` name the ops with an output
        torch makes on the host whatever their inputs."""
        if self.cuda or not isinstance(result, (torch.Tensor, tuple, list)):
            return
        inputs = [a for a in _flat((*args, *kwargs.values())) if isinstance(a, torch.Tensor)]
        if made_on_host(func, kwargs, cuda=False) or (not inputs and "device" not in kwargs):
            self.mark_host(result)  # a factory told no device, or an op on Python numbers alone
            return
        if isinstance(result, tuple) and func in HOST_OUTPUTS:  # most results are one tensor: no lookup
            self.mark_host(result[HOST_OUTPUTS[func]])
        if not self._host:
            return
        if all(self.on_host(t) for t in inputs):
            for tensor in result if isinstance(result, (tuple, list)) else (result,):
                self.mark_host(tensor)

    def report(self, pattern: str, frame: FrameType | None, func: Any, args: Any, kwargs: Any) -> Any:
        """Tell `on_sync` (unless `paused`), then make the call (the debug mode is quiet for it:
        already reported).

        What the call moves on the allocator's counters (``empty_cache`` syncs every stream) is
        part of this report, so it is not counted again as the allocator's own.
        """
        if not self.paused:
            self.on_sync(pattern, frame)
        self._quiet += 1
        before = _allocator_counters() if self._counters else None
        try:
            return func(*args, **kwargs)
        finally:
            self._quiet -= 1
            if before is not None:
                for key, value in _allocator_counters().items():
                    self._counters[key] = self._counters.get(key, 0) + value - before[key]

    def start(self) -> None:
        if self.active:
            return
        self._patch(torch.cuda, "synchronize", "synchronize")
        self._patch(torch.cuda, "empty_cache", "empty_cache")
        self._patch(torch.cuda.Event, "synchronize", "stream_sync")
        self._patch(torch.cuda.Stream, "synchronize", "stream_sync")
        if torch.distributed.is_available():
            for name in COLLECTIVES:
                self._patch(torch.distributed, name, "collective")
        if self.cuda:
            self._start_cuda()
        self._pause_while_loading()
        self._mode = _Mode(self)
        self._mode.__enter__()

    def stop(self) -> dict[str, int]:
        """Switch everything off; return the allocator's sync counters since `start` (CUDA only).

        Stopping a watch that is not running returns nothing: the counters are cumulative for the
        process, so read without a `start` they would count everything before it (a batch-size
        probe's ``empty_cache`` between trials) as the user's.
        """
        if not self.active:
            return {}
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        while self._undo:
            self._undo.pop()()
        counts = self._counter_deltas() if self.cuda else {}
        self._counters = {}
        return counts

    def _patch(self, owner: Any, name: str, pattern: str) -> None:
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None:
            return
        watch = self

        def synced(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("async_op"):
                return original(*args, **kwargs)
            return watch.report(pattern, sys._getframe(1), original, args, kwargs)

        setattr(owner, name, synced)
        self._undo.append(lambda: setattr(owner, name, original))

    def _pause_while_loading(self) -> None:
        """Watch nothing while a DataLoader makes its next batch on the watched thread. Loading runs
        on the host by design (`syncs.attribute` drops what it finds there), and a checked step's
        window takes in the next batch's loading: with ``num_workers=0``, each sample's transforms
        ran through the mode, and their reads were attributed one by one, 0.27 s of a 12 s demo fit
        on 2 CPUs (by hand). Another thread's loading (a tuner's) leaves the watch as it is."""
        iterator = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)  # torch's, private
        original = vars(iterator).get("__next__") if isinstance(iterator, type) else None
        if original is None:  # another torch: loading is watched, and `attribute` drops it as before
            return
        watched = threading.get_ident()
        watch = self

        def loading(each: Any) -> Any:
            if threading.get_ident() != watched:
                return original(each)
            watch.loading += 1
            try:
                return original(each)
            finally:
                watch.loading -= 1

        setattr(iterator, "__next__", loading)  # noqa: B010 (put back by `stop`)
        self._undo.append(lambda: setattr(iterator, "__next__", original))

    # -- CUDA ----------------------------------------------------------------------------------

    def _start_cuda(self) -> None:
        catcher = warnings.catch_warnings()
        catcher.__enter__()
        # torch says, once, that the debug mode is a prototype: the guard's doing, not the user's
        warnings.filterwarnings("ignore", message=_PROTOTYPE_TEXT, category=UserWarning)
        warnings.filterwarnings("always", message=".*" + re.escape(_DEBUG_TEXT), category=UserWarning)
        previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        show = warnings.showwarning

        def showwarning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if category is UserWarning and _DEBUG_TEXT in str(message):
                if not self._quiet and not self.paused:
                    self.on_sync("cuda", sys._getframe(1))
                return
            show(message, category, *args, **kwargs)

        warnings.showwarning = showwarning

        def undo() -> None:
            catcher.__exit__(None, None, None)
            torch.cuda.set_sync_debug_mode(previous_mode)

        self._undo.insert(0, undo)
        self._counters = _allocator_counters()

    def _counter_deltas(self) -> dict[str, int]:
        """The counters' moves since `start`; a retry syncs every stream before it frees the cache,
        so that sync is the retry's (one finding), and only the syncs beyond the retries are others."""
        now = _allocator_counters()
        moved = {value: now[key] - self._counters.get(key, 0) for key, value in ALLOCATOR_COUNTERS.items()}
        moved["sync_all_streams"] -= moved["alloc_retry"]
        return {pattern: count for pattern, count in moved.items() if count > 0}


def host_side(module: torch.nn.Module, optimizers: Iterable[Optimizer]) -> Iterator[torch.Tensor]:
    """Tensors a GPU run keeps on the host, for `SyncWatch.mark_host` on a CPU run.

    - A module's plain tensor attributes (``self.weights = torch.tensor(...)`` in ``__init__``):
      moving a module moves its parameters and buffers only (a module with its own ``_apply``,
      such as a torchmetrics metric, moves its state too and is skipped).
    - Optimizers' ``step`` counters, which torch keeps on the host unless ``capturable`` or
      ``fused`` (its Adam reads them with ``.item()`` in every step).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> model.scale = torch.tensor(2.0)
        >>> adam = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(2)).sum().backward(); adam.step()
        >>> [tuple(t.shape) for t in host_side(model, [adam])]
        [(), (), ()]
    """
    for each in module.modules():
        if type(each)._apply is not torch.nn.Module._apply:
            continue
        for value in vars(each).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                yield value
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for parameter in group["params"]:
                step = optimizer.state.get(parameter, {}).get("step")
                if isinstance(step, torch.Tensor):
                    yield step


def _allocator_counters() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTERS}


def _flat(values: tuple[Any, ...]) -> list[Any]:
    """`values` with lists and tuples opened one level (``torch.cat([a, b])`` takes its tensors so)."""
    return [item for value in values for item in (value if isinstance(value, (list, tuple)) else (value,))]
