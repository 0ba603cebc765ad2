"""``torch.nn.DataParallel`` inside a LightningModule: found, said, and stopped where it cannot run.

Code ported from plain PyTorch often wraps a network in ``nn.DataParallel``. Each forward then
copies the module onto every GPU it spans and splits the batch from one Python process, and
gathers the outputs on the first GPU; PyTorch's documentation recommends DistributedDataParallel
instead, "even if there is only a single node". Under Lightning the strategy already places the
model and, with several devices, runs one process per GPU: there a DataParallel over the
machine's GPUs (or one: it needs the module on its first) fails at the first forward on every rank
whose device is another ("module must have its parameters and buffers on device cuda:0").
The preset names the wrapper with the fix (a `Finding`), and raises before the fit starts in
the case that cannot run. Nothing is unwrapped: that would change the model's state-dict keys,
so its checkpoints. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from lightning_boost.report import Finding, Severity

_DOCS = "https://pytorch.org/docs/stable/generated/torch.nn.DataParallel.html"


class Wrapper(NamedTuple):
    """One ``nn.DataParallel`` in a model: its attribute path and the GPUs it spans (none on a
    machine without one, where it passes each call through)."""

    name: str
    device_ids: tuple[int, ...]


def data_parallel_wrappers(module: torch.nn.Module) -> list[Wrapper]:
    """Every ``nn.DataParallel`` in `module` (not those inside another).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.DataParallel(torch.nn.Linear(2, 2)))
        >>> [w.name for w in data_parallel_wrappers(net)]
        ['0']
    """
    found: list[Wrapper] = []
    for name, each in module.named_modules():
        inside = any(name.startswith(f"{w.name}.") for w in found)
        if isinstance(each, torch.nn.DataParallel) and not inside:
            found.append(Wrapper(name, tuple(each.device_ids)))
    return found


def data_parallel_error(wrappers: Sequence[Wrapper], processes: int, preset: str) -> str | None:
    """Why the run cannot train, else ``None``: in a run of several processes, each on its own
    device, a DataParallel over any GPU needs the module on its first one, so it fails on every
    rank but one.

    Example:
        >>> print(data_parallel_error([Wrapper("net", (0, 1, 2, 3))], 4, "fast-ddp"))  # doctest: +ELLIPSIS
        preset('fast-ddp') trains in 4 processes, each on its own device, but `self.net` is a ...
        >>> data_parallel_error([Wrapper("net", (0, 1, 2, 3))], 1, "auto") is None
        True
    """
    on_gpus = [w for w in wrappers if w.device_ids]
    if processes <= 1 or not on_gpus:
        return None
    wrapper = on_gpus[0]
    return (
        f"preset({preset!r}) trains in {processes} processes, each on its own device, but"
        f" `self.{wrapper.name}` is a torch.nn.DataParallel over GPUs {list(wrapper.device_ids)}: its"
        f" forward needs the module on cuda:{wrapper.device_ids[0]}, so it fails on every rank whose"
        " device is another. The strategy already splits each batch across the devices: hold the"
        f" module itself (`self.{wrapper.name} = net`, not"
        " `nn.DataParallel(net)`); a checkpoint saved with the wrapper loads after removing"
        f" `{wrapper.name}.module.` from its keys."
    )


def data_parallel_finding(wrappers: Sequence[Wrapper]) -> Finding | None:
    """The finding for a run that can train with its DataParallel, else ``None`` (there is none):
    a warning where it spans several GPUs, a note where it spans one or none.

    Example:
        >>> data_parallel_finding([Wrapper("net", (0, 1))]).title
        '`self.net` is a torch.nn.DataParallel over 2 GPUs: DDP is the faster way to use them'
        >>> data_parallel_finding([Wrapper("net", ())]).severity.value
        'info'
    """
    if not wrappers:
        return None
    wrapper = max(wrappers, key=lambda w: len(w.device_ids))
    gpus = len(wrapper.device_ids)
    names = ", ".join(f"`self.{w.name}`" for w in wrappers)
    if gpus > 1:
        title = f"`self.{wrapper.name}` is a torch.nn.DataParallel over {gpus} GPUs: DDP is the faster way"
        title += " to use them"
        detail = (
            f"{names}: each forward copies the module onto all {gpus} GPUs and splits the batch from one"
            " Python process, then gathers the outputs on the first, while the run's strategy trains on"
            f" its own device(s); PyTorch recommends DistributedDataParallel instead ({_DOCS})."
        )
    else:
        where = "one GPU: each forward only adds a scatter and a gather" if gpus else "no GPU here"
        title = f"`self.{wrapper.name}` is a torch.nn.DataParallel ({where})"
        detail = (
            f"{names}: on a machine with several GPUs each forward would copy the module onto all of them"
            " from one Python process, and a multi-GPU Lightning run (one process per GPU) would fail at"
            f" its first forward; PyTorch recommends DistributedDataParallel instead ({_DOCS})."
        )
    fix = (
        f"Hold the module itself (`self.{wrapper.name} = net`, not `nn.DataParallel(net)`) and train on"
        " every GPU with `Trainer(devices=-1, strategy=preset('fast-ddp'))`; a checkpoint saved with the"
        f" wrapper loads after removing `{wrapper.name}.module.` from its keys."
    )
    severity = Severity.WARN if gpus > 1 else Severity.INFO
    data = {"data_parallel": [w.name for w in wrappers], "gpus": gpus}
    return Finding("preset", "precision and strategy", severity, title, detail, fix, data=data)
