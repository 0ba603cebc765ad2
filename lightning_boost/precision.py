"""Which precision fits the hardware, and whether bf16 autocast pays on a CPU: pure functions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

from lightning_boost._validation import validated
from lightning_boost.hardware import HardwareInfo

#: bf16 autocast is what a CPU with bf16 dot products is built for, as a GPU's bf16 is (chosen
#: there by capability, with no trial); the trial keeps it from the models it slows down: bf16
#: stays unless its steps are at least this much slower than fp32's. Closer than that, the pairs
#: cannot tell the settings apart, and on a host whose speed drifts (a shared VM) a trial that fell
#: in a slow spell, where both settings ran alike, would cost the whole run bf16's gain.
AUTOCAST_MAX_LOSS = 0.05

#: Timed step pairs (one fp32, one bf16) before a decision: at least the first number (one pair
#: of each order), when every pair gives the same verdict; else the second.
AUTOCAST_PAIRS = (2, 8)

#: A first pair whose bf16 step is at least this fast (fp32's time over bf16's) keeps bf16 at once:
#: the trial is there to find models bf16 slows down, and a step that bf16 does not slow is no such
#: model; only a setting that would replace bf16 needs a pair of each order to agree.
AUTOCAST_KEEP_AT_ONCE = 1.0
#: ... when both of its steps took at least this long (seconds). A shorter step's pair is cheap to
#: repeat and its noise (the timer, a collection, another process) can hide a loss: the
#: time-to-quality MLP (1 ms steps, 0.75x with bf16 over 2 pairs) once read 1.11x on its first pair.
AUTOCAST_AT_ONCE_MIN_S = 0.02

#: Untimed steps first: one fp32, one bf16 (oneDNN builds its bf16 kernels on first use).
AUTOCAST_WARMUP = 2

#: The trial's time: at least this many seconds, or this share of the planned run when longer.
AUTOCAST_BUDGET = (1.0, 0.02)


def autocast_budget(step_s: float, run_steps: float) -> float:
    """Seconds the trial may take, given a step's seconds and the steps the run plans.

    Example:
        >>> autocast_budget(0.1, 256), autocast_budget(2.0, 10_000)
        (1.0, 400.0)
    """
    floor, share = AUTOCAST_BUDGET
    return max(floor, share * step_s * run_steps) if math.isfinite(run_steps) else floor


def budget_spent(seconds: Sequence[float], run_steps: float) -> bool:
    """Whether a trial's steps so far (`seconds`, the first one's time setting the budget) took
    its time (`autocast_budget`): then it decides on the pairs it has.

    Example:
        >>> budget_spent([0.3] * 5, 256), budget_spent([0.3] * 6, 256)  # 1.5 s, 1.8 s of 1.54 s
        (False, True)
    """
    return sum(seconds) > autocast_budget(seconds[0], run_steps)


@validated
def auto_precision(hardware: HardwareInfo) -> str:
    """The Lightning ``precision`` an expert would pick for this hardware.

    - CUDA with bf16 (capability >= 8.0: A100, H100, RTX 30xx and newer): ``"bf16-mixed"``,
      same range as fp32 so no loss scaling is needed and no fp16 overflow NaNs.
    - Older CUDA (T4, V100): ``"16-mixed"``, with Lightning's gradient scaler.
    - A CPU with bf16 dot products (AVX512-BF16, AMX): ``"bf16-mixed"``, kept unless the
      model's training step is slower with it (`decide_autocast`, timed on a copy before
      training): in `benchmarks/RESULTS.md` a ResNet-18 step ran 1.26x as fast, a 32-128-10
      MLP's 0.74x.
    - Other CPUs and MPS: ``"32-true"``.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> [auto_precision(EXAMPLES[n]) for n in ("h100", "t4", "cpu", "cpu-bf16")]
        ['bf16-mixed', '16-mixed', '32-true', 'bf16-mixed']
    """
    if hardware.accelerator == "cpu" and hardware.cpu_supports_bf16:
        return "bf16-mixed"
    if not hardware.is_cuda:
        return "32-true"
    return "bf16-mixed" if hardware.supports_bf16 else "16-mixed"


class AutocastChoice(NamedTuple):
    """Whether a CPU run keeps bf16 autocast, and the step times that said so.

    Args:
        bf16: keep bf16 autocast; else the steps run in fp32.
        speedup: fp32's step time over bf16's, the median over adjacent pairs (>1: bf16 faster);
            ``None`` when nothing was measured.
        pairs: timed pairs behind it.
        why_not: why nothing was measured (manual optimization), else ``""``.
        cached: taken from the cache, where an earlier run on this machine stored it.
    """

    bf16: bool
    speedup: float | None
    pairs: int
    why_not: str = ""
    cached: bool = False


def autocast_setting(step: int) -> bool:
    """Whether trial step `step` runs under bf16 autocast: fp32 then bf16 as warm-ups, then pairs
    in alternating order (fp32 first, then bf16 first, ...), so a trend favours neither.

    Example:
        >>> [autocast_setting(step) for step in range(8)]
        [False, True, False, True, True, False, False, True]
    """
    if step < AUTOCAST_WARMUP:
        return step == 1
    pair, second = divmod(step - AUTOCAST_WARMUP, 2)
    return (pair % 2 == 1) != bool(second)


def decide_autocast(
    seconds: Sequence[float], final: bool = False, keep_at_once: float = AUTOCAST_KEEP_AT_ONCE
) -> AutocastChoice | None:
    """The choice once the trial steps timed so far settle it (``seconds[k]``: step `k`'s time,
    run as `autocast_setting` says), else ``None``. Each pair compares adjacent steps, so a
    machine that slows down for a while hits both settings alike; bf16 is kept unless the median
    pair is `AUTOCAST_MAX_LOSS` slower with it. A first pair in which bf16 is not slower
    (fp32's time over bf16's at least `keep_at_once`), of steps that are not short
    (`AUTOCAST_AT_ONCE_MIN_S`), keeps it at once; otherwise the search stops after `AUTOCAST_PAIRS`'s
    first number when every pair gives the same verdict (each at most that much slower with bf16,
    or each more), else after its second; `final` (the trial's time is spent) decides on the pairs
    there are, and keeps fp32 when there is none.

    Example:
        >>> decide_autocast([0.2, 0.3, 0.10, 0.08])  # bf16 not slower: kept after one pair
        AutocastChoice(bf16=True, speedup=1.25, pairs=1, why_not='', cached=False)
        >>> decide_autocast([0.2, 0.3, 0.10, 0.104]) is None  # a slower bf16 needs both orders
        True
        >>> decide_autocast([0.002, 0.003, 0.0010, 0.0008]) is None  # so does a 1 ms step
        True
        >>> decide_autocast([0.2, 0.3, 0.10, 0.101, 0.099, 0.10])  # alike: the hardware's bf16 stays
        AutocastChoice(bf16=True, speedup=1.0, pairs=2, why_not='', cached=False)
        >>> decide_autocast([0.2, 0.3, 0.10, 0.13, 0.13, 0.10])  # 0.77x: fp32
        AutocastChoice(bf16=False, speedup=0.769, pairs=2, why_not='', cached=False)
    """
    ratios, shortest = [], math.inf
    for first in range(AUTOCAST_WARMUP, len(seconds) - 1, 2):
        a, b = seconds[first], seconds[first + 1]
        fp32, bf16 = (b, a) if autocast_setting(first) else (a, b)
        ratios.append(fp32 / bf16 if bf16 > 0 else 1.0)
        shortest = min(shortest, a, b)
    least, most = AUTOCAST_PAIRS
    if final and not ratios:
        return AutocastChoice(False, None, 0, "steps too slow to time both within the trial's time")
    if len(ratios) == 1 and ratios[0] >= keep_at_once and shortest >= AUTOCAST_AT_ONCE_MIN_S:
        return AutocastChoice(True, round(ratios[0], 3), 1)
    keep = [r >= 1 - AUTOCAST_MAX_LOSS for r in ratios]  # each pair's own verdict
    agree = all(keep) or not any(keep)
    if not final and (len(ratios) < least or (not agree and len(ratios) < most)):
        return None
    speedup = statistics.median(ratios)
    return AutocastChoice(speedup >= 1 - AUTOCAST_MAX_LOSS, round(speedup, 3), len(ratios))


#: A run that kept bf16 autocast checks it again on its own steps: pairs of adjacent training
#: batches, one in fp32 and one in bf16 (`recheck_setting`), the first at this batch, the next
#: ones `AUTOCAST_RECHECK_GAPS` apart (`next_recheck`). The first pair is a warm-up (a run whose
#: verdict came from the cache builds its fp32 kernels there), not counted. A trial is a few steps
#: on a copy before training; a shared host can change its speed for minutes at a time, and on this
#: project's 2-CPU host a trial that read bf16 1.15x as fast was followed by a fit 1.6x as slow as
#: plain fp32's (`demo_cold`, 2026-11-27).
AUTOCAST_RECHECK_FIRST = 4
#: Batches from one pair's start to the next's: for the first three pairs, then for the others.
#: Each later pair costs one fp32 batch in 64: by arithmetic, 0.4 % of a run whose bf16 runs 1.25x
#: as fast (`autocast_recheck`'s CNN row, 0.98x with the checks, cannot resolve that on this host).
AUTOCAST_RECHECK_GAPS = (4, 64)


def recheck_setting(batch: int, start: int, pair: int) -> bool | None:
    """Whether training batch `batch` runs in bf16 (``True``) or fp32 (``False``) as a half of
    check pair number `pair` (0: the warm-up), which starts at batch `start`; ``None`` when it is
    no half of it (bf16, as chosen). Pairs alternate their order (fp32 first, then bf16
    first, ...), so a trend favours neither.

    Example:
        >>> [recheck_setting(batch, 4, 0) for batch in (3, 4, 5, 6)]
        [None, False, True, None]
        >>> recheck_setting(8, 8, 1), recheck_setting(9, 8, 1)
        (True, False)
    """
    half = batch - start
    if half not in (0, 1):
        return None
    return half != pair % 2


def next_recheck(end: int, done: int, ratios: Sequence[float]) -> int:
    """The first batch of the next check pair, once the `done`-th pair (1: the warm-up) ended at
    batch `end`, the counted pairs having read `ratios` (fp32's time over bf16's): the very next
    batch while they are unsettled (the last put bf16 more than `AUTOCAST_MAX_LOSS` slower, or the
    last two disagree), else `AUTOCAST_RECHECK_GAPS` after its start.

    Example:
        >>> next_recheck(5, 1, []), next_recheck(13, 3, [1.2, 1.3]), next_recheck(77, 4, [1.2, 0.7])
        (8, 76, 78)
        >>> next_recheck(79, 5, [1.2, 0.7, 1.1])  # one against, one for: a third pair decides
        80
    """
    early, late = AUTOCAST_RECHECK_GAPS
    against = [ratio < 1 - AUTOCAST_MAX_LOSS for ratio in ratios[-2:]]
    if against and (against[-1] or len(set(against)) > 1):
        return end + 1
    return end - 1 + (early if done < 3 else late)


def recheck_verdict(ratios: Sequence[float]) -> bool:
    """Whether a run that kept bf16 switches to fp32, from its check pairs' ratios (fp32's batch
    time over bf16's, oldest first): when the last pair and one of the two before it put bf16 more
    than `AUTOCAST_MAX_LOSS` slower (consecutive pairs run in opposite orders). One noisy pair
    switches nothing, and one noisy pair does not clear two.

    Example:
        >>> recheck_verdict([0.70]), recheck_verdict([0.70, 0.72]), recheck_verdict([0.70, 1.2])
        (False, True, False)
        >>> recheck_verdict([1.25, 1.3, 0.8, 0.75])  # the host slowed bf16 down mid-run
        True
        >>> recheck_verdict([0.75, 1.22, 0.77])  # two of three, the last among them
        True
    """
    against = [ratio < 1 - AUTOCAST_MAX_LOSS for ratio in ratios[-3:]]
    return len(against) >= 2 and against[-1] and sum(against) >= 2
