"""With LightningCLI, the run's config as it trained: ``config.tuned.yaml`` beside ``config.yaml``.

LightningCLI saves the config it was given before anything is tuned, so a run tuned to batch 256
and a learning rate x8 leaves a config that says 32 and 0.1. `tuned_changes` works out, as plain
data, which config entries the run changed; `write_tuned_config` writes the whole config with
them, and without the tuning callbacks whose values it holds, so ``fit --config config.tuned.yaml``
repeats the run exactly instead of tuning again.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L

from lightning_boost._lightning import callbacks_of, is_lightning

TUNED_CONFIG = "config.tuned.yaml"


class NotWritten(Exception):
    """Why ``config.tuned.yaml`` cannot repeat the run: the message says what to change."""


#: Callbacks whose work the tuned config can hold.
TUNERS = ("AutoBatchSize", "AutoNumWorkers")
_LR_KEYS = ("optimizer.init_args.lr", "optimizer.lr", "model.init_args.lr", "model.lr",
            "model.init_args.learning_rate", "model.learning_rate")  # fmt: skip


def tuned_changes(
    flat: Mapping[str, Any],
    *,
    batch_size: int | None = None,
    attr_name: str = "batch_size",
    configured_batch_size: int | None = None,
    derived_from: tuple[str, float] | None = None,
    accumulate_grad_batches: int | None = None,
    lr_factor: float = 1.0,
    loader: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Dotted config key -> the value the run trained with, for the keys `flat` (the config as
    dotted keys) has; `AutoBatchSize` is dropped from ``trainer.callbacks``, and `AutoNumWorkers`
    when the `loader` settings are the datamodule's arguments (``None``: loaders the config
    cannot set, whose tuning stays, its cache repeating the choice). The batch size goes
    to `attr_name`'s entry, else to that of the attribute it was derived from (`derived_from`: its
    name and how many times larger it is, as a per-device size is derived from a global one).

    Raises:
        NotWritten: when the batch size changed from `configured_batch_size` and no entry holds it.

    Example:
        >>> tuned_changes({"data.batch_size": 32, "model.lr": 0.1}, batch_size=256, lr_factor=8.0)
        {'data.batch_size': 256, 'model.lr': 0.8}
        >>> tuned_changes({"data.batch_size": 32}, batch_size=64, attr_name="_batch_size",
        ...               derived_from=("batch_size", 1.0))
        {'data.batch_size': 64}
    """
    changes: dict[str, Any] = {}

    def first(*keys: str) -> str | None:
        return next((key for key in keys if key in flat), None)

    if batch_size is not None:
        key = first(*_entries(attr_name))
        derived = first(*_entries(derived_from[0])) if derived_from is not None else None
        if key is not None:
            changes[key] = batch_size
        elif derived is not None and derived_from is not None and float(derived_from[1]).is_integer():
            changes[derived] = batch_size * int(derived_from[1])
        elif configured_batch_size is not None and batch_size != configured_batch_size:
            raise NotWritten(
                f"config.tuned.yaml not written: the run trained at batch size {batch_size} (configured"
                f" {configured_batch_size}), and no config entry holds `{attr_name}`, the attribute the"
                " training loader reads. Make it an `__init__` argument of the datamodule or model, or"
                " keep AutoBatchSize in the config (its cache repeats the decision)."
            )
    if accumulate_grad_batches is not None and flat.get("trainer.accumulate_grad_batches", 1) != (
        accumulate_grad_batches
    ):
        changes["trainer.accumulate_grad_batches"] = accumulate_grad_batches
    lr_key = first(*_LR_KEYS)
    if lr_factor != 1.0 and lr_key is not None and isinstance(flat[lr_key], (int, float)):
        changes[lr_key] = flat[lr_key] * lr_factor
    for name, value in (loader or {}).items():
        key = first(f"data.init_args.{name}", f"data.{name}")
        if key is not None:
            changes[key] = value
    # the worker settings of loaders the config cannot set (not a `BoostedDataModule`'s) stay
    # with `AutoNumWorkers`, whose cache repeats them
    tuners = TUNERS if loader is not None else ("AutoBatchSize",)
    callbacks = flat.get("trainer.callbacks")
    if isinstance(callbacks, list):
        kept = [c for c in callbacks if _class_name(c) not in tuners]
        if len(kept) != len(callbacks):
            changes["trainer.callbacks"] = kept
    return changes


