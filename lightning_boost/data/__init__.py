"""DataLoaders built and tuned for the machine: `BoostedDataModule` and the tuner it shares."""

from lightning_boost.data.datamodule import BoostedDataMixin, BoostedDataModule
from lightning_boost.workers.tuner import LoaderTuner

#: `LoaderTuner` by its former name, two letters from `WorkerTuning` (the settings it is given).
WorkerTuner = LoaderTuner

__all__ = ["BoostedDataMixin", "BoostedDataModule", "LoaderTuner", "WorkerTuner"]
