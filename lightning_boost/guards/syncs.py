"""Host-device syncs: which calls make the CPU wait for the GPU, and whose code made them.

`classify` names the sync a torch call makes (``"item"``, ``"mask_index"``, ...) from the function
and its arguments, modelling a GPU run when the tensors are on the CPU: the same patterns are
flagged as "would sync on a GPU", while checks that only the CPU kernels make (``one_hot`` *with*
``num_classes`` validates its range with ``.item()`` on the CPU, not on CUDA) never reach it,
since it sees the call, not the kernels behind it. `attribute` reads the stack of a sync: the
user's line, the hook it ran in, the library in between (named with the setting that removes the
sync) and whether the framework made it. No Lightning imports here: frames are plain data.
"""

from __future__ import annotations

import functools
import io
import linecache
import os
import sys
import sysconfig
import tokenize
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_boost.guards.sources import Site


@dataclass(frozen=True)
class Pattern:
    """A kind of sync.

    Args:
        name: its key in `PATTERNS`.
        what: what the call does to the host, one sentence.
        fix: how to keep the step free of it.
    """

    name: str
    what: str
    fix: str


_KEEP_ON_DEVICE = (
    "Keep it a tensor: `self.log(name, value)` (Lightning reads it only when it logs) or a torchmetrics"
    " metric on the device; read numbers once per epoch."
)
_HOST_ONCE = (
    "Keep tensors on the device through the step; move what you need to the host once per epoch"
    " (an epoch-end hook), or with `.to('cpu', non_blocking=True)` into a buffer read later. What the"
    " step needs on the host (lengths for `pack_padded_sequence`, sizes) can come from the"
    " `collate_fn` as Python lists: Lightning moves tensors only."
)
_FIXED_SHAPE = (
    "Keep shapes fixed: multiply by the mask or use `torch.where(mask, x, 0)`; a masked mean is"
    " `(x * mask).sum() / mask.sum()`."
)
_NO_SYNC_CALL = (
    "Remove it from the step. To time GPU work, use `torch.cuda.Event(enable_timing=True)` read after"
    " the step, or the profiler."
)
_ALLOCATOR = (
    "Leave memory headroom: a smaller batch (`AutoBatchSize` keeps 10 %), or"
    " `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` against fragmentation."
)

PATTERNS: dict[str, Pattern] = {
    p.name: p
    for p in (
        Pattern("item", "`.item()` copies a value to the host and waits for the GPU", _KEEP_ON_DEVICE),
        Pattern(
            "float", "`float()`/`int()` of a tensor waits for the GPU to read the value", _KEEP_ON_DEVICE
        ),
        Pattern(
            "bool",
            "A Python branch on a tensor (`if loss > x:`, `bool()`, `and`/`or`) waits for the GPU",
            "Decide on the device (`torch.where`, masks) or every N steps; to stop training on a value,"
            " log it and use `EarlyStopping`.",
        ),
        Pattern(
            "index",
            "A tensor used as a Python int (`range(t)`, `my_list[t]`) waits for the GPU",
            "Use Python ints for sizes and indices, or index on the device (`index_select`, `gather`).",
        ),
        Pattern(
            "format",
            'Formatting a tensor (`f"{loss:.3f}"`) copies it to the host',
            "Log it with `self.log(...)`: the progress bar and loggers format it when they show it.",
        ),
        Pattern(
            "print",
            "`print()`/`str()`/`repr()` of a tensor copies it to the host",
            "Drop the print from the step: `self.log(name, value)` records it (read every"
            " `log_every_n_steps`), with `on_step=False, on_epoch=True, prog_bar=True` the bar shows its"
            " epoch mean (a step value there is read every step), or print in an epoch-end hook.",
        ),
        Pattern("cpu", "`.cpu()` copies device memory to the host and waits for it", _HOST_ONCE),
        Pattern("to_cpu", "`.to('cpu')` copies device memory to the host and waits for it", _HOST_ONCE),
        Pattern(
            "h2d",
            "A copy of host memory to the GPU (`torch.tensor(..., device=...)`, or `.to(device)`,"
            " `.cuda()`, `.type_as(x)` of a tensor made on the host) waits for the GPU's queue",
            "Make it on the device: `torch.ones(..., device=x.device)`, `x.new_tensor(...)`,"
            " `x.new_ones(...)`; a constant belongs in `self.register_buffer(...)`, moved once with the"
            " model; host data: `.pin_memory()` once, then `.to(device, non_blocking=True)`.",
        ),
        Pattern("tolist", "`.tolist()` copies to the host and builds Python numbers", _HOST_ONCE),
        Pattern("numpy", "`.numpy()` needs the values on the host", _HOST_ONCE),
        Pattern(
            "nonzero",
            "`nonzero()`/`argwhere()`/`torch.where(cond)` return a size known only once the GPU is done",
            _FIXED_SHAPE + " With a bound on the count, `torch.nonzero_static(x, size=k)`.",
        ),
        Pattern("mask_index", "Boolean-mask indexing (`x[mask]`) has a data-dependent size", _FIXED_SHAPE),
        Pattern(
            "slice_bound",
            "A tensor as a slice bound (`x[t:t + n]`) is read as a Python int, which waits for the GPU",
            "Keep offsets and sizes as Python ints: read them all at once before the loop"
            " (`offsets = lengths.cumsum(0).tolist()`), or keep them on the host in the batch.",
        ),
        Pattern(
            "ctc_lengths",
            "`F.ctc_loss` reads `input_lengths`/`target_lengths` on the host: lengths on the GPU are"
            " copied back and waited for",
            "Keep the lengths on the host: Python lists (or CPU tensors) from the `collate_fn`, left off"
            " the device (Lightning moves tensors only; or override `transfer_batch_to_device`).",
        ),
        Pattern(
            "mask_assign",
            "Assigning through a boolean mask (`x[mask] = v`) finds the indices with a hidden `nonzero`",
            "`x.masked_fill_(mask, v)` or `x = torch.where(mask, v, x)`: no sync.",
        ),
        Pattern("masked_select", "`masked_select` has a data-dependent size", _FIXED_SHAPE),
        Pattern(
            "unique",
            "`unique()` has a data-dependent size",
            "Count with a known number of classes instead: `F.one_hot(x, num_classes=n).sum(0)`.",
        ),
        Pattern(
            "repeat_interleave",
            "`repeat_interleave` with tensor repeats sizes its output from the GPU's values",
            "Pass `output_size=` (the total, known on the host).",
        ),
        Pattern(
            "one_hot",
            "`F.one_hot` without `num_classes` reads the largest label from the GPU",
            "Pass `num_classes=`.",
        ),
        Pattern(
            "bincount",
            "`bincount` reads the largest value from the GPU to size its output",
            "With n classes, count on the device: `F.one_hot(x, num_classes=n).sum(0)`.",
        ),
        Pattern(
            "equal",
            "`torch.equal`/`allclose` return a Python bool read from the GPU",
            "Compare on the device and keep the result a tensor (`torch.isclose(a, b).all()`), or"
            " compare once per epoch.",
        ),
        Pattern(
            "nested_mask",
            "`nn.TransformerEncoder` checks the padding mask on the GPU before it packs the batch as"
            " nested tensors",
            "`nn.TransformerEncoder(..., enable_nested_tensor=False)`: evaluation runs on the padded"
            " batch, as training does.",
        ),
        Pattern(
            "synchronize", "`torch.cuda.synchronize()` blocks the host until the GPU is idle", _NO_SYNC_CALL
        ),
        Pattern("stream_sync", "`Event.synchronize()`/`Stream.synchronize()` blocks the host", _NO_SYNC_CALL),
        Pattern(
            "empty_cache",
            "`torch.cuda.empty_cache()` syncs and hands cached memory back, so the next step pays for"
            " `cudaMalloc` again",
            "Remove it: the caching allocator reuses the memory. Against fragmentation, set"
            " `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.",
        ),
        Pattern(
            "collective",
            "A blocking collective (`all_reduce`, `broadcast`, `barrier`, ...) waits for every rank",
            "Reduce once per epoch, or pass `async_op=True` and wait later; torchmetrics metrics"
            " sync only at `compute()`.",
        ),
        Pattern(
            "cuda",
            "A synchronizing CUDA operation, reported by `torch.cuda.set_sync_debug_mode`",
            "Look at the line: a copy to the host, a data-dependent size, or a blocking copy"
            " (`non_blocking=True` from pinned memory avoids that).",
        ),
        Pattern(
            "alloc_retry",
            "The caching allocator ran out of cached blocks, freed them and retried `cudaMalloc`"
            " (a full sync)",
            _ALLOCATOR,
        ),
        Pattern(
            "sync_all_streams", "The caching allocator synchronized every stream to free memory", _ALLOCATOR
        ),
        Pattern(
            "cudnn_autotune",
            "cuDNN's autotuner (`cudnn.benchmark`) emptied the allocator's cache to try its algorithms on"
            " a new input shape (a sync of every stream)",
            "Nothing to do for a few shapes: each is tuned once. Inputs whose shape changes from step to"
            " step pay it again and again: pad or bucket them to a few shapes, or turn it off"
            " (`preset(..., cudnn_benchmark=False)`).",
        ),
    )
}

