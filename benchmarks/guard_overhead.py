"""What the guards cost per step against plain Lightning: default sampling, and checking every step.

The MLP of `monitor_overhead` (1 ms steps on 2 CPUs, so any per-step cost shows) fitted with no
guard, with two no-op callbacks (Lightning's cost of calling any two callbacks' hooks), with
``LossLoggingGuard()`` and ``SyncGuard()`` as shipped, alternating in one process; each guard run
carries a silent `BoostReport`, so it is two callbacks too. Then shorter fits with each guard
checking every step (``every_n_steps=1``): the loss guard's includes the garbage-collector scan of
its growth watch (timed on its own here, with the number of objects it walks). Last, the demo's
small CNN on its augmented images loaded in the run's process (``num_workers=0``, as a 2-CPU
machine runs it), plain against ``SyncGuard(every_n_steps=1)``: each checked step's window takes in
the next batch's loading, which the guard leaves unwatched.
Run: ``python -m benchmarks guard_overhead``.
"""

from __future__ import annotations

import gc
import statistics
import time
import timeit
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from benchmarks.common import Row, rotated
from benchmarks.monitor_overhead import TrainTime, paired_fits
from lightning_boost import BoostReport, LossLoggingGuard, SyncGuard
from lightning_boost.demo import ClassImages, SmallCNN, train_transform
from lightning_boost.guards.graphs import census

COMMAND = "python -m benchmarks guard_overhead"


def _silent_report() -> BoostReport:
    return BoostReport(console=False, files=False, log_hyperparams=False)


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


def _fastest(a: list[float], b: list[float]) -> str:
    """The ratio of the fastest fits, the least disturbed by other work on a shared machine."""
    return f"fastest fit / fastest fit {min(a) / min(b):.3f}"


def run(
    steps: int = 1000,
    repeats: int = 11,
    every_step_steps: int = 60,
    every_step_repeats: int = 3,
    loading_steps: int = 40,
    loading_repeats: int = 5,
) -> list[Row]:
    loss_guards: list[LossLoggingGuard] = []
    sync_guards: list[SyncGuard] = []

    def kept(guards: list[Any], guard: L.Callback) -> list[L.Callback]:
        guards.append(guard)
        return [guard, _silent_report()]

    default = paired_fits(
        {
            "plain": list,
            "two no-op callbacks": lambda: [L.Callback(), L.Callback()],
            "LossLoggingGuard": lambda: kept(loss_guards, LossLoggingGuard()),
            "SyncGuard": lambda: kept(sync_guards, SyncGuard()),
        },
        steps,
        repeats,
    )
    every = paired_fits(
        {
            "plain": list,
            "LossLoggingGuard": lambda: [LossLoggingGuard(every_n_steps=1), _silent_report()],
            "SyncGuard": lambda: [SyncGuard(every_n_steps=1), _silent_report()],
        },
        every_step_steps,
        every_step_repeats,
    )
    plain_ms = 1e3 * statistics.median(default["plain"])
    setup = (
        f"median of {repeats} paired fits of {steps} steps; 3-layer MLP, batch 32, in-memory data,"
        f" {plain_ms:.3f} ms per plain step"
    )
    every_setup = f"median of {every_step_repeats} paired fits of {every_step_steps} steps, same MLP"
    own = _own_clock(
        default,
        steps,
        {"LossLoggingGuard": [(g._sampler.spent_s, g._sampler.checks) for g in loss_guards]}
        | {"SyncGuard": [(_spent(g), g.checked_steps["training"]) for g in sync_guards]},
    )
    return (
        _loss_guard_rows(default, every, setup, every_setup, own["LossLoggingGuard"])
        + _sync_guard_rows(default, every, setup, every_setup, own["SyncGuard"])
        + [_loading_row(loading_steps, loading_repeats)]
    )


