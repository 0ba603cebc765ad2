"""bf16 autocast on a CPU, kept unless the model's own training step is slower with it.

A CPU with bf16 dot products (AVX512-BF16, AMX) runs a convolutional network's step faster under
bf16 autocast and a small MLP's slower, the casts costing more than its matmuls gain (ResNet-18
1.26x, a 32-128-10 MLP 0.74x: `benchmarks/RESULTS.md`). So before the first training step, a
copy of the model trains on one of the run's own batches, alternating fp32 and bf16 autocast
step by step (`autocast_setting`; weights, optimizer and RNG of the run untouched), and
`decide_autocast` keeps bf16 unless its steps are measurably slower. With `AutoBatchSize`, its
first trial (a copy at the start size, timed anyway) runs these alternating steps itself
(`begin_trial`, `settle_trial`): one trial instead of two before the first step. The run's own
steps run at the chosen setting: when fp32 is kept, the run trains exactly the model plain
Lightning trains. Every rank keeps rank zero's decision. Manual optimization is not measured (its
step needs the live fit): it stays in fp32, with a finding.

A run that kept bf16 checks it on its own steps, since a shared host's speed can change after a
trial of a few steps: a warm-up pair at batch 4, pairs at 8 and 12, then one every 64 batches,
each one training batch in fp32 beside one in bf16 (`recheck_setting`), forward and backward
timed; a pair that puts bf16 more than 5 % slower is followed at once by others until they
settle. When the last pair and one of the two before it say so (`recheck_verdict`), the rest of
the run trains in fp32, with a finding, and the cache keeps fp32 for the next run. A run told
``deterministic=True`` is not checked: it trains every batch at the trial's setting, as its
repeat from the cache does.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_boost import cache
from lightning_boost._lightning import (
    hardware_for,
    moved_as_the_loop_moves,
    preserved_rng,
    training_batch_index,
)
from lightning_boost.fingerprints import describe_model, hardware_parts
from lightning_boost.precision import (
    AUTOCAST_MAX_LOSS,
    AUTOCAST_RECHECK_FIRST,
    AUTOCAST_WARMUP,
    AutocastChoice,
    autocast_setting,
    budget_spent,
    decide_autocast,
    next_recheck,
    recheck_setting,
    recheck_verdict,
)
from lightning_boost.ranks import from_rank_zero
from lightning_boost.report import BoostWarning, Finding, Severity
from lightning_boost.step_probe import StepProbe, evaluation_failure, first_batch

if TYPE_CHECKING:  # the mixin is typed as the plugin it is mixed into
    _Plugin = MixedPrecision
else:
    _Plugin = object


class MeasuredAutocastMixin(_Plugin):
    """``MixedPrecision("bf16-mixed", "cpu")`` that keeps bf16 autocast unless the model's
    training step is slower with it (`measure`, before the first step); ``precision`` reads
    ``"32-true"`` until then, and after when it was not.

    ``choice`` holds the decision once made. ``owner``, the preset strategy (set when it sets up),
    broadcasts rank zero's decision to every rank and receives the finding.
    """

    def __init__(self) -> None:
        super().__init__("bf16-mixed", "cpu")
        self.autocast = False  # fp32 until the trial says otherwise, and `precision` says so:
        self.precision = "32-true"  # Lightning's model summary warns about any "-mixed" string
        self.seconds: list[float] = []
        self.choice: AutocastChoice | None = None
        self.owner: Any = None
        self.batch = -1  # the run's last training batch seen
        self.pairs = 0  # check pairs run, the warm-up included
        self.next_pair = AUTOCAST_RECHECK_FIRST  # the batch the next check pair starts at
        self.rechecks: list[float] = []  # the check pairs' fp32/bf16 ratios, oldest first
        self.switched_at: int | None = None  # the run's first batch in fp32 after its checks
        self._key = ""  # the cache entry of this run's decision
        self._trial_batch: Any = None  # the batch `AutoBatchSize`'s trial decides on (`begin_trial`)
        self._timing: tuple[bool, int, float] | None = None  # a check batch's bf16, threads, start
        self._halves: list[tuple[bool, int, float]] = []  # the open pair's bf16, threads, seconds

    @override
    def autocast_context_manager(self) -> torch.autocast:
        return self._bf16()

    @staticmethod
    def _bf16() -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        context = self.autocast_context_manager() if self.autocast else contextlib.nullcontext()
        with context:
            yield

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        """The training step's forward, at the check's setting when this batch is half of a check
        pair (timed until its backward ends: `post_backward`). A trial's step on a copy of the
        model (the batch-size and worker probes use this context too) is no batch of the run's.
        The pairs count from the fit's first batch, a resumed fit's too."""
        kept = self.autocast
        setting = self._check_setting() if self._rechecking() else None  # fp32 runs: nothing per step
        if setting is not None:
            self.autocast = setting
            self._timing = (setting, torch.get_num_threads(), time.perf_counter())
        try:
            with self.forward_context():
                yield
        finally:
            self.autocast = kept

    @override
    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        tensor = super().post_backward(tensor, module)
        if self._timing is not None:
            bf16, threads, start = self._timing
            self._timing = None
            self._halves.append((bf16, threads, time.perf_counter() - start))
            if len(self._halves) == 2:
                self._end_pair()
        return tensor

    def _check_setting(self) -> bool | None:
        """This step's setting when its batch is half of a check pair, else ``None``; a probe's
        step comes at the last batch's index, and is none of the run's."""
        batch = training_batch_index(getattr(self.owner, "lightning_module", None))
        if batch is None or batch == self.batch:
            return None
        if batch < self.batch or self.batch < 0:  # a fit's first batch (a resumed one's too)
            self.pairs, self.next_pair, self._halves = 0, batch + AUTOCAST_RECHECK_FIRST, []
        self.batch = batch
        return recheck_setting(batch, self.next_pair, self.pairs)

    def _rechecking(self) -> bool:
        """Whether the run's bf16 is still checked: kept by a trial (or the cache), not switched
        off, and the run not told ``deterministic=True`` (its repeat must train alike: its pairs
        train a batch in fp32 now and then, and a switch would follow the host's timing)."""
        kept = self.choice is not None and self.choice.bf16 and self.autocast
        return kept and not torch.are_deterministic_algorithms_enabled()

    def _end_pair(self) -> None:
        """Add the pair's ratio (none for the warm-up pair, or when the model's threads changed
        between its halves: a worker search's probe), plan the next pair, and switch to fp32 when
        `recheck_verdict` says so; every rank as rank zero's pairs say."""
        (first, threads, a), (_, other_threads, b) = self._halves
        self._halves = []
        fp32, bf16 = (b, a) if first else (a, b)
        ratio = fp32 / bf16 if bf16 > 0 else 1.0
        counted = threads == other_threads and self.pairs > 0
        if counted:
            self.rechecks.append(ratio)
        self.pairs += 1
        planned = (next_recheck(self.batch, self.pairs, self.rechecks), recheck_verdict(self.rechecks))
        self.next_pair, switch = from_rank_zero(self.owner, planned)  # every rank at the same batches
        if switch:
            self._switch_off()

    def _switch_off(self) -> None:
        """fp32 for the rest of the run, in the cache and in the report, from the last pairs."""
        assert self.choice is not None  # only a kept bf16 is checked
        trial = self.choice
        self.choice = AutocastChoice(
            False, round(statistics.median(self.rechecks[-3:]), 3), len(self.rechecks)
        )
        self.autocast = False
        self.precision = "32-true"
        self.switched_at = self.batch + 1
        if getattr(self.owner, "is_global_zero", True):
            _store(self._key, self.choice)
        if self.owner is not None:
            findings = [f for f in self.owner.findings if "autocast_bf16" not in f.data]
            switch = recheck_finding(trial, self.choice, self.rechecks, self.switched_at)
            self.owner.findings = [*findings, switch]

    def measure(self, trainer: Any, batch: Any = None, run_steps: float | None = None) -> None:
        """Decide before the first training step, on a copy of the model and one of the run's
        batches: `batch` (on the device) when given, else the training loader's first; `run_steps`,
        the optimizer steps the run plans (the trial's budget), else the trainer's estimate."""
        if self.choice is not None:
            return
        module = trainer.lightning_module
        if not module.automatic_optimization:
            self._settle(AutocastChoice(False, None, 0, "manual optimization"))
            return
        with preserved_rng():
            choice = self._decide(trainer, one_batch(trainer) if batch is None else batch, run_steps)
        self._settle(choice)

    def begin_trial(self, trainer: Any, batch: Any, run_steps: float) -> AutocastTrial | None:
        """For a trial that times the run's steps on a copy anyway (`AutoBatchSize`'s first, at
        `batch`'s shapes): ``None`` when the choice needs no trial (made already, in the cache,
        manual optimization; settled here), else the `AutocastTrial` its timed steps are to run
        under, for `settle_trial` after it. Every rank calls both, and takes rank zero's path."""
        if self.choice is not None:
            return None
        known: AutocastChoice | None = None
        key = ""
        if not trainer.lightning_module.automatic_optimization:
            known = AutocastChoice(False, None, 0, "manual optimization")
        else:
            key, known = _lookup(trainer, batch)
            known = None if known is None else evaluation_checked(trainer, batch, known, self._bf16)
        self._key, self._trial_batch = key, batch
        known = from_rank_zero(self.owner, known)
        if known is not None:
            self._apply(known)
            return None
        return AutocastTrial(self.autocast_context_manager, run_steps, key)

    def settle_trial(self, trainer: Any, trial: AutocastTrial) -> None:
        """Rank zero's choice from `trial` on every rank (and in the cache); none when its steps
        ran out of memory before it decided (`choice` stays ``None``: the next batch-size trial
        takes `trial.again()`, else `measure` decides at the first step)."""
        timed = trial.choice
        checked = None if timed is None else evaluation_checked(trainer, self._trial_batch, timed, self._bf16)
        choice = from_rank_zero(self.owner, checked)
        if timed is None or choice is None:
            return
        self.seconds = list(trial.seconds)
        if trainer.is_global_zero:
            _store(trial.key, timed)
        self._apply(choice)

    def _decide(self, trainer: Any, batch: Any, run_steps: float | None) -> AutocastChoice:
        """An earlier run's decision for this machine, model and batch shape, else the trial's
        (stored for the next run)."""
        if batch is None:
            return AutocastChoice(False, None, 0, "no training batch to time the step on")
        key, cached = _lookup(trainer, batch)
        self._key = key
        if cached is not None:
            return evaluation_checked(trainer, batch, cached, self._bf16)
        steps = trainer.estimated_stepping_batches if run_steps is None else run_steps
        trial = AutocastTrial(self.autocast_context_manager, steps, key)
        probe = StepProbe(
            trainer.lightning_module, trainer.optimizers, 1, contextlib.nullcontext, contextlib.nullcontext
        )
        contexts = map(trial.context, itertools.count())
        try:
            with contextlib.closing(probe.time_steps(batch, contexts)) as timed:  # frees the copy on return
                for seconds in timed:
                    if trial.add(seconds):
                        break
        except Exception as error:  # the run's own step says so itself, if it is real
            return AutocastChoice(False, None, 0, f"the step failed on a copy of the model ({error!r})")
        assert trial.choice is not None  # the contexts never end: only a decision stops the loop
        self.seconds = list(trial.seconds)
        if trainer.is_global_zero:
            _store(key, trial.choice)
        return evaluation_checked(trainer, batch, trial.choice, self._bf16)

    def _settle(self, choice: AutocastChoice) -> None:
        self._apply(from_rank_zero(self.owner, choice))

    def _apply(self, choice: AutocastChoice) -> None:
        """Keep `choice` (every rank's: rank zero's) for the run's steps, with its finding."""
        self.choice = choice
        self.autocast = choice.bf16
        self.precision = "bf16-mixed" if choice.bf16 else "32-true"
        if self.owner is not None:
            self.owner.findings.append(autocast_finding(choice, len(self.seconds)))


class AutocastTrial:
    """Training steps alternating fp32 and bf16 autocast (`autocast_setting`), added one by one
    until `decide_autocast` settles (`choice`) or the trial's time is spent (`autocast_budget`,
    from the first step's time and `run_steps`). The plugin's own trial times its steps, or
    `AutoBatchSize`'s first trial does (`StepProbe.train`'s `alternate`); `key` is the cache entry
    the choice goes to."""

    def __init__(self, bf16: Callable[[], torch.autocast], run_steps: float, key: str = "") -> None:
        self.bf16 = bf16
        self.run_steps = run_steps
        self.key = key
        self.seconds: list[float] = []
        self.choice: AutocastChoice | None = None

    def context(self, step: int) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """The setting step `step` (0: the first) runs under."""
        return self.bf16 if autocast_setting(step) else contextlib.nullcontext

    def add(self, seconds: float) -> bool:
        """The next step's time; whether the trial has decided."""
        self.seconds.append(seconds)
        self.choice = decide_autocast(self.seconds, final=budget_spent(self.seconds, self.run_steps))
        return self.choice is not None

    def again(self) -> AutocastTrial:
        """The same trial, with no step timed yet (for the next batch-size trial, when this one's
        steps ran out of memory before it decided)."""
        return AutocastTrial(self.bf16, self.run_steps, self.key)

    def kept_times(self) -> list[float]:
        """The timed steps (after the warm-ups) run at the setting the choice keeps."""
        if self.choice is None:
            return []
        bf16 = self.choice.bf16
        return [
            s
            for step, s in enumerate(self.seconds)
            if step >= AUTOCAST_WARMUP and autocast_setting(step) == bf16
        ]


class MeasuredAutocast(MeasuredAutocastMixin, MixedPrecision):
    """`MeasuredAutocastMixin` on ``lightning.pytorch``'s `MixedPrecision`."""


#: The decisions of earlier runs, in the cache directory: a warm run does not time the step again.
CACHE_FILE = "autocast.json"
USE_BF16 = "preset('auto', precision='bf16-mixed') uses bf16 autocast unmeasured"


def evaluation_checked(
    trainer: Any, batch: Any, choice: AutocastChoice, bf16: Callable[[], torch.autocast]
) -> AutocastChoice:
    """`choice`, unless it keeps bf16 and an evaluation step (`evaluation_failure`) on a training
    batch runs on a copy of the model in fp32 and fails under bf16 autocast: then fp32, saying
    why. Timed on training steps alone, bf16 was kept for a model whose validation could not run in
    it (an `nn.TransformerEncoder` given a padding mask runs it as nested tensors in eval mode,
    which fail under a CPU's autocast), and the fit stopped at its sanity check."""
    if not choice.bf16 or batch is None:
        return choice
    probe = StepProbe(
        trainer.lightning_module, trainer.optimizers, 1, contextlib.nullcontext, contextlib.nullcontext
    )

    def attempt(hook: str, autocast: bool) -> None:
        with preserved_rng(), bf16() if autocast else contextlib.nullcontext():
            probe.evaluate(batch, hook)

    failed = evaluation_failure(probe.module, attempt)
    if failed is None:
        return choice
    hook, error = failed
    why = f"{hook} failed under bf16 autocast on a copy of the model ({error!r})"
    return AutocastChoice(False, choice.speedup, choice.pairs, why, choice.cached)


def step_cache_parts(trainer: Any, batch: Any) -> dict[str, Any]:
    """What the step's speed under bf16 depends on: the machine, the model, its optimizers and
    the batch's shapes and dtypes."""
    return {
        "kind": "autocast",
        "hardware": hardware_parts(hardware_for(trainer)),
        "model": describe_model(trainer.lightning_module),
        "optimizers": [type(optimizer).__qualname__ for optimizer in trainer.optimizers],
        "batch": _shapes(batch),
    }


def _shapes(value: Any) -> Any:
    """`value`'s tensors as ``[shape, dtype]``, in its own nesting; other leaves by type name.

    Example:
        >>> _shapes({"x": torch.zeros(2, 3), "y": [torch.ones(2, dtype=torch.long), "label"]})
        {'x': [[2, 3], 'torch.float32'], 'y': [[[2], 'torch.int64'], 'str']}
    """
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, dict):
        return {str(key): _shapes(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shapes(item) for item in value]
    return type(value).__name__


def _lookup(trainer: Any, batch: Any) -> tuple[str, AutocastChoice | None]:
    """The cache key of this run's decision (`batch`'s shapes) and an earlier run's decision under it."""
    key = cache.fingerprint(step_cache_parts(trainer, batch))
    return key, _cached(cache.default_cache_dir() / CACHE_FILE, key)


def _store(key: str, choice: AutocastChoice) -> None:
    """Keep a timed verdict for the next run; a choice made without one (steps too slow to time a
    pair in the trial's time: a longer run may time them) is not a measurement to reuse."""
    if choice.why_not or choice.speedup is None:
        return
    result = {"bf16": choice.bf16, "speedup": choice.speedup, "pairs": choice.pairs}
    cache.store_entry(cache.default_cache_dir() / CACHE_FILE, key, {"result": result})


def _cached(path: Path, key: str) -> AutocastChoice | None:
    """The decision an earlier run stored under `key`; ``None`` (measure) when there is none or
    the file is not a cache of this schema (said in a warning)."""
    entry, problem = cache.load_entry(path, key)
    if entry is None and problem is None:
        return None
    result = entry.get("result") if entry else None
    valid = (
        isinstance(result, dict)
        and isinstance(result.get("bf16"), bool)
        and isinstance(result.get("speedup"), (int, float))
        and isinstance(result.get("pairs"), int)
    )
    if problem is None and not valid:
        problem = f"{path} holds a malformed entry {key!r}"
    if problem is not None or not isinstance(result, dict):
        rank_zero_warn(f"Ignoring the autocast cache, measuring again: {problem}.", category=BoostWarning)
        return None
    return AutocastChoice(result["bf16"], float(result["speedup"]), result["pairs"], cached=True)


def autocast_finding(choice: AutocastChoice, steps: int) -> Finding:
    """What the measured autocast decided, and from which steps.

    Example:
        >>> autocast_finding(AutocastChoice(True, 1.25, 3), 8).title
        'bf16 autocast kept on this CPU: its steps ran 1.25x as fast as fp32'
    """
    data: dict[str, Any] = {"autocast_bf16": choice.bf16, "speedup": choice.speedup, "steps": steps}
    if choice.cached:
        data["source"] = "cache"
    keep_fp32 = "preset('auto', precision='32-true')"
    if choice.why_not and choice.speedup is not None:  # timed faster, but an evaluation step fails
        title = f"fp32 kept on this CPU: {choice.why_not.split(' on a copy', 1)[0]}"
        detail = (
            f"{choice.why_not}. Its training steps ran {choice.speedup:.2f}x as fast in bf16, but in"
            " bf16 the fit would stop at its first validation."
        )
        fix = (
            "An `nn.TransformerEncoder` given a padding mask runs it as nested tensors in eval mode,"
            " which fail under bf16 autocast on a CPU: build it with `enable_nested_tensor=False`, then "
            + USE_BF16
        )
        return Finding("preset", "precision and strategy", Severity.INFO, title, detail, fix, data=data)
    if choice.why_not:
        detail = f"not measured: {choice.why_not}"
        fix = USE_BF16
        return Finding(
            "preset", "precision and strategy", Severity.INFO, "fp32 kept on this CPU", detail, fix, data=data
        )
    if choice.cached:
        kept = "bf16 autocast kept" if choice.bf16 else "fp32 kept"
        title = f"{kept} on this CPU, as an earlier run measured (bf16 step {choice.speedup:.2f}x as fast)"
        detail = (
            f"from the cache ({CACHE_FILE} in the cache directory): an earlier run on this machine timed"
            f" this model's step on a batch of the same shapes, {_pairs(choice.pairs)}; delete the entry"
            " (or point LIGHTNING_BOOST_CACHE_DIR elsewhere) to measure again"
        )
        fix = keep_fp32 if choice.bf16 else USE_BF16
        return Finding("preset", "precision and strategy", Severity.INFO, title, detail, fix, data=data)
    detail = (
        f"before training, {steps} steps of a copy of the model on the run's training batches alternated"
        f" bf16 autocast and fp32 (one warm-up each, then {_pairs(choice.pairs)} timed; median fp32/bf16"
        f" step time {choice.speedup:.2f}; bf16, the setting this CPU is built for, is kept unless under"
        f" {1 - AUTOCAST_MAX_LOSS:.2f}); weights, gradients and optimizer state are fp32 either way"
    )
    if choice.bf16:
        title = f"bf16 autocast kept on this CPU: its steps ran {choice.speedup:.2f}x as fast as fp32"
        return Finding("preset", "precision and strategy", Severity.INFO, title, detail, keep_fp32, data=data)
    title = f"fp32 kept on this CPU: bf16 autocast steps ran {choice.speedup:.2f}x as fast"
    return Finding("preset", "precision and strategy", Severity.INFO, title, detail, data=data)


def recheck_finding(
    trial: AutocastChoice, switched: AutocastChoice, ratios: list[float], batches: int
) -> Finding:
    """bf16 switched off mid-run: what the trial read, and what the run's own check pairs read
    (`ratios`, the last three's median in `switched`).

    Example:
        >>> switched = AutocastChoice(False, 0.70, 2)
        >>> recheck_finding(AutocastChoice(True, 1.15, 1), switched, [0.71, 0.69], 14).title
        "fp32 from training batch 14 on: bf16 autocast ran 0.70x as fast as fp32 on the run's own steps"
    """
    speedup = switched.speedup
    source = (
        "an earlier run (cache)" if trial.cached else f"the trial before training ({_pairs(trial.pairs)})"
    )
    detail = (
        f"{source} read bf16 steps {trial.speedup:.2f}x as fast as fp32, so bf16 was kept; the run then"
        f" timed one fp32 training batch beside a bf16 one now and then (forward and backward), and"
        f" its last pairs read {', '.join(f'{r:.2f}x' for r in ratios[-3:])} (the median"
        f" {speedup:.2f}x):"
        f" bf16 over {AUTOCAST_MAX_LOSS:.0%} slower, so the rest of the run trains in fp32 (a shared"
        " host's speed can change after a trial); the cache keeps fp32 for the next run"
    )
    title = (
        f"fp32 from training batch {batches} on: bf16 autocast ran {speedup:.2f}x as fast as fp32"
        " on the run's own steps"
    )
    data = {"autocast_bf16": False, "speedup": speedup, "rechecks": [round(r, 3) for r in ratios]}
    return Finding("preset", "precision and strategy", Severity.INFO, title, detail, USE_BF16, data=data)


def _pairs(count: int) -> str:
    """``"1 pair"``, ``"2 pairs"``."""
    return f"{count} pair" if count == 1 else f"{count} pairs"


def one_batch(trainer: Any) -> Any:
    """The first batch of the run's training set, collated and moved as the run's are (the
    module's batch-transfer hooks included); ``None`` without a DataLoader with a batch size."""
    loader = trainer.train_dataloader
    if isinstance(loader, (list, tuple)) and loader:
        loader = loader[0]
    if not isinstance(loader, DataLoader) or not loader.batch_size:
        return None
    batch = first_batch(loader.dataset, loader.collate_fn, loader.batch_size)
    return moved_as_the_loop_moves(trainer, batch)