# -- classify: which torch calls sync ----------------------------------------------------------

Rule = Callable[[Sequence[Any], dict[str, Any], bool], "str | None"]


def _on_device(value: object, cuda: bool) -> bool:
    """Whether `value` is a tensor a GPU run would hold on the GPU (every tensor, on a CPU run)."""
    return isinstance(value, Tensor) and (value.is_cuda if cuda else True)


def _always(name: str) -> Rule:
    return lambda args, kwargs, cuda: name if args and _on_device(args[0], cuda) else None


def _either(name: str) -> Rule:
    return lambda args, kwargs, cuda: name if any(_on_device(a, cuda) for a in args[:2]) else None


def _is_mask(index: object) -> bool:
    if isinstance(index, (tuple, list)):
        return any(_is_mask(i) for i in index)
    return isinstance(index, Tensor) and index.dtype in (torch.bool, torch.uint8)


def _to(args: Sequence[Any], kwargs: dict[str, Any], cuda: bool) -> str | None:
    """``t.to("cpu")`` syncs; on a CPU run only a device *written* as CPU does (``t.to(self.device)``
    moves to the GPU on a GPU run, and Lightning moves batches with device objects)."""
    if not args or not _on_device(args[0], cuda) or kwargs.get("non_blocking"):
        return None
    if any(a is True for a in args[1:]):  # non_blocking given by position
        return None
    device = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)) or (cuda and isinstance(arg, Tensor)):
            device = arg.device if isinstance(arg, Tensor) else arg
    if device is None or (not cuda and not isinstance(device, str)):
        return None
    return "to_cpu" if torch.device(device).type == "cpu" else None


def slice_bound(index: object) -> Tensor | None:
    """The first tensor used as a slice's start, stop or step in `index`, else ``None``."""
    parts = index if isinstance(index, tuple) else (index,)
    bounds = (b for part in parts if isinstance(part, slice) for b in (part.start, part.stop, part.step))
    return next((b for b in bounds if isinstance(b, Tensor)), None)


def _getitem(args: Sequence[Any], kwargs: dict[str, Any], cuda: bool) -> str | None:
    if len(args) < 2:
        return None
    if _on_device(args[0], cuda) and _is_mask(args[1]):
        return "mask_index"
    return "slice_bound" if _on_device(slice_bound(args[1]), cuda) else None


