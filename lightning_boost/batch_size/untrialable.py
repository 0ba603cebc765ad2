"""Models whose trials cannot train a copy as the run trains the model (pure: torch only): why the
run keeps its batch size instead, or ``""``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parameter import is_lazy


def lazy_reason(model: nn.Module) -> str:
    """A lazy module not shaped yet (``nn.LazyLinear``, whose parameters stay uninitialized until
    its first forward): the model's memory cannot be read before that forward.

    Example:
        >>> lazy_reason(nn.Sequential(nn.Linear(4, 8)))
        ''
        >>> lazy_reason(nn.Sequential(nn.LazyLinear(8)))[:35]
        '`0` (LazyLinear) is a lazy module, '
    """
    lazy = [
        (name, type(module).__name__)
        for name, module in model.named_modules()
        if any(is_lazy(param) for param in module.parameters(recurse=False))
    ]
    if not lazy:
        return ""
    name, kind = lazy[0]
    return (
        f"`{name or 'the model'}` ({kind}) is a lazy module, shaped by its first forward, so the"
        " model's memory cannot be read before it. Initialize it with a dry run at the end of"
        " `__init__` (`self(torch.zeros(1, ...))`, as PyTorch advises for lazy modules) and"
        " AutoBatchSize tunes the size"
    )


def scripted_reason(model: nn.Module) -> str:
    """A TorchScript module (``torch.jit.script``) with trainable parameters: ``copy.deepcopy`` of
    one gives parameters that are not graph leaves, which take no gradients, so a copy's trial
    steps would train none of them."""
    scripted = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.jit.ScriptModule)
        and any(param.requires_grad for param in module.parameters())
    ]
    if not scripted:
        return ""
    return (
        f"`{scripted[0] or 'the model'}` is a TorchScript module (`torch.jit.script`), and a copy of"
        " one takes no gradients, so trials on a copy would not train it. Hold the module itself"
        " (TorchScript is deprecated; `torch.compile` speeds the step up instead, and a copy of it"
        " trains) and AutoBatchSize tunes the size"
    )


def skipped_reason(size: int) -> str:
    """A ``training_step`` that returned ``None`` (Lightning skips the batch) at the first trial's
    batch of `size` samples: no step to time, whether it skips by `batch_idx` or by content.

    Example:
        >>> skipped_reason(32)[:61]
        '`training_step` returned None at the first trial (32 samples,'
    """
    return (
        f"`training_step` returned None at the first trial ({size} samples, batch_idx 0): Lightning"
        " skips such a batch, so there was no step to time. A step that returns its loss at the"
        " run's first batch is tuned"
    )
