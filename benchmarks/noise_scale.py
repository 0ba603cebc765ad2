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
whole batch's (about 2 expected without BatchNorm). See docs/batch-size.md.

The second row reads the same initial weights another way: `gradients` per size, each on
an independent batch, and the mean of their pairwise dot products, an unbiased estimate of
``|E g_B|^2`` whatever BatchNorm does within a batch (a product of independent batches' noise has
mean zero), against their mean squared norm ``E|g_B|^2``; the noise scale is
``B (E|g_B|^2 - |E g_B|^2) / |E g_B|^2``, and its cautious bound takes ``|E g_B|^2`` two
jackknife standard errors higher.

The third row is what `AutoBatchSize` reads on an accelerator: the first trial with `gradients`
independent batches' gradients before its steps (`StepProbe.train`'s `cross`), the noise scale
`noise_of` gives from them (two standard errors of the disjoint pairs on the cautious side), on
the same draws.

The fourth row is what that first trial reads where issue 32's criterion 6 measures
`AutoBatchSize` on a GPU: `gpu_batch_size`'s ResNet-50 at 224 px with AdamW on its random images
and labels, at its configured 32 (run here on the CPU, in fp32: the statistics are the model's
and the data's; a device changes their speed, and bf16 their rounding), with the sizes the 80 %
efficiency floor and the square-root rule's learning-rate limit (`LR_FACTOR_WARN`) leave to the search. Run:
``python -m benchmarks noise_scale``.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from benchmarks.common import Row
from benchmarks.gpu_batch_size import Classifier, RandomImages
from lightning_boost.batch_size.goodput import LR_FACTOR_WARN, efficiency
from lightning_boost.batch_size.search import Limits, lr_capped, noise_of
from lightning_boost.demo import ValidatedResNet18, demo_dataset
from lightning_boost.step_probe import StepProbe, sample_batches

COMMAND = "python -m benchmarks noise_scale"
_BUDGET = 1 << 40  # no memory limit: only the gradients matter here


def run(
    draws: int = 12,
    samples: int = 8192,
    size: int = 64,
    gradients: int = 8,
    sizes: tuple[int, ...] = (32, 64, 128, 256),
    arch: str = "resnet50",
    image: int = 224,
) -> list[Row]:
    torch.manual_seed(0)
    model = ValidatedResNet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = demo_dataset(samples)
    crossed = _cross_row(model, dataset, sizes, gradients)
    probe = StepProbe(model, [optimizer], 3, contextlib.nullcontext, contextlib.nullcontext)
    ratios, first_found, both_found, crossed_found = [], [], [], []
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
        torch.manual_seed(100 + draw)
        batches = sample_batches(dataset, None, size)
        accelerator = noise_of(
            [probe.train(next(batches), size, batches, split=True, cross=gradients)], _BUDGET
        )
        if accelerator is not None and not accelerator.lower_bound:
            crossed_found.append(accelerator.value)
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
        ),
        crossed,
        Row(
            "noise scale at BatchNorm initial weights, first trial on an accelerator: draws resolved / draws",
            len(crossed_found) / draws,
            f"the same {draws} draws, the first trial reading {gradients} independent batches' gradients"
            f" first (run here on the CPU): noise scale {_values(crossed_found)}; {4 * size} is"
            f" {_efficiency(crossed_found, 4 * size, size)} efficient against {size} at them",
            COMMAND,
        ),
        _gpu_benchmark_row(gradients, arch, image),
    ]