def _setitem(args: Sequence[Any], kwargs: dict[str, Any], cuda: bool) -> str | None:
    if len(args) < 2:
        return None
    if _on_device(args[0], cuda) and _is_mask(args[1]):
        return "mask_assign"
    return "slice_bound" if _on_device(slice_bound(args[1]), cuda) else None


def ctc_lengths(args: Sequence[Any], kwargs: dict[str, Any]) -> list[object]:
    """`ctc_loss`'s ``input_lengths`` and ``target_lengths``, by position or keyword."""
    names = ("input_lengths", "target_lengths")
    return [args[2 + i] if len(args) > 2 + i else kwargs.get(name) for i, name in enumerate(names)]


def _ctc(args: Sequence[Any], kwargs: dict[str, Any], cuda: bool) -> str | None:
    return "ctc_lengths" if any(_on_device(t, cuda) for t in ctc_lengths(args, kwargs)) else None


def subject(pattern: str, args: Sequence[Any], kwargs: dict[str, Any]) -> object:
    """The tensor whose place decides whether `pattern` syncs: a GPU run's host tensors never do."""
    if pattern == "slice_bound":
        return slice_bound(args[1])
    if pattern == "ctc_lengths":
        return next((t for t in ctc_lengths(args, kwargs) if isinstance(t, Tensor)), None)
    return args[0] if args else None


def _where(args: Sequence[Any], kwargs: dict[str, Any], cuda: bool) -> str | None:
    return "nonzero" if len(args) == 1 and not kwargs and _on_device(args[0], cuda) else None


def _repeat_interleave(args: Sequence[Any], kwargs: dict[str, Any], cuda: bool) -> str | None:
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
    if kwargs.get("output_size") is not None or not _on_device(repeats, cuda):
        return None
    return "repeat_interleave"


def _one_hot(args: Sequence[Any], kwargs: dict[str, Any], cuda: bool) -> str | None:
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    return "one_hot" if num_classes == -1 and args and _on_device(args[0], cuda) else None


@functools.cache
def _rules() -> dict[Callable[..., Any], Rule]:
    T = torch.Tensor
    by_name: dict[str, Rule] = {
        "item": _always("item"),
        "__float__": _always("float"),
        "__int__": _always("float"),
        "__complex__": _always("float"),
        "__bool__": _always("bool"),
        "is_nonzero": _always("bool"),
        "__contains__": _always("bool"),
        "__index__": _always("index"),
        "__format__": _always("format"),
        "__repr__": _always("print"),
        "cpu": _always("cpu"),
        "to": _to,
        "tolist": _always("tolist"),
        "numpy": _always("numpy"),
        "__array__": _always("numpy"),
        "nonzero": _always("nonzero"),
        "argwhere": _always("nonzero"),
        "masked_select": _always("masked_select"),
        "__getitem__": _getitem,
        "__setitem__": _setitem,
        "unique": _always("unique"),
        "unique_consecutive": _always("unique"),
        "repeat_interleave": _repeat_interleave,
        "bincount": _always("bincount"),
        "equal": _either("equal"),
        "allclose": _either("equal"),
    }
    rules: dict[Callable[..., Any], Rule] = {}
    for name, rule in by_name.items():
        for owner in (T, torch):
            function = getattr(owner, name, None)
            if function is not None:
                rules[function] = rule
    rules[torch.where] = _where
    rules[T.index_put_] = rules[T.index_put] = lambda args, kwargs, cuda: _setitem(args, kwargs, cuda)
    rules[torch._nested_tensor_from_mask_left_aligned] = _always("nested_mask")
    rules[F.one_hot] = _one_hot
    rules[F.ctc_loss] = rules[torch.ctc_loss] = _ctc
    return rules


#: torch functions that make a tensor where `device=` says: on the host when it says nothing.
FACTORIES = frozenset(
    getattr(torch, name)
    for name in (
        "tensor",
        "as_tensor",
        "scalar_tensor",
        "ones",
        "zeros",
        "empty",
        "full",
        "arange",
        "linspace",
        "logspace",
        "eye",
        "rand",
        "randn",
        "randint",
        "randperm",
    )
)


def device_side(device: object, cuda: bool) -> bool:
    """Whether `device` (a ``device=`` argument) is the GPU in a GPU run.

    On a CPU run a device *object* (``self.device``, ``x.device``) is the run's device, which a GPU
    run points at the GPU; a string says what it means (``"cpu"`` stays on the host).
    """
    if device is None:
        return False
    if isinstance(device, str) or (cuda and isinstance(device, torch.device)):
        return torch.device(device).type == "cuda"
    return isinstance(device, (torch.device, int))


def made_on_host(func: Callable[..., Any], kwargs: dict[str, Any], cuda: bool) -> bool:
    """`func` is a factory (`FACTORIES`) told no device, or the host: its tensor stays on the host."""
    return func in FACTORIES and not device_side(kwargs.get("device"), cuda)


#: The tensor methods that copy to a device.
_COPIES = frozenset({Tensor.to, Tensor.cuda, Tensor.type_as})


