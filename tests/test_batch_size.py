"""The pure batch-size decisions (`lightning_boost.batch_size.search`) on scripted tables."""

import dataclasses
from collections.abc import Callable

import pytest

from lightning_boost.batch_size.search import Limits, accumulation, choose, lr_factor, next_size
from lightning_boost.trials import Trial, merge

GIB = 1024**3


def drive(measure: Callable[[int], Trial], start: int, limits: Limits) -> tuple[list[Trial], str]:
    """The search loop the callback runs, over a scripted measurement."""
    trials: list[Trial] = []
    while True:
        size, reason = next_size(trials, start, limits)
        if size is None:
            return trials, reason
        assert size not in {t.size for t in trials}, "a size is never measured twice"
        trials.append(measure(size))


def gpu_like(oom_above: int, knee: int, peak_per_sample: int = GIB // 100) -> Callable[[int], Trial]:
    """Throughput rises until `knee` then stays flat; memory grows with the size; OOM above `oom_above`."""

    def measure(size: int) -> Trial:
        if size > oom_above:
            return Trial(size, oom=True, seconds=1.0)
        rate = 1000.0 * min(size, knee) / knee
        return Trial(size, rate, GIB + size * peak_per_sample, seconds=1.0)

    return measure


def test_grows_to_the_knee_then_stops_on_the_plateau() -> None:
    limits = Limits(max_size=4096, budget_bytes=80 * GIB, tolerance=0.05)
    trials, reason = drive(gpu_like(oom_above=100_000, knee=128), 2, limits)
    assert [t.size for t in trials] == [2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert "plateau" in reason
    assert choose(trials, limits).size == 128  # the knee, not the largest


def test_oom_stops_growth_and_refines_while_throughput_still_rises() -> None:
    limits = Limits(max_size=4096, budget_bytes=80 * GIB, tolerance=0.0)
    trials, reason = drive(gpu_like(oom_above=100, knee=10_000), 8, limits)
    assert [t.size for t in trials] == [8, 16, 32, 64, 128, 96, 112, 104]
    assert "out of memory at 104" in reason
    assert choose(trials, limits).size == 96


def test_headroom_bounds_the_choice_before_oom() -> None:
    # 1 GiB + 10 MiB per sample: 512 needs 6.1 GiB, over a 5 GiB budget although it would not OOM.
    limits = Limits(max_size=4096, budget_bytes=5 * GIB, tolerance=0.0)
    trials, reason = drive(gpu_like(oom_above=100_000, knee=100_000), 64, limits)
    chosen = choose(trials, limits)
    assert chosen.peak_bytes <= limits.budget_bytes
    # 64-256 put the peak on a line: 512 would need 6.1 GiB, so 400 (4 GiB + 1 GiB) is measured
    # instead, and nothing over the budget is (before: 512, 448 and 416, then 384)
    assert [t.size for t in trials] == [64, 128, 256, 400]
    assert not [t for t in trials if not t.fits(limits.budget_bytes)]
    assert chosen.size == 400
    assert "memory budget" in reason


def test_start_that_does_not_fit_is_halved() -> None:
    limits = Limits(max_size=4096, budget_bytes=80 * GIB)
    trials, _ = drive(gpu_like(oom_above=20, knee=10_000), 256, limits)
    assert [t.size for t in trials][:5] == [256, 128, 64, 32, 16]
    assert choose(trials, dataclasses.replace(limits, tolerance=0.0)).size == 20  # refined between 16 and 32


def test_nothing_fits_stops_at_one() -> None:
    trials, reason = drive(gpu_like(oom_above=0, knee=8), 4, Limits(max_size=64, budget_bytes=GIB))
    assert [t.size for t in trials] == [4, 2, 1]
    assert reason == "out of memory"
    assert choose(trials, Limits(64, GIB)) is None


def test_max_size_and_time_budget_bound_the_search() -> None:
    trials, reason = drive(gpu_like(10_000, 10_000), 2, Limits(max_size=100, budget_bytes=80 * GIB))
    assert [t.size for t in trials] == [2, 4, 8, 16, 32, 64, 100]
    assert reason == "the size limit of 100"
    timed = Limits(max_size=4096, budget_bytes=80 * GIB, time_budget_s=3.0)
    trials, reason = drive(gpu_like(10_000, 10_000), 2, timed)  # 1 s per trial
    assert [t.size for t in trials] == [2, 4] and "time budget" in reason  # 8 might take 2 s more
    assert sum(t.seconds for t in trials) <= timed.time_budget_s


def test_a_peak_that_grows_faster_than_projected_is_refined_as_before() -> None:
    # the projection says 400 fits; the real peak grows faster there (simulated: an extra 2 GiB
    # from 300 samples on, like a workspace a larger convolution asks for): refined below it
    def measure(size: int) -> Trial:
        trial = gpu_like(oom_above=100_000, knee=100_000)(size)
        extra = 2 * GIB if size >= 300 else 0
        return Trial(size, trial.samples_per_s, (trial.peak_bytes or 0) + extra, seconds=1.0)

    limits = Limits(max_size=4096, budget_bytes=5 * GIB, tolerance=0.0)
    trials, _ = drive(measure, 64, limits)
    assert [t.size for t in trials][:4] == [64, 128, 256, 400]
    assert not trials[3].fits(limits.budget_bytes)
    assert choose(trials, dataclasses.replace(limits, tolerance=0.0)).size == max(
        t.size for t in trials if t.fits(limits.budget_bytes)
    )


def test_choice_is_always_a_measured_size() -> None:
    table = [Trial(16, 500.0, 1), Trial(32, 990.0, 2), Trial(64, 1000.0, 3), Trial(128, oom=True)]
    for tolerance in (0.0, 0.005, 0.02, 0.5, 0.9):
        for budget in (1, 2, 3, 4):
            chosen = choose(table, Limits(4096, budget, tolerance))
            assert chosen in table
    assert choose(table, Limits(4096, 3, 0.02)).size == 32  # within 2 % of 1000 at half the size
    assert choose(table, Limits(4096, 3, 0.005)).size == 64
    assert choose(table, Limits(4096, 1, 0.0)).size == 16  # the budget leaves only 16


def test_noisy_throughput_keeps_the_smallest_within_tolerance() -> None:
    table = [Trial(64, 1000.0, 1), Trial(128, 980.0, 1), Trial(256, 1020.0, 1)]
    assert choose(table, Limits(4096, 10, 0.05)).size == 64


def test_merge_takes_any_oom_the_largest_peak_and_the_slowest_rank() -> None:
    merged = merge(32, [Trial(32, 900.0, 5, seconds=1.0), Trial(32, 800.0, 7, seconds=2.0)])
    assert merged == Trial(32, 800.0, 7, False, 2.0)
    assert merge(32, [Trial(32, 900.0, 5), Trial(32, oom=True)]).oom


@pytest.mark.parametrize(
    ("target", "batch", "world", "expected"),
    [(256, 32, 2, 4), (256, 64, 1, 4), (256, 96, 1, 3), (256, 100, 1, 3), (64, 128, 1, 1), (100, 7, 3, 5)],
)
def test_accumulation_comes_closest_to_the_target(target: int, batch: int, world: int, expected: int) -> None:
    assert accumulation(target, batch, world) == expected
    best = min(range(1, 64), key=lambda k: (abs(batch * k * world - target), k))
    assert abs(batch * expected * world - target) == abs(batch * best * world - target)


def test_lr_factor_rules() -> None:
    assert lr_factor("linear", 256, 64) == 4.0
    assert lr_factor("sqrt", 256, 64) == 2.0
    assert lr_factor("linear", 32, 64) == 0.5
    assert lr_factor(None, 256, 64) == 1.0


def test_trial_round_trips_as_plain_data() -> None:
    trial = Trial(64, 123.5, 2048, False, 0.25)
    assert Trial.from_dict(trial.to_dict()) == trial
