"""DataLoaders built and tuned for the machine: `BoostedDataModule` and the tuner it shares."""

from lightning_boost.data.datamodule import BoostedDataMixin, BoostedDataModule
from lightning_boost.workers.tuner import WorkerTuner

__all__ = ["BoostedDataMixin", "BoostedDataModule", "WorkerTuner"]
