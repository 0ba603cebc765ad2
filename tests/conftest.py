import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_boost.cache import CACHE_DIR_ENV

pytest_plugins = ["lightning_boost.testing.pytest_plugin"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--simulate-cpus",
        type=int,
        metavar="N",
        help="tell this process it has N CPUs (os.cpu_count, os.sched_getaffinity): the suite as a"
        " many-core machine runs it, such as the GPU machine's 16 (`make test-many-cpus`)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Under `pytest -n N` (the GPU machine's run, issue 32) the N processes share the CPUs: each
    gets its part for torch's threads, not all of them (14 x 16 threads on 16 CPUs made a tiny
    bf16 step there slower than the 50 ms sleep the autocast tests time it against).

    ``--simulate-cpus N`` reports N CPUs to the process (and the DataLoader workers it forks; a
    spawned DDP rank sees the real count), its torch threads as they were: the H100 machine's
    whole suite failed tests it did not name (2026-11-27), and under this option the worker
    search's thread-probe test, passing on 2 CPUs, failed here."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    cpus = config.getoption("--simulate-cpus")
    if cpus:
        os.cpu_count = lambda: cpus
        os.sched_getaffinity = lambda pid: set(range(cpus))


@pytest.fixture(autouse=True)
def _private_tuning_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test measures into its own cache: no test reads another's (or the user's) results."""
    cache_dir = tmp_path / "lightning_boost_cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache_dir))
    yield cache_dir


@pytest.fixture(autouse=True)
def _torch_flags_put_back() -> Iterator[None]:
    """The process-wide speed flags as each test found them: a program run whole may set them for
    its process, as Lightning's ``Trainer(benchmark=True)`` does (the imagenet example), and the
    next test must not start from its setting. Whether the pack puts back what it sets is tested
    inside the tests of its presets. `Trainer(deterministic=True)` turns torch's deterministic
    algorithms on for the process: they go back as they were. On a GPU, CUDA's sync debug mode
    goes back to off, its default: a test that leaves it on would fail every later test of its
    process that syncs (one did, on an H100, 2026-11-27); SyncGuard's tests assert inside
    themselves that it puts it back."""
    before = (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision())
    deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )  # `Trainer(deterministic=True)` sets them for the process
    yield
    torch.backends.cudnn.benchmark = before[0]
    torch.set_float32_matmul_precision(before[1])
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    # reading or setting the mode would start CUDA otherwise; setting it warns once a process that
    # the mode is a prototype (an error here: the first CUDA test of each process failed at its
    # teardown on an H100, 2026-11-27), so it is set only where a test left it on
    if torch.cuda.is_initialized() and torch.cuda.get_sync_debug_mode() != 0:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
            torch.cuda.set_sync_debug_mode(0)


@pytest.fixture
def long_planned_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`AutoBatchSize`'s search on a real fit as a long run would have it. The suite's fits train a
    few batches (a run long enough to repay a search takes minutes on CPU), so the run-length
    rules, tested on real fits of their own in `tests/test_goodput.py`, are lifted where a test
    is about the search, the decision's use or its report, not about the run's length."""
    from lightning_boost.batch_size.plan import RunPlan

    monkeypatch.setattr(RunPlan, "keep_reason", lambda self, size, target: "")
    monkeypatch.setattr(RunPlan, "samples_planned", lambda self, size: float("inf"))
    monkeypatch.setattr(RunPlan, "largest_size", lambda self: None)


@pytest.fixture
def fixed_cost_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trial steps timed as a fixed-cost step (10 ms a step plus 1 µs a sample: a small model on a
    GPU, or a busy CPU), so which size the search reaches does not hang on this shared machine's
    load. The gradients and memory each trial reads stay the real step's: only the clock is scripted.
    """
    script_trials(monkeypatch, lambda size: {"samples_per_s": size / (0.01 + 1e-6 * size), "spread": 0.0})


def spawned_ddp_trainer(root: Path, callbacks: list[L.Callback]) -> L.Trainer:
    """A 2-process ``ddp_spawn`` fit long enough to repay a batch size search (spawned ranks miss
    `long_planned_run`): 8 epochs of a tenth of the loader."""
    from lightning_boost.testing import tiny_trainer

    return tiny_trainer(
        root,
        devices=2,
        strategy="ddp_spawn",
        callbacks=callbacks,
        enable_checkpointing=False,
        limit_train_batches=0.1,
        max_epochs=8,
    )


def script_trials(monkeypatch: pytest.MonkeyPatch, scripted: Callable[[int], dict[str, Any]]) -> None:
    """`StepProbe.train` runs its real steps (memory, OOMs, gradients, the autocast pairs), then
    the fields `scripted` gives for the trial's size replace the measured ones (not an OOM's)."""
    import dataclasses

    from lightning_boost.step_probe import StepProbe

    real = StepProbe.train

    def train(
        self: StepProbe,
        batch: Any,
        size: int,
        following: Any = None,
        split: bool = False,
        alternate: Any = None,
        cross: int = 0,
    ) -> Any:
        trial = real(self, batch, size, following, split, alternate, cross)
        return trial if trial.oom else dataclasses.replace(trial, **scripted(size))

    monkeypatch.setattr(StepProbe, "train", train)


def worker_bounds(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The `WorkerTuning.max_workers` of each measurement before a loop (`decide_workers`), in
    order, as the test goes on: the real decision runs, only watched."""
    from lightning_boost.workers import tuner

    bounds: list[int | None] = []
    real = tuner.decide_workers

    def watched(probes: Any, hardware: Any, tuning: Any, *rest: Any) -> Any:
        bounds.append(tuning.max_workers)
        return real(probes, hardware, tuning, *rest)

    monkeypatch.setattr(tuner, "decide_workers", watched)
    return bounds


def minor_version(version: str) -> tuple[int, int]:
    """``(2, 14)`` of ``"2.14.1+cu130"``: to compare a package's release with a floor."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


#: Below torch 2.6 or Lightning 2.5 (the oldest set: torch 2.5.1, Lightning 2.4.0), where the
#: libraries behave as some tests' expectations do not (each test says how).
OLD_TORCH_OR_LIGHTNING = minor_version(torch.__version__) < (2, 6) or minor_version(L.__version__) < (2, 5)
