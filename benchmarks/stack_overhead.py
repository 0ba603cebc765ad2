"""What the README's whole set-up costs per step once its decisions are made, against plain Lightning.

The 1-2 ms MLP of ``monitor_overhead`` (in-memory tensors, so any per-step cost shows), fitted
three ways in rotating order within each repeat: plain Lightning; ``boost_callbacks()`` (silent
report) with ``preset("auto")``; and plain with as many callbacks that do nothing as
``boost_callbacks()`` returns, which is Lightning's own cost of calling that many callbacks' hooks
at every step. Steps are timed from step `from_step` on, after the run's one-off work (the
precision's trial, the worker search's segments, the guards' first checked steps), which the
``time_to_quality`` and tuning rows count. The row names what the set-up decided for this run
(precision, workers, threads, and whether its `TensorDataset` is loaded a whole batch at a time,
which `AutoNumWorkers` does since 5fba7f7): where that is plain Lightning's, what is left is the
callbacks' per-step work.

Run: ``python -m benchmarks stack_overhead``.
"""

from __future__ import annotations

import collections
import statistics
import tempfile
from collections.abc import Callable

import lightning as L
from lightning.pytorch.strategies import Strategy

from benchmarks.common import Row
from benchmarks.guard_overhead import _fastest, _ratio
from benchmarks.monitor_overhead import fit_per_step
from lightning_boost import AutoNumWorkers, boost_callbacks, preset
from lightning_boost.workers.whole_batches import whole_batches_finding

COMMAND = "python -m benchmarks stack_overhead"

Variant = Callable[[str], tuple[list[L.Callback], Strategy | str]]


def _boosted(root: str) -> tuple[list[L.Callback], Strategy]:
    callbacks = boost_callbacks(
        boost_report={"console": False, "files": False, "log_hyperparams": False},
        auto_num_workers={"cache_dir": root},
    )
    return callbacks, preset("auto")


def _decisions(callbacks: list[L.Callback], strategy: Strategy) -> str:
    """What the set-up chose for a fit: the precision, and each loader's workers and threads."""
    choice = getattr(strategy.precision_plugin, "choice", None)
    speedup = getattr(choice, "speedup", None)
    precision = str(strategy.precision_plugin.precision)
    if speedup is not None:
        precision += f" (bf16 step {speedup:.2f}x fp32's)"
    tuner = next(c for c in callbacks if isinstance(c, AutoNumWorkers)).worker_tuner
    loaders = ", ".join(
        f"{c.num_workers} workers, {c.threads or 'all'} threads" for c in tuner.choices.values()
    )
    whole = whole_batches_finding(AutoNumWorkers.__name__) in tuner.findings
    loading = "; whole batches (`whole_batches`)" if whole else ""
    return f"precision {precision}; {loaders or 'no loader decided'}{loading}"


def _most_common(texts: list[str]) -> str:
    text, count = collections.Counter(texts).most_common(1)[0]
    return text if count == len(texts) else f"{text}, in {count} of {len(texts)} fits"


def run(steps: int = 1000, repeats: int = 11, from_step: int = 100) -> list[Row]:
    """Three variants per repeat, in rotating order; ratios are taken within a repeat, then the median."""
    added = len(_boosted(tempfile.gettempdir())[0])
    made: list[tuple[list[L.Callback], Strategy]] = []

    def boosted(root: str) -> tuple[list[L.Callback], Strategy]:
        made.append(_boosted(root))
        return made[-1]

    variants: dict[str, Variant] = {
        "plain": lambda root: ([], "auto"),
        "no-op": lambda root: ([L.Callback() for _ in range(added)], "auto"),
        "boosted": boosted,
    }
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    with tempfile.TemporaryDirectory() as root:
        fit_per_step(root, 150, *_boosted(root), from_step=100)  # warm-up: imports, first-fit costs
        for repeat in range(repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                callbacks, strategy = variants[name](f"{root}/cache{repeat}")
                per_step[name].append(fit_per_step(root, steps, callbacks, strategy, from_step))
    plain_ms, boosted_ms = (1e3 * statistics.median(per_step[name]) for name in ("plain", "boosted"))
    setup = (
        f"median of {repeats} paired fits of {steps} steps timed from step {from_step}; 3-layer MLP,"
        f" batch 32, in-memory data: {plain_ms:.3f} ms per plain step, {boosted_ms:.3f} ms boosted"
        f" ({_most_common([_decisions(*fit) for fit in made])})"
    )
    noop = _ratio(per_step["no-op"], per_step["plain"])
    return [
        Row(
            "README set-up (boost_callbacks() + preset('auto')), once decided: step time / plain Lightning",
            _ratio(per_step["boosted"], per_step["plain"]),
            f"{setup}; {_fastest(per_step['boosted'], per_step['plain'])}. Of this, {added} callbacks that"
            f" do nothing cost {noop:.2f}x: Lightning calling their hooks. Worst case: a longer step (any"
            " real model, any GPU step) dilutes the fixed per-step cost",
            COMMAND,
        ),
        Row(
            f"README set-up, once decided: step time / {added} no-op callbacks (its own per-step work)",
            _ratio(per_step["boosted"], per_step["no-op"]),
            f"{setup}; {_fastest(per_step['boosted'], per_step['no-op'])}",
            COMMAND,
        ),
    ]
