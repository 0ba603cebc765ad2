"""Worker search replayed on measured curves, with noise: is the answer right and stable?

The curves are the ones measured on a 16-CPU H100 machine (`data/h100-16cpu.json`: the
data-bound benchmark's full ``num_workers`` sweep, the demo's loader alone per worker count, the
demo model's step per batch size), plus made-up machines from 2 to 128 CPUs. Every measurement
the search asks for is the curve's value times a seeded uniform draw in ``1 +- noise``; no
clock is read, so the result is the same on any machine.

What a setting trains at is predicted as the search reasons: workers and the step overlap (the
slower sets the pace), no workers take turns with the step. The data-bound sweep was measured
end to end, so there the curve itself is the training rate. Each setting the search chooses is
compared with the best of an exhaustive sweep of the same curve (``ratio``) and with Lightning's
hint ``num_workers = CPUs per process - 1`` (``vs_hint``).
The search on the run's own batches (``online``, `lightning_boost.workers.online`) is replayed
too: each segment measures the training rate itself, and the H100 curves get a contention model
(`contention`) in which workers past half the CPUs slow the whole pipeline, down to the 0.47x the
demo trained at with 15 workers (8.3k samples/s where its loader alone gave 17.5k, the step 41.8k).
Run: ``python -m benchmarks worker_replay``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import Row
from lightning_boost.hardware import EXAMPLES, MIB, HardwareInfo
from lightning_boost.workers.online import plan_segments, search_online, search_start
from lightning_boost.workers.search import WorkerChoice, WorkerTrial, WorkerTuning, search_workers

COMMAND = "python -m benchmarks worker_replay"
MEASUREMENTS = Path(__file__).with_name("data") / "h100-16cpu.json"
SEEDS = (0, 1, 2)  # three cold runs
NOISE = 0.10


@dataclass(frozen=True)
class Scenario:
    """A machine, its loader's samples/s per worker count and the training step's own rate.

    Args:
        name: what the curve is.
        hardware: the machine (its CPUs set the budget).
        loader: measured samples/s per worker count; counts between two measured ones are
            interpolated linearly, counts past the last measured one keep its rate.
        consumer: the training step's samples/s alone; ``None`` when not measured.
        end_to_end: the curve is the training rate itself, measured with the model.
    """

    name: str
    hardware: HardwareInfo
    loader: dict[int, float]
    consumer: float | None = None
    end_to_end: bool = False
    contended: bool = False

    def loader_rate(self, workers: int) -> float:
        counts = sorted(self.loader)
        if workers >= counts[-1]:
            return self.loader[counts[-1]]
        upper = next(count for count in counts if count >= workers)
        if upper == workers:
            return self.loader[upper]
        lower = max(count for count in counts if count < workers)
        share = (workers - lower) / (upper - lower)
        return self.loader[lower] + share * (self.loader[upper] - self.loader[lower])

    def trains_at(self, workers: int) -> float:
        loader = self.loader_rate(workers)
        if self.end_to_end or self.consumer is None:
            return loader
        if workers == 0:
            return 1 / (1 / loader + 1 / self.consumer)
        pace = min(loader, self.consumer)
        return pace * contention(workers, self.hardware.cpus_per_process) if self.contended else pace

    @property
    def counts(self) -> range:
        """Every count an exhaustive sweep tries: 0 to the machine's CPUs per process."""
        return range(self.hardware.cpus_per_process + 1)

    @property
    def hint(self) -> int:
        """Lightning's suggested ``num_workers`` (`suggested_max_num_workers`)."""
        return max(1, self.hardware.cpus_per_process - 1)


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    choices: tuple[WorkerChoice, ...]

    @property
    def paces(self) -> list[float]:
        return [self.scenario.trains_at(choice.num_workers) for choice in self.choices]

    @property
    def ratio(self) -> float:
        """The worst chosen setting's training rate over the best of the sweep."""
        return min(self.paces) / max(self.scenario.trains_at(n) for n in self.scenario.counts)

    @property
    def vs_hint(self) -> float:
        return min(self.paces) / self.scenario.trains_at(self.scenario.hint)

    @property
    def spread(self) -> float:
        """The fastest chosen setting's rate over the slowest's, minus one."""
        return max(self.paces) / min(self.paces) - 1

    @property
    def measurements(self) -> int:
        return max(len(choice.trials) for choice in self.choices)


def replay(scenario: Scenario, seed: int, noise: float = NOISE) -> WorkerChoice:
    """One cold search on `scenario`, every measurement off by a seeded draw in ``1 +- noise``."""
    draws = random.Random(seed)

    def measure(workers: int, prefetch_factor: int | None) -> WorkerTrial:
        rate = scenario.loader_rate(workers) * draws.uniform(1 - noise, 1 + noise)
        return WorkerTrial(workers, prefetch_factor, rate, 1.0, batch_bytes=MIB)

    tuning = WorkerTuning(target_samples_per_s=scenario.consumer)
    return search_workers(measure, scenario.hardware, tuning, clock=lambda: 0.0)


def contention(workers: int, cpus: int, at_budget: float = 8.3 / 17.5) -> float:
    """The share of its pace a pipeline keeps beside `workers` workers: 1 up to half the CPUs,
    then falling linearly to `at_budget` at ``cpus - 1`` workers (the H100 demo's 15)."""
    half = cpus // 2
    if workers <= half or cpus - 1 <= half:
        return 1.0
    return 1 - (1 - at_budget) * min(1.0, (workers - half) / (cpus - 1 - half))


