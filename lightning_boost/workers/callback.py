"""`AutoNumWorkers`: measured worker settings for DataLoaders the user built themselves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_boost._lightning import (
    batch_size_pending,
    datamodule_of,
    rebuild_dataloaders,
    reload_every_n_epochs,
)
from lightning_boost._validation import Directory, validated
from lightning_boost.callbacks.base import BoostCallback
from lightning_boost.data.datamodule import builds_loader, built_by_datamodule
from lightning_boost.report import Finding, Severity
from lightning_boost.workers.decision import capped_finding
from lightning_boost.workers.loaders import (
    MEASURED_SETTINGS,
    DeferredStartDataLoader,
    SameOrderDataLoader,
    cannot_rebuild,
    draws_each_iteration,
    holds_module,
    keep_workers_alive,
    loader_batch_size,
    rebuild_loader,
)
from lightning_boost.workers.search import WorkerTuning
from lightning_boost.workers.segments import SegmentedDataLoader
from lightning_boost.workers.tuner import LoaderTuner, epoch_batches, own_pass, workload
from lightning_boost.workers.whole_batches import WholeBatches, whole_batches_finding


class AutoNumWorkers(BoostCallback):
    """Re-creates the DataLoaders of ``fit``, ``validate``, ``test`` and ``predict`` with measured
    ``num_workers`` and ``prefetch_factor``.

    The training loader is searched on the first epoch's own batches (as `BoostedDataModule`'s:
    every sample trained once, in the sampler's order); a fit's validation loaders are timed
    before the fit. The loader of ``trainer.validate()``, ``test()`` or ``predict()`` is searched
    on its one pass the same way, against the step that consumes it; a pass too short to search
    keeps the prior: under 80 batches, the main process on a CPU; on a GPU, one too short to
    time half the CPU budget's workers (about 1,200 batches on 16 CPUs), the budget. On a CPU
    run each loop's model gets the threads its own loader's workers leave, set as the loop starts.

    For users who do not subclass `BoostedDataModule`: whatever returns the loaders (a datamodule,
    the model's ``*_dataloader()`` hooks, or loaders passed to ``fit``), each plain ``DataLoader``
    over a map-style dataset is rebuilt with every other argument kept, plus
    ``persistent_workers`` when it has workers. Each loader is decided on its own, against the
    step it feeds (a validation set with lighter transforms and a lighter step may need fewer
    workers); loaders over datasets alike in type, length and transforms that feed the same step
    share one measurement.
    Loaders a `BoostedDataModule` builds are left to it (it tunes its own, unless told a count);
    those of a hook its subclass overrides (``train_dataloader()`` returning a loader per task) are rebuilt.
    What it cannot rebuild (a DataLoader subclass, an ``IterableDataset``, a loader without a
    batch size) is left as it is, with a finding that says why. Measurements are made on rank
    zero, broadcast, and cached as JSON; tuned values live in ``state_dict`` for resuming.

    Args:
        tuning: how workers are measured (`WorkerTuning`).
        retune: measure again even when the cache has this setting.
        cache_dir: where measurements are cached (default ``$LIGHTNING_BOOST_CACHE_DIR`` or
            ``~/.cache/lightning_boost``).

    Example::

        trainer = L.Trainer(callbacks=[AutoNumWorkers()])
        trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_size=64, shuffle=True))
    """

    @validated
    def __init__(
        self, tuning: WorkerTuning | None = None, *, retune: bool = False, cache_dir: Directory | None = None
    ) -> None:
        self.tuning = tuning or WorkerTuning()
        self.retune = retune
        self.cache_dir = cache_dir
        self.worker_tuner = LoaderTuner(type(self).__name__, self.tuning, cache_dir, retune)
        self._set_state_key(tuning=self.tuning)
        self._undo: Any = None

    @property
    def findings(self) -> list[Finding]:
        return self.worker_tuner.findings

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # attaches the report
        datamodule = datamodule_of(trainer)

        def rebuilt(split: str, loaders: Any) -> Any:  # a BoostedDataModule tunes the loaders it builds
            return loaders if builds_loader(datamodule, split) else self._rebuild(trainer, split, loaders)

        self._undo = rebuild_dataloaders(trainer, stage, rebuilt)

    # a CPU run's model threads follow the loop that runs: each loader's workers leave it theirs
    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.worker_tuner.enter("train")

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.worker_tuner.enter("val")

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self.worker_tuner.enter("train")

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.worker_tuner.enter("test")

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.worker_tuner.enter("predict")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
        self.worker_tuner.restore()

    def _rebuild(self, trainer: L.Trainer, split: str, loaders: Any, name: str = "") -> Any:
        """`loaders` (one, or a list or dict of them) rebuilt at the workers each is decided;
        `name` tells one of several apart in the findings (``"train ['a']"``)."""
        if isinstance(loaders, DataLoader):
            rebuilt = self._rebuild_one(trainer, split, loaders, name)
            if isinstance(rebuilt.dataset, WholeBatches) and not isinstance(loaders.dataset, WholeBatches):
                self.worker_tuner.add_finding(whole_batches_finding(type(self).__name__))
            return rebuilt
        if isinstance(loaders, (list, tuple)):
            several = len(loaders) > 1
            return type(loaders)(
                self._rebuild(trainer, split, loader, f"{name or split} [{index}]" if several else name)
                for index, loader in enumerate(loaders)
            )
        if isinstance(loaders, Mapping):
            return {
                key: self._rebuild(trainer, split, loader, f"{name or split} [{key!r}]")
                for key, loader in loaders.items()
            }
        self._cannot(split, f"{type(loaders).__name__} is not a DataLoader or a list or dict of them")
        return loaders

    def _rebuild_one(
        self, trainer: L.Trainer, split: str, loader: DataLoader[Any], name: str = ""
    ) -> DataLoader[Any]:
        if built_by_datamodule(loader):  # a hook that returns the datamodule's own: tuned there
            return loader
        why_not = cannot_rebuild(loader)
        batch_size = loader_batch_size(loader)
        if why_not is not None or batch_size is None:
            self._cannot(split, why_not or "no batch size", loader.dataset, trainer.lightning_module)
            return loader
        settings = {name: getattr(loader, name, None) for name in MEASURED_SETTINGS}
        samples = workload(trainer, split, loader.dataset, batch_size, loader.sampler)
        alone = own_pass(trainer, split)  # an evaluation stage run alone: searched on its own pass
        per_pass = epoch_batches(trainer, loader.dataset, batch_size, loader.drop_last, split, loader.sampler)
        searched = per_pass if split == "train" or alone else None
        cap = per_pass if split != "train" else None  # a worker past a pass's batches never gets one
        choice, search = self.worker_tuner.decide(
            trainer, loader.dataset, batch_size, settings, samples, split, searched, cap, name
        )
        workers = choice.num_workers
        if cap is not None and cap < workers:
            self.worker_tuner.add_finding(capped_finding(type(self).__name__, split, cap, workers))
            workers = cap
        reload = reload_every_n_epochs(trainer)
        options: dict[str, Any] = {
            "num_workers": workers,
            "prefetch_factor": choice.prefetch_factor,
            "persistent_workers": keep_workers_alive(workers, loader.pin_memory, reload),
        }
        if search is None:  # the user's own draws from the global RNG kept: see `SameOrderDataLoader`
            same_order = SameOrderDataLoader if draws_each_iteration(loader) else DeferredStartDataLoader
            kept = rebuild_loader(loader, loader_class=same_order, **options)
            if split == "train" and isinstance(kept, DeferredStartDataLoader):  # may be built again
                kept.defer_start = batch_size_pending(trainer)
            return kept
        # for the winner, once it has workers (one pass of an evaluation stage needs none kept)
        persist = keep_workers_alive(1, loader.pin_memory, reload) and not alone
        rebuilt = rebuild_loader(
            loader, loader_class=SegmentedDataLoader, online=search, persist_after_search=persist, **options
        )
        if cap is not None:
            rebuilt.workers_cap = cap  # for the search's winner (`apply_setting`)
        return rebuilt

    def _cannot(
        self, split: str, why: str, dataset: object = None, module: L.LightningModule | None = None
    ) -> None:
        name = type(dataset).__name__
        stream = isinstance(dataset, IterableDataset)
        model = holds_module(dataset, module) if stream and module is not None else None
        if model is not None:  # workers would run copies of the model, never trained
            finding = Finding(
                type(self).__name__,
                "data",
                Severity.INFO,
                f"The {split} DataLoader loads in the main process: {name} runs the model it holds",
                f"{name}'s samples come from the module in `self.{model}` (rollouts of a policy): each"
                " worker would run a copy of it made when the worker starts, which training never"
                " updates, so its `num_workers` is left as you set it.",
            )
        else:
            finding = Finding(
                type(self).__name__,
                "data",
                Severity.WARN,
                f"The {split} DataLoader was not tuned: {why}",
                fix="Set `num_workers` on this loader by hand, each worker reading its own shard"
                " (`torch.utils.data.get_worker_info()`)."
                if stream
                else "Use `BoostedDataModule`, or set `num_workers` on this loader by hand.",
            )
        self.worker_tuner.add_finding(finding)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.worker_tuner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.worker_tuner.load_state_dict(state_dict)
