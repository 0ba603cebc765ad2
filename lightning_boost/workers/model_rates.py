"""How fast the model trains at a given number of CPU threads, measured on a copy of it.

On a CPU run the DataLoader's workers and the model share the CPUs, so how many workers pay
depends on the model's step as much as on the loader: `model_step_rates` gives the first half
of that, `lightning_boost.workers.search.split_cpus` makes the decision.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor

from lightning_boost._lightning import call_step, detached_copy, preserved_rng


def model_step_rates(
    module: L.LightningModule,
    batch: Any,
    threads: Sequence[int],
    repeats: int = 2,
    rounds: int = 2,
    budget_s: float = 5.0,
) -> dict[int, float]:
    """Samples/s of ``training_step`` and its backward on `batch`, per intra-op thread count: the
    fastest step of `rounds` rounds over the counts, each `repeats` timed steps (after one warm-up
    step per count, in the first round).

    A copy of `module`, detached from the trainer, takes the steps: the module's weights,
    gradients, buffers (BatchNorm statistics) and metrics are untouched, and the RNG states and
    torch's thread count are restored. Once `budget_s` is spent, counts already measured are not
    measured again. Returns ``{}`` when the step cannot run outside the fit (manual optimization,
    a step that reads the trainer): the caller then decides without it.
    """
    if not module.automatic_optimization:
        return {}
    before = torch.get_num_threads()
    rates: dict[int, float] = {}
    try:
        clone = detached_copy(module)
        size = extract_batch_size(batch)
        start = time.perf_counter()
        with preserved_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # `self.log` without a trainer warns, once per call
            for _ in range(rounds):  # rounds of every count, so a busy moment does not hit one alone
                for count in threads:
                    if count in rates and time.perf_counter() - start > budget_s:
                        continue
                    torch.set_num_threads(count)
                    if count not in rates:
                        _step(clone, batch)  # warm-up, once a count: first-call allocations, kernel choices
                    fastest = min(_timed_step(clone, batch) for _ in range(repeats))
                    rates[count] = max(rates.get(count, 0.0), size / fastest)  # the least disturbed
    except Exception:  # any step that needs the live fit: no rates rather than a failed tuning
        return {}
    finally:
        torch.set_num_threads(before)
    return rates


def _timed_step(clone: L.LightningModule, batch: Any) -> float:
    start = time.perf_counter()
    _step(clone, batch)
    return time.perf_counter() - start


def _step(clone: L.LightningModule, batch: Any) -> None:
    output = call_step(clone, "training_step", batch)
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(loss, Tensor) and loss.requires_grad:
        loss.backward()
    clone.zero_grad(set_to_none=True)
