"""The worker search replayed on the curves measured on a 16-CPU H100 machine and on made-up
machines of 2-128 CPUs, every measurement off by a seeded +-10 % (`benchmarks.worker_replay`):
the answer is right (>= 0.95x an exhaustive sweep's best, and of Lightning's hint) and stable
(three cold runs within 5 % of each other). No clock is read: these hold on any machine."""

from __future__ import annotations

import math

import pytest

from benchmarks.worker_replay import (
    Outcome,
    Scenario,
    made_up_scenarios,
    measured_scenarios,
    outcomes,
    replay,
)
from lightning_boost.hardware import EXAMPLES

MEASURED = outcomes(measured_scenarios())
MADE_UP = outcomes(made_up_scenarios())


def _ids(results: list[Outcome]) -> list[str]:
    return [outcome.scenario.name for outcome in results]


@pytest.mark.parametrize("outcome", MEASURED + MADE_UP, ids=_ids(MEASURED + MADE_UP))
def test_the_choice_is_right_and_stable_under_noise(outcome: Outcome) -> None:
    assert outcome.ratio >= 0.95  # of the best setting an exhaustive sweep finds
    assert outcome.vs_hint >= 0.95  # never more than 5 % below Lightning's `num_workers` hint
    assert outcome.spread <= 0.05  # three cold runs agree


def test_the_measured_curves_are_all_replayed() -> None:
    names = _ids(MEASURED)
    assert names[0].startswith("data_bound sweep")
    assert len(names) == 6  # the sweep, and the demo's loader against five measured step rates
    # the H100 data-bound run: 15 workers (3767 samples/s) against the sweep's best, 14 (3868)
    data_bound = MEASURED[0]
    assert {choice.num_workers for choice in data_bound.choices} == {15}
    assert data_bound.ratio == pytest.approx(3767 / 3868)


def test_a_step_slower_than_the_loader_gets_the_fewest_workers_that_feed_it() -> None:
    # the demo's loader at the step's fp32 rate for batch 64 (4402 samples/s): 5 workers feed it
    demo64 = next(o for o in MEASURED if o.scenario.name.endswith("batch 64"))
    assert {choice.num_workers for choice in demo64.choices} == {5}
    assert all("feeds the step" in choice.reason for choice in demo64.choices)
    assert all(choice.consumer_samples_per_s == 4402 for choice in demo64.choices)


def test_loading_in_the_main_process_is_weighed_as_taking_turns_with_a_known_step() -> None:
    # 2 CPUs beside a GPU: the main process loads at 180 samples/s, one worker at 200, the step takes
    # 220. Ranked by the loader alone, 2 of 30 cold runs read the main process faster (197 against
    # 180) and kept it, training at 0.49x one worker's pace: loading and the step take turns there.
    scenario = next(
        s for s in made_up_scenarios() if s.name == "2 CPUs, loader to 1 workers, step at 1.1x the loader"
    )
    choices = [replay(scenario, seed) for seed in range(30)]
    assert {choice.num_workers for choice in choices} == {1}
    assert any("takes turns with the step" in choice.reason for choice in choices)


def test_measurements_grow_with_the_log_of_the_cpus() -> None:
    for outcome in MADE_UP:
        budget = outcome.scenario.hardware.cpus_per_process - 1
        assert outcome.measurements <= 3 + math.ceil(math.log2(budget + 1))


def test_the_replay_noise_is_seeded_and_real() -> None:
    scenario = Scenario("flat", EXAMPLES["h100"], {0: 100.0, 15: 1500.0})
    first, again, other = replay(scenario, 7), replay(scenario, 7), replay(scenario, 8)
    assert first == again
    assert [t.samples_per_s for t in first.trials] != [t.samples_per_s for t in other.trials]
    assert all(0.9 * 1500 <= t.samples_per_s <= 1.1 * 1500 for t in first.trials if t.num_workers == 15)
