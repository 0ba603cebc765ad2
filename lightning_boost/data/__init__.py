"""DataLoaders built and tuned for the machine: `BoostedDataModule` and the tuner it shares."""

from lightning_boost.data.datamodule import BoostedDataModule
from lightning_boost.data.tuner import WorkerTuner

__all__ = ["BoostedDataModule", "WorkerTuner"]
