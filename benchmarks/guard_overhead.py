"""What the guards cost per step against plain Lightning: default sampling, and checking every step.

The MLP of `monitor_overhead` (1 ms steps on 2 CPUs, so any per-step cost shows) fitted with no
guard, with two no-op callbacks (Lightning's cost of calling any two callbacks' hooks), with
``LossLoggingGuard()`` as shipped and with ``LossLoggingGuard(every_n_steps=1)``, alternating in one
process; each guard run carries a silent `BoostReport`, so it is two callbacks too. Every-step
checking includes the garbage-collector scan of the growth watch (timed on its own here, with
the number of objects it walks), so it is timed on shorter fits. Run: ``python -m benchmarks guard_overhead``.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable

import lightning as L

from benchmarks.common import Row
from benchmarks.monitor_overhead import fit_per_step
from lightning_boost import BoostReport, LossLoggingGuard
from lightning_boost.tuning.graphs import census

COMMAND = "python -m benchmarks guard_overhead"


def _silent_report() -> BoostReport:
    return BoostReport(console=False, files=False, log_hyperparams=False)


def _paired(
    variants: dict[str, Callable[[], list[L.Callback]]], steps: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per step of each variant, fitted in rotating order within each repeat."""
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    with tempfile.TemporaryDirectory() as root:
        fit_per_step(root, 50, [])  # warm-up: imports, allocator, first-fit costs
        for repeat in range(repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                per_step[name].append(fit_per_step(root, steps, variants[name]()))
    return per_step


def _census_seconds(repeats: int = 5) -> float:
    """Median seconds of one growth-watch scan (`census`) in this process, as it is now."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        census()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _hook_microseconds(number: int = 200_000) -> tuple[float, float]:
    """The guard's ``on_train_batch_end`` on a step it does not check, and a no-op callback's, in µs."""
    guard, noop = LossLoggingGuard(), L.Callback()
    guard._sampler.next_step = 2**62  # past the first steps: only the step count and `due()` run
    args = (None, None, None, None, 0)
    guarded = timeit.timeit(lambda: guard.on_train_batch_end(*args), number=number)  # type: ignore[arg-type]
    plain = timeit.timeit(lambda: noop.on_train_batch_end(*args), number=number)  # type: ignore[arg-type]
    return 1e6 * guarded / number, 1e6 * plain / number


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def run(
    steps: int = 1000, repeats: int = 11, every_step_steps: int = 60, every_step_repeats: int = 3
) -> list[Row]:
    guards: list[LossLoggingGuard] = []

    def guarded() -> list[L.Callback]:
        guards.append(LossLoggingGuard())
        return [guards[-1], _silent_report()]

    default = _paired(
        {"plain": list, "two no-op callbacks": lambda: [L.Callback(), L.Callback()], "guard": guarded},
        steps,
        repeats,
    )
    # the guard's own clock: time inside its checks over the fit's training time
    own = statistics.median(
        g._sampler.spent_s / (t * steps) for g, t in zip(guards, default["guard"], strict=True)
    )
    checks = statistics.median(g._sampler.checks for g in guards)
    every = _paired(
        {"plain": list, "guard": lambda: [LossLoggingGuard(every_n_steps=1), _silent_report()]},
        every_step_steps,
        every_step_repeats,
    )
    scan_s, objects = _census_seconds(), len(gc.get_objects())
    hook_us, noop_us = _hook_microseconds()
    plain_ms = 1e3 * statistics.median(default["plain"])
    setup = (
        f"median of {repeats} paired fits of {steps} steps; 3-layer MLP, batch 32, in-memory data,"
        f" {plain_ms:.3f} ms per plain step"
    )
    return [
        Row(
            "LossLoggingGuard default (first 3 steps, then 0.5 % budget): step time / plain Lightning",
            _ratio(default["guard"], default["plain"]),
            f"{setup}; includes Lightning calling the hooks of two more callbacks (guard + BoostReport)",
            COMMAND,
        ),
        Row(
            "LossLoggingGuard default: step time / two no-op callbacks (own cost; target <= 1.01)",
            _ratio(default["guard"], default["two no-op callbacks"]),
            f"{setup}; against two callbacks that do nothing, this is the guard's own work. By its own"
            f" clock its checks took {own:.2%} of training time ({checks:.0f} checks per fit); its hook"
            f" on an unchecked step takes {hook_us:.2f} µs (a no-op callback's {noop_us:.2f} µs)",
            COMMAND,
        ),
        Row(
            "LossLoggingGuard every step (every_n_steps=1, GC scan each step): step time / plain Lightning",
            _ratio(every["guard"], every["plain"]),
            f"median of {every_step_repeats} paired fits of {every_step_steps} steps, same MLP: the cost"
            f" the budget avoids; the growth watch's scan dominates: {scan_s:.3f} s for the"
            f" {objects} objects this Lightning process holds",
            COMMAND,
        ),
    ]