def host_copy(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    cuda: bool,
    on_host: Callable[[object], bool],
) -> str | None:
    """``"h2d"`` when calling `func` copies host memory to the GPU (in a GPU run) and waits.

    A copy with ``non_blocking=True`` does not wait (from pinned memory). `on_host` says which
    tensors a CPU run's model of a GPU run keeps on the host (on CUDA the tensors say it).

    Example:
        >>> import torch
        >>> made = set()
        >>> host = lambda t: id(t) in made
        >>> weights = torch.tensor([1.0, 2.0]); made.add(id(weights))
        >>> x = torch.ones(2)  # a batch: on the GPU in a GPU run
        >>> host_copy(torch.Tensor.to, (weights, x.device), {}, False, host)
        'h2d'
        >>> host_copy(torch.Tensor.type_as, (weights, x), {}, False, host)
        'h2d'
        >>> host_copy(torch.Tensor.to, (weights, x.device), {"non_blocking": True}, False, host) is None
        True
        >>> host_copy(torch.tensor, (0.1,), {"device": x.device}, False, host)  # self.log(name, 0.1)
        'h2d'
        >>> host_copy(torch.Tensor.to, (x, x.device), {}, False, host) is None  # already there
        True
    """
    if func is torch.tensor or func is torch.as_tensor:
        data = args[0] if args else kwargs.get("data")
        from_host = not isinstance(data, Tensor) or (not data.is_cuda if cuda else on_host(data))
        return "h2d" if from_host and device_side(kwargs.get("device"), cuda) else None
    if func not in _COPIES or not args or not isinstance(args[0], Tensor):
        return None
    source = args[0]
    if (source.is_cuda if cuda else not on_host(source)) or kwargs.get("non_blocking"):
        return None
    if any(a is True for a in args[1:]):  # non_blocking given by position
        return None
    if func is Tensor.cuda:
        return "h2d"
    target = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("device"))
    if isinstance(target, Tensor):
        return "h2d" if (target.is_cuda if cuda else not on_host(target)) else None
    return "h2d" if device_side(target, cuda) else None


def classify(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None, cuda: bool
) -> str | None:
    """The `PATTERNS` name of the sync that calling `func` makes, or ``None``.

    With ``cuda=False`` every tensor is taken as one a GPU run would hold on the GPU, except where
    the device is given as an object (``.to(self.device)``), which a GPU run points at the GPU.

    Example:
        >>> import torch
        >>> x = torch.ones(3)
        >>> classify(torch.Tensor.item, (x,), None, cuda=False)
        'item'
        >>> classify(torch.Tensor.__getitem__, (x, x > 0), None, cuda=False)
        'mask_index'
        >>> classify(torch.nn.functional.one_hot, (x.long(), 4), None, cuda=False) is None
        True
        >>> classify(torch.Tensor.item, (x,), None, cuda=True) is None  # a CPU tensor on a GPU run
        True
    """
    rule = _rules().get(func)
    return None if rule is None else rule(args, kwargs or {}, cuda)


# -- attribute: whose code made it -------------------------------------------------------------


