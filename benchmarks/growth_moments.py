"""A batch grown during an Adam run: does the grown run end with the model a fixed batch reaches?

`AutoBatchSize(grow=True)` grows the batch between epochs and raises the learning rates by the
square-root rule. Adam divides each step by the running average of squared gradients, which
still holds the smaller batch's noisier squares after a growth and for about ``1 / (1 - beta2)``
steps (1,000 for its default) undoes the raised rate. A growth therefore also multiplies that
average by the squared gradient expected at the new size over the old
(`second_moment_factor`, from the noise scale the growth read).

This replays the growth the pack made on this workload (`time_to_quality`'s MLP and its 7,168
samples, Adam at 1e-3, batch 32, 8 epochs): 32, then 64 after epoch 0 and 128 after epoch 1, the
learning rates x1.41 and x2, in a plain training loop, so the schedule does not hang on this
shared host's timing as the pack's trials do. The noise scale at each growth is `NoiseMeter`'s,
read from pairs of the epoch's own steps as the pack reads it. Three fits per seed: the batch of
32 throughout, the growth without the rescale (the pack before it), the growth with it
(`rescale_second_moments`); the rows give the fixed batch's final val loss over each grown
run's (above 1: the grown run ended better), the median over the seeds.

Run: ``python -m benchmarks growth_moments``.
"""

from __future__ import annotations

import math
import statistics

import torch
from torch import nn

from benchmarks.common import Row
from benchmarks.time_to_quality import classes
from lightning_boost.batch_size.regrow import NoiseMeter, rescale_second_moments, second_moment_factor

COMMAND = "python -m benchmarks growth_moments"
#: Epoch -> the batch it trains at: the sizes the pack grew this run to.
GROWN = {0: 32, 1: 64, 2: 128}


def run(seeds: int = 3, epochs: int = 8) -> list[Row]:
    finals: dict[str, list[float]] = {"fixed": [], "grown": [], "rescaled": []}
    factors: list[float] = []
    for seed in range(1, seeds + 1):
        finals["fixed"].append(_fit({0: 32}, seed, epochs, rescale=False)[0])
        finals["grown"].append(_fit(GROWN, seed, epochs, rescale=False)[0])
        loss, used = _fit(GROWN, seed, epochs, rescale=True)
        finals["rescaled"].append(loss)
        factors += used
    fixed = statistics.median(finals["fixed"])
    detail = (
        f"an MLP (32-128-10) with Adam, 7168 samples, {epochs} epochs, {seeds} seeds; val loss at the"
        f" batch of 32 throughout {_listed(finals['fixed'])}; grown 32 -> 64 -> 128 after epochs 0 and 1"
        f" (learning rates x1.41, x2)"
    )
    return [
        Row(
            "growth with Adam, squared gradients rescaled: fixed batch's final val loss / grown run's",
            fixed / statistics.median(finals["rescaled"]),
            f"{detail}, Adam's running squared gradients rescaled at each growth (x"
            f"{_listed(factors, 2)}): {_listed(finals['rescaled'])}; 2.7x fewer optimizer steps",
            COMMAND,
        ),
        Row(
            "growth with Adam, not rescaled (before the fix): fixed batch's final val loss / grown run's",
            fixed / statistics.median(finals["grown"]),
            f"{detail}, Adam's state left as it was: {_listed(finals['grown'])}",
            COMMAND,
        ),
    ]


def _fit(sizes: dict[int, int], seed: int, epochs: int, rescale: bool) -> tuple[float, list[float]]:
    """The final val loss of a fit at `sizes` (epoch -> batch from that epoch on), and the factors
    the squared gradients were rescaled by."""
    train, val = classes(7168, 0), classes(2048, 1)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    order = torch.Generator().manual_seed(seed)
    batch, step, used = sizes[0], 0, []
    meter = NoiseMeter(batch)
    for epoch in range(epochs):
        grown = sizes.get(epoch, batch)
        if grown != batch:
            noise = meter.estimate()
            assert noise is not None, "every epoch here reads more than enough pairs"
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * math.sqrt(grown / sizes[0])
            if rescale:
                used.append(second_moment_factor(noise.value, batch, grown))
                rescale_second_moments(optimizer, used[-1])
            batch = grown
        meter.reset(batch)
        for index in torch.randperm(len(train), generator=order).split(batch):
            x, y = train.tensors[0][index], train.tensors[1][index]
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            meter.observe(step, [p.grad for p in net.parameters() if p.grad is not None])
            optimizer.step()
            step += 1
    with torch.no_grad():
        return nn.functional.cross_entropy(net(val.tensors[0]), val.tensors[1]).item(), used


def _listed(values: list[float], digits: int = 4) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)
