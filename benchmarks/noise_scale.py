"""The gradient noise scale AutoBatchSize reads at a BatchNorm network's initial weights, drawn
again and again: how often is it hidden, and how often does the larger size's trial resolve it?

The demo's ResNet-18 (BatchNorm, SGD) at one set of initial weights: each draw runs the search's
first trial (batch 64 and its two halves) and its next one (128) on fresh random batches of the
demo's training images, as `AutoBatchSize` does on a copy of the model, and fits the noise scale
after each. The ratio is the share of draws the 128 trial resolved (a resolved noise scale can
grow the batch, and its learning rate, on one batch's luck); the detail gives the halves' squared
gradient norm over the whole batch's (about 2 expected without BatchNorm). See
docs/batch-size.md. Run: ``python -m benchmarks noise_scale``.
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
    ratios, hidden, resolved, values = [], 0, 0, []
    for draw in range(draws):
        torch.manual_seed(100 + draw)
        batches = sample_batches(dataset, None, size)
        first = probe.train(next(batches), size, batches, split=True)
        larger = sample_batches(dataset, None, 2 * size)
        second = probe.train(next(larger), 2 * size, larger)
        assert first.half_grad_sq is not None and first.grad_sq is not None
        ratios.append(first.half_grad_sq / first.grad_sq)
        after_first, after_both = noise_of([first], _BUDGET), noise_of([first, second], _BUDGET)
        hidden += after_first is not None and after_first.lower_bound
        if after_both is not None and not after_both.lower_bound:
            resolved += 1
            values.append(after_both.value)
    found = ", ".join(f"{value:,.0f}" for value in values) or "none"
    return [
        Row(
            f"noise scale at BatchNorm initial weights: draws the {2 * size} trial resolved / draws",
            resolved / draws,
            f"ResNet-18 (demo), batch {size}, {draws} draws of the trials' batches at one set of initial"
            f" weights: hidden after the first trial in {hidden}, resolved after the {2 * size} trial in"
            f" {resolved} (noise scale {found}); the halves' squared gradient norm over the whole"
            f" batch's {min(ratios):.2f}-{max(ratios):.2f} (about 2 without BatchNorm)",
            COMMAND,
        )
    ]