def _gpu_benchmark_row(gradients: int, arch: str, image: int, size: int = 32, floor: float = 0.8) -> Row:
    """The first trial's cross products on `gpu_batch_size`'s classifier at its configured `size`,
    and the doublings the efficiency `floor` and the learning-rate limit leave the search."""
    torch.manual_seed(0)
    data = RandomImages(65_536, image, 1000)
    model = Classifier(arch, data, size, workers=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, [optimizer], 1, contextlib.nullcontext, contextlib.nullcontext)
    batches = sample_batches(data, None, size)
    trial = probe.train(next(batches), size, batches, split=True, cross=gradients)
    noise = noise_of([trial], _BUDGET)
    value = noise.value if noise is not None and not noise.lower_bound else None
    limit = lr_capped(Limits(2**31, _BUDGET, reference=size), "sqrt").max_size
    doublings = [size * 2**k for k in range(1, 12) if size * 2**k <= limit]
    allowed = [b for b in doublings if value is not None and efficiency(value, b, size) >= floor]
    at_limit = f"{efficiency(value, limit, size):.0%}" if value is not None else "unknown"
    products = (
        "no cross products (a pass failed)"
        if trial.cross_grad_sq is None
        else f"|G|^2 {trial.cross_grad_sq:.4g} +- {trial.cross_se:.2g}, E|g|^2 {trial.batch_grad_sq:.4g}"
    )
    return Row(
        "noise scale, gpu_batch_size's classifier (criterion 6), first trial on an accelerator: doublings"
        " the efficiency floor leaves / doublings to the learning-rate limit",
        len(allowed) / len(doublings),
        f"{arch} at {image} px, AdamW, its random images and labels, initial weights, batch {size},"
        f" {gradients} independent batches' gradients (run here on the CPU, fp32): cautious noise scale"
        f" {'unresolved' if value is None else f'{value:,.0f}'} ({products}); the square-root rule's"
        f" x{LR_FACTOR_WARN:g} limit is {limit}, {at_limit} efficient against {size}; doublings at or over"
        f" the {floor:.0%} floor: {_values([float(b) for b in allowed])}",
        COMMAND,
    )


def _cross_row(
    model: L.LightningModule, dataset: Dataset[Any], sizes: tuple[int, ...], gradients: int
) -> Row:
    reads = [_crossed(model, dataset, size, gradients) for size in sizes]
    text = "; ".join(
        f"{size}: |E g|^2 {mean:.3g} of E|g|^2's {square:.4g}, noise scale {_scale(size, square, mean)}"
        f" (bound {_scale(size, square, bound)})"
        for size, (mean, square, bound) in zip(sizes, reads, strict=True)
    )
    return Row(
        "noise scale at BatchNorm initial weights from independent batches: sizes resolved / sizes",
        sum(bound > 0 for _, _, bound in reads) / len(sizes),
        f"ResNet-18 (demo), the same initial weights, {gradients} gradients per size on independent batches"
        f" (|E g|^2: their pairwise dot products' mean; bound: 2 jackknife standard errors above it): {text}",
        COMMAND,
    )


def _crossed(
    model: L.LightningModule, dataset: Dataset[Any], size: int, gradients: int
) -> tuple[float, float, float]:
    """``|E g|^2`` (the mean of pairwise dot products), ``E|g|^2``, and ``|E g|^2`` two jackknife
    standard errors higher, from `gradients` at `size` on independent batches of `dataset`; the
    model is left as it was (weights, BatchNorm's running statistics, no gradients)."""
    state = {name: value.clone() for name, value in model.state_dict().items()}
    model.train()
    grads = []
    for batch in itertools.islice(sample_batches(dataset, None, size), gradients):
        grads.append(_gradient(model, batch))
        model.load_state_dict(state)  # BatchNorm's running statistics back
    model.zero_grad(set_to_none=True)
    n = gradients
    products = {(i, j): float(grads[i] @ grads[j]) for i, j in itertools.combinations(range(n), 2)}
    mean = statistics.mean(products.values())
    left_out = [statistics.mean(p for pair, p in products.items() if k not in pair) for k in range(n)]
    error = ((n - 1) / n * sum((v - statistics.mean(left_out)) ** 2 for v in left_out)) ** 0.5
    return mean, statistics.mean(float(g @ g) for g in grads), mean + 2 * error


def _gradient(model: L.LightningModule, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.zero_grad(set_to_none=True)
    images, labels = batch
    nn.functional.cross_entropy(model(images), labels).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _scale(size: int, square: float, mean: float) -> str:
    """``size (E|g|^2 - |E g|^2) / |E g|^2``; unresolved where that estimate is not positive."""
    return f"{size * (square - mean) / mean:,.0f}" if mean > 0 else "unresolved"


def _efficiency(noises: list[float], size: int, reference: int) -> str:
    """The range of `size`'s statistical efficiency against `reference` at these noise scales."""
    if not noises:
        return "unknown"
    low, high = (efficiency(noise, size, reference) for noise in (min(noises), max(noises)))
    return f"{low:.0%}-{high:.0%}"


def _values(values: list[float]) -> str:
    return ", ".join(f"{value:,.0f}" for value in values) or "none"