def _entries(name: str) -> tuple[str, ...]:
    """The config entries an attribute `name` of the datamodule or model can be."""
    return (f"data.init_args.{name}", f"data.{name}", f"model.init_args.{name}", f"model.{name}")


def _class_name(entry: Any) -> str:
    """A callback entry's class name: a config's ``class_path`` or an instance's class."""
    class_path = getattr(entry, "class_path", None)
    if class_path is None and isinstance(entry, Mapping):
        class_path = entry.get("class_path")
    return str(class_path).rpartition(".")[2] if class_path is not None else type(entry).__name__


def repeat_command(trainer: L.Trainer, path: Path) -> str:
    """How to repeat the run from `path`: ``fit --config PATH`` for a LightningCLI run with
    subcommands, ``--config PATH`` for one built with ``run=False`` (which takes no subcommand)."""
    saver: Any = _saver(trainer)
    last = str(getattr(getattr(saver, "parser", None), "prog", "")).rpartition(" ")[2]
    subcommand = f"{last} " if last in ("fit", "validate", "test", "predict") else ""
    return f"{subcommand}--config {path}"


def write_tuned_config(trainer: L.Trainer, tuned: Mapping[str, Any]) -> Path | None:
    """Write ``config.tuned.yaml`` beside the config LightningCLI saved; ``None`` without one."""
    saver: Any = _saver(trainer)
    if saver is None or not getattr(saver, "save_to_log_dir", True) or trainer.log_dir is None:
        return None
    config = copy.deepcopy(saver.config)
    tuner = next((c for c in callbacks_of(trainer) if type(c).__name__ == "AutoBatchSize"), None)
    loader = {key: tuned[key] for key in ("num_workers", "prefetch_factor") if key in tuned}
    decision = getattr(tuner, "decision", None)
    changes = tuned_changes(
        dict(vars(config.as_flat())),
        batch_size=tuned.get("batch_size") if tuner is not None else None,
        attr_name=getattr(tuner, "attr_name", "batch_size"),
        configured_batch_size=getattr(decision, "configured_batch_size", None),
        derived_from=getattr(tuner, "derived_from", None),
        accumulate_grad_batches=tuned.get("accumulate_grad_batches"),
        lr_factor=float(tuned.get("lr_factor", 1.0)),
        loader=loader if is_boosted(trainer) else None,
    )
    for key, value in changes.items():
        config[key] = value
    instances = [
        type(c).__name__ for c in config.get("trainer.callbacks") or [] if _class_name(c) == type(c).__name__
    ]
    if instances:
        raise NotWritten(
            f"config.tuned.yaml not written: trainer.callbacks holds instances ({', '.join(instances)}),"
            " which a config file cannot hold. Give them as `class_path` entries in the config, or as"
            " LightningCLI(trainer_defaults={'callbacks': [...]}), which the config does not carry."
        )
    path = Path(trainer.log_dir, TUNED_CONFIG)
    saver.parser.save(config, path, skip_none=False, skip_check=True, overwrite=True)
    return path


def _saver(trainer: L.Trainer) -> Any:
    return next((c for c in callbacks_of(trainer) if is_lightning(c, "SaveConfigCallback")), None)


def is_boosted(trainer: L.Trainer) -> bool:
    """Whether the run's loaders come from a `BoostedDataModule` (its worker settings are arguments)."""
    from lightning_boost.data.datamodule import BoostedDataMixin

    return isinstance(getattr(trainer, "datamodule", None), BoostedDataMixin)
