"""The one place lightning-boost reads Lightning internals that have no public API (tested)."""

from __future__ import annotations

import atexit
import copy
import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from typing_extensions import override

from lightning_boost.hardware import HardwareInfo
from lightning_boost.trainer_reads import TrainerReads


def from_pytorch_lightning(obj: object) -> bool:
    """`obj`'s class derives from a ``pytorch_lightning`` class (a ``pl.Trainer``, a user's subclass)."""
    return any(cls.__module__.split(".")[0] == "pytorch_lightning" for cls in type(obj).__mro__)


def namespace_of(obj: object) -> str:
    """``"pytorch_lightning"`` when `obj`'s class derives from a ``pytorch_lightning`` class, else
    ``"lightning"``."""
    return "pytorch_lightning" if from_pytorch_lightning(obj) else "lightning"


_TWINS: dict[str, type] = {}


#: The callback hooks Lightning calls at every batch (`_call_callback_hooks`).
BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)


def skip_unused_batch_hooks(cls: type[L.Callback]) -> None:
    """Let Lightning skip the per-batch hooks the pack's callback class `cls` leaves as
    ``Callback``'s no-ops.

    Lightning calls every hook of every callback at every batch, a no-op too, each in a profiler
    context: about 1.6 µs a call on the 2-CPU development host (timed by hand), 35 calls a training
    step for the pack's seven callbacks. It calls one only when it is ``callable``, so such a hook
    reads ``None`` on an instance of the pack's own classes (`_Unused`); a user's subclass, and
    ``super()`` in it, gets the no-op, as from any callback.
    """
    if not _ours(cls):
        return
    for name in BATCH_HOOKS:
        if getattr(cls, name) is getattr(L.Callback, name):
            setattr(cls, name, _Unused(name))


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "lightning_boost"


class _Unused:
    """A per-batch hook left as ``Callback``'s no-op: ``None`` on an instance of the pack's own
    class, for Lightning to skip; the no-op itself for a subclass of anyone else's."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is not None and _ours(type(instance)):
            return None
        return getattr(L.Callback, self.name).__get__(instance, owner)


def pytorch_lightning_twin(cls: type) -> type:
    """`cls`, a ``lightning`` `LightningDataModule` subclass, as a ``pytorch_lightning`` one: a
    subclass of both in which every attribute `cls` takes from ``lightning``'s own classes is
    ``pytorch_lightning``'s. Lightning's ``is_overridden`` compares code objects, so ``lightning``'s
    default hooks would look overridden to a ``pytorch_lightning`` Trainer (which would then prefer
    the datamodule's default ``transfer_batch_to_device`` over the model's own)."""
    import pytorch_lightning as pl

    key = f"{cls.__module__}.{cls.__qualname__}:{id(cls)}"
    if key in _TWINS:
        return _TWINS[key]
    base = pl.LightningDataModule
    names = {name for klass in base.__mro__[:-1] for name in vars(klass) if not name.startswith("__")}
    taken = {
        name: inspect.getattr_static(base, name)
        for name in names
        if _owner(cls, name).__module__.split(".")[0] == "lightning"
    }
    body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    twin = type(cls.__name__, (cls, base), {**taken, **body, "__reduce_ex__": _reduce_twin})
    return _TWINS.setdefault(key, twin)


def _owner(cls: type, name: str) -> type:
    return next((klass for klass in cls.__mro__ if name in vars(klass)), object)


def _reduce_twin(self: Any, protocol: Any) -> tuple[Any, ...]:
    """Pickled as its `lightning` class's instance and made a twin again when loaded (the twin class
    is made at run time: pickle cannot find it by name)."""
    original = type(self).__mro__[1]
    return (_new_twin, (original,), dict(vars(self)))


def _new_twin(cls: type) -> Any:
    return object.__new__(pytorch_lightning_twin(cls))


def trainer_precision_flag(trainer: L.Trainer) -> str:
    """The precision the user passed to `Trainer` ("32-true" when none was passed).

    `trainer.precision` reports the strategy's plugin, which is the preset's when the strategy
    carries one, so the user's own choice is only on the accelerator connector.
    """
    return str(trainer._accelerator_connector._precision_flag)


def moved_as_the_loop_moves(trainer: L.Trainer, batch: Any) -> Any:
    """`batch` as Lightning's loops hand a loader's batch to a step: converted by the precision
    plugin (``"bf16-true"``, ``"64-true"`` cast its floating tensors), through the
    ``on_before_batch_transfer`` hook, then moved by the strategy (``transfer_batch_to_device``,
    ``on_after_batch_transfer``); each hook the model's or the datamodule's, as Lightning picks."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def call_step(module: L.LightningModule, name: str, batch: Any, batch_idx: int = 0) -> Any:
    """Call ``module.<name>`` (``training_step``, ``validation_step``) the way Lightning's loops do:
    with `batch_idx` only where the signature takes it (``def training_step(self, batch)`` is legal).
    """
    step = getattr(module, name)
    if is_param_in_hook_signature(step, "batch_idx", min_args=2):
        return step(batch, batch_idx)
    return step(batch)