def _images_fit(steps: int, callbacks: list[L.Callback]) -> float:
    """Seconds per training step of the demo's small CNN on `steps` batches of 64 augmented images,
    loaded in the run's process."""
    timer = TrainTime()
    loader = DataLoader(ClassImages(64 * steps, 0, train_transform()), batch_size=64, num_workers=0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        callbacks=[timer, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    L.seed_everything(0, verbose=False)
    trainer.fit(SmallCNN(), train_dataloaders=loader)
    return timer.seconds / steps


def _loading_row(steps: int, repeats: int) -> Row:
    variants = {
        "plain": list,
        "SyncGuard": lambda: [SyncGuard(every_n_steps=1), _silent_report()],
    }
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    _images_fit(min(steps, 5), [])  # warm-up
    for repeat in range(repeats):
        for name in rotated(list(variants), repeat):
            per_step[name].append(_images_fit(steps, variants[name]()))
    plain_ms = 1e3 * statistics.median(per_step["plain"])
    return Row(
        "SyncGuard every step, images loaded in the run's process: step time / plain Lightning",
        _ratio(per_step["SyncGuard"], per_step["plain"]),
        f"median of {repeats} paired fits of {steps} steps; the demo's small CNN, batch 64, its random"
        f" crop and flip run by num_workers=0 in each checked step's window, {plain_ms:.1f} ms per plain"
        f" step; {_fastest(per_step['SyncGuard'], per_step['plain'])}. The default checks the first 3"
        " steps, then about 0.5 % of the time",
        COMMAND,
    )


def _spent(guard: SyncGuard) -> float:
    return sum(phase.sampler.spent_s for phase in guard._phases.values())


def _own_clock(
    default: dict[str, list[float]], steps: int, clocks: dict[str, list[tuple[float, int]]]
) -> dict[str, tuple[float, float]]:
    """Each guard's time in its checks over the fit's training time, and its checks per fit (medians)."""
    return {
        name: (
            statistics.median(spent / (t * steps) for (spent, _), t in zip(runs, default[name], strict=True)),
            statistics.median(checks for _, checks in runs),
        )
        for name, runs in clocks.items()
    }


def _loss_guard_rows(
    default: dict[str, list[float]],
    every: dict[str, list[float]],
    setup: str,
    every_setup: str,
    own: tuple[float, float],
) -> list[Row]:
    scan_s, objects = _census_seconds(), len(gc.get_objects())
    hook_us, noop_us = _hook_microseconds()
    return [
        Row(
            "LossLoggingGuard default (first 3 steps, then 0.5 % budget): step time / plain Lightning",
            _ratio(default["LossLoggingGuard"], default["plain"]),
            f"{setup}; includes Lightning calling the hooks of two more callbacks (guard + BoostReport);"
            f" {_fastest(default['LossLoggingGuard'], default['plain'])}",
            COMMAND,
        ),
        Row(
            "LossLoggingGuard default: step time / two no-op callbacks (own cost; target <= 1.01)",
            _ratio(default["LossLoggingGuard"], default["two no-op callbacks"]),
            f"{setup}; against two callbacks that do nothing, this is the guard's own work"
            f" ({_fastest(default['LossLoggingGuard'], default['two no-op callbacks'])}). By its own"
            f" clock its checks took {own[0]:.2%} of training time ({own[1]:.0f} checks per fit); its hook"
            f" on an unchecked step takes {hook_us:.2f} µs (a no-op callback's {noop_us:.2f} µs)",
            COMMAND,
        ),
        Row(
            "LossLoggingGuard every step (every_n_steps=1, GC scan each step): step time / plain Lightning",
            _ratio(every["LossLoggingGuard"], every["plain"]),
            f"{every_setup}: the cost the budget avoids; the growth watch's scan dominates: {scan_s:.3f} s"
            f" for the {objects} objects this Lightning process holds",
            COMMAND,
        ),
    ]


def _sync_guard_rows(
    default: dict[str, list[float]],
    every: dict[str, list[float]],
    setup: str,
    every_setup: str,
    own: tuple[float, float],
) -> list[Row]:
    return [
        Row(
            "SyncGuard default (first 3 steps, then 0.5 % budget): step time / plain (target <= 1.02)",
            _ratio(default["SyncGuard"], default["plain"]),
            f"{setup}; includes Lightning calling the hooks of two more callbacks (guard + BoostReport);"
            f" {_fastest(default['SyncGuard'], default['plain'])}. By its own estimate (a checked step's"
            f" time beyond a plain one) checks took {own[0]:.2%} of training time ({own[1]:.0f} checked"
            " steps per fit)",
            COMMAND,
        ),
        Row(
            "SyncGuard default: step time / two no-op callbacks (own cost)",
            _ratio(default["SyncGuard"], default["two no-op callbacks"]),
            f"{setup}; against two callbacks that do nothing, this is the guard's own work;"
            f" {_fastest(default['SyncGuard'], default['two no-op callbacks'])}",
            COMMAND,
        ),
        Row(
            "SyncGuard every step (every_n_steps=1): step time / plain Lightning",
            _ratio(every["SyncGuard"], every["plain"]),
            f"{every_setup}: every torch call of the step (and Lightning's work around it) goes through"
            " the guard's TorchFunctionMode; the cost the sampling avoids",
            COMMAND,
        ),
    ]
