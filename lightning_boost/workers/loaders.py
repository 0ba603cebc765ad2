"""DataLoader plumbing for worker tuning: measurement loaders, fingerprints, rebuilding a loader.

Plain functions over `torch.utils.data`; no Lightning here either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler

from lightning_boost.fingerprints import describe_dataset, hardware_parts, stable_repr
from lightning_boost.hardware import HardwareInfo
from lightning_boost.workers.search import WorkerTuning
from lightning_boost.workers.whole_batches import whole_batches

#: DataLoader arguments a measurement loader copies from the real one.
MEASURED_SETTINGS = (
    "collate_fn",
    "pin_memory",
    "worker_init_fn",
    "multiprocessing_context",
    "pin_memory_device",
)
#: Samples a measurement sampler can draw: far more than any window needs, drawn lazily.
_MEASURE_SAMPLES = 1 << 40


def measurement_loaders(
    dataset: Dataset[Any], batch_size: int, settings: Mapping[str, Any], timeout_s: float
) -> Callable[[int, int | None], DataLoader[Any]]:
    """A factory of loaders for timing `dataset` at a worker setting, touching no global RNG.

    Each loader draws random indices (with replacement, so it never runs dry) from its own seeded
    generator and has its own base-seed generator: building and iterating it leaves the training
    loader's sampler, and the epoch's order, exactly as they were. `settings` supplies the real
    loader's collate function, pinning, worker init and multiprocessing context; a `TensorDataset`
    gathers whole batches, as the tuned loader's does (`whole_batches`).
    """
    copied = {key: settings[key] for key in MEASURED_SETTINGS if settings.get(key) is not None}
    dataset, collate_fn = whole_batches(dataset, copied.get("collate_fn"))  # as the tuned loader loads
    if collate_fn is not None:
        copied["collate_fn"] = collate_fn

    def make(num_workers: int, prefetch_factor: int | None) -> DataLoader[Any]:
        sampler = RandomSampler(
            dataset,  # type: ignore[arg-type]
            replacement=True,
            num_samples=_MEASURE_SAMPLES,
            generator=torch.Generator().manual_seed(0),
        )
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers else None,
            timeout=timeout_s if num_workers else 0,
            generator=torch.Generator().manual_seed(1),
            **copied,
        )

    return make


def cannot_measure(dataset: object) -> str | None:
    """Why worker tuning cannot measure `dataset` without consuming it, or ``None`` when it can."""
    if isinstance(dataset, IterableDataset):
        return (
            f"{type(dataset).__name__} is an IterableDataset: timing it would consume the stream, and"
            " how it splits across workers is its own (each worker must read its own shard, e.g. by"
            " `torch.utils.data.get_worker_info()`)"
        )
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return f"{type(dataset).__name__} has no `__getitem__` and `__len__` to sample from."
    return None


def holds_module(dataset: object, model: torch.nn.Module) -> str | None:
    """The attribute of `dataset` holding the `model` being trained or a part of it, as a stream
    that runs the model to make its samples holds it (reinforcement-learning rollouts: Lightning's
    PPO and DQN examples), or ``None``. A worker would run a copy of it, made when the worker
    starts and never trained. Other modules (transforms.v2 pipelines, a frozen feature extractor
    of its own) are not the model: a worker's copy of those is what it needs.

    Example:
        >>> class Rollouts:  # an IterableDataset's attributes
        ...     def __init__(self, policy, transform=None): self.policy, self.transform = policy, transform
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> holds_module(Rollouts(model[0]), model), holds_module(Rollouts(None, torch.nn.ReLU()), model)
        ('policy', None)
    """
    trained = {id(parameter) for parameter in model.parameters()}
    for name, value in getattr(dataset, "__dict__", {}).items():
        if isinstance(value, torch.nn.Module) and any(id(p) in trained for p in value.parameters()):
            return name
    return None


def cannot_rebuild(loader: DataLoader[Any]) -> str | None:
    """Why `loader` cannot be rebuilt with tuned worker settings, or ``None`` when it can."""
    if type(loader) is not DataLoader:
        return f"{type(loader).__name__} is a DataLoader subclass whose own arguments are unknown"
    why_not = cannot_measure(loader.dataset)
    if why_not is None and loader.batch_sampler is None:  # no batching: each item is a batch
        why_not = (
            "it loads whole batches from its dataset (`batch_size=None`), and the worker search"
            " times batches it makes of samples"
        )
    if why_not is None and loader_batch_size(loader) is None:
        why_not = f"its batch sampler {type(loader.batch_sampler).__name__} has no `batch_size`"
    return why_not


def loader_batch_size(loader: DataLoader[Any]) -> int | None:
    """Samples per batch of `loader`, from its batch size or its batch sampler's."""
    size: int | None = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    return size


