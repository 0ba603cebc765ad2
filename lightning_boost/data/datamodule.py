"""`BoostedDataModule`: a LightningDataModule that builds its DataLoaders the way an expert would."""

from __future__ import annotations

import contextlib
import functools
import inspect
import multiprocessing
import multiprocessing.context
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import lightning as L
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler
from typing_extensions import override

from lightning_boost._lightning import (
    batch_size_pending,
    destroy_process_group_at_exit,
    from_pytorch_lightning,
    hardware_for,
    overrides,
    pytorch_lightning_twin,
    reload_every_n_epochs,
)
from lightning_boost._validation import Count, Directory, PositiveInt, unknown_choice_error, validated
from lightning_boost.report import Finding, Severity
from lightning_boost.workers.decision import capped_finding
from lightning_boost.workers.loaders import DeferredStartDataLoader, SameOrderDataLoader, keep_workers_alive
from lightning_boost.workers.search import WorkerTuning
from lightning_boost.workers.segments import OnlineSearch, SegmentedDataLoader
from lightning_boost.workers.tuner import LoaderTuner, epoch_batches, own_pass, workload
from lightning_boost.workers.whole_batches import whole_batches, whole_batches_finding

#: An evaluation split's datasets: one, or several (a list or dict of them, `several`).
Datasets = Dataset[Any] | Sequence[Dataset[Any]] | Mapping[Any, Dataset[Any]]
#: What an evaluation hook returns: one loader, or one per dataset of several.
Loaders = DataLoader[Any] | list[DataLoader[Any]] | dict[Any, DataLoader[Any]]

#: Loader arguments the mixin manages itself; the rest of DataLoader's may go in `loader_kwargs`.
_MANAGED = {"dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "collate_fn",
            "num_workers", "prefetch_factor", "pin_memory", "persistent_workers"}  # fmt: skip
_SPLITS = ("train", "val", "test", "predict")
#: Where a managed argument that has no parameter of its own goes instead.
_ELSEWHERE = {
    "dataset": "assign `self.train_dataset = ...` in `setup()` (and `val_dataset`, ...)",
    "sampler": "assign `self.train_sampler = ...` in `setup()` (a `WeightedRandomSampler` of the set"
    " you just built)",
    "batch_sampler": "BoostedDataModule batches by `batch_size`, which tuning may change; a batch"
    " sampler of your own goes in a DataLoader you build (override `train_dataloader()`), and"
    " `AutoNumWorkers` tunes its workers",
}

if TYPE_CHECKING:  # the mixin is typed as the datamodule it is mixed into
    _DataModule = L.LightningDataModule
else:
    _DataModule = object


def several(value: object) -> bool:
    """Whether `value` is several datasets, one loader each (a list, tuple or dict whose items
    are all torch `Dataset`\\ s), rather than one dataset (a list of samples is one).

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> one = TensorDataset(torch.zeros(4, 2))
        >>> several([one, one]), several({"clean": one, "noisy": one}), several(one), several([(1, 2)])
        (True, True, False, False)
    """
    if isinstance(value, Mapping):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        return False
    return bool(items) and all(isinstance(item, Dataset) for item in items)


def first_of(items: Any) -> Any:
    """The first item of a non-empty list, tuple or dict (its first value): the lead of several
    datasets or loaders.

    Example:
        >>> first_of([3, 4]), first_of({"clean": 5, "noisy": 6})
        (3, 5)
    """
    return next(iter(items.values() if isinstance(items, Mapping) else items))


class _DeviceHook:
    """A `BoostedDataMixin`'s ``on_after_batch_transfer``: its device transforms where it was given
    any, else Lightning's own default. Lightning runs a datamodule's hook *instead of* the model's
    whenever the datamodule's class overrides it, so a hook the mixin always defined would drop the
    model's own (normalizing or augmenting batches on the device) from every run."""

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        names = ("device_transforms", "eval_device_transforms")
        if all(getattr(instance, name, None) is None for name in names):  # none given, or not set yet
            return _lightning_default(instance).__get__(instance, owner)
        return BoostedDataMixin._device_transformed.__get__(instance, owner)