def overrides(instance: object, hook: str) -> bool:
    """Whether `instance`'s class implements `hook` itself rather than inheriting Lightning's
    default, under either namespace (`lightning` or `pytorch_lightning`; Lightning's own
    ``is_overridden`` knows only its own).

    Example:
        >>> import lightning as L
        >>> class Model(L.LightningModule):
        ...     def validation_step(self, batch, batch_idx): ...
        >>> overrides(Model(), "validation_step"), overrides(Model(), "test_step")
        (True, False)
    """
    if getattr(instance, hook, None) is None:  # removed with `validation_step = None`
        return False
    for base in type(instance).__mro__:
        if base.__module__.split(".")[0] in ("lightning", "pytorch_lightning") and hook in vars(base):
            return getattr(type(instance), hook) is not getattr(base, hook)
    return True


def is_lightning(instance: object, *names: str) -> bool:
    """Whether `instance` is of Lightning's class named one of `names` (or a subclass), under either
    namespace: ``isinstance`` against ``lightning``'s class is false for ``pytorch_lightning``'s.

    Example:
        >>> from pytorch_lightning.loggers import CSVLogger
        >>> is_lightning(CSVLogger("logs"), "TensorBoardLogger", "CSVLogger")
        True
    """
    return any(
        base.__name__ in names and base.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
        for base in type(instance).__mro__
    )


