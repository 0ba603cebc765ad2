"""How fast the model trains at a given number of CPU threads, measured on a copy of it.

On a CPU run the DataLoader's workers and the model share the CPUs, so how many workers pay
depends on the model's step as much as on the loader: `model_step_rates` gives the first half
of that (with the step probe `AutoBatchSize` uses, `lightning_boost.step_probe.StepProbe`),
`lightning_boost.workers.search.split_cpus` makes the decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import lightning as L

from lightning_boost._lightning import overrides, preserved_rng
from lightning_boost.micro_batch.split import batch_length
from lightning_boost.step_probe import StepProbe
from lightning_boost.workers.search import PROBE_REPEATS, PROBE_ROUNDS


def model_step_rates(
    module: L.LightningModule,
    batch: Any,
    threads: Sequence[int],
    repeats: int = PROBE_REPEATS,
    rounds: int = PROBE_ROUNDS,
    budget_s: float = 5.0,
    hook: str = "training_step",
    context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> dict[int, float]:
    """Samples/s of ``training_step`` and its backward on `batch`, per intra-op thread count: the
    fastest step of `rounds` rounds over the counts, each `repeats` timed steps (after one warm-up
    step per count, in the first round; `StepProbe.rates`). With an evaluation `hook`
    (``"validation_step"``, ``"test_step"``, ``"predict_step"``), that step without gradients: the
    one an evaluation loader feeds (``{}`` when the module does not implement it), under
    `context` (the run's precision for that step; none by default).

    A copy of `module`, detached from the trainer, takes the steps: the module's weights,
    gradients, buffers (BatchNorm statistics) and metrics are untouched, and the RNG states and
    torch's thread count are restored. Once `budget_s` is spent, counts already measured are not
    measured again. Returns ``{}`` when the step cannot run outside the fit (manual optimization,
    a module without a trainer whose step reads one): the caller then decides without it.
    """
    samples = batch_length(batch)  # a detection batch's images (Lightning's count: its channels)
    if samples is None or not overrides(module, hook):
        return {}
    if hook == "training_step" and not module.automatic_optimization:
        return {}
    probe = StepProbe(module, [], repeats, context, context)
    try:
        with preserved_rng():
            return probe.rates(batch, samples, threads, rounds, budget_s, hook)
    except Exception:  # any step that needs the live fit: no rates rather than a failed tuning
        return {}
