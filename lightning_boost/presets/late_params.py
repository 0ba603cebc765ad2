"""Parameters unfrozen after DDP wrapped the model, averaged over the ranks by the preset.

DDP's reducer holds the parameters that required gradients when it was built. A fine-tuning
callback (Lightning's `BackboneFinetuning`, or any `BaseFinetuning`) that unfreezes a backbone later
leaves its gradients to each rank, so every replica trains on its own batches' gradients alone and
the replicas drift apart, silently (Lightning issue #20340; by hand, 2 CPU processes, 3 epochs:
weights up to 0.012 apart). `LateParams` averages those gradients itself, in one all-reduce per
dtype at each optimizer step, after the step's backward and before the optimizer reads them
(inside the closure: before an fp16 scaler unscales, so every rank sees the same infs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_boost.report import Finding, Severity


class LateParams:
    """The parameters of `module` that DDP's reducer, built now, leaves out."""

    def __init__(self, module: nn.Module) -> None:
        #: Those frozen now, which DDP's reducer leaves out: only these can train unreduced later
        #: (none in a model that trains whole, so each step checks nothing).
        self.frozen = [p for p in module.parameters() if not p.requires_grad]

    def late(self) -> list[nn.Parameter]:
        """The trainable parameters DDP does not reduce: unfrozen since it wrapped the model."""
        return [p for p in self.frozen if p.requires_grad]

    def average(self) -> int:
        """Average the late parameters' gradients over the ranks; how many tensors it averaged.

        A rank where one has no gradient adds zeros, so every rank reduces the same tensors; one
        that no rank used keeps none, as DDP's reducer leaves a parameter used on no rank (the
        optimizer then skips it: a zero gradient would let weight decay and momentum move it).
        Whether each had one is summed in the same all-reduce, after the gradients; only a rank
        that lacked one reads the sums back (a sync on a GPU), so a backbone every rank uses costs
        no sync."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        late = self.late() if world_size > 1 else []
        by_kind: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for param in late:
            key = (param.device, param.grad.dtype if param.grad is not None else param.dtype)
            by_kind.setdefault(key, []).append(param)
        for (device, dtype), params in by_kind.items():
            lacked = any(p.grad is None for p in params)
            had = torch.ones(len(params), device=device, dtype=dtype)
            if lacked:
                had = torch.tensor([p.grad is not None for p in params], device=device, dtype=dtype)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p, dtype=dtype) for p in params]
            flat = torch.cat([*(grad.reshape(-1) for grad in grads), had])
            dist.all_reduce(flat)
            *parts, used = flat.split([*(grad.numel() for grad in grads), len(params)])
            anyone = used.tolist() if lacked else [1.0] * len(params)
            for param, grad, part, any_rank in zip(params, grads, parts, anyone, strict=True):
                param.grad = grad.copy_(part.view_as(grad).div_(world_size)) if any_rank else None
        return len(late)

    def finding(self) -> Finding:
        """INFO: the preset averages the late parameters."""
        late = self.late()
        return Finding(
            "preset",
            "precision and strategy",
            Severity.INFO,
            f"{_count(late):,} parameters unfrozen after DDP wrapped the model are averaged by the preset",
            f"{_UNREDUCED.format(tensors=len(late))}: the replicas would drift apart without an error"
            " (Lightning issue #20340). The preset all-reduces them once per optimizer step, after the"
            " backward: one more collective, not overlapped with the backward as DDP's own buckets"
            " are.",
            data={"late_parameters": _count(late), "late_tensors": len(late)},
        )


def unaveraged_finding(late: list[nn.Parameter]) -> Finding:
    """WARN: under a DDP that does not average them (Lightning's own), `late` train apart."""
    return Finding(
        "BoostReport",
        "precision and strategy",
        Severity.WARN,
        f"{_count(late):,} parameters unfrozen after DDP wrapped the model train apart on each rank",
        f"{_UNREDUCED.format(tensors=len(late))}: each rank steps them with its own batches' gradients"
        " and the replicas drift apart without an error (Lightning issue #20340, open).",
        "`Trainer(strategy=preset('fast-ddp'))`, which averages them at each optimizer step, or"
        " leave them trainable from the start of the fit",
        data={"unaveraged_parameters": _count(late), "unaveraged_tensors": len(late)},
    )


_UNREDUCED = (
    "DDP averages the gradients of the parameters that trained when it wrapped the model;"
    " {tensors} tensors were unfrozen since (a fine-tuning callback such as `BackboneFinetuning`),"
    " whose gradients it leaves to each rank"
)


def _count(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)