def keep_workers_alive(num_workers: int, pin_memory: bool, reload_every_n_epochs: int) -> bool:
    """``persistent_workers`` for a loader: with workers, unless pinned memory meets reloading
    loaders every n epochs, a combination Lightning warns against.

    Example:
        >>> keep_workers_alive(2, pin_memory=True, reload_every_n_epochs=1)
        False
    """
    return num_workers > 0 and not (pin_memory and reload_every_n_epochs > 0)


def fingerprint_parts(
    hardware: HardwareInfo,
    dataset: Dataset[Any],
    batch_size: int,
    settings: Mapping[str, Any],
    tuning: WorkerTuning,
    model: str | None = None,
) -> dict[str, Any]:
    """What a worker measurement depends on: the machine, the dataset and its transforms, the batch
    and, on a CPU run, the model (`describe_model`), which shares the CPUs with the workers."""
    return {
        "model": model,
        "kind": "workers",
        "hardware": hardware_parts(hardware),
        "dataset": describe_dataset(dataset),
        "batch_size": batch_size,
        "loader": {key: stable_repr(settings.get(key)) for key in MEASURED_SETTINGS},
        "tuning": {
            "tolerance": tuning.tolerance,
            "max_workers": tuning.max_workers,
            "prefetch_factors": list(tuning.prefetch_factors),
            "target_samples_per_s": tuning.target_samples_per_s,
        },
    }


def rebuild_loader(
    loader: DataLoader[Any], loader_class: type[DataLoader[Any]] = DataLoader, **changes: Any
) -> DataLoader[Any]:
    """A new `loader_class` like `loader` (dataset, sampler, batching and every other setting) with
    `changes` (which may include `loader_class`'s own arguments); a `TensorDataset` collated by
    ``default_collate`` gathers whole batches (`whole_batches`: the same batches, sooner).

    Raises:
        TypeError: when `cannot_rebuild` says why not (a DataLoader subclass, an IterableDataset, ...).
    """
    why_not = cannot_rebuild(loader)
    if why_not is not None:
        raise TypeError(
            f"Cannot rebuild this DataLoader with new worker settings: {why_not}. "
            "Use `BoostedDataModule` or set `num_workers` on it by hand."
        )
    batching: dict[str, Any]
    if loader.batch_size is not None:
        batching = {"batch_size": loader.batch_size, "sampler": loader.sampler, "drop_last": loader.drop_last}
    else:  # a batch sampler of the user's (with a `batch_size`: `cannot_rebuild`) makes the batches
        batching = {"batch_sampler": loader.batch_sampler}
    kept = loader_options(loader)
    options = kept | changes
    if not options["num_workers"]:
        options.update(prefetch_factor=None, persistent_workers=False, timeout=0)
    dataset, options["collate_fn"] = whole_batches(loader.dataset, options["collate_fn"])
    return loader_class(dataset, **batching, **options)