def pytorch_lightning_takes_our_callbacks() -> bool:
    """Whether ``pytorch_lightning.Trainer`` takes callbacks of the ``lightning`` namespace: from
    pytorch-lightning 2.6.0 on (before, its check of stateful callbacks raised "Expected a parent")."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("pytorch-lightning")) >= Version("2.6.0")


def user_hyperparameters(trainer: L.Trainer) -> dict[str, Any]:
    """What Lightning logs as hyperparameters when fit starts: the model's and the datamodule's
    ``hparams_initial`` (each unless saved with ``logger=False``; none with autolog turned off)."""
    if not getattr(trainer, "enable_autolog_hparams", True):
        return {}
    params: dict[str, Any] = {}
    for holder in (trainer.lightning_module, datamodule_of(trainer)):
        if holder is not None and getattr(holder, "_log_hyperparams", False):
            params.update(holder.hparams_initial)
    params.pop("_class_path", None)  # LightningCLI's, which Lightning does not log either
    return params


def hold_hyperparameters(trainer: L.Trainer) -> Callable[[], None]:
    """Keep Lightning from logging the hyperparameters at fit start (they go out later, once, with
    the tuned values: a second call is a second, competing TensorBoard session); returns the undo."""
    holders = [h for h in (trainer.lightning_module, datamodule_of(trainer)) if h is not None]
    saved = [(holder, getattr(holder, "_log_hyperparams", False)) for holder in holders]
    for holder in holders:
        holder._log_hyperparams = False

    def undo() -> None:
        for holder, value in saved:
            holder._log_hyperparams = value

    return undo


def reload_every_n_epochs(trainer: L.Trainer) -> int:
    """``Trainer(reload_dataloaders_every_n_epochs=...)``, which Lightning stores without declaring it."""
    return int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0))


def training_batch_index(module: L.LightningModule | None) -> int | None:
    """The index (0: the first, counted over every epoch by Lightning's loop) of the training batch
    `module`'s fit is in; ``None`` outside a fit's training."""
    trainer = None if module is None else module._trainer
    if trainer is None or not trainer.training:
        return None
    return trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1


def callbacks_of(trainer: L.Trainer) -> list[L.Callback]:
    """``trainer.callbacks``: public, but set by a connector, so type checkers do not see it."""
    callbacks: list[L.Callback] = getattr(trainer, "callbacks")  # noqa: B009
    return callbacks


def has_callback(trainer: L.Trainer, name: str) -> bool:
    """Whether a callback of `trainer` is of Lightning's class `name`, under either namespace
    (`is_lightning`)."""
    return any(is_lightning(callback, name) for callback in callbacks_of(trainer))


def datamodule_of(trainer: L.Trainer) -> L.LightningDataModule | None:
    """``trainer.datamodule`` (set by a connector, like `callbacks_of`); ``None`` without one."""
    return getattr(trainer, "datamodule", None)


def training_log_step(trainer: L.Trainer) -> int | None:
    """The step Lightning logs this training batch's metrics at, or ``None`` when it does not log it.

    The same private pair Lightning's own `DeviceStatsMonitor` and `LearningRateMonitor` read, so
    boost metrics land on the same rows as the user's (``log_every_n_steps`` cadence).
    """
    if not trainer._logger_connector.should_update_logs:
        return None
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def on_training_fetch(trainer: L.Trainer, call: Callable[[], None]) -> Callable[[], None]:
    """Calls `call` each time the fit's training loop asks its loader for a batch; returns what
    stops it. Lightning starts its profiler's ``train_dataloader_next`` action there, through the
    epoch loop's ``_on_before_fetch``, which it hands to each epoch's data fetcher (the loop's
    instance attribute shadows the method; the current fetcher gets it too). Where a Lightning
    version has no such hook, `call` is never called (the step-time split then counts the whole
    span between steps as the wait for data)."""
    loop = trainer.fit_loop.epoch_loop
    before = getattr(loop, "_on_before_fetch", None)
    if before is None:
        return lambda: None

    active = True

    def fetch() -> None:
        before()
        if active:
            call()

    shadowed = "_on_before_fetch" in vars(loop)  # another caller's, set before ours
    loop._on_before_fetch = fetch  # type: ignore[method-assign]
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None and fetcher._start_profiler == before:
        fetcher._start_profiler = fetch

    def stop() -> None:
        nonlocal active
        active = False
        if vars(loop).get("_on_before_fetch") is fetch:
            if shadowed:
                loop._on_before_fetch = before  # type: ignore[method-assign]
            else:
                del loop._on_before_fetch
        current = trainer.fit_loop._data_fetcher
        if current is not None and current._start_profiler is fetch:
            current._start_profiler = before

    return stop


class _RebuildingSource(_DataLoaderSource):
    """A loop's dataloader source whose loaders pass through `rebuild` before the loop sees them."""

    def __init__(self, original: _DataLoaderSource, rebuild: Callable[[Any], Any]) -> None:
        super().__init__(original.instance, original.name)
        self.original = original
        self.rebuild = rebuild

    # The original answers (its own class knows its namespace: `pytorch_lightning` too); Lightning
    # may point this source at another instance, which the original follows.

    @override
    def dataloader(self) -> Any:
        self.original.instance = self.instance
        return self.rebuild(self.original.dataloader())

    @override
    def is_defined(self) -> bool:
        self.original.instance = self.instance
        return self.original.is_defined()

    @override
    def is_module(self) -> bool:
        self.original.instance = self.instance
        return self.original.is_module()


def rebuild_dataloaders(
    trainer: L.Trainer, stage: str, rebuild: Callable[[str, Any], Any]
) -> Callable[[], None]:
    """Route the loaders `stage` requests through ``rebuild(split, loaders)``; return the undo.

    Lightning has no public hook between "the user's ``*_dataloader()`` returned" and "the loop
    uses it"; the loops' ``_data_source`` is that point. For ``"fit"`` the train and val loaders
    are routed, for ``"validate"``, ``"test"`` and ``"predict"`` that stage's loaders.
    """
    loops: dict[str, list[tuple[str, Any]]] = {
        "fit": [("train", trainer.fit_loop), ("val", trainer.fit_loop.epoch_loop.val_loop)],
        "validate": [("val", trainer.validate_loop)],
        "test": [("test", trainer.test_loop)],
        "predict": [("predict", trainer.predict_loop)],
    }
    originals = []
    for split, loop in loops.get(stage, []):
        original = loop._data_source
        originals.append((loop, original))
        loop._data_source = _RebuildingSource(original, functools.partial(rebuild, split))

    def undo() -> None:
        for loop, original in originals:
            original.instance = loop._data_source.instance
            loop._data_source = original

    return undo


def train_loader_built(trainer: L.Trainer) -> bool:
    """Whether the fit loop already holds its training loader: before ``on_fit_start`` only when
    something asked for it early, as ``trainer.estimated_stepping_batches`` in ``configure_optimizers``."""
    return trainer.fit_loop._combined_loader is not None


def train_loaders(trainer: L.Trainer) -> list[Any]:
    """The training loaders the fit loop holds (a `CombinedLoader`'s too); none before it built them."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def batch_size_pending(trainer: L.Trainer | None) -> bool:
    """Whether a callback of `trainer` may still change the training batch size before the first
    step: one whose ``batch_size_pending`` is set, as `AutoBatchSize`'s is from its ``setup`` to its
    decision in ``on_fit_start``. A training loader built meanwhile defers its workers' start."""
    return trainer is not None and any(getattr(c, "batch_size_pending", False) for c in callbacks_of(trainer))


def forget_train_loader(trainer: L.Trainer) -> None:
    """Let the fit loop request its training loader again (at the batch size set since) before its
    next epoch; the old loader's workers (persistent ones too) are shut down."""
    loop = trainer.fit_loop
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    loop._combined_loader = None


def rebuild_train_loader(trainer: L.Trainer) -> None:
    """Build the fit loop's training loader again now, at the batch size set since, for the next
    epoch (called at an epoch's end): the trainer holds a loader throughout, as in plain Lightning,
    where a user's ``on_train_epoch_end`` reads it. Left to Lightning where its own reload
    (``reload_dataloaders_every_n_epochs``) builds it before the next epoch anyway."""
    loop = trainer.fit_loop
    every = reload_every_n_epochs(trainer)
    if every and trainer.current_epoch + 1 - loop._last_train_dl_reload_epoch >= every:
        return
    forget_train_loader(trainer)
    loop.setup_data()


def redo_optimizers(trainer: L.Trainer) -> bool:
    """Run ``configure_optimizers`` again, as ``Strategy.setup`` did, so schedulers sized from the
    step count see the steps the run will now take. Only at ``on_fit_start``: no step taken, no
    state restored yet. False, changing nothing, where the strategy or precision plugin wraps or
    shards the optimizers (FSDP, DeepSpeed, model parallel), which only their own setup can redo.
    """
    strategy = trainer.strategy
    plain = (
        type(strategy).setup_optimizers.__qualname__ == "Strategy.setup_optimizers"
        and type(strategy.precision_plugin).connect.__qualname__ == "Precision.connect"
    )
    if plain:
        strategy.setup_optimizers(trainer)
        _optimizers_to_device(strategy.optimizers, strategy.root_device)
    return plain


def detached_copy(module: L.LightningModule) -> L.LightningModule:
    """A deep copy of `module`, made without its trainer (``_trainer``).

    The copy's steps read the run's trainer through `TrainerReads` (what they set on it stays
    theirs, no loggers, no collectives across processes), and ``self.log``/``self.log_dict``
    record nothing (its optimizers and schedulers: `answer_optimizers`). A module Lightning took
    from ``torch.compile`` gets its own (uncompiled) steps back: the compiled wrappers would call
    the original module's, trainer and all. Its `SyncBatchNorm` layers
    (``Trainer(sync_batchnorm=True)``) compute as plain batch norm (`unsynced_batchnorm`).
    """
    trainer = module._trainer
    module._trainer = None
    try:
        clone = copy.deepcopy(module, _computed_attributes(module))
    finally:
        module._trainer = trainer
    if getattr(clone, "_compiler_ctx", None):  # `fit(torch.compile(module))`
        for name in _COMPILED_STEPS:  # the compiled wrappers call the original module's methods
            clone.__dict__.pop(name, None)
        clone._compiler_ctx = None
    unsynced_batchnorm(clone)
    for inner in clone.modules():
        if is_lightning(inner, "LightningModule"):
            vars(inner).update(log=_unlogged, log_dict=_unlogged)
    if trainer is not None:
        clone.trainer = TrainerReads(trainer)  # type: ignore[assignment]  # the setter reaches inner modules
    return clone


def _unlogged(*args: Any, **kwargs: Any) -> None:
    """``self.log`` and ``self.log_dict`` of a copy: its values are not the run's."""


def answer_optimizers(
    clone: L.LightningModule, optimizers: list[Any], trainer: L.Trainer | None, memo: dict[int, Any]
) -> None:
    """``clone.optimizers()`` gives `optimizers` (the copy's own) and ``clone.lr_schedulers()``
    copies of `trainer`'s schedulers over them (`memo` maps the run's optimizers to the copy's),
    as Lightning gives the run's: the one alone, else the list (no schedulers: ``None``). A rate
    the copy's step writes, or a schedule it steps, stays the copy's."""
    configs = trainer.lr_scheduler_configs if trainer is not None else []
    schedulers = [
        copy.deepcopy(config.scheduler, memo)
        for config in configs
        if id(getattr(config.scheduler, "optimizer", None)) in memo  # over an optimizer copied
    ]

    def own(use_pl_optimizer: bool = True) -> Any:
        return optimizers[0] if len(optimizers) == 1 else optimizers

    def own_schedulers() -> Any:
        return (schedulers[0] if len(schedulers) == 1 else schedulers) if schedulers else None

    clone.optimizers = own  # type: ignore[method-assign]
    clone.lr_schedulers = own_schedulers  # type: ignore[method-assign]


def _computed_attributes(module: torch.nn.Module) -> dict[int, Any]:
    """A `copy.deepcopy` memo that copies each plain tensor attribute of `module`'s layers computed
    with gradients (``torch.nn.utils.spectral_norm`` and the older ``weight_norm`` set ``weight``
    so at each forward) as a detached clone: deepcopy refuses a tensor that is not a graph leaf,
    and the copy's own forward computes it again."""
    return {
        id(value): value.detach().clone()
        for layer in module.modules()
        for value in vars(layer).values()
        if isinstance(value, torch.Tensor) and value.grad_fn is not None
    }


class _UnsyncedBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """`SyncBatchNorm`'s batch norm on this process alone, for any input of 2+ dimensions as it takes."""

    @override
    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def unsynced_batchnorm(module: torch.nn.Module) -> None:
    """Replace each `SyncBatchNorm` in `module` by plain batch norm over the same parameters and
    statistics (the same tensors). Its forward all-gathers the batch's statistics from every rank
    of the process group: a copy's trial steps, which each rank runs on its own and as many as its
    own clock says, would wait on ranks that run none (or raise, outside CUDA)."""
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.SyncBatchNorm):
            plain = _UnsyncedBatchNorm(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            plain.weight, plain.bias = child.weight, child.bias
            for buffer in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(plain, buffer, getattr(child, buffer))
            plain.train(child.training)
            setattr(module, name, plain)
        else:
            unsynced_batchnorm(child)


#: What Lightning's ``from_compiled`` replaces on the instance with ``torch.compile``d wrappers.
_COMPILED_STEPS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def user_dataloaders(trainer: L.Trainer, split: str) -> Any:
    """What the user's ``train``/``val`` loader source returns now, past any boost rebuilding;
    ``None`` when the split has no source (no ``val_dataloader``)."""
    loop = trainer.fit_loop if split == "train" else trainer.fit_loop.epoch_loop.val_loop
    source = loop._data_source
    if isinstance(source, _RebuildingSource):
        source = source.original
    return source.dataloader() if source.is_defined() else None


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Lightning's ``isolate_rng`` (Python's, NumPy's, torch's and CUDA's states), with two changes
    a measurement needs: the states come back when the block raises too (a failed trial must not
    shift the run's data order), and CUDA's are kept only when CUDA is already initialized
    (reading them would initialize it in the main process, before the DataLoader workers fork).

    Example:
        >>> with preserved_rng():
        ...     _ = torch.rand(3)
    """
    states = _collect_rng_states(include_cuda=torch.cuda.is_initialized())
    try:
        yield
    finally:
        _set_rng_states(states)


def hardware_for(trainer: L.Trainer | None) -> HardwareInfo:
    """This machine as `trainer` uses it: its accelerator and its processes per node."""
    hardware = HardwareInfo.detect()
    if trainer is None:
        return hardware
    accelerator = "cpu"
    if is_lightning(trainer.accelerator, "CUDAAccelerator"):
        accelerator = "cuda"
    elif is_lightning(trainer.accelerator, "MPSAccelerator"):
        accelerator = "mps"
    if accelerator == "cpu" and hardware.is_cuda:  # a Trainer pinned to the CPU on a GPU machine
        hardware = hardware.on_cpu()
    return hardware.replace(accelerator=accelerator, local_world_size=max(trainer.num_devices, 1))


def debugging_mode(trainer: L.Trainer) -> str:
    """``"fast_dev_run"`` or ``"overfit_batches"`` when Lightning runs the fit as a check (both are
    set on the Trainer by its debugging-flags connector, not declared on the class), else ``""``."""
    if getattr(trainer, "fast_dev_run", False):
        return "fast_dev_run"
    return "overfit_batches" if getattr(trainer, "overfit_batches", 0) else ""


def destroy_process_group_at_exit() -> None:
    """Have the process group, when there is one, destroyed while the interpreter is still whole.

    Lightning registers this for NCCL only. A gloo group left to interpreter shutdown can abort
    the process after a finished fit ("terminate called without an active exception": its worker
    threads outlive the objects they hold), which turns a successful run's exit status into
    SIGABRT. Registered once per process; a no-op when the group is already gone.
    """
    global _exit_hook_registered
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if initialized and not _exit_hook_registered:
        atexit.register(_destroy_process_group)
        _exit_hook_registered = True


_exit_hook_registered = False


#: How long the exit hook hands the GIL to gloo's worker threads before destroying the group.
GIL_HANDOVER_S = 0.05


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Before torch 2.8 (pytorch#154976) the group's destructor holds the GIL while it joins
        # gloo's worker threads, and a worker releasing a finished collective's tensors needs the
        # GIL to free their Python objects: a deadlock that hung a finished fit's rank at exit.
        # Sleeping releases the GIL, so a worker waiting for it finishes first.
        time.sleep(GIL_HANDOVER_S)
        torch.distributed.destroy_process_group()


def backward_piece(trainer: L.Trainer, loss: torch.Tensor) -> None:
    """Backward of `loss` as Lightning's backward does it (the AMP grad scaler's scale, the module's
    own ``backward``), without the ``on_before_backward``/``on_after_backward`` hooks: for a
    micro-batch that is part of a step whose one backward the hooks see."""
    precision = trainer.strategy.precision_plugin
    scaler = getattr(precision, "scaler", None)
    tensor = scaler.scale(loss) if scaler is not None else loss
    precision.backward(tensor, trainer.lightning_module, None)


def finish_backward(trainer: L.Trainer, closure_loss: torch.Tensor) -> torch.Tensor:
    """What ``Strategy.backward`` does after the precision plugin's backward (the
    ``on_after_backward`` hooks), for a backward that was completed another way."""
    strategy = trainer.strategy
    closure_loss = strategy.precision_plugin.post_backward(closure_loss, trainer.lightning_module)
    strategy.post_backward(closure_loss)
    return closure_loss


def zeroes_gradients_this_step(trainer: L.Trainer) -> bool:
    """Whether Lightning's automatic optimization zeroes the gradients in this training step: it
    does so after ``training_step`` and before the backward, on the first batch of each
    ``accumulate_grad_batches`` window (``_AutomaticOptimization._make_zero_grad_fn``)."""
    return trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
