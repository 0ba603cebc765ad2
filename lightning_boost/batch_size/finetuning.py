"""Fine-tuning callbacks that unfreeze parameters during the fit (Lightning's `BaseFinetuning`,
`BackboneFinetuning`): the batch size must fit, and train fast, once they train too."""

from __future__ import annotations

from typing import Any

import lightning as L
from torch import nn

from lightning_boost._lightning import callbacks_of, is_lightning
from lightning_boost.report import Finding, Severity


def unfrozen_later(trainer: L.Trainer, module: nn.Module) -> list[str]:
    """Names of `module`'s frozen parameters that a fine-tuning callback of the run makes trainable
    during the fit: the ``backbone``'s for a `BackboneFinetuning` that unfreezes it before
    ``max_epochs``; every frozen one for another `BaseFinetuning`, whose `finetune_function` is the
    user's code (a frozen part it never unfreezes is then measured as trainable: a batch that fits
    with more trainable than the run has fits the run)."""
    frozen = {id(p): name for name, p in module.named_parameters() if not p.requires_grad}
    if not frozen:
        return []
    unfrozen: set[int] = set()
    for callback in callbacks_of(trainer):
        if is_lightning(callback, "BackboneFinetuning"):
            backbone = getattr(module, "backbone", None)
            if isinstance(backbone, nn.Module) and _unfreezes_in_run(trainer, callback):
                unfrozen |= {id(p) for p in backbone.parameters()}
        elif is_lightning(callback, "BaseFinetuning"):
            unfrozen |= set(frozen)
    return [name for key, name in frozen.items() if key in unfrozen]


def _unfreezes_in_run(trainer: L.Trainer, callback: Any) -> bool:
    epochs = trainer.max_epochs
    return epochs is None or epochs < 0 or int(callback.unfreeze_backbone_at_epoch) < epochs


def make_trainable(module: nn.Module, optimizers: list[Any], names: list[str]) -> None:
    """`names`' parameters of `module` trainable and held by the first optimizer, the way
    `BaseFinetuning.unfreeze_and_add_param_group` unfreezes them: in a new param group at a tenth of
    the first group's rate (its default) when the optimizer does not hold them already."""
    wanted = set(names)
    params = [p for name, p in module.named_parameters() if name in wanted]
    for param in params:
        param.requires_grad_(True)
    if not optimizers or not params:
        return
    optimizer = optimizers[0]
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [p for p in params if id(p) not in held]
    if missing:
        optimizer.add_param_group({"params": missing, "lr": optimizer.param_groups[0]["lr"] / 10})


def unfrozen_finding(module: nn.Module, names: list[str]) -> Finding:
    wanted = set(names)
    count = sum(p.numel() for name, p in module.named_parameters() if name in wanted)
    return Finding(
        "AutoBatchSize",
        "batch size",
        Severity.INFO,
        f"Batch size measured with the {count:,} parameters a fine-tuning callback unfreezes trainable",
        f"They are frozen now ({len(names)} tensors, e.g. `{names[0]}`), and the run's fine-tuning"
        " callback (`BaseFinetuning`) makes them trainable during the fit. The trial steps train them"
        " too (gradients, optimizer state, saved activations), so the batch fits after they unfreeze"
        " and its speed is that of the steps after it.",
        data={"unfrozen_parameters": count, "unfrozen_tensors": len(names)},
    )
