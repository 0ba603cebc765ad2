"""Which attribute `AutoBatchSize` tunes: the one the training DataLoader reads its batch size from,
found by rebuilding the loader, and why a module cannot be tuned at all (the finding of a run that
then trains as written)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.utils.data import DataLoader

from lightning_boost._lightning import datamodule_of, user_dataloaders
from lightning_boost.data.datamodule import builds_loader, sizing_only
from lightning_boost.report import Finding, Severity
from lightning_boost.workers.loaders import loader_batch_size


def not_tunable(pl_module: L.LightningModule, name: str, explicit: bool) -> Finding | None:
    """Why this module's batch size cannot be tuned without changing the program, as the finding of
    a run that then trains as written; ``None`` when it can. An `attr_name` the user named that
    does not exist is an error instead."""
    if not pl_module.automatic_optimization:
        return Finding(
            "AutoBatchSize",
            "batch size",
            Severity.INFO,
            "Batch size kept as written: manual optimization",
            "`training_step` steps its own optimizers through the trainer (`self.optimizers()`,"
            " `self.manual_backward`), so it cannot be timed on a copy of the model outside the fit."
            " The batch size and the learning rates stay as written.",
            "Set the batch size by hand for this module (AutoBatchSize can be left out).",
        )
    if lightning_hasattr(pl_module, name):
        return None
    where = f"AutoBatchSize found no `{name}` to tune on the model, its `hparams` or the datamodule."
    fix = (
        f"Give the datamodule a `{name}` attribute that `train_dataloader()` reads"
        f" (`BoostedDataModule(batch_size=...)` has one, as does `BoostedDataModule.from_datasets`"
        " where `LightningDataModule.from_datasets` keeps the size inside its loaders), or take"
        f" `{name}` in the model's `__init__` with `self.save_hyperparameters()`. Loaders passed to"
        " `trainer.fit(train_dataloaders=...)` cannot be re-batched: pass a datamodule instead."
    )
    if explicit:
        raise AttributeError(f"{where} {fix}")
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.WARN,
        f"Batch size not tuned: no `{name}` to set",
        f"{where} The run trains with the loaders' own batch sizes, as written.",
        fix,
    )


def several_loaders_finding(why: str) -> Finding:
    """The finding of a run that trains on several loaders at once (`why` says which): it trains
    as written."""
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"Batch size kept as written: {why}",
        "Each step takes a batch from every training loader, and a trial times one loader's batches,"
        " so it cannot weigh a size for all of them. The batch sizes and the learning rates stay as"
        " written.",
        "Set each loader's batch size by hand (AutoBatchSize can be left out).",
    )


def attribute_the_loader_reads(
    trainer: L.Trainer, pl_module: L.LightningModule, name: str, configured: int
) -> str:
    """`name` when the training loader takes its batch size from it; else the datamodule's one int
    attribute it does read (a template's ``batch_size_per_device``, which ``setup()`` derives from
    ``batch_size``), found by setting each candidate and rebuilding the loader. Raises before any
    measurement when there is none."""
    datamodule = datamodule_of(trainer)
    if builds_loader(datamodule, "train"):
        if name == "batch_size":
            return name
        built: int | None = datamodule.batch_size
    else:
        built = _built_with(trainer, pl_module, name, configured + 1)
        if built in (configured + 1, None):
            return name  # read; or not a DataLoader, which `split_data` explains
        derived = _derived_attribute(trainer, datamodule, name, built)
        if derived is not None:
            return derived
    raise ValueError(
        f"`attr_name` is {name!r}, but the training DataLoader does not read it: with `{name}` set to"
        f" {configured + 1} it was built with batch_size={built}, so a tuned size would never reach"
        f" training. Build the loader with `batch_size=self.{name}` in `train_dataloader()`, or pass"
        " `attr_name=` the attribute it reads."
    )


def _built_with(trainer: L.Trainer, owner: Any, name: str, value: int) -> int | None:
    """The training loader's batch size when built with `owner`'s `name` set to `value` (put back)."""
    before = lightning_getattr(owner, name) if isinstance(owner, L.LightningModule) else getattr(owner, name)
    setter = lightning_setattr if isinstance(owner, L.LightningModule) else setattr
    setter(owner, name, value)
    try:
        with sizing_only(datamodule_of(trainer)):  # a probe: no loader of it trains
            loader = user_dataloaders(trainer, "train")
    finally:
        setter(owner, name, before)
    if isinstance(loader, (list, tuple)) and loader:
        loader = loader[0]
    return loader_batch_size(loader) if isinstance(loader, DataLoader) else None


def _derived_attribute(trainer: L.Trainer, datamodule: Any, name: str, built: int | None) -> str | None:
    """The one int attribute of `datamodule` equal to the loader's batch size that the rebuilt
    loader follows when it changes, else ``None``: a public one first, then a private one
    (Lightning's own fine-tuning example keeps its size in ``self._batch_size``)."""
    if datamodule is None or built is None:
        return None
    ints = {key: value for key, value in vars(datamodule).items() if type(value) is int}
    candidates = [key for key, value in ints.items() if value == built and key != name]
    for private in (False, True):
        tried = [key for key in candidates if key.startswith("_") == private]
        read = [key for key in tried if _built_with(trainer, datamodule, key, built + 1) == built + 1]
        if read:
            return read[0] if len(read) == 1 else None
    return None


def adopted_finding(name: str, read: str) -> Finding:
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"Tuned `{read}`, the attribute the training DataLoader reads",
        f"The loader does not read `{name}`: `setup()` derives `{read}` from it (a per-device size,"
        f" as project templates do), so the tuned size is set on `{read}`; `{name}` keeps the"
        " configured value.",
        f"AutoBatchSize(attr_name={read!r}) says so up front.",
        data={"attr_name": read, "configured_attr": name},
    )
