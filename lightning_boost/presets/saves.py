"""Checkpoint saves off the training thread, in order, and never at the cost of a checkpoint.

A `ModelCheckpoint` save stops training while the checkpoint is serialized and written, and
while the file it replaces is removed: fitting the demo's ResNet-18 (94 MB with its optimizer
state), the training thread spent 1.60 s in 8 saves and their removals on an H200 and 2.72 s on a
2-CPU host (`python -m benchmarks checkpoint_saves`; in the background 0.61 s and 0.08 s).
`BackgroundSaves` copies the checkpoint's
tensors to host memory on the training thread (where the values are taken, so the next step
cannot change them) and hands the serialization, the write and the removals to one worker
thread, which runs them in the order they were asked for:

- a CUDA tensor's copy goes into pinned memory without waiting for the device (`host_copy`): it
  is queued on the tensor's stream ahead of the next step's in-place updates, and the worker
  waits for it before it writes; other tensors are copied at once;
- a file a save replaces is removed only after that save has landed; a failed save keeps it,
  and the next save, removal, load or the end of the fit raises the error;
- at most one save is in flight: a save waits for the one before it, so host memory holds one
  copy of the state;
- a load (``trainer.test(ckpt_path="best")``, a resume), the ``on_train_end`` hooks (where
  users upload or evaluate the fit's checkpoints: `SavesLanded`) and the strategy's teardown wait
  for every write first, so the file is whole when anything reads it.

The file holds the same values, as host tensors: Lightning's loads (a resume, ``ckpt_path=``,
``load_from_checkpoint``) put them on the model's device as before, and a bare ``torch.load`` of
it needs no GPU. PyTorch's ``torch.distributed.checkpoint.async_save`` stages to host memory the
same way.
Lightning's experimental `AsyncCheckpointIO` clones on the device (a second copy of the state in
GPU memory) and removes the old file while the new one may still be unwritten.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning.fabric.plugins.io import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Callback
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_boost.report import Finding, Severity

#: How a user turns it off, for the error message.
OFF = "preset(..., background_saves=False)"
#: The most bytes of CUDA tensors a save copies into pinned host memory without waiting for the
#: device; a larger checkpoint's are copied as the CPU's are, each copy waiting. PyTorch's caching
#: host allocator keeps the pinned blocks for the next save, so this is also what stays pinned.
PINNED_LIMIT_BYTES = 4 << 30


def file_readers(loggers: Iterable[object]) -> list[str]:
    """The names of `loggers` that read each checkpoint file as it is saved: those that log models
    (``log_model``: WandbLogger, MLFlowLogger, ...) and any other whose `after_save_checkpoint` is
    its own (it may open the file). A save in the background could leave them no file to read.

    Example:
        >>> from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
        >>> file_readers([CSVLogger("logs"), TensorBoardLogger("logs")])
        []
    """
    return [type(logger).__name__ for logger in loggers if _reads_files(logger)]


def _reads_files(logger: object) -> bool:
    if hasattr(logger, "_log_model"):
        return bool(logger._log_model)
    hook = getattr(type(logger), "after_save_checkpoint", None)
    return getattr(hook, "__qualname__", "") not in _NO_OP_HOOKS


#: `after_save_checkpoint` hooks that do nothing (Lightning's base logger's and TensorBoard's).
_NO_OP_HOOKS = ("Logger.after_save_checkpoint", "TensorBoardLogger.after_save_checkpoint")


def copies_saved_files(callbacks: Iterable[object]) -> bool:
    """Whether a `ModelCheckpoint` would copy a file just saved: ``save_last="link"`` links
    ``last.ckpt`` to it, and copies it where links need permissions (Windows)."""
    return os.name == "nt" and any(getattr(c, "save_last", None) == "link" for c in callbacks)


def saves_finding(readers: list[str]) -> Finding:
    """What the preset did with the run's checkpoint saves: on a worker thread, or not (`readers`:
    what reads each file as it is saved)."""
    if readers:
        title = f"checkpoint saves on the training thread: {', '.join(readers)} reads each file saved"
        detail = "a save in the background could leave it no file to read yet"
    else:
        title = "checkpoint saves in the background"
        detail = (
            "the training thread copies the checkpoint's tensors to host memory and goes on; a worker"
            " thread writes the file and then removes the one it replaces, in order, and a load or the"
            f" end of the fit waits for it. {OFF} saves on the training thread"
        )
    data = {"background_saves": not readers}
    return Finding("preset", "precision and strategy", Severity.INFO, title, detail, data=data)


def host_copy(checkpoint: dict[str, Any], pin: bool = True) -> tuple[dict[str, Any], Callable[[], None]]:
    """`checkpoint` with new containers and every tensor copied to host memory (detached), and the
    wait for those copies, to call before reading them.

    With `pin`, CUDA tensors (`PINNED_LIMIT_BYTES` at most in all) are copied into pinned memory
    without waiting for the device, on each device's current stream: queued ahead of whatever the
    training thread launches next (the optimizer's in-place updates), each copy holds the value
    at the call, and the wait is an event recorded after them. Other tensors are copied at once.

    Example:
        >>> snapshot, landed = host_copy({"state_dict": {"w": torch.ones(2, requires_grad=True)}})
        >>> landed()
        >>> snapshot["state_dict"]["w"]
        tensor([1., 1.])
    """
    tensors: list[torch.Tensor] = []
    apply_to_collection(checkpoint, torch.Tensor, tensors.append)
    pinned = sum(t.nbytes for t in tensors if _pinnable(t))
    if not pin or not pinned or pinned > PINNED_LIMIT_BYTES:
        return apply_to_collection(checkpoint, torch.Tensor, _copied), _landed
    streams: dict[torch.device, torch.cuda.Stream] = {}

    def staged(t: torch.Tensor) -> torch.Tensor:
        if not _pinnable(t):
            return _copied(t)
        streams.setdefault(t.device, torch.cuda.current_stream(t.device))
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach(), non_blocking=True)

    snapshot = apply_to_collection(checkpoint, torch.Tensor, staged)
    return snapshot, functools.partial(_landed, *map(_recorded, streams.values()))


def _pinnable(t: torch.Tensor) -> bool:
    return t.is_cuda and t.layout is torch.strided and not t.is_quantized


def _copied(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event after everything queued on `stream` so far; waiting for it sleeps (no CPU spun)."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


def _landed(*events: torch.cuda.Event) -> None:
    """Wait for `events` (the GIL released meanwhile)."""
    for event in events:
        event.synchronize()


class BackgroundSaves(CheckpointIO):
    """Runs `inner`'s saves and removals on one worker thread, in order (see the module)."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner
        self._worker: ThreadPoolExecutor | None = None
        self._last: Future[None] | None = None
        self._error: tuple[str, BaseException] | None = None  # kept: nothing after it runs
        self._raised = False
        self._pin = True  # until pinned memory cannot be had

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any = None) -> None:
        self._wait()
        fs = get_filesystem(path)  # the directory now: `save_last="link"` links into it at once
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        snapshot, landed = self._host_copy(checkpoint)
        self._submit(f"saving {path}", self._write, snapshot, landed, path, storage_options)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        self._raise()
        self._submit(f"removing {path}", self.inner.remove_checkpoint, path)

    @override
    def load_checkpoint(self, path: _PATH, *args: Any, **kwargs: Any) -> Any:
        self._wait()
        return self.inner.load_checkpoint(path, *args, **kwargs)

    @override
    def teardown(self) -> None:
        """Wait for every save and removal, stop the worker, then raise a failure not raised yet
        (one already raised is ending the fit: teardown runs while it propagates)."""
        try:
            if self._last is not None:
                self._last.result()
            if not self._raised:
                self._raise()
        finally:
            self._last = None
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self.inner.teardown()

    def _host_copy(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], None]]:
        """`host_copy`, without pinned memory from the first time it cannot be allocated (the
        device's copies then wait, as a save on the training thread's do)."""
        if self._pin:
            try:
                return host_copy(checkpoint)
            except RuntimeError:  # pinned memory refused: copies already queued finish on their own
                self._pin = False
        return host_copy(checkpoint, pin=False)

    def _write(
        self, snapshot: dict[str, Any], landed: Callable[[], None], path: _PATH, storage_options: Any
    ) -> None:
        """On the worker: the write, once the snapshot's copies have landed."""
        landed()
        self.inner.save_checkpoint(snapshot, path, storage_options)

    def _submit(self, what: str, work: Callable[..., None], *args: Any) -> None:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-boost-saves")
        self._last = self._worker.submit(self._run, what, work, *args)

    def _run(self, what: str, work: Callable[..., None], *args: Any) -> None:
        """On the worker: skip everything after a failure (a removal must not follow a failed save)."""
        if self._error is not None:
            return
        try:
            work(*args)
        except BaseException as error:  # re-raised on the training thread
            self._error = (what, error)

    def wait(self) -> None:
        """Block until every save and removal asked for so far is done; raise a failure."""
        self._wait()

    def _wait(self) -> None:
        """Block until everything asked for so far is done; raise a failure."""
        if self._last is not None:
            self._last.result()
            self._last = None
        self._raise()

    def _raise(self) -> None:
        """Raise the failure, at every call after it: nothing more is saved or removed."""
        if self._error is None:
            return
        what, error = self._error
        self._raised = True
        raise RuntimeError(
            f"lightning-boost: {what} in the background failed ({type(error).__name__}: {error}). The"
            " checkpoints saved before it are kept: the removals queued after it were skipped. Fix the"
            f" cause (disk space, permissions), or save on the training thread with {OFF}."
        ) from error


class SavesLanded(Callback):
    """Waits for `saves` before the ``on_train_end`` hooks after it, where users read the fit's
    checkpoint files (an upload, an evaluation of ``best_model_path``): placed first among the
    trainer's callbacks, it lands the last save of the fit, which training no longer overlaps."""

    def __init__(self, saves: BackgroundSaves) -> None:
        self.saves = saves

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.saves.wait()
