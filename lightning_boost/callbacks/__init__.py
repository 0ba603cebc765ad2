"""Lightning callbacks: thin hooks that gather data, call a decision from `tuning/`, apply it."""

from lightning_boost.callbacks.auto_num_workers import AutoNumWorkers

__all__ = ["AutoNumWorkers"]
