"""LBFGS with a line search, trained over several processes: said at set-up, before the fit hangs.

LBFGS's line search (``line_search_fn="strong_wolfe"``) evaluates the step again, through the
closure Lightning hands it, as many times as the loss it reads asks. Under DDP each rank reads its
own batch's loss, so the ranks can evaluate different numbers of times; each evaluation's backward
waits in the gradient all-reduce for every rank's, and a rank that evaluates once more than the
others waits for ever. Reproduced on 2 CPU processes over gloo (a regression MLP, ``max_iter=5``,
2026-12-02): still hung after 90 s, with or without the pack; without a line search the same fit
finished. A warning at set-up is seen before the hang; the report at the fit's end never comes.
No Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_boost.report import Finding, Severity


def line_searches(optimizers: Sequence[object]) -> list[str]:
    """Each LBFGS among `optimizers` that has a line search, by its place and its setting.

    Example:
        >>> p = [torch.zeros(1, requires_grad=True)]
        >>> line_searches([torch.optim.SGD(p, lr=0.1), torch.optim.LBFGS(p, line_search_fn="strong_wolfe")])
        ["optimizer 1: LBFGS(line_search_fn='strong_wolfe')"]
        >>> line_searches([torch.optim.LBFGS(p)])
        []
    """
    return [
        f"optimizer {index}: LBFGS(line_search_fn={optimizer.param_groups[0]['line_search_fn']!r})"
        for index, optimizer in enumerate(optimizers)
        if isinstance(optimizer, torch.optim.LBFGS) and optimizer.param_groups[0].get("line_search_fn")
    ]


def line_search_finding(found: Sequence[str], processes: int) -> Finding | None:
    """A warning for a line search over `processes` ranks, else ``None`` (none, or one process).

    Example:
        >>> found = ["optimizer 0: LBFGS(line_search_fn='strong_wolfe')"]
        >>> print(line_search_finding(found, 2).title)  # doctest: +ELLIPSIS
        LBFGS with a line search over 2 processes can hang: the ranks may evaluate the step ...
        >>> line_search_finding(found, 1) is None
        True
    """
    if not found or processes < 2:
        return None
    title = (
        f"LBFGS with a line search over {processes} processes can hang: the ranks may evaluate the step"
        " different numbers of times"
    )
    detail = (
        f"{', '.join(found)}: the line search evaluates the step again as often as the loss it reads"
        " asks, and each rank reads its own batch's loss; each evaluation's backward waits for every"
        " rank's gradients, so a rank that evaluates once more than the others waits for ever, with"
        " no error."
    )
    fix = (
        "Train LBFGS in one process (`Trainer(devices=1)`), or without a line search"
        " (`line_search_fn=None`: every rank then evaluates the step `max_iter` times, unless its"
        " own loss stops changing by `tolerance_change`)."
    )
    return Finding(
        "preset",
        "precision and strategy",
        Severity.WARN,
        title,
        detail,
        fix,
        data={"line_search": list(found)},
    )
