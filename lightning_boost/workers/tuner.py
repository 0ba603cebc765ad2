"""`LoaderTuner`: the Lightning side of worker tuning, shared by `BoostedDataModule` and `AutoNumWorkers`.

It gathers what the decision needs (hardware as the trainer runs it, the dataset, the real
loader's settings), measures on rank zero or reads the cache, broadcasts the choice so every rank
uses the same value, applies the process settings that go with it and records findings.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset, DistributedSampler

from lightning_boost import cache
from lightning_boost._lightning import debugging_mode, hardware_for, moved_as_the_loop_moves, preserved_rng
from lightning_boost.fingerprints import describe_model
from lightning_boost.hardware import HardwareInfo
from lightning_boost.ranks import decided_on_rank_zero, from_rank_zero
from lightning_boost.report import BoostWarning, Finding
from lightning_boost.step_probe import StepProbe
from lightning_boost.workers.decision import (
    WorkerProbes,
    before_fit_finding,
    capped_finding,
    choice_findings,
    decide_workers,
    open_files_finding,
    threads_finding,
)
from lightning_boost.workers.loaders import cannot_measure, fingerprint_parts, measurement_loaders
from lightning_boost.workers.model_rates import model_step_rates
from lightning_boost.workers.online import (
    SegmentPlan,
    Setting,
    plan_segments,
    prior_setting,
    queue_depth,
    search_online,
    search_start,
    timeable,
    untimeable_reason,
)
from lightning_boost.workers.search import (
    WorkerChoice,
    WorkerTrial,
    WorkerTuning,
    bounded,
    compute_threads,
    measure_loader,
    model_threads,
    open_files_plan,
    rest_of_measuring,
    run_samples,
    workers_allowed,
)
from lightning_boost.workers.segments import OnlineSearch

CACHE_FILE = "workers.json"
#: The most samples a batch of a loader trial holds (a larger tuned batch is timed at this size).
MEASURE_BATCH_CAP = 1024
#: What follows the prior's worker count in a short run's reason, before why (StepTimeMonitor reads it).
NOT_SEARCHED = ", not searched: "
#: The choices a later batch size of the same dataset may keep where its epoch cannot search it.
CARRIED_SOURCES = ("measured", "searched", "cache")


@dataclasses.dataclass(frozen=True)
class LoaderAsk:
    """One loader's worker question as `LoaderTuner.decide` gathered it: what rank zero decides on.

    Args:
        tuning: how to measure, bounded by the loader's batches (`bounded`).
        hardware: as the trainer runs it.
        dataset: the loader's dataset.
        batch_size: the loader's batch size.
        settings: the real loader's other arguments (collate function, pinning, ...).
        trainer: the run's trainer, or ``None`` outside a fit.
        workload_samples: what the run will load from it, when known.
        hook: the step the loader feeds, whose rate a measurement before the loop weighs.
    """

    tuning: WorkerTuning
    hardware: HardwareInfo
    dataset: Dataset[Any]
    batch_size: int
    settings: Mapping[str, Any]
    trainer: L.Trainer | None
    workload_samples: int | None
    hook: str = "training_step"


class LoaderTuner:
    """Chooses `num_workers`/`prefetch_factor` per dataset and batch size, once per fingerprint.

    Args:
        source: the name findings carry (the class that owns this tuner).
        tuning: how to measure (`WorkerTuning`).
        cache_dir: where measurements are cached (default `lightning_boost.cache.default_cache_dir`).
        retune: measure even when the cache has an entry.
    """

    def __init__(self, source: str, tuning: WorkerTuning, cache_dir: str | Path | None, retune: bool) -> None:
        self.source = source
        self.tuning = tuning
        self.cache_dir = cache_dir
        self.retune = retune
        self.choices: dict[str, WorkerChoice] = {}
        self.searches: dict[str, OnlineSearch] = {}
        self.findings: list[Finding] = []  # the last run's (a fit, validate, ...): see `restore`
        self.restored: set[str] = set()
        self._short_runs: dict[str, int | None] = {}  # a short run's choice: the samples it was for
        self._told: set[str] = set()  # the choices whose findings this run's list holds
        self._ended = False
        self._threads_before: int | None = None
        self._split_threads: dict[str, int] = {}  # a CPU run's model threads beside each split's workers
        self._files_before: tuple[tuple[int, int], str] | None = None
        self._sizes: dict[str, tuple[str, int]] = {}  # each key's dataset (its key without the batch size)
        self._found: dict[str, tuple[int, WorkerChoice]] = {}  # each dataset's last measured choice

    def decide(
        self,
        trainer: L.Trainer | None,
        dataset: Dataset[Any],
        batch_size: int,
        settings: Mapping[str, Any],
        workload_samples: int | None = None,
        loader: str = "",
        epoch_batches: int | None = None,
        most: int | None = None,
        name: str = "",
    ) -> tuple[WorkerChoice, OnlineSearch | None]:
        """The worker setting for `dataset` at `batch_size`, the same on every rank, and the
        search that decides it on the first epoch's own batches when one runs (else ``None``).

        `settings` are the real loader's other arguments (collate function, pinning, ...);
        `workload_samples`, what the run will load from it, when known (`run_samples`): a run too
        short for measuring to pay back loads in the main process, and that is not cached. Given
        the training loader's `epoch_batches` (per rank) and ``WorkerTuning(online=True)``, the
        setting is the search's prior (`OnlineSearch`); a loader over the same dataset asked for
        while that search runs (an evaluation loader) gets the prior and the search, to follow it.
        `loader` names the split (``"train"``, ``"val"``, ...), `name` one of the split's several
        loaders in the findings (``"train ['a']"``, default: the split); the loader of an evaluation stage
        run alone (`own_pass`: ``trainer.predict``, ...) is given its pass's `epoch_batches` and
        searched on that pass, timed against its own step, and cached apart from training's.
        `most` bounds the candidates (an evaluation loader's batches per pass: a worker past them
        never gets one, so none is measured) and is part of the cache key.
        """
        hardware = hardware_for(trainer)
        tuning = bounded(self.tuning, most)
        # `Trainer(deterministic=True)` turns torch's deterministic algorithms on: its repeat must
        # train the same batches, so no search on them (`before_fit_finding`)
        on_its_batches = tuning.online and epoch_batches is not None
        before_fit = on_its_batches and torch.are_deterministic_algorithms_enabled()
        if before_fit:  # a key of its own: a later run's search on its batches is not skipped for it
            tuning = dataclasses.replace(tuning, online=False)
        split = loader
        unit = PASS_NAMES[loader] if own_pass(trainer, loader) else "first epoch"
        hook = CONSUMING_STEPS.get(loader, "training_step")  # what a measurement before the loop weighs
        # a loader is decided again at each batch size (Lightning builds the training loader at the
        # configured one to count the run's steps before `AutoBatchSize` changes it): say which
        loader = f"{name or loader} loader at batch {batch_size}" if loader else ""
        # the model's step is part of the decision: on a CPU it shares the CPUs with the workers,
        # on a GPU its rate is what the loader must feed
        module = trainer.lightning_module if trainer is not None else None
        model = describe_model(module)
        if model is not None and trainer is not None:
            model += f", precision {trainer.precision}"
            if unit != "first epoch":  # searched on its pass, against the step it feeds
                model += f", {unit}"
            elif hook != "training_step":  # measured before the fit against the step it feeds
                model += f", feeding {hook}"
        parts = fingerprint_parts(hardware, dataset, batch_size, settings, tuning, model)
        key = cache.fingerprint(parts)
        self._sizes[key] = (cache.fingerprint({**parts, "batch_size": None}), batch_size)
        self._begin_run()
        pending = self.searches.get(key)
        if pending is not None and pending.choice is None:
            return pending_choice(pending), pending
        choice = self._choice_for(key, workload_samples, loader)
        if choice is None:
            online = (epoch_batches, workload_samples, unit) if tuning.online else None

            ask = LoaderAsk(tuning, hardware, dataset, batch_size, settings, trainer, workload_samples, hook)

            def decide() -> dict[str, Any]:
                return self._decide(ask, key, online)

            result = decided_on_rank_zero(
                trainer.strategy if trainer is not None else None,
                trainer is None or trainer.is_global_zero,
                decide,
            )
            bound: list[Finding] = []  # said where a worker count was tried (a short run may try none)
            tried = "online" in result or any(trial["num_workers"] for trial in result.get("trials", ()))
            if tried and most is not None and most < workers_allowed(hardware.cpus_per_process, self.tuning):
                bound.append(capped_finding(self.source, split, most, None))
            if "online" in result:
                plan = SegmentPlan(**result["online"])
                search = self._online(tuning, trainer, hardware, key, plan, loader, split)
                self.searches[key] = search
                self.configure_segment(hardware, search.prior.num_workers, split=split)
                self.findings += bound
                return pending_choice(search), search
            choice = WorkerChoice.from_dict(result)
            self.choices[key] = choice
            self._remember(key, choice)
            if choice.source == "short run":
                self._short_runs[key] = workload_samples
            self.findings += choice_findings(self.source, choice, loader) + bound
            if before_fit and choice.source == "measured":
                self.findings.append(before_fit_finding(self.source, loader, unit))
        elif key in self.restored:
            self.restored.discard(key)
            self.findings += choice_findings(self.source, choice.replace(source="checkpoint"), loader)
        elif key not in self._told:  # decided in an earlier run of this process: said for this one
            self.findings += choice_findings(self.source, choice, loader)
        self._told.add(key)
        self.apply_process_settings(hardware, choice.num_workers, choice.threads, split)
        return choice, None

    def _online(
        self,
        tuning: WorkerTuning,
        trainer: L.Trainer | None,
        hardware: HardwareInfo,
        key: str,
        plan: SegmentPlan,
        loader: str,
        split: str,
    ) -> OnlineSearch:
        """The search every rank runs on its own batches, each deciding on rank zero's measurements."""
        prior = search_start(hardware, tuning, plan)
        assert prior is not None, "_decide plans a search only where one can start"
        share = None
        if trainer is not None and trainer.world_size > 1:
            strategy = trainer.strategy

            def share(trial: WorkerTrial) -> WorkerTrial:
                return WorkerTrial(**from_rank_zero(strategy, dataclasses.asdict(trial)))

        def settled(choice: WorkerChoice) -> None:
            self.choices[key] = choice
            self._remember(key, choice)
            self.findings += choice_findings(self.source, choice, loader)
            self._told.add(key)
            self.apply_process_settings(hardware, choice.num_workers, choice.threads, split)
            searched = len(choice.trials) >= min(plan.max_segments, 2)
            if searched and (trainer is None or trainer.is_global_zero):
                path = Path(self.cache_dir or cache.default_cache_dir()) / CACHE_FILE
                cache.store_entry(path, key, {"choice": choice.to_dict()})

        return OnlineSearch(
            functools.partial(search_online, hardware, tuning, plan, prior, self.threads_found()),
            plan,
            tuning,
            prior,
            share=share,
            configure=lambda count, threads: self.configure_segment(hardware, count, threads, split),
            copy_steps=copy_steps(trainer, split),
            settled=settled,
        )

    def _decide(
        self, ask: LoaderAsk, key: str, online: tuple[int | None, int | None, str] | None = None
    ) -> dict[str, Any]:
        """Rank zero: the cached choice for `key`, else the plan of a search on the run's own batches
        (`online`: the epoch's or pass's batches, the run's samples, `SegmentPlan.unit`), else a
        measured one; never raises (the others are waiting)."""
        tuning, hardware, trainer = ask.tuning, ask.hardware, ask.trainer
        try:
            checking = debugging_mode(trainer) if trainer is not None else ""
            if checking:  # nothing a check of a few batches could repay
                return WorkerChoice(
                    0, None, f"no workers: `{checking}` runs the fit as a check", source="short run"
                ).to_dict()
            why_not = cannot_measure(ask.dataset)
            if why_not is not None:
                return WorkerChoice(0, None, f"not measured: {why_not}", source="unmeasurable").to_dict()
            path = Path(self.cache_dir or cache.default_cache_dir()) / CACHE_FILE
            if not self.retune:
                cached = self._cached(path, key)
                if cached is not None:
                    return cached.to_dict()
            if online is not None and online[0] is not None:
                epoch_batches, samples, unit = online
                run_batches = None if samples is None else -(-samples // ask.batch_size)
                # the counts a search may try split its segments
                most = workers_allowed(hardware.cpus_per_process, tuning)
                plan = plan_segments(epoch_batches, run_batches, most, unit)
                found = self._found.get(self._sizes[key][0])
                prior = prior_setting(hardware, tuning)
                carried = None if found is None else carried_choice(*found, ask.batch_size, prior, plan)
                if carried is not None:
                    return carried.to_dict()
                if not plan.why_not and search_start(hardware, tuning, plan) is not None:
                    return {"online": dataclasses.asdict(plan)}
                workers, factor, _ = prior
                why = plan.why_not or untimeable_reason(hardware, tuning, plan)
                reason = f"{workers} workers{NOT_SEARCHED}{why}"
                return WorkerChoice(workers, factor, reason, source="short run").to_dict()
            choice = self._measure(ask)
            if choice.source == "measured":  # a short run's shortcut would shortchange a long one
                cache.store_entry(path, key, {"choice": choice.to_dict()})
            return choice.to_dict()
        except Exception as err:  # every rank waits on this one: fall back rather than hang them
            reason = f"tuning failed ({type(err).__name__}: {err})"
            return WorkerChoice(0, None, reason, source="error").to_dict()

    def _remember(self, key: str, choice: WorkerChoice) -> None:
        """Keep `choice` as its dataset's, for a later batch size of it (`carried_choice`)."""
        if choice.source in CARRIED_SOURCES:
            data, size = self._sizes[key]
            self._found[data] = (size, choice)

    def _cached(self, path: Path, key: str) -> WorkerChoice | None:
        entry, problem = cache.load_entry(path, key)
        if problem is not None:
            rank_zero_warn(
                f"Ignoring the worker-tuning cache, measuring again: {problem}.", category=BoostWarning
            )
        try:
            return WorkerChoice.from_dict(entry["choice"]).replace(source="cache") if entry else None
        except (KeyError, TypeError, ValueError) as err:
            message = f"Ignoring a malformed worker-tuning cache entry in {path}: {err!r}."
            rank_zero_warn(message, category=BoostWarning)
            return None

    def _measure(self, ask: LoaderAsk) -> WorkerChoice:
        """The measurements `decide_workers` asks for, built on this run, the model's rates those of
        ``ask.hook``, the step the loader feeds; its choice."""
        tuning, trainer, batch_size = ask.tuning, ask.trainer, ask.batch_size
        # loader trials time samples per second, which the batch size barely changes: a batch tuned
        # to the whole dataset is timed at `MEASURE_BATCH_CAP` samples a batch, not loaded whole
        # by every trial; the model's step is still timed on one batch of the real size
        size = min(batch_size, MEASURE_BATCH_CAP)
        make = measurement_loaders(ask.dataset, size, ask.settings, tuning.timeout_s)
        make_full = measurement_loaders(ask.dataset, batch_size, ask.settings, tuning.timeout_s)
        module = trainer.lightning_module if trainer is not None else None
        window, consume = tuning.window_s, None
        short = ask.workload_samples if tuning.skip_short_runs else None
        if trainer is not None and ask.hardware.accelerator != "cpu":
            consume = device_transfer(trainer)
        times_model = module is not None and consume is None  # a CPU run: the model's step timed too
        rest_s = rest_of_measuring(tuning, times_model)

        def loader(num_workers: int, prefetch_factor: int | None) -> WorkerTrial:
            trial = measure_loader(
                make,
                num_workers,
                prefetch_factor,
                batch_size=size,
                window_s=window,
                consume=consume,
                workload_samples=short if num_workers == 0 else None,
                rest_s=rest_s,
            )  # the memory budget is for batches of the real size
            return dataclasses.replace(trial, batch_bytes=trial.batch_bytes * batch_size // size)

        def step_rate() -> float | None:
            assert trainer is not None and module is not None and consume is not None
            batch = consume(next(iter(make_full(0, None))))
            return consumer_rate(trainer, module, batch, batch_size, ask.hook)

        probes = WorkerProbes(
            loader, consumer_rate=step_rate if module is not None and consume is not None else None
        )
        if times_model:
            assert module is not None
            assert trainer is not None
            move = functools.partial(moved_as_the_loop_moves, trainer)
            probes = cpu_probes(probes, module, make_full, move, batch_size, ask.hook, tuning.budget_s / 2)
        with preserved_rng():  # the measurement loaders draw their seeds from the run's generator
            return decide_workers(probes, ask.hardware, tuning, ask.workload_samples)

    def configure_segment(
        self, hardware: HardwareInfo, num_workers: int, threads: int | None = None, split: str = ""
    ) -> None:
        """Before a search segment at `num_workers`: the open-file limit, and on a CPU run the
        model's threads on the CPUs the workers leave (all it had, with none), or `threads` (never
        more than it had), kept as `split`'s (`enter`)."""
        plan = open_files_plan(hardware, num_workers)
        if plan is not None and self._files_before is None:
            self._files_before = (
                resource.getrlimit(resource.RLIMIT_NOFILE),
                torch.multiprocessing.get_sharing_strategy(),
            )
            apply_open_files_plan(*plan)
        if hardware.accelerator != "cpu":
            return
        if self._threads_before is None:
            self._threads_before = torch.get_num_threads()
        before = self._threads_before
        if threads is None:
            threads = model_threads(hardware.cpus_per_process, num_workers) if num_workers else before
        self._split_threads[split] = min(threads, before)
        self.enter(split)

    def apply_process_settings(
        self, hardware: HardwareInfo, num_workers: int, measured_threads: int | None = None, split: str = ""
    ) -> None:
        """Open-file limit and, on a CPU run, the model's threads beside the workers, or the
        `measured_threads` a search found faster (`WorkerChoice.threads`); those are `split`'s, set
        again whenever it runs (`enter`): all the threads the run had for a split without workers."""
        plan = open_files_plan(hardware, num_workers)
        if plan is not None:
            if self._files_before is None:  # put back at teardown: they are the process's, not the run's
                self._files_before = (
                    resource.getrlimit(resource.RLIMIT_NOFILE),
                    torch.multiprocessing.get_sharing_strategy(),
                )
            self.add_finding(open_files_finding(self.source, apply_open_files_plan(*plan), hardware))
        before = self.threads_found()
        threads = compute_threads(hardware, num_workers, before)
        if measured_threads is not None and hardware.accelerator == "cpu":
            threads = measured_threads if measured_threads < before else None
        if threads is not None:
            self._threads_before = before
            self.add_finding(
                threads_finding(self.source, threads, num_workers, hardware, measured_threads is not None)
            )
        if hardware.accelerator == "cpu":
            self._split_threads[split] = threads or before
            self.enter(split)

    def threads_found(self) -> int:
        """The model's intra-op threads as the run had them before tuning (a search's segments, or
        another split's, may have set them since)."""
        return self._threads_before if self._threads_before is not None else torch.get_num_threads()

    def enter(self, split: str) -> None:
        """A CPU run's model threads beside `split`'s workers, once decided: set as they are
        decided and again as its loop starts (a fit's training loader may have none while its
        validation loader has two: training keeps every CPU, validation leaves the workers theirs)."""
        threads = self._split_threads.get(split)
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def add_finding(self, finding: Finding) -> None:
        """Record `finding` once, however often its cause recurs."""
        self._begin_run()
        if finding not in self.findings:
            self.findings.append(finding)

    def _choice_for(self, key: str, workload_samples: int | None, loader: str) -> WorkerChoice | None:
        """The choice made for `key`, but not a short run's where this run loads more (Lightning's
        `LearningRateFinder` runs 30 or 100 steps of the fit's loop before the fit; a
        `fast_dev_run` may come before the real fit): that run decides again, and the short
        run's finding goes (`loader` names it)."""
        choice = self.choices.get(key)
        if choice is None or key not in self._short_runs:
            return choice
        decided_for = self._short_runs[key]
        if decided_for is None or (workload_samples is not None and workload_samples <= decided_for):
            return choice
        del self.choices[key], self._short_runs[key]
        title = choice_findings(self.source, choice, loader)[0].title
        self.findings = [f for f in self.findings if f.title != title]
        return None

    def _begin_run(self) -> None:
        """After a run's teardown, the next decision starts the next run's findings (those of the
        run that ended stay readable until then)."""
        if self._ended:
            self.findings, self._ended = [], False
            self._told.clear()

    def restore(self) -> None:
        """Put back what tuning changed in the process (call at teardown): torch's intra-op
        thread count, the open-file limit and torch's tensor sharing strategy. The run has ended."""
        self._ended = True
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        self._split_threads.clear()
        if self._files_before is not None:
            limits, strategy = self._files_before
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            torch.multiprocessing.set_sharing_strategy(strategy)
            self._files_before = None

    def state_dict(self) -> dict[str, Any]:
        return {"choices": {key: choice.to_dict() for key, choice in self.choices.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the choices a checkpoint holds; they are reported as restored when first used."""
        for key, data in state.get("choices", {}).items():
            self.choices[key] = WorkerChoice.from_dict(data)
            self.restored.add(key)


def carried_choice(
    measured_at: int, choice: WorkerChoice, batch_size: int, prior: Setting, plan: SegmentPlan
) -> WorkerChoice | None:
    """`choice`, measured or searched for the same dataset at batch `measured_at` in this process,
    kept at `batch_size` where `plan` cannot time its workers (an epoch at a grown batch too short to
    search), rather than the `prior`. A loader's cost per sample does not depend on its batch size;
    on a CPU the prior loads in the main process, and a grown run that found 2 workers faster at 32
    went back to none at 128. ``None`` where the plan times it (searched again) or where the prior
    has as many workers (a GPU's: the CPU budget).

    Example:
        >>> searched = WorkerChoice(2, 2, "fastest on the run's own steps", source="searched")
        >>> short = SegmentPlan(why_not="the first epoch has 64 batches: ...")
        >>> carried_choice(32, searched, 128, Setting(0), short).reason
        '2 workers, as searched at batch 32, not searched: the first epoch has 64 batches: ...'
        >>> carried_choice(32, searched, 64, Setting(0), SegmentPlan(4, 3)).reason.partition(": ")[2]
        'segments of 4 batches cannot time them (4 batches in flight)'
        >>> carried_choice(32, searched, 256, Setting(0), SegmentPlan(16, 3)) is None  # timed: searched
        True
        >>> carried_choice(32, searched, 128, Setting(15, 2), SegmentPlan(4, 3)) is None  # a GPU's prior
        True
    """
    workers, factor = choice.num_workers, choice.prefetch_factor
    if measured_at == batch_size or workers <= prior.num_workers:
        return None
    if not plan.why_not and timeable(workers, factor, plan):
        return None
    why = plan.why_not or (
        f"segments of {plan.segment_batches} batches cannot time them ({queue_depth(workers, factor)}"
        " batches in flight)"
    )
    how = "searched" if choice.source == "searched" else "measured"
    reason = f"{workers} workers, as {how} at batch {measured_at}{NOT_SEARCHED}{why}"
    return choice.replace(reason=reason, trials=(), skipped=(), seconds=0.0, source="carried")


def pending_choice(search: OnlineSearch) -> WorkerChoice:
    """What a loader starts with while `search` runs: its prior setting."""
    workers, factor, _ = search.prior
    reason = f"searching on the {search.plan.unit}'s own batches"
    return WorkerChoice(workers, factor, reason, source="online")


def device_transfer(trainer: L.Trainer) -> Callable[[Any], Any]:
    """What the run does with a batch before its step: Lightning's transfer to the device (with the
    datamodule's transfer hooks), waited for, so its CPU share counts against the workers."""
    device = trainer.strategy.root_device

    def transfer(batch: Any) -> Any:
        moved = moved_as_the_loop_moves(trainer, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return moved

    return transfer


def consumer_rate(
    trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_size: int, hook: str = "training_step"
) -> float | None:
    """Samples/s of the run's training step alone (forward, backward, optimizer step, in the
    run's precision) on a copy of the model at `batch`, already on the device; with an evaluation
    `hook`, that step without gradients in its precision context. ``None`` when the step cannot
    run outside the fit (manual optimization, a step that needs the live fit, one the module does
    not implement), runs out of memory, or would call collectives on this rank alone
    (``SyncBatchNorm``)."""
    if any(isinstance(layer, torch.nn.SyncBatchNorm) for layer in module.modules()):
        return None
    plugin = trainer.precision_plugin
    if hook != "training_step":
        contexts = {
            "validation_step": plugin.val_step_context,
            "test_step": plugin.test_step_context,
            "predict_step": plugin.predict_step_context,
        }
        rates = model_step_rates(
            module, batch, [torch.get_num_threads()], 3, 1, hook=hook, context=contexts[hook]
        )
        return next(iter(rates.values()), None)
    if not module.automatic_optimization:
        return None
    probe = StepProbe(module, trainer.optimizers, 3, plugin.train_step_context, plugin.val_step_context)
    try:
        trial = probe.train(batch, batch_size)
    except Exception:  # the step needs the live fit: decide without the consumer's rate
        return None
    return trial.samples_per_s if not trial.oom and trial.samples_per_s > 0 else None


def copy_steps(
    trainer: L.Trainer | None, split: str
) -> Callable[[], Callable[[Any, int | None], float]] | None:
    """A fit's training loader: what makes a stepper of a fresh copy of the model, in the run's
    precision (`StepProbe.stepper`), for the worker search's probe of the model's threads; ``None``
    where nothing trains (an evaluation pass) or the step cannot run on a copy (manual
    optimization; ``SyncBatchNorm``, whose collectives would run on one rank), where the probe
    alternates the threads of the run's own steps instead."""
    module = trainer.lightning_module if trainer is not None and split == "train" else None
    if trainer is None or module is None or not module.automatic_optimization:
        return None
    if any(isinstance(layer, torch.nn.SyncBatchNorm) for layer in module.modules()):
        return None

    def make() -> Callable[[Any, int | None], float]:
        plugin = trainer.precision_plugin
        move = functools.partial(moved_as_the_loop_moves, trainer)
        contexts = (plugin.train_step_context, plugin.val_step_context)
        return StepProbe(module, trainer.optimizers, 1, *contexts, move=move).stepper()

    return make


def apply_open_files_plan(action: str, minimum: int) -> str:
    """Carry out `open_files_plan`'s decision; return what was done."""
    if action == "raise_limit":
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (minimum, hard))
        return f"raised the open-file limit (ulimit -n) to {minimum}"
    torch.multiprocessing.set_sharing_strategy("file_system")
    return "switched torch's tensor sharing strategy to 'file_system'"


#: The step each split's loader feeds: a measurement before the loop weighs that one (a fit's
#: validation loader over a set of its own; test and predict with ``WorkerTuning(online=False)``).
CONSUMING_STEPS = {"val": "validation_step", "test": "test_step", "predict": "predict_step"}
#: What an evaluation stage run alone loads from its split's loader: one pass.
PASS_NAMES = {"val": "validation pass", "test": "test pass", "predict": "predict pass"}
_STAGES = {"val": "validate", "test": "test", "predict": "predict"}


def cpu_probes(
    probes: WorkerProbes,
    module: L.LightningModule,
    make_full: Callable[[int, int | None], Iterable[Any]],
    move: Callable[[Any], Any],
    batch_size: int,
    hook: str,
    budget_s: float,
) -> WorkerProbes:
    """`probes` with a CPU run's model probes on one batch of the real size, fetched once in the
    main process (its samples/s: a first, pessimistic loading rate), then handed to `move` (as the
    run's loop moves it): the model's `hook` step rates per thread count, and one step's seconds to
    price them first."""
    fetched: list[tuple[Any, float]] = []

    def batch() -> tuple[Any, float]:
        if not fetched:
            start = time.perf_counter()
            first = next(iter(make_full(0, None)))
            rate = batch_size / max(time.perf_counter() - start, 1e-9)
            fetched.append((move(first), rate))
        return fetched[0]

    def cpu_step(threads: Sequence[int]) -> tuple[float, Mapping[int, float]]:
        data, loading = batch()
        return loading, model_step_rates(module, data, threads, budget_s=budget_s, hook=hook)

    def step_s(threads: int) -> float | None:
        rates = model_step_rates(module, batch()[0], [threads], repeats=1, rounds=1, hook=hook)
        return batch_size / rates[threads] if rates else None

    return dataclasses.replace(probes, cpu_step=cpu_step, step_s=step_s, batch_size=batch_size)


def own_pass(trainer: L.Trainer | None, split: str) -> bool:
    """Whether `split`'s loader feeds an evaluation stage run alone (``trainer.validate()``,
    ``test()``, ``predict()``): one pass, whose own batches and step decide its workers. A
    fit's validation loader does not: `BoostedDataModule`'s follows the training loader's
    decision, `AutoNumWorkers`' is measured before the fit against its step (`CONSUMING_STEPS`)."""
    return trainer is not None and split in _STAGES and trainer.state.fn == _STAGES[split]


def epoch_length(dataset: Dataset[Any], sampler: Iterable[Any] | None = None) -> int | None:
    """Samples a pass over `dataset` draws, over every rank: the `sampler`'s draws where there is
    one (a ``WeightedRandomSampler(weights, num_samples)`` draws `num_samples`; a
    ``DistributedSampler`` its rank's share on each rank); ``None`` without a length.

    Example:
        >>> from torch.utils.data import TensorDataset, WeightedRandomSampler
        >>> data = TensorDataset(torch.zeros(64, 2))
        >>> epoch_length(data), epoch_length(data, WeightedRandomSampler(torch.ones(64), 96))
        (64, 96)
        >>> epoch_length(data, DistributedSampler(data, num_replicas=2, rank=0))
        64
        >>> epoch_length(iter([1, 2])) is None
        True
    """
    if isinstance(sampler, DistributedSampler):
        return len(sampler) * sampler.num_replicas
    for sized in (sampler, dataset):  # a stream's loader has a sampler of no length
        try:
            return len(sized)  # type: ignore[arg-type]
        except TypeError:
            continue
    return None


def workload(
    trainer: L.Trainer | None,
    split: str,
    dataset: Dataset[Any],
    batch_size: int,
    sampler: Iterable[Any] | None = None,
) -> int | None:
    """Samples the run will load from its `split` loader over `dataset` (`run_samples`), an epoch
    being the `sampler`'s draws where there is one (`epoch_length`); ``None`` when unknown (no
    trainer, no length, validation by steps). ``trainer.validate()``, ``test()`` and
    ``predict()`` load one pass (``limit_<split>_batches`` of it), whatever the fit's epochs."""
    length = epoch_length(dataset, sampler)
    if length is None:
        return None
    if own_pass(trainer, split):
        limit = getattr(trainer, f"limit_{split}_batches")
        return run_samples("val", length, batch_size, limit, max_epochs=1)
    if trainer is None or split not in ("train", "val"):
        return None
    return run_samples(
        split,
        length,
        batch_size,
        trainer.limit_train_batches if split == "train" else trainer.limit_val_batches,
        trainer.max_epochs,
        trainer.max_steps,
        trainer.accumulate_grad_batches,
        trainer.check_val_every_n_epoch,
        val_checks_per_epoch(trainer.val_check_interval),
    )


def val_checks_per_epoch(interval: object) -> int:
    """Validations an epoch for Lightning's ``val_check_interval``: a fraction of an epoch
    gives ``int(1 / interval)`` of them (about what Lightning runs); a count of batches or a
    time interval is taken as one (the least it can be, without the training set's length).

    Example:
        >>> val_checks_per_epoch(0.25), val_checks_per_epoch(1.0), val_checks_per_epoch(100)
        (4, 1, 1)
    """
    if isinstance(interval, float) and 0 < interval < 1:
        return int(1 / interval)
    return 1


def epoch_batches(
    trainer: L.Trainer | None,
    dataset: Dataset[Any],
    batch_size: int,
    drop_last: bool,
    split: str = "train",
    sampler: Iterable[Any] | None = None,
) -> int | None:
    """Batches per pass of `split` on each rank (the distributed sampler's share of the `sampler`'s
    draws or the dataset, `epoch_length`; Lightning's ``limit_<split>_batches``); ``None`` without
    a trainer or a length."""
    length = epoch_length(dataset, sampler)
    if length is None or trainer is None:
        return None
    per_rank = -(-length // max(trainer.world_size, 1))
    batches = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
    limit = getattr(trainer, f"limit_{split}_batches")
    if limit is None:
        return batches
    return int(batches * limit) if isinstance(limit, float) else min(batches, int(limit))
