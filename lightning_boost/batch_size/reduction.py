"""Whether the training loss sums over the batch rather than averaging it.

`AutoBatchSize`'s model of a batch (the gradient noise scale, the learning rate scaled by the
square root of the batch's growth) is that of a loss averaged over the batch, as PyTorch's losses
are by default. A loss summed over it (``reduction="sum"``, or a mean over a fixed count) already
takes steps as large as the batch: under SGD a 4x batch then trained at 4x the learning rate
before any scaling, and a noise scale read across sizes had no meaning. On the first trial's batch
a copy's loss is taken at the batch and at its two halves, without gradients: averaged, the
batch's loss is the halves' mean; summed, their sum.
"""

from __future__ import annotations

#: The batch's loss over its halves' mean from which the loss is taken to sum over the batch:
#: 1 for a mean, 2 for a sum (exactly, for per-sample losses without batch statistics).
SUMMED_RATIO = 1.6


def summed_reason(ratio: float | None, size: int) -> str:
    """Why the run keeps its size when its loss at `size` samples was `ratio` times the mean of
    its halves' (a sum over the batch), else ``""``.

    Example:
        >>> summed_reason(1.01, 32), summed_reason(None, 32)
        ('', '')
        >>> summed_reason(2.0, 32)[:60]
        "`training_step`'s loss sums over the batch (at 32 samples it"
    """
    if ratio is None or ratio < SUMMED_RATIO:
        return ""
    return (
        f"`training_step`'s loss sums over the batch (at {size} samples it was {ratio:.2f}x the mean"
        " of its halves' losses, where a mean is 1x), so a larger batch would take larger steps at"
        " the same learning rate before any scaling, and the noise scale read across sizes would mean"
        " nothing. Average the loss over the batch (`reduction='mean'`, with the learning rate"
        f" multiplied by {size} for the same steps) to let AutoBatchSize tune it"
    )
