"""The gradient noise scale AutoBatchSize reads at a BatchNorm network's initial weights, drawn
again and again: how often is it hidden after the first trial, and how often would a trial of the
larger size have resolved it?

The demo's ResNet-18 (BatchNorm, SGD) at one set of initial weights: each draw runs the search's
first trial (batch 64, its two halves, and the next batch's gradient added: 32, 64 and 128 at the
same weights) on fresh random batches of the demo's training images, as `AutoBatchSize` does on a
copy of the model, and fits the noise scale; then a trial of 128 on its own batches (what the
search ran before the first trial read the next batch), fitted with the first. The ratio is the
share of draws the first trial resolved (a resolved noise scale can grow the batch, and its
learning rate, on one batch's luck); the detail gives the halves' squared gradient norm over the
whole batch's (about 2 expected without BatchNorm). See docs/batch-size.md. Run:
``python -m benchmarks noise_scale``.
"""

from __future__ import annotations

import contextlib

import torch

from benchmarks.common import Row
from lightning_boost.batch_size.search import noise_of
from lightning_boost.demo import ValidatedResNet18, demo_dataset
from lightning_boost.step_probe import StepProbe, sample_batches

COMMAND = "python -m benchmarks noise_scale"
_BUDGET = 1 << 40  # no memory limit: only the gradients matter here


def run(draws: int = 12, samples: int = 8192, size: int = 64) -> list[Row]:
    torch.manual_seed(0)
    model = ValidatedResNet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = demo_dataset(samples)
    probe = StepProbe(model, [optimizer], 3, contextlib.nullcontext, contextlib.nullcontext)
    ratios, first_found, both_found = [], [], []
    for draw in range(draws):
        torch.manual_seed(100 + draw)
        batches = sample_batches(dataset, None, size)
        first = probe.train(next(batches), size, batches, split=True)
        larger = sample_batches(dataset, None, 2 * size)
        second = probe.train(next(larger), 2 * size, larger)
        assert first.half_grad_sq is not None and first.grad_sq is not None
        ratios.append(first.half_grad_sq / first.grad_sq)
        after_first, after_both = noise_of([first], _BUDGET), noise_of([first, second], _BUDGET)
        if after_first is not None and not after_first.lower_bound:
            first_found.append(after_first.value)
        if after_both is not None and not after_both.lower_bound:
            both_found.append(after_both.value)
    return [
        Row(
            "noise scale at BatchNorm initial weights: draws the first trial resolved / draws",
            len(first_found) / draws,
            f"ResNet-18 (demo), batch {size}, {draws} draws of the trials' batches at one set of initial"
            f" weights: resolved by the first trial (sizes {size // 2}, {size}, {2 * size}) in"
            f" {len(first_found)} (noise scale {_values(first_found)}), with a trial of {2 * size}"
            f" added in {len(both_found)} ({_values(both_found)}); the halves' squared gradient norm"
            f" over the whole batch's {min(ratios):.2f}-{max(ratios):.2f} (about 2 without BatchNorm)",
            COMMAND,
        )
    ]


def _values(values: list[float]) -> str:
    return ", ".join(f"{value:,.0f}" for value in values) or "none"