def replay_online(scenario: Scenario, seed: int, noise: float = NOISE) -> WorkerChoice:
    """One cold search on the run's own batches: each segment measures the training rate."""
    draws = random.Random(seed)
    tuning = WorkerTuning()
    hardware = scenario.hardware
    plan = plan_segments(10_000, None, hardware.cpus_per_process)
    prior = search_start(hardware, tuning, plan)
    assert prior is not None, f"{plan} times too few of {hardware.cpus_per_process} CPUs' workers"
    search = search_online(hardware, tuning, plan, prior)
    setting = next(search)
    try:
        while True:
            rate = scenario.trains_at(setting[0]) * draws.uniform(1 - noise, 1 + noise)
            setting = search.send(WorkerTrial(setting[0], setting[1], rate, 1.0, batch_bytes=MIB))
    except StopIteration as stop:
        return stop.value


def measured_scenarios(path: Path = MEASUREMENTS) -> list[Scenario]:
    """The H100 machine's curves: the data-bound sweep, and the demo's loader with the step's rate
    at each batch size measured (64, 128 and 256 in fp32 as the demo tuned; 256 and 1024 bf16)."""
    data = json.loads(path.read_text())
    h100 = EXAMPLES["h100"]
    sweep = data["data_bound_benchmark"]["sweep_samples_per_s_by_num_workers"]
    demo = data["demo_workload"]
    loader = {int(n): float(rate) for n, rate in demo["loader_alone_samples_per_s_by_num_workers"].items()}
    fp32 = demo["make_demo_default_8192x2"]["batch_size_trials_samples_per_s"]
    steps = {f"batch {size}": rate for size, rate in fp32.items()}
    steps |= {key.split(", ")[-1] + " bf16": rate for key, rate in demo["model_alone_samples_per_s"].items()}
    curve = {int(n): float(rate) for n, rate in sweep.items()}
    scenarios = [Scenario("data_bound sweep (end to end)", h100, curve, end_to_end=True)]
    for name, rate in steps.items():
        scenarios.append(Scenario(f"demo loader, step at {name}", h100, loader, float(rate)))
    return scenarios


def made_up_scenarios() -> list[Scenario]:
    """Machines of 2-128 CPUs: loaders that scale to all or half of the CPUs the training process
    leaves (as the H100 sweep does: 14-15 workers best on 16 CPUs), then flatten, and lose 8 %
    once workers and the training process want more CPUs than there are (16 workers there: -7 %);
    steps far slower, a little slower, a little faster and far faster than the loader can go."""
    scenarios = []
    for cpus, reach in itertools.product((2, 4, 8, 16, 32, 64, 96, 128), (1.0, 0.5)):
        hardware = EXAMPLES["h100"].replace(cpus_available=cpus, cpu_count=cpus)
        saturation = max(1, int((cpus - 1) * reach))
        curve = {0: 180.0}
        for workers in range(1, cpus + 1):
            rate = 200.0 * min(workers, saturation)
            curve[workers] = rate * (0.92 if workers >= cpus else 1.0)
        top = max(curve.values())
        for share in (None, 0.3, 0.9, 1.1, 3.0):
            consumer = None if share is None else share * top
            step = "step rate unknown" if share is None else f"step at {share}x the loader"
            name = f"{cpus} CPUs, loader to {saturation} workers, {step}"
            scenarios.append(Scenario(name, hardware, curve, consumer))
    return scenarios


def outcomes(
    scenarios: list[Scenario], seeds: tuple[int, ...] = SEEDS, online: bool = False
) -> list[Outcome]:
    search = replay_online if online else replay
    return [Outcome(s, tuple(search(s, seed) for seed in seeds)) for s in scenarios]


def contended(scenarios: list[Scenario]) -> list[Scenario]:
    return [dataclasses.replace(s, contended=True, name=f"{s.name}, contention") for s in scenarios]


def run(seeds: tuple[int, ...] = SEEDS) -> list[Row]:
    """The rows, each over `seeds` cold runs per curve (the table's: three)."""
    rows = []
    cases = (
        ("measured", measured_scenarios(), False),
        ("made-up", made_up_scenarios(), False),
        ("online, measured + contention", measured_scenarios() + contended(measured_scenarios()), True),
        ("online, made-up", made_up_scenarios(), True),
    )
    for label, scenarios, online in cases:
        results = outcomes(scenarios, seeds, online=online)
        worst = min(results, key=lambda o: o.ratio)
        for outcome in results if label.startswith(("measured", "online, measured")) else ():
            chosen = sorted({c.num_workers for c in outcome.choices})
            print(
                f"  {outcome.scenario.name}: chose {chosen}, {outcome.ratio:.3f}x the sweep's best,"
                f" {outcome.vs_hint:.3f}x Lightning's hint, spread {outcome.spread:.1%},"
                f" {outcome.measurements} measurements"
            )
        rows.append(
            Row(
                f"worker_replay ({label})",
                worst.ratio,
                f"worst chosen/best-of-sweep over {len(results)} curves x {len(seeds)} seeded cold runs,"
                f" +-{NOISE:.0%} noise ({worst.scenario.name}); vs Lightning's hint >="
                f" {min(o.vs_hint for o in results):.2f}x; spread between runs <="
                f" {max(o.spread for o in results):.1%}; <= {max(o.measurements for o in results)}"
                " measurements per search",
                COMMAND,
            )
        )
    return rows