def _lightning_default(instance: object) -> Callable[..., Any]:
    """Lightning's own ``on_after_batch_transfer`` in `instance`'s namespace: what its
    ``is_overridden`` compares against."""
    if from_pytorch_lightning(instance):
        import pytorch_lightning as pl

        return pl.LightningDataModule.on_after_batch_transfer
    return L.LightningDataModule.on_after_batch_transfer


class BoostedDataMixin(_DataModule):
    """The loader logic of `BoostedDataModule`, for a LightningDataModule of either namespace.

    ``class MyData(BoostedDataMixin, pytorch_lightning.LightningDataModule)`` is what
    `lightning_boost.pytorch_lightning.BoostedDataModule` is; `BoostedDataModule` is the same on
    ``lightning.LightningDataModule``. Everything is documented on `BoostedDataModule`.
    """

    train_dataset: Dataset[Any] | None = None
    train_sampler: Sampler[Any] | None = None  # draws the training batches' samples in place of `shuffle`
    val_dataset: Datasets | None = None  # several: a loader each (`several`)
    test_dataset: Datasets | None = None
    predict_dataset: Datasets | None = None
    _sizing_only = False  # inside `sizing_only`

    @validated
    def __init__(
        self,
        batch_size: PositiveInt = 32,
        *,
        eval_batch_size: PositiveInt | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: Count | None = None,
        prefetch_factor: PositiveInt | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        device_transforms: Callable[[Any], Any] | None = None,
        eval_device_transforms: Callable[[Any], Any] | None = None,
        worker_tuning: WorkerTuning | None = None,
        retune: bool = False,
        cache_dir: Directory | None = None,
        loader_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if prefetch_factor is not None and num_workers == 0:
            raise ValueError("`prefetch_factor` expected None with `num_workers=0` (no workers load ahead).")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.tuned_eval_batch_size: int | None = None
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.device_transforms = device_transforms
        self.eval_device_transforms = eval_device_transforms
        self.loader_kwargs = _checked_loader_kwargs(loader_kwargs or {})
        tuning = worker_tuning or WorkerTuning()
        self.worker_tuner = LoaderTuner(type(self).__name__, tuning, cache_dir, retune)

    @classmethod
    def from_datasets(  # type: ignore[override]
        cls,
        train_dataset: Dataset[Any] | None = None,
        val_dataset: Datasets | None = None,
        test_dataset: Datasets | None = None,
        predict_dataset: Datasets | None = None,
        batch_size: int = 32,
        num_workers: int | None = None,
        **datamodule_kwargs: Any,
    ) -> Any:
        """Lightning's ``from_datasets``, with this datamodule's loaders: the datasets are set as a
        subclass's ``setup()`` sets them (several evaluation sets in a list or dict get a loader
        each), `batch_size` (32 by default, as the constructor's, where Lightning's is 1) is an
        attribute `AutoBatchSize` can tune and ``num_workers=None`` (the default, where
        Lightning's is 0) is measured; any other argument goes to the constructor. Lightning's own
        put plain loaders on the instance, with the size in a closure, which nothing could tune.

        Example:
            >>> from torch.utils.data import TensorDataset
            >>> samples = TensorDataset(torch.zeros(8, 2))
            >>> data = BoostedDataModule.from_datasets(train_dataset=samples, batch_size=4)
            >>> data.batch_size, data.num_workers, len(data.train_dataset)
            (4, None, 8)
        """
        datamodule = cls(batch_size=batch_size, num_workers=num_workers, **datamodule_kwargs)
        datamodule.train_dataset, datamodule.val_dataset = train_dataset, val_dataset
        datamodule.test_dataset, datamodule.predict_dataset = test_dataset, predict_dataset
        return datamodule

    @property
    def findings(self) -> list[Finding]:
        """What the loader decisions found, with their measurements."""
        return self.worker_tuner.findings

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return self.build_dataloader("train", shuffle=self.shuffle, drop_last=self.drop_last)

    @property
    def val_dataloader(self) -> Callable[[], Loaders] | None:  # type: ignore[override]
        """The ``val_dataloader`` hook, or ``None`` when this run has no validation set.

        ``None`` is how Lightning learns there is no validation loop: once ``setup()`` has
        assigned a training set but no validation set, or when the model has no
        ``validation_step`` and no validation set was assigned.
        """
        if self.val_dataset is None:
            module = self.trainer.lightning_module if self.trainer is not None else None
            no_step = module is not None and not overrides(module, "validation_step")
            if self.train_dataset is not None or no_step:
                return None
        return functools.partial(self._evaluation_loaders, "val")

    @override
    def test_dataloader(self) -> Loaders:
        return self._evaluation_loaders("test")

    @override
    def predict_dataloader(self) -> Loaders:
        return self._evaluation_loaders("predict")

    @property
    def evaluation_batch_size(self) -> int:
        """The validation, test and predict loaders' batch size: `eval_batch_size` when given, else
        the one `AutoBatchSize` measured (``tuned_eval_batch_size``), else `batch_size`."""
        return self.eval_batch_size or self.tuned_eval_batch_size or self.batch_size

    def build_dataloader(self, split: str, *, shuffle: bool, drop_last: bool) -> DataLoader[Any]:
        """The DataLoader for `split` (``"train"``, ``"val"``, ``"test"``, ``"predict"``) with tuned settings.

        Raises:
            RuntimeError: when ``setup()`` did not assign ``self.<split>_dataset``.
            TypeError: when it holds several datasets (an evaluation split's hook builds a loader
                for each).
        """
        dataset = self._dataset(split)
        if several(dataset):
            fix = (
                "BoostedDataModule trains on one: join them (`torch.utils.data.ConcatDataset`), or"
                " override `train_dataloader()` to return a loader for each (a `CombinedLoader`)"
                if split == "train"
                else f"`{split}_dataloader()` builds a loader for each"
            )
            raise TypeError(f"`{type(self).__name__}.{split}_dataset` holds several datasets: {fix}.")
        return self._build(split, dataset, shuffle, drop_last, tuning=dataset, lead=True)

    def _evaluation_loaders(self, split: str) -> Loaders:
        """`split`'s loader, or a list or dict of loaders when its dataset attribute holds several
        (Lightning then passes ``dataloader_idx`` to the step). They are tuned as one: on the
        training set's decision, or, in a pass run alone, on the first one's search, which the
        others follow."""
        dataset = self._dataset(split)
        if not several(dataset):
            return self._build(split, dataset, False, False, tuning=dataset, lead=True)
        named = dataset.items() if isinstance(dataset, Mapping) else enumerate(dataset)
        first = first_of(dataset)
        loaders = {
            key: self._build(split, each, False, False, first, i == 0) for i, (key, each) in enumerate(named)
        }
        return loaders if isinstance(dataset, Mapping) else list(loaders.values())

    def _dataset(self, split: str) -> Any:
        if split not in _SPLITS:
            raise unknown_choice_error("split", split, _SPLITS)
        dataset = getattr(self, f"{split}_dataset")
        if dataset is None:
            raise RuntimeError(
                f"`{type(self).__name__}.{split}_dataset` is not set: assign `self.{split}_dataset = ...` "
                f"in `setup()` for the stage that needs it."
            )
        return dataset

    def _build(
        self, split: str, dataset: Dataset[Any], shuffle: bool, drop_last: bool, tuning: Any, lead: bool
    ) -> DataLoader[Any]:
        """The loader of `dataset` (`_tuned`); inside `sizing_only`, a plain one with the split's
        batch size, training sampler and collate function, nothing decided."""
        if self._sizing_only:
            sampler = self._train_sampler() if split == "train" else None
            size = self.batch_size if split == "train" else self.evaluation_batch_size
            return DataLoader(dataset, batch_size=size, sampler=sampler, collate_fn=self.collate_fn)
        loader = self._tuned(split, dataset, shuffle, drop_last, tuning, lead)
        _BUILT.add(loader)
        return loader

    def _tuned(
        self, split: str, dataset: Dataset[Any], shuffle: bool, drop_last: bool, tuning: Any, lead: bool
    ) -> DataLoader[Any]:
        """The loader of `dataset`; `tuning` is the dataset an evaluation pass run alone is tuned
        on (the first of several), and only the `lead` loader of such a pass runs its search."""
        sampler = self._train_sampler() if split == "train" else None
        if isinstance(dataset, IterableDataset):
            if sampler is not None:
                raise TypeError(
                    f"`{type(self).__name__}.train_sampler` is set, but `train_dataset`"
                    f" ({type(dataset).__name__}) is an IterableDataset, which orders its own samples:"
                    " draw them inside its `__iter__`, or leave `train_sampler` as None."
                )
            shuffle = self._stream_order(split, dataset, shuffle)
        elif not hasattr(dataset, "__len__"):
            raise TypeError(
                f"`{type(self).__name__}.{split}_dataset` ({type(dataset).__name__}) has no `__len__`:"
                " the DataLoader's sampler needs the length of a map-style dataset. Define `__len__`,"
                " or subclass `torch.utils.data.IterableDataset` if it is a stream."
            )
        # an evaluation stage run alone decides on its own pass; else the training set decides
        alone = own_pass(self.trainer, split) and self.num_workers is None
        tuning_dataset = self.train_dataset if self.train_dataset is not None and not alone else tuning
        settings, search = self._settings(tuning_dataset, drop_last, split if alone else None)
        size = self.batch_size if split == "train" else self.evaluation_batch_size
        cap = self._eval_cap(split, dataset, size)
        if cap is not None and cap < settings["num_workers"]:
            settings = self._capped(split, settings, cap)
        batching: dict[str, Any] = {"batch_size": size, "shuffle": shuffle, "drop_last": drop_last}
        if sampler is not None:  # it orders the samples, not `shuffle`
            batching = batching | {"shuffle": None, "sampler": sampler}
        gathered, collate_fn = whole_batches(dataset, settings["collate_fn"])  # the same batches, sooner
        if gathered is not dataset:
            self.worker_tuner.add_finding(whole_batches_finding("BoostedDataModule"))
        dataset, settings = gathered, settings | {"collate_fn": collate_fn}
        if search is not None and (split == "train" or (alone and lead)):
            persist = self.persistent_workers
            if persist is None:
                reload = reload_every_n_epochs(self.trainer) if self.trainer is not None else 0
                persist = keep_workers_alive(1, settings["pin_memory"], reload) and not alone
            segmented = SegmentedDataLoader(
                dataset, **batching, online=search, persist_after_search=bool(persist), **settings
            )
            if cap is not None:
                segmented.workers_cap = cap
            return segmented
        # tuned workers must not change the run's random draws: see `SameOrderDataLoader`
        loader_class = SameOrderDataLoader if self.num_workers is None else DeferredStartDataLoader
        loader = loader_class(dataset, **batching, **settings)
        if split == "train" and batch_size_pending(self.trainer):  # may be built again at once
            loader.defer_start = True
        if cap is not None:
            loader.workers_cap = cap  # for the training search's winner
        if search is not None:  # an evaluation loader built while the training loader searches
            search.follow(loader)
        return loader

    def _train_sampler(self) -> Sampler[Any] | None:
        """``self.train_sampler``, checked: it draws samples, not batches."""
        sampler = self.train_sampler
        if isinstance(sampler, BatchSampler):
            raise TypeError(
                f"`{type(self).__name__}.train_sampler` is a BatchSampler, which draws whole batches:"
                " BoostedDataModule batches by `batch_size`, which tuning may change. Assign its"
                " `sampler` (the one it batches) instead."
            )
        return sampler

    def _eval_cap(self, split: str, dataset: Dataset[Any], batch_size: int) -> int | None:
        """The most workers an evaluation loader of `split` can use: its batches per pass on each
        rank. Each pass hands a map-style dataset's batches to the workers in turn from the first
        (torch's ``_reset``), so a worker past them never gets one; it only costs a process start
        (about 20 ms in a CUDA process: 45 took 0.9 s in a cProfile of the H200 demo, by hand) and
        its memory. ``None`` for the training split, workers set by hand, a stream, or without a
        trainer."""
        if split == "train" or self.num_workers is not None or isinstance(dataset, IterableDataset):
            return None
        return epoch_batches(self.trainer, dataset, batch_size, drop_last=False, split=split)

    def _capped(self, split: str, settings: dict[str, Any], cap: int) -> dict[str, Any]:
        """`settings` with `cap` workers, and an INFO that says why."""
        finding = capped_finding("BoostedDataModule", split, cap, settings["num_workers"])
        self.worker_tuner.add_finding(finding)
        return settings | {
            "num_workers": cap,
            "prefetch_factor": settings["prefetch_factor"] if cap else None,
            "persistent_workers": settings["persistent_workers"] and cap > 0,
        }

    def _stream_order(self, split: str, dataset: IterableDataset[Any], shuffle: bool) -> bool:
        """An IterableDataset orders its own samples: the DataLoader takes no ``shuffle`` for it."""
        if shuffle and split == "train":
            self.worker_tuner.add_finding(
                Finding(
                    "BoostedDataModule",
                    "data",
                    Severity.INFO,
                    f"`shuffle` left to {type(dataset).__name__}",
                    "an IterableDataset yields samples in its own order; a DataLoader cannot shuffle it",
                    "shuffle inside the dataset's `__iter__` (e.g. a shuffle buffer), or pass shuffle=False",
                )
            )
        return False

    def loader_settings(self, tuning_dataset: Dataset[Any]) -> dict[str, Any]:
        """Every DataLoader argument but dataset, batch size, shuffle and drop_last.

        Worker settings are those measured on `tuning_dataset` (the training set when there is
        one, so evaluation loaders reuse the training measurement) unless fixed by hand.
        """
        return self._settings(tuning_dataset, self.drop_last)[0]

    def _settings(
        self, tuning_dataset: Dataset[Any], drop_last: bool, own_split: str | None = None
    ) -> tuple[dict[str, Any], OnlineSearch | None]:
        """`loader_settings`, and the search on the first epoch's own batches when one runs
        (the settings are then its starting point); with `own_split`, the split of an evaluation
        stage run alone (`own_pass`), on that pass's own batches."""
        trainer = self.trainer
        destroy_process_group_at_exit()  # a DDP run with the pack ends without gloo's exit abort
        hardware = hardware_for(trainer)
        pin = self.pin_memory if self.pin_memory is not None else hardware.is_cuda
        rank = trainer.global_rank if trainer is not None else 0
        settings: dict[str, Any] = {
            "collate_fn": self.collate_fn,
            "pin_memory": pin,
            "worker_init_fn": functools.partial(pl_worker_init_function, rank=rank),
            **self.loader_kwargs,
        }
        workers, prefetch, search = self.num_workers, self.prefetch_factor, None
        if workers is None:
            train = tuning_dataset is self.train_dataset and own_split is None
            split = own_split or ("train" if train else "evaluation")
            size = self.batch_size if own_split is None else self.evaluation_batch_size
            sampler = self.train_sampler if train else None  # an epoch is its draws
            samples = workload(trainer, split, tuning_dataset, size, sampler)
            searched = train or own_split is not None
            batches = (
                epoch_batches(trainer, tuning_dataset, size, drop_last, split, sampler) if searched else None
            )
            # an evaluation pass's workers past its batches never get one (`_eval_cap`): none is tried
            stream = isinstance(tuning_dataset, IterableDataset)
            most = batches if own_split is not None and not stream else None
            choice, search = self.worker_tuner.decide(
                trainer, tuning_dataset, size, settings, samples, split, batches, most
            )
            workers, prefetch = choice.num_workers, prefetch or choice.prefetch_factor
        else:
            self.worker_tuner.apply_process_settings(hardware, workers)
        persistent = self.persistent_workers
        if persistent is None:
            reload = reload_every_n_epochs(trainer) if trainer is not None else 0
            persistent = keep_workers_alive(workers, pin, reload)
        return settings | {
            "num_workers": workers,
            "prefetch_factor": prefetch if workers else None,
            "persistent_workers": bool(persistent and workers),
        }, search

    def _device_transformed(self, batch: Any, dataloader_idx: int) -> Any:
        """`on_after_batch_transfer` while the datamodule has device transforms (`_DeviceHook`)."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        ours = isinstance(inspect.getattr_static(type(self), "on_after_batch_transfer"), _DeviceHook)
        if ours and module is not None and overrides(module, "on_after_batch_transfer"):
            raise ValueError(
                f"`device_transforms`/`eval_device_transforms` of {type(self).__name__} and"
                f" {type(module).__name__}.on_after_batch_transfer both change batches on the device,"
                " and Lightning runs only the datamodule's hook. Move the hook's work into the"
                " transforms (a `torchvision.transforms.v2.Compose`, or any callable), or drop the"
                " transforms from the datamodule and apply them in the hook, in the order you want."
            )
        training = self.trainer is not None and self.trainer.training
        transform = self.device_transforms if training else self.eval_device_transforms
        return transform(batch) if transform is not None else batch

    on_after_batch_transfer = _DeviceHook()

    @override
    def teardown(self, stage: str) -> None:
        self.worker_tuner.restore()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"worker_tuner": self.worker_tuner.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.worker_tuner.load_state_dict(state_dict.get("worker_tuner", {}))


def _checked_loader_kwargs(loader_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    allowed = set(inspect.signature(DataLoader).parameters) - _MANAGED
    for key in loader_kwargs:
        if key in _ELSEWHERE:
            raise ValueError(f"`loader_kwargs` got {key!r}: {_ELSEWHERE[key]}.")
        if key in _MANAGED:
            raise ValueError(
                f"`loader_kwargs` got {key!r}, which has its own argument: pass `{key}=...` instead."
            )
        if key not in allowed:
            raise unknown_choice_error("loader_kwargs", key, allowed)
        check = _LOADER_VALUES.get(key)
        if check is not None and not check[0](loader_kwargs[key]):
            raise ValueError(
                f"`loader_kwargs[{key!r}]` expected {check[1]}, got {loader_kwargs[key]!r}: the DataLoader"
                " would fail with it later, at its first batch."
            )
    return dict(loader_kwargs)


def _start_method(value: object) -> bool:
    if isinstance(value, str):
        return value in multiprocessing.get_all_start_methods()
    return value is None or isinstance(value, multiprocessing.context.BaseContext)


#: What the DataLoader arguments a user may fix by hand must be (checked here, not at the first batch).
_LOADER_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "timeout": (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"),
        "seconds >= 0 (0: wait forever)",
    ),
    "multiprocessing_context": (
        _start_method,
        "None, a multiprocessing context or one of "
        + ", ".join(map(repr, multiprocessing.get_all_start_methods())),
    ),
    "generator": (lambda v: v is None or isinstance(v, torch.Generator), "None or a torch.Generator"),
    "worker_init_fn": (lambda v: v is None or callable(v), "None or a function of the worker id"),
    "pin_memory_device": (lambda v: isinstance(v, str), "a device name such as 'cuda'"),
    "in_order": (lambda v: isinstance(v, bool), "True or False"),
}


#: The loaders a `BoostedDataModule` built: tuned, whichever hook returns them.
_BUILT: weakref.WeakSet[DataLoader[Any]] = weakref.WeakSet()


def built_by_datamodule(loader: object) -> bool:
    """Whether a `BoostedDataModule` built `loader` (its workers decided and reported there), as
    a hook that wraps the datamodule's (``return super().train_dataloader()``) returns it."""
    return isinstance(loader, DataLoader) and loader in _BUILT


@contextlib.contextmanager
def sizing_only(datamodule: object) -> Iterator[None]:
    """Loaders `datamodule` (a `BoostedDataModule`) builds inside are plain ones with its batch
    sizes, training sampler and collate function: `AutoBatchSize`'s reads of what a hook's loader
    holds (the attribute its size follows, the data its trials load) decide no workers and say
    nothing of loaders that never load a batch."""
    if not isinstance(datamodule, BoostedDataMixin):
        yield
        return
    datamodule._sizing_only = True
    try:
        yield
    finally:
        datamodule._sizing_only = False


def builds_loader(datamodule: object, split: str) -> TypeGuard[BoostedDataMixin]:
    """Whether `datamodule` is a `BoostedDataModule` (or mixin) that builds `split`'s loader itself,
    tuned, from ``self.<split>_dataset``; not where the user overrides ``<split>_dataloader()``
    (several tasks' loaders, a collate of their own), whose loaders are then theirs, as in any
    datamodule.

    Example:
        >>> class Own(BoostedDataModule):
        ...     def train_dataloader(self): ...
        >>> builds_loader(Own(), "train"), builds_loader(Own(), "val")
        (False, True)
    """
    hook = f"{split}_dataloader"
    return isinstance(datamodule, BoostedDataMixin) and (
        inspect.getattr_static(type(datamodule), hook) is inspect.getattr_static(BoostedDataMixin, hook)
    )


class BoostedDataModule(BoostedDataMixin, L.LightningDataModule):
    """Builds the train/val/test/predict DataLoaders from datasets a subclass assigns in ``setup()``.

    Every setting left as ``None`` is chosen for you:

    - ``num_workers`` and ``prefetch_factor``: measured on the training dataset (see
      `lightning_boost.workers.search`), once per machine, dataset and batch size, cached as JSON,
      made on rank zero and broadcast so every rank uses the same value;
    - ``pin_memory``: on when the trainer runs on CUDA;
    - ``persistent_workers``: on when there are workers, except with pinned memory and
      ``Trainer(reload_dataloaders_every_n_epochs>0)``, a combination Lightning warns against;
    - workers seeded per worker and rank (Lightning's ``pl_worker_init_function``), so random
      augmentation is reproducible under ``seed_everything``; the distributed sampler is Lightning's.

    On a CPU run the model's torch threads are set to the CPUs the workers leave (restored at
    teardown). Each decision, with its measurements, is a `Finding` in ``self.findings``.

    Args:
        batch_size: samples per batch; a plain attribute that batch-size tuning may change.
        eval_batch_size: samples per validation, test and predict batch, fixed by hand. ``None``
            (default): the size `AutoBatchSize` measured for evaluation steps on an accelerator
            (no gradients are kept, so usually several times `batch_size`), else `batch_size`.
        shuffle: shuffle the training set (evaluation sets are never shuffled). A
            ``self.train_sampler`` that ``setup()`` assigns (a ``WeightedRandomSampler``) draws the
            training samples instead; the batches are then its draws, in its order.
        drop_last: drop the last incomplete training batch.
        collate_fn: merges samples into a batch (default: PyTorch's).
        num_workers: fix the worker count by hand instead of measuring it.
        prefetch_factor: fix the batches each worker loads ahead.
        pin_memory: fix page-locked host memory on or off.
        persistent_workers: fix whether workers outlive an epoch.
        device_transforms: applied to each training batch once it is on the device
            (``on_after_batch_transfer``), e.g. a ``torchvision.transforms.v2`` pipeline: heavy
            augmentation batched on the GPU instead of per sample on the CPU. Note that a v2
            transform called on a batch draws one set of random parameters for the whole batch.
            Without transforms the model's own ``on_after_batch_transfer`` runs; beside one,
            the fit stops at its first batch with a ``ValueError`` (Lightning runs only one).
        eval_device_transforms: the same for validation, test and predict batches.
        worker_tuning: how workers are measured (`WorkerTuning`).
        retune: measure again even when the cache has this setting.
        cache_dir: where measurements are cached (default ``$LIGHTNING_BOOST_CACHE_DIR`` or
            ``~/.cache/lightning_boost``).
        loader_kwargs: any other ``DataLoader`` argument, fixed by hand (``timeout``,
            ``multiprocessing_context``, ``worker_init_fn``, ...).

    Raises:
        TypeError, ValueError: for an argument that does not fit its type (a batch size below 1,
            a negative worker count, ``shuffle="no"``, ...), or a `loader_kwargs` key that is not
            a DataLoader argument or that has its own parameter here.

    Example::

        class CIFAR(BoostedDataModule):
            def setup(self, stage: str) -> None:
                self.train_dataset = torchvision.datasets.CIFAR10("data", transform=...)
                self.val_dataset = torchvision.datasets.CIFAR10("data", train=False, transform=...)

        trainer.fit(model, datamodule=CIFAR(batch_size=128))
    """

    @property
    def trainer(self) -> L.Trainer | None:
        return self.__dict__.get("_boosted_trainer")

    @trainer.setter
    def trainer(self, trainer: L.Trainer | None) -> None:
        if trainer is not None and from_pytorch_lightning(trainer) and not from_pytorch_lightning(self):
            # a `lightning` datamodule given to `pytorch_lightning.Trainer.fit(datamodule=...)`
            # (Lightning's "Expected a parent" otherwise): it becomes that namespace's own
            self.__class__ = pytorch_lightning_twin(type(self))
        self._boosted_trainer = trainer