def frames_from(frame: Any) -> list[Site]:
    """The stack from `frame` (a Python frame object) outwards, as `Site`s (code not read yet)."""
    frames = []
    while frame is not None:
        frames.append(Site(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


@dataclass(frozen=True)
class Cause:
    """A library's or the framework's reason for a sync, and the setting that removes it.

    Args:
        key: short name (``"progress_bar"``).
        package: the top-level package whose frame shows it.
        file: a fragment of that frame's path (``"/"``-separated).
        functions: the frame's function names (``"*_validation"``: any name that ends so); empty
            for any.
        framework: whether it is the training framework's own sync (not the user's code).
        title: what it is.
        fix: the setting that removes it.
        in_validation: ``(title, fix)`` where validation works otherwise, if it does.
        reported: ``False`` for a one-time setup cost with nothing to change (not reported).
    """

    key: str
    package: str
    file: str
    functions: tuple[str, ...]
    framework: bool
    title: str
    fix: str
    in_validation: tuple[str, str] | None = None
    reported: bool = True

    def says(self, phase: str) -> tuple[str, str]:
        """``(title, fix)`` for a sync seen in `phase` (``"training"`` or ``"validation"``)."""
        if phase == "validation" and self.in_validation is not None:
            return self.in_validation
        return self.title, self.fix

    def matches(self, frame: Site, package: str | None) -> bool:
        return (
            package == self.package
            and self.file in frame.file.replace(os.sep, "/")
            and (not self.functions or any(_named(frame.function, name) for name in self.functions))
        )


def _named(function: str, name: str) -> bool:
    """Whether `function` is `name`, or ends with what follows a leading ``*`` in it."""
    return function.endswith(name[1:]) if name.startswith("*") else function == name


#: Known causes, most specific first: the first one any frame of the step matches is taken.
CAUSES: tuple[Cause, ...] = (
    Cause(  # in the last validation step's window: Lightning computes them before any epoch-end hook
        "epoch_values",
        "lightning",
        "/logger_connector/logger_connector.py",
        ("update_eval_epoch_metrics", "update_train_epoch_metrics"),
        True,
        "Lightning computes the epoch's logged values (metric objects, `on_epoch=True` means)",
        "Nothing to change: once per epoch, outside the steps.",
        reported=False,
    ),
    Cause(
        "sigterm",
        "lightning",
        "/loops/training_epoch_loop.py",
        ("_broadcast_sigterm_tensor",),
        True,
        "DDP: Lightning copies a SIGTERM flag to the GPU, broadcasts it before every training batch"
        " and reads it with `.item()`",
        "Lightning 2.6 has no setting for it; it is one one-element broadcast per batch, so larger"
        " batches (`AutoBatchSize`) make it rarer.",
    ),
    Cause(
        "sync_dist",
        "lightning",
        "/logger_connector/result.py",
        ("update", "compute"),
        True,
        "`self.log(..., sync_dist=True)` reduces the value across ranks at every logged step",
        "Log step values without `sync_dist`; for epoch values use `on_step=False, on_epoch=True,"
        " sync_dist=True` (one reduction per epoch), or a torchmetrics metric (syncs at `compute()`).",
    ),
    Cause(
        "checkpoint_timer",
        "lightning",
        "/callbacks/model_checkpoint.py",
        (),
        True,
        "`ModelCheckpoint(train_time_interval=...)` broadcasts its timer decision every step",
        "Checkpoint by steps or epochs: `ModelCheckpoint(every_n_train_steps=...)` or `every_n_epochs=`.",
    ),
    Cause(
        "progress_bar",
        "lightning",
        "/callbacks/progress/",
        (),
        True,
        "The progress bar reads the `prog_bar=True` values again at each refresh",
        "Refresh less often (`TQDMProgressBar(refresh_rate=50)`, `RichProgressBar(refresh_rate=50)`),"
        " or `Trainer(enable_progress_bar=False)`; fewer `prog_bar=True` values.",
    ),
    Cause(
        "lightning_moves",
        "lightning",
        "fabric/utilities/apply_func.py",
        ("batch_to",),
        True,
        "Lightning moves batches and logged state to the GPU with `non_blocking=True`",
        "Nothing to change here; pinned batches (`pin_memory=True`) make the copy truly asynchronous.",
        reported=False,
    ),
    Cause(
        "prog_bar_values",
        "lightning",
        "/logger_connector/result.py",
        ("metrics",),
        True,
        "Lightning converts each step-level `prog_bar=True` value with `.item()` after every batch,"
        " whether a progress bar shows it or not",
        "Keep step values off the bar (`prog_bar=False`, the default), or put epoch values on it"
        " (`on_step=False, on_epoch=True, prog_bar=True`): those are converted once per epoch.",
    ),
    Cause(
        "grad_scaler",
        "torch",
        "/amp/grad_scaler.py",
        (),
        True,
        "fp16 AMP: the GradScaler reads its inf/NaN check at every optimizer step",
        '`precision="bf16-mixed"` needs no scaler where the GPU has bf16 (`preset("auto")` picks it).',
    ),
    Cause(
        "metric_nan_check",
        "torchmetrics",
        "/aggregation.py",
        ("_cast_and_nan_check_input",),
        False,
        "torchmetrics aggregators (`MeanMetric`, `SumMetric`, ...) check every `update()` for NaN",
        'Build them with `nan_strategy="disable"`.',
    ),
    Cause(  # before metric_bincount: the same count, which no average removes here
        "metric_confusion_matrix",
        "torchmetrics",
        "/functional/classification/confusion_matrix.py",
        ("*_confusion_matrix_update",),
        False,
        "torchmetrics counts a confusion matrix (`JaccardIndex`, `ConfusionMatrix`, `CohenKappa`,"
        " `MatthewsCorrCoef`) with `torch.bincount`, which sizes its output from the GPU's values",
        "The count is the metric, whatever its `average`: one wait per `update()`."
        " `torch.use_deterministic_algorithms(True)` counts by"
        " comparison instead, through a table of values x classes² (small for class labels, too large"
        " for segmentation masks; it also changes other kernels).",
    ),
    Cause(
        "metric_bincount",
        "torchmetrics",
        "/utilities/data.py",
        ("_bincount",),
        False,
        "torchmetrics counts per class with `torch.bincount` (macro and weighted averages), which sizes"
        " its output from the GPU's values",
        '`average="micro"` needs no per-class counts. For class labels (not segmentation masks),'
        " `torch.use_deterministic_algorithms(True)` makes torchmetrics count by comparison instead,"
        " through a table of values x classes² (it also changes other kernels).",
    ),
    Cause(  # the input checks only: a metric's update and compute run in `/functional/` too
        "metric_validation",
        "torchmetrics",
        "/functional/",
        ("*_validation",),
        False,
        "torchmetrics validates its inputs at every `update()` (`torch.unique`, range checks)",
        "`validate_args=False` once the inputs are known to be right.",
    ),
    Cause(
        "metric_compute_groups",
        "torchmetrics",
        "torchmetrics/collections.py",
        ("_equal_metric_states",),
        False,
        "A `MetricCollection` compares its metrics' states at its first `update()` to share their"
        " computation (`compute_groups`)",
        "Nothing to change: once per collection; `compute_groups=[[...]]` names the groups instead.",
        reported=False,
    ),
    Cause(
        "metric_forward",
        "torchmetrics",
        "/torchmetrics/metric.py",
        ("_forward_reduce_state_update", "_forward_full_state_update"),
        False,
        "Calling a torchmetrics metric (`metric(preds, target)`) also computes the batch's value",
        "Call `metric.update(preds, target)` in the step and log the metric object"
        " (`self.log(name, metric)`): it is computed once per epoch.",
    ),
    Cause(
        "clip_grad",
        "torch",
        "/nn/utils/clip_grad.py",
        (),
        False,
        "`clip_grad_norm_(error_if_nonfinite=True)` reads the norm to check it",
        "`error_if_nonfinite=False` (the default); Lightning's `gradient_clip_val` does not sync.",
    ),
    Cause(
        "weight_averaging",
        "torch",
        "/optim/swa_utils.py",
        ("update_parameters",),
        False,  # the user's when called from their code; Lightning's callbacks have no user line
        "torch's `AveragedModel.update_parameters` (an EMA or SWA of the weights, Lightning's"
        " `WeightAveraging` callbacks) reads its count of updates from the GPU twice an update",
        "Update the average every few steps: `EMAWeightAveraging(update_every_n_steps=10,"
        " decay=0.99)` keeps about the average of `decay=0.999` at every step. Keeping it on the CPU"
        ' (`device="cpu"`) would copy every weight to the host instead.',
    ),
    Cause(  # the model's own, as Lightning's are the framework's: nothing in the user's step makes them
        "detection_model",
        "torchvision",
        "/models/detection/",
        (),
        True,
        "torchvision's detection models (Faster R-CNN, RetinaNet, SSD, ...) sync by design: how many"
        " boxes each image keeps (proposals, matched anchors, NMS) is known once the GPU has counted"
        " them, and the model copies small constants to the GPU at each call",
        "Nothing to change in your step: these are the model's own; the rest of the step can stay free"
        " of syncs.",
    ),
    Cause(  # the guard's own checks turn the fast path off: the check before it is what it sees
        "nested_tensor",
        "torch",
        "/nn/modules/transformer.py",
        ("forward",),
        False,
        "`nn.TransformerEncoder(enable_nested_tensor=True)`, torch's default, packs each evaluation"
        " batch as nested tensors, which also reads the rows' lengths from the GPU",
        "`nn.TransformerEncoder(..., enable_nested_tensor=False)`: evaluation runs on the padded batch,"
        " as training does (nested tensors skip the padding's work: on batches mostly padding, time"
        " both).",
    ),
    Cause(
        "distribution_validation",
        "torch",
        "/distributions/distribution.py",
        ("__init__", "_validate_sample"),
        False,
        "`torch.distributions` checks each parameter when a distribution is built, and each value"
        " `log_prob` scores, against its constraint (`validate_args`, on by default), branching on"
        " the GPU's answer",
        "`validate_args=False` where the step builds each distribution (`Normal(mean, std,"
        " validate_args=False)`, `Categorical(logits=..., validate_args=False)`), or"
        " `torch.distributions.Distribution.set_default_validate_args(False)` once before training"
        " (`python -O` too). The checks stop NaN or out-of-range parameters with an error: keep them"
        " while debugging.",
    ),
    Cause(
        "batchnorm_cumulative",
        "torch",
        "/nn/modules/batchnorm.py",
        ("forward",),
        False,
        "A BatchNorm with `momentum=None` keeps a cumulative average of the batch statistics and reads"
        " its count of batches from the GPU at each training forward (`float(num_batches_tracked)`)",
        "Give it a momentum (`nn.BatchNorm2d(c, momentum=0.1)`, torch's default). Lightning's"
        " `StochasticWeightAveraging` sets `momentum=None` itself for the extra epoch that recomputes"
        " the statistics of the averaged weights: there it is one epoch of forward passes, nothing to"
        " change.",
    ),
    Cause(
        "packed_sequence",
        "torch",
        "/nn/utils/rnn.py",
        ("pack_padded_sequence", "pad_packed_sequence"),
        False,
        "`pack_padded_sequence(..., enforce_sorted=False)` copies the batch's sort order to the GPU,"
        " and `pad_packed_sequence` copies it back to the host",
        "Sort each batch longest first in the `collate_fn` and pass `enforce_sorted=True`: there is no"
        " order to copy.",
    ),
    Cause(
        "log_number",
        "lightning",
        "/core/module.py",
        ("__to_tensor",),
        False,
        "`self.log(name, number)`: Lightning makes each Python number a tensor on the GPU, a blocking"
        " copy at every call",
        "Log the tensor itself (`self.log(name, loss)`, not `loss.item()` or a float); log a constant"
        " once per epoch (`on_step=False, on_epoch=True`), and learning rates with `LearningRateMonitor`.",
    ),
    Cause(
        "logging",
        "lightning",
        "/logger_connector/logger_connector.py",
        ("log_metrics",),
        True,
        "Logged values are read with `.item()` every `log_every_n_steps`",
        "`Trainer(log_every_n_steps=...)`: a larger interval means fewer reads.",
        (
            "Values logged with `on_step=True` in `validation_step` are read with `.item()` at every"
            " validation step (`log_every_n_steps` does not apply to validation)",
            "Log them per epoch: `self.log(name, value)` without `on_step=True` (validation's default"
            " is `on_step=False, on_epoch=True`: one read per epoch), or update a torchmetrics metric"
            " in the step and log the metric object.",
        ),
    ),
)

#: Files of torch that only route a call (the tensor API, its formatting), never a library's choice.
_TORCH_API = ("/_tensor.py", "/_tensor_str.py", "/functional.py", "/overrides.py", "/_jit_internal.py")


@dataclass(frozen=True)
class Attribution:
    """Whose code made a sync.

    Args:
        site: the user's innermost line in the step, if any.
        hook: the outermost user function of the step's stack (``training_step``,
            ``on_train_batch_end``), if any.
        library: the innermost library frame below the user's line (not torch's tensor API).
        package: that frame's top-level package.
        cause: the known `Cause`, if one matched.
        framework: whether the framework made it (no user line, or Lightning in between).
    """

    site: Site | None
    hook: str | None
    library: Site | None
    package: str | None
    cause: Cause | None
    framework: bool


#: Lightning's standalone namespaces (``import pytorch_lightning as pl``) are Lightning too.
LIGHTNING_ALIASES = {"pytorch_lightning": "lightning", "lightning_fabric": "lightning"}


class Packages:
    """Which installed package a source file belongs to (``None``: the user's own code).

    Lightning's code is ``"lightning"`` under either namespace: ``pytorch_lightning`` and
    ``lightning_fabric`` (the standalone packages) are the same framework.
    """

    def __init__(self, extra: Iterable[str] = ()) -> None:
        paths = sysconfig.get_paths()
        self._stdlib = tuple({paths["stdlib"], paths["platstdlib"]})
        self._site = tuple({paths["purelib"], paths["platlib"]})
        self._known: list[tuple[str, str]] = []
        for name in (
            "lightning_boost",
            "lightning",
            "pytorch_lightning",
            "lightning_fabric",
            "torchmetrics",
            "torchvision",
            "torch",
            *extra,
        ):
            module = sys.modules.get(name)
            if module is not None and getattr(module, "__file__", None):
                self._known.append((str(Path(module.__file__).parent), name))  # type: ignore[arg-type]
        self._cache: dict[str, str | None] = {}

    def __call__(self, file: str) -> str | None:
        if file not in self._cache:
            self._cache[file] = self._package(file)
        return self._cache[file]

    def _package(self, file: str) -> str | None:
        for directory, name in self._known:
            if file.startswith(directory + os.sep):
                return LIGHTNING_ALIASES.get(name, name)
        for directory in self._site:
            if file.startswith(directory + os.sep):
                name = file[len(directory) + 1 :].split(os.sep)[0].removesuffix(".py")
                return LIGHTNING_ALIASES.get(name, name)
        if file.startswith(self._stdlib) or file.startswith("<"):
            return "python"
        return None


def _is_loop(frame: Site, package: str | None) -> bool:
    """Lightning's loops: the edge of the step (``trainer.fit`` and the user's script lie beyond)."""
    return package == "lightning" and "/loops/" in frame.file.replace(os.sep, "/")


def _is_data_loading(frame: Site, package: str | None) -> bool:
    return package == "torch" and "/utils/data/" in frame.file.replace(os.sep, "/")


def attribute(frames: Sequence[Site], packages: Callable[[str], str | None]) -> Attribution | None:
    """Read a sync's stack, innermost frame first; ``None`` when it belongs to data loading or
    to a cause not worth reporting (a one-time setup cost).

    The walk stops at Lightning's loops, so the user's script that called ``trainer.fit`` is never
    taken for the step's code. Data loading (``torch.utils.data``) runs on the host by design.

    Example:
        >>> pkgs = {"/venv/torchmetrics/aggregation.py": "torchmetrics",
        ...         "/venv/lightning/pytorch/loops/fit_loop.py": "lightning"}.get
        >>> a = attribute([Site("/venv/torchmetrics/aggregation.py", 93, "_cast_and_nan_check_input"),
        ...                Site("/home/me/model.py", 41, "training_step"),
        ...                Site("/venv/lightning/pytorch/loops/fit_loop.py", 200, "run"),
        ...                Site("/home/me/train.py", 9, "<module>")], pkgs)
        >>> a.site.location, a.hook, a.package, a.cause.key, a.framework
        ('/home/me/model.py:41', 'training_step', 'torchmetrics', 'metric_nan_check', False)
    """
    site = hook = library = package = None
    causes: set[int] = set()
    for frame in frames:
        pkg = packages(frame.file)
        if _is_data_loading(frame, pkg):
            return None
        causes.update(i for i, c in enumerate(CAUSES) if c.matches(frame, pkg))
        if _is_loop(frame, pkg):
            break
        if pkg is None:
            site = site or frame
            hook = frame.function
        elif site is None and library is None and pkg not in ("python",) and not _torch_api(frame, pkg):
            library, package = frame, pkg
    cause = CAUSES[min(causes)] if causes else None
    if cause is not None and not cause.reported:
        return None
    framework = site is None or (cause.framework if cause else package == "lightning")
    return Attribution(site, hook, library, package, cause, framework)


def _torch_api(frame: Site, package: str | None) -> bool:
    return package == "torch" and frame.file.replace(os.sep, "/").endswith(_TORCH_API)


def code_at(frame: Site) -> str:
    """The text of `frame`'s line without its comment (``""`` when the source cannot be read).

    Example:
        >>> import inspect
        >>> here = Site(__file__, inspect.getsourcelines(code_at)[1], "code_at")
        >>> code_at(here)
        'def code_at(frame: Site) -> str:'
    """
    text = linecache.getline(frame.file, frame.line).strip()
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                return text[: token.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):  # a line in the middle of a bracket: keep it whole
        pass
    return text


# -- group: what the report says ---------------------------------------------------------------


#: A user's read made this many times a step or more is a read inside a loop.
LOOPED = 4


@dataclass
class SyncGroup:
    """The syncs seen at one place: one user line (whatever made them there), or one framework
    cause.

    Args:
        phase: ``"training"`` or ``"validation"``.
        attribution: the first sync's: its user line and hook name the place.
        code: the text of the user's line (empty for the framework's own).
        reasons: what made them (`reason`: a library's known cause, a library's other code, or the
            user's own call) -> that attribution and its own counts.
        first_checked: the phase's checked steps before the one it was first seen in.
        batches: the batch indices (in their epoch) of the steps it was seen in.
    """

    phase: str
    attribution: Attribution
    code: str = ""
    reasons: dict[str, tuple[Attribution, dict[str, int]]] = field(default_factory=dict)
    first_checked: int = 0
    batches: set[int] = field(default_factory=set)

    @staticmethod
    def key(phase: str, attribution: Attribution) -> tuple[str, ...]:
        """One group per user line, so each line is reported once with every reason it syncs for;
        the framework's own, one per known cause, else per library function (its title's)."""
        a = attribution
        if a.framework and a.cause is not None:
            return (phase, "framework", a.cause.key)
        if a.framework and a.site is None and a.library is not None:
            return (phase, "framework", a.library.file, a.library.function)
        place = a.site or a.library
        return (phase, "framework" if a.framework else "user", place.location if place else "")

    def add(self, pattern: str, count: int = 1, attribution: Attribution | None = None) -> None:
        a = attribution or self.attribution
        counts = self.reasons.setdefault(reason(a), (a, {}))[1]
        counts[pattern] = counts.get(pattern, 0) + count

    @property
    def counts(self) -> dict[str, int]:
        """Pattern name -> syncs seen over the checked steps, every reason's together."""
        total: dict[str, int] = {}
        for _, counts in self.reasons.values():
            for pattern, count in counts.items():
                total[pattern] = total.get(pattern, 0) + count
        return total

    @property
    def framework(self) -> bool:
        return self.attribution.framework

    @property
    def location(self) -> str | None:
        """The user's line; for the framework's own syncs without a known cause, its line."""
        a = self.attribution
        place = a.site or (a.library if a.cause is None else None)
        return place.location if place else None

    def per_step(self, steps: int) -> float:
        return sum(self.counts.values()) / max(steps, 1)

    def title(self, steps: int, so_far: bool = False) -> str:
        """The finding's title over `steps` checked steps; `so_far`: the warning's, over the
        `steps` checked since the group was first seen (the report counts every checked step, and
        a `MetricCollection` syncs more in its first step, before it merges its compute groups)."""
        rate = f"{self.per_step(steps):.3g}x per {self.phase} step"
        if so_far:
            rate += f" over the {steps} checked since it was first seen"
        a = self.attribution
        if self.framework:
            where = f"{a.package} syncs in `{a.library.function}`" if a.library else "The framework syncs"
            what = a.cause.says(self.phase)[0] if a.cause else where
            return f"{what} ({rate})"
        return f"`{self.code}` syncs {rate} in {a.hook}"

    def only_at(self, checked_batches: set[int]) -> int | None:
        """The one batch index of its epoch the group synced at, where steps at other indices were
        checked and did not sync there (``if batch_idx == 0:`` logging a sample image, reading a
        value once a pass); ``None`` otherwise.

        Example:
            >>> mine = Attribution(None, "validation_step", None, None, None, framework=False)
            >>> group = SyncGroup("validation", mine, batches={0})
            >>> group.only_at({0, 1, 2}), group.only_at({0})
            (0, None)
        """
        if len(self.batches) != 1 or not checked_batches - self.batches:
            return None
        return next(iter(self.batches))

    def once_title(self, steps: int, batch: int) -> str:
        """The title of a user line that synced only at `batch` of its epoch (`only_at`)."""
        return (
            f"`{self.code}` syncs only at batch_idx {batch} of a {self.phase} epoch, in"
            f" {self.attribution.hook} ({sum(self.counts.values())}x over {steps} checked steps)"
        )

    def detail(
        self, steps: int, cpu_run: bool, batch: int | None = None, checked_batches: Collection[int] = ()
    ) -> str:
        """What the group's syncs are, over `steps` checked steps; `batch`: the one batch index it
        synced at (`only_at` over `checked_batches`), said so."""
        parts = [f"{PATTERNS[p].what} ({n}x)" for p, n in self.counts.items()]
        text = "; ".join(parts) + f", over {steps} checked {self.phase} step(s)."
        if batch is not None:
            text += (
                f" Only steps at batch_idx {batch} synced here, of the checked batch indices"
                f" {_listed([str(b) for b in sorted(checked_batches)])}: one wait a pass at most, which"
                " costs next to nothing; nothing to change."
            )
        told: set[str] = set()
        for a, _ in self.reasons.values():
            if a.library is None or a.package in (None, "lightning"):
                continue
            if a.cause is not None:
                why = a.cause.says(self.phase)[0]
                text += f" Inside {a.package} ({a.library.function} at {a.library.location}): {why}."
            elif a.package not in told:  # one sentence per library: its functions of no known cause
                told.add(a.package)
                places = [f"{f.function} at {f.location}" for f in self._unexplained(a.package)]
                text += f" Inside {a.package} ({_listed(places)})."
        a = self.attribution
        if self.framework and a.site is not None:
            text += f" Called from `{self.code}` at {a.site.location}."
        if cpu_run:
            text += " This run is on the CPU: on a GPU each would make the host wait."
        return text

    def fix(self, steps: int | None = None) -> str:
        """Each reason's fix (`_fix`), in the order the reasons were first seen."""
        fixes = (self._fix(a, counts, steps) for a, counts in self.reasons.values())
        return " ".join(dict.fromkeys(fixes))

    def _fix(self, a: Attribution, counts: dict[str, int], steps: int | None) -> str:
        """The cause's setting; for a library's sync of no known cause, where to look (advice meant
        for the user's own `.item()` would not fit a line inside a library); for the user's read
        made `LOOPED` times a step or more (over `steps` checked ones), one read before the loop."""
        if a.cause is not None:
            return a.cause.says(self.phase)[1]
        per_step = sum(counts.values()) / max(steps or 1, 1)
        reads = {"item", "float", "index", "format", "cpu", "to_cpu", "tolist", "numpy"} & set(counts)
        if steps and not self.framework and reads and per_step >= LOOPED:
            return (
                f"This line runs {per_step:.3g}x per {self.phase} step, as in a loop over a"
                " tensor's elements: read the tensor to the host once, before the loop (`values ="
                " tensor.tolist()`, or `.cpu()`), and use the Python values inside it; better still,"
                " keep the whole computation in tensor ops."
            )
        if a.library is not None and a.package not in (None, "lightning") and not self.framework:
            functions = [f"`{f.function}`" for f in self._unexplained(a.package)]
            return (
                f"It syncs inside {a.package} (in {_listed(functions)}): look for a {a.package} setting"
                " that avoids it, or make this call less often (once per epoch, or every N steps)."
            )
        return " ".join(dict.fromkeys(PATTERNS[p].fix for p in counts))

    def _unexplained(self, package: str | None) -> list[Site]:
        """The functions inside `package` where syncs of no known cause were made: each one's
        first frame, first seen first."""
        firsts: dict[str, Site] = {}
        for a, _ in self.reasons.values():
            if a.library is not None and a.package == package and a.cause is None:
                firsts.setdefault(a.library.function, a.library)
        return list(firsts.values())

    def to_data(self, steps: int) -> dict[str, Any]:
        a = self.attribution
        reasons = [r for r, _ in self.reasons.values()]
        return {
            "phase": self.phase,
            "framework": self.framework,
            "hook": a.hook,
            "function": a.site.function if a.site else None,
            "code": self.code,
            "syncs": dict(self.counts),
            "per_step": round(self.per_step(steps), 4),
            "checked_steps": steps,
            "causes": [r.cause.key for r in reasons if r.cause],
            "libraries": [f"{r.package}.{r.library.function}" for r in reasons if r.library],
            "batches": sorted(self.batches),
        }


#: Places listed by name in one sentence; past it, how many more.
LISTED = 6


def _listed(names: list[str]) -> str:
    """`names` joined, the first `LISTED` of them, with how many more.

    Example:
        >>> _listed(["a", "b"]), _listed([str(n) for n in range(8)])
        ('a, b', '0, 1, 2, 3, 4, 5 and 2 more')
    """
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more


def reason(a: Attribution) -> str:
    """What made a sync at a place, for `SyncGroup.reasons`: a known cause, else the library
    frame it was made in, else ``""`` (the user's own call)."""
    if a.cause is not None:
        return a.cause.key
    return a.library.location if a.library else ""