class DeferredStartDataLoader(DataLoader[Any]):
    """A ``DataLoader`` whose workers can wait for its first batch.

    With `defer_start` set (by whoever builds the training loader while a callback may still
    change its batch size: `AutoBatchSize` before its decision), ``iter()`` returns a
    `DeferredStart`: the real iterator, which forks the workers and draws the base seed and the
    sampler's order, is made at the first batch or at `start_deferred_workers`. A loader thrown
    away at the new size then never starts its workers (about 20 ms a worker in a process that
    holds a CUDA context: 15 of the H100 warm demo's 34 forks, in a cProfile read by hand).
    """

    defer_start = False
    _deferred: DeferredStart | None = None
    _workers_saw: Any = None  # `dataset_state` when the persistent workers started

    def __iter__(self) -> Any:
        self._drop_stale_workers()
        if self.defer_start and self.num_workers > 0 and self._iterator is None:
            self._deferred = DeferredStart(self)
            return self._deferred
        before = self._iterator
        iterator = super().__iter__()
        if self._iterator is not None and self._iterator is not before:  # persistent workers started
            self._workers_saw = dataset_state(self.dataset)
        return iterator

    def _drop_stale_workers(self) -> None:
        """Persistent workers hold the dataset as it was when they started. When the main process
        changed it since (a callback's curriculum or progressive resizing sets an attribute at an
        epoch's start), they end, and this iteration starts new ones: the epoch loads what it
        would without workers (before, a curriculum's epochs 2 and on loaded epoch 1's samples)."""
        if self._iterator is None or not self.persistent_workers:
            return
        if dataset_state(self.dataset) != self._workers_saw:
            shutdown = getattr(self._iterator, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
            self._iterator = None


class DeferredStart:
    """The iterator of a `DeferredStartDataLoader` before its workers start (see there)."""

    def __init__(self, loader: DeferredStartDataLoader) -> None:
        self.loader = loader
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> DeferredStart:
        return self

    def __next__(self) -> Any:
        return next(self.start())

    def start(self) -> Iterator[Any]:
        """The loader's real iterator, made (workers started) on the first call."""
        if self._iterator is None:
            loader = self.loader
            loader.defer_start = False
            loader._deferred = None  # the iterator's workers end with whoever holds it, as usual
            self._iterator = iter(loader)
        return self._iterator


def start_deferred_workers(loader: object) -> None:
    """Start the workers `loader` holds back (`DeferredStartDataLoader`) now: its batch size stays,
    and they load while the rest of the set-up runs, as a loader's workers do from ``iter()``."""
    if isinstance(loader, DeferredStartDataLoader):
        loader.defer_start = False
        if loader._deferred is not None:
            loader._deferred.start()


class SameOrderDataLoader(DeferredStartDataLoader):
    """A ``DataLoader`` whose draws from the global RNG do not depend on its worker setting.

    With persistent workers PyTorch reuses the iterator from the second iteration on and draws no
    new base seed, where a loader without them draws one at every iteration (each epoch, each
    validation run). This loader draws it then too, so the next epoch's shuffle, and every random
    draw of the training step after it, are those the run would see with the loader's default
    settings, whatever workers the tuning chose.
    """

    def __iter__(self) -> Any:
        self._drop_stale_workers()  # new workers draw their own seed
        if not draws_each_iteration(self) and self._iterator is not None:
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # as a new iterator does
        return super().__iter__()


def dataset_state(dataset: Any, depth: int = 2) -> tuple[Any, ...]:
    """What a worker's copy of `dataset` holds that the main process may change between epochs:
    each attribute's value where it is a number, string or ``None``, else its identity and (for an
    object, `depth` levels down: a transform's size, a `Subset`'s dataset) its own state.

    Example:
        >>> class Curriculum:
        ...     def __init__(self): self.scale, self.samples = 1.0, [0.5, 0.25]
        >>> data = Curriculum()
        >>> before = dataset_state(data)
        >>> data.samples.append(0.125); dataset_state(data) == before  # the same list: not read
        True
        >>> data.scale = 2.0; dataset_state(data) == before
        False
    """
    state: list[Any] = []
    for name, value in sorted(getattr(dataset, "__dict__", {}).items()):
        if value is None or isinstance(value, (bool, int, float, str)):
            state.append((name, value))
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type)):
            state.append((name, id(value), dataset_state(value, depth - 1)))
        else:
            state.append((name, id(value)))
    return tuple(state)


def draws_each_iteration(loader: DataLoader[Any]) -> bool:
    """Whether `loader` draws a base seed from its generator at every iteration (it keeps no
    persistent workers), as `SameOrderDataLoader` does whatever its setting."""
    return not (loader.persistent_workers and loader.num_workers > 0)


def loader_options(loader: DataLoader[Any]) -> dict[str, Any]:
    """Every argument of `loader` but its dataset and batching (batch size, sampler, drop_last)."""
    kept = {
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "prefetch_factor": loader.prefetch_factor,
        "num_workers": loader.num_workers,
    }
    if hasattr(loader, "in_order"):
        kept["in_order"] = loader.in_order
    return kept
