"""`SyncGuard`: every host-device sync in the step, at the user's line, at an overhead users leave on."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Annotated, Any, ClassVar, Literal, get_args

import lightning as L
import torch
from typing_extensions import override

from lightning_boost import instrumented
from lightning_boost._lightning import has_callback
from lightning_boost._validation import Matches, validated
from lightning_boost.guards.base import EveryNSteps, Guard, GuardMode, Overhead
from lightning_boost.guards.sampling import Sampler
from lightning_boost.guards.sync_watch import SyncWatch, host_side
from lightning_boost.guards.syncs import (
    PATTERNS,
    Attribution,
    Packages,
    SyncGroup,
    attribute,
    code_at,
    frames_from,
)
from lightning_boost.report import Finding, Severity

MODES = get_args(GuardMode)
Scope = Literal["steps", "fit"]
SCOPES = get_args(Scope)
#: A line of the user's code, as the end of its location.
Location = Annotated[str, Matches(r".+:[0-9]+", "model.py:57")]


class SyncError(RuntimeError):
    """Raised by ``SyncGuard(mode="error")`` at the first host-device sync in the user's step code."""


@dataclass
class _Phase:
    """Training or validation: which of its steps are checked, and what a plain step costs."""

    sampler: Sampler
    steps: int = 0
    checked: int = 0
    last_begin: float | None = None
    last_checked: bool = False
    plain_s: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    batches: set[int] = field(default_factory=set)  # the batch indices (in their epoch) checked

    def begin(self, now: float) -> bool:
        """Count a step starting at `now`; return whether to check it."""
        if self.last_begin is not None and not self.last_checked:
            self.plain_s.append(now - self.last_begin)
        self.steps += 1
        self.last_begin = now
        self.last_checked = self.sampler.due(self.steps)
        return self.last_checked

    def end_check(self, seconds: float) -> None:
        """A checked step took `seconds`; what it took beyond a plain step is the check's cost.
        Where that reads nothing (no plain step timed yet, or plain steps that took longer: one
        whose loader ran a tuner's trial, say), the next step is left unchecked to time a plain
        one: read as free, checks would come every step and no plain step would ever correct it
        (the demo's ResNet-18 checked 127 steps of 128, its loading 4.7x slower under the mode, timed
        by hand)."""
        self.checked += 1
        cost = max(seconds - statistics.median(self.plain_s), 0.0) if self.plain_s else 0.0
        self.sampler.record(self.steps, cost)
        if not cost and self.sampler.every_n_steps is None and self.steps >= self.sampler.first:
            self.sampler.next_step = max(self.sampler.next_step, self.steps + 2)


class SyncGuard(Guard):
    """Finds every host-device sync in the training and validation steps and names the line.

    ``.item()``, ``float(loss)``, ``print(loss)``, ``if loss > x:``, ``.cpu()``/``.tolist()``,
    ``x[mask]``, ``x[t:t + n]`` with tensor bounds, ``nonzero``, ``unique``, ``one_hot`` without
    ``num_classes``, ``ctc_loss`` with lengths on the device, ``torch.equal``,
    ``torch.cuda.synchronize()`` and ``empty_cache()`` make the CPU wait for the GPU, which then
    starves. During checked steps (from ``on_train_batch_start`` to the next one, so the step,
    its backward, optimizer step and Lightning's work around them; the same for validation
    batches) a ``TorchFunctionMode`` sees each such call, and wrappers see the CUDA and
    ``torch.distributed`` calls that sync. On CUDA, ``torch.cuda.set_sync_debug_mode`` adds the
    syncs inside kernels, and the allocator's retry counters the ones from memory pressure.

    It works on CPU too: the same calls are reported as "would sync on a GPU", so CPU-only CI
    catches them; checks only the CPU kernels make (``one_hot(x, num_classes)`` validates its
    range on the CPU, not on CUDA) are not reported, since the guard sees calls, not kernels.

    Each sync is attributed to the user's line (``file:line``, the code, the hook it ran in) and
    counted per checked step. A sync inside a library called from the step is reported at the
    user's calling line with the library's setting that removes it (torchmetrics aggregators'
    NaN check: ``nan_strategy="disable"``; input checks: ``validate_args=False``). Lightning's
    own syncs (progress-bar values read with ``.item()``, the DDP SIGTERM broadcast before every
    batch, ``sync_dist=True``, ``ModelCheckpoint(train_time_interval=...)``, logging every
    ``log_every_n_steps``, the fp16 GradScaler) are reported apart, each with its setting.

    Checking is sampled: the first 3 steps of each phase, then as often as `max_overhead`
    allows (a checked step's time beyond a plain one sets the gap to the next). The guard only
    watches: results are the same with or without it.

    Args:
        mode: ``"warn"`` (a `BoostWarning` on rank zero, once per line, at that line, once the
            line has synced at two batch indices of its epoch or at the end of the fit; a line
            that syncs at one batch index alone, such as ``if batch_idx == 0:``, is a note),
            ``"error"`` (raise `SyncError` at the first sync in the user's code; for CI; under
            DDP every rank raises at the end of that step) or ``"report"`` (findings only).
            Framework syncs are only reported.
        allow: the user's lines whose syncs are deliberate, as the end of their location
            (``["model.py:57"]``).
        every_n_steps: check every n-th step after the first 3 instead of following the budget.
        max_overhead: the share of step time checks may take (0 to 1). A checked step's time
            beyond a plain step's is its cost (the step after it, a little slower too, is not
            counted).
        scope: ``"steps"`` (training and validation steps with their backward and optimizer
            step) or ``"fit"`` (everything from the start to the end of training, every step
            checked; an audit, not for long runs).

    Raises:
        ValueError: for an unknown `mode` or `scope`, a bad `every_n_steps` or `max_overhead`, or
            an `allow` entry that is not a location.
        TypeError: for an argument of the wrong type (`allow` given as one string, ...).

    Example::

        trainer = L.Trainer(callbacks=[SyncGuard(mode="error")])  # in CI
    """

    _transient: ClassVar[dict[str, Any]] = {"_watch": None, "_packages": None}  # rebuilt at the next fit

    @validated
    def __init__(
        self,
        mode: GuardMode = "warn",
        allow: Sequence[Location] = (),
        every_n_steps: EveryNSteps = None,
        max_overhead: Overhead = 0.005,
        scope: Scope = "steps",
    ) -> None:
        super().__init__(mode, tuple(allow), every_n_steps, max_overhead)
        self.scope = scope
        self._set_state_key(mode=mode, scope=scope)
        self._reset(cuda=False, world_size=1)

    def _reset(self, cuda: bool, world_size: int) -> None:
        every = 1 if self.scope == "fit" else self.every_n_steps
        self._phases = {
            name: _Phase(Sampler(first=3, every_n_steps=every, budget=self.max_overhead))
            for name in ("training", "validation")
        }
        self._groups: dict[tuple[str, ...], SyncGroup] = {}
        self._unwarned: list[SyncGroup] = []  # user lines found, warned of once seen at two batches
        self._batch = 0  # the current step's batch index in its epoch
        self._allocator: dict[str, int] = {}
        self._window: tuple[str, float, bool] | None = None  # phase, start, a new input shape
        self._shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._phase = "training"
        self._error: str | None = None
        self._cuda = cuda
        self._world_size = world_size
        self._packages: Packages | None = None
        self._watch: SyncWatch | None = None
        self._compiled = False
        self._averaging = False  # a StochasticWeightAveraging callback: its own BatchNorm epoch

    @property
    def checked_steps(self) -> dict[str, int]:
        """How many training and validation steps were checked in the last fit."""
        return {name: phase.checked for name, phase in self._phases.items()}

    # -- hooks ---------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset(cuda=pl_module.device.type == "cuda", world_size=trainer.world_size)
        self.findings = []
        self._packages = Packages()
        self._watch = SyncWatch(self._on_sync, cuda=self._cuda)
        self._compiled = _compiled(pl_module)
        self._averaging = has_callback(trainer, "StochasticWeightAveraging")
        self._mark_host_side(trainer, pl_module)
        if self.scope == "fit":
            self._watch.start()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._close(trainer)
        self._begin("training", trainer, batch, batch_idx)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(trainer, interrupted=True)

    @override
    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking:
            return
        self._close(trainer)
        self._begin("validation", trainer, batch, batch_idx)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning computed the epoch's logged values in the last step's window (`epoch_values`)
        self._close(trainer, interrupted=True)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(trainer, interrupted=True)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(trainer, interrupted=True)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(trainer, interrupted=True)
        self._warn_unwarned(trainer, final=True)
        self._finish(pl_module)

    # -- windows -------------------------------------------------------------------------------

    def _mark_host_side(self, trainer: L.Trainer, module: torch.nn.Module | None = None) -> None:
        """Model a GPU run on the CPU: what would stay on the host (optimizers make their step
        counters at their first step, so they are looked for before each checked training step)."""
        if self._watch is None or self._cuda:
            return
        for tensor in host_side(module or torch.nn.Module(), trainer.optimizers):
            self._watch.mark_host(tensor)

    def _begin(self, phase: str, trainer: L.Trainer, batch: Any, batch_idx: int) -> None:
        self._phase, self._batch = phase, batch_idx
        now = time.perf_counter()
        checked = self._phases[phase].begin(now) and self._watch is not None
        if checked:
            self._phases[phase].batches.add(batch_idx)
        if phase == "training" and (checked or self.scope == "fit"):  # unchecked steps: no work
            self._mark_host_side(trainer)
        if checked and self._watch is not None:
            if phase == "training":
                instrumented.mark()  # tuners timing the run's steps leave this one out
            shapes = batch_shapes(batch)
            self._window = (phase, now, shapes not in self._shapes)
            self._shapes.add(shapes)
            self._watch.start()

    def _close(self, trainer: L.Trainer, interrupted: bool = False) -> None:
        """End the open check (its step and the work after it), then warn or raise for it."""
        if interrupted:  # the next step's time would include validation or the epoch's end
            for each in self._phases.values():
                each.last_begin = None
        if self._window is None:
            return
        phase, start, new_shape = self._window
        self._window = None
        if self.scope == "steps":
            self._stop_watch(new_shape)
        self._phases[phase].end_check(time.perf_counter() - start)
        if self.mode == "error":
            self._raise_if_found(trainer, self._phases[phase])
        elif self.mode == "warn":
            self._warn_unwarned(trainer)

    def _warn_unwarned(self, trainer: L.Trainer, final: bool = False) -> None:
        """Warn of each user line once it synced at a second batch index of its epoch (a line seen
        at one index alone may run once a pass, `SyncGroup.only_at`); at the `final` end of the fit,
        of the rest that are not that."""
        if self.mode != "warn":
            return
        for group in list(self._unwarned):
            phase = self._phases[group.phase]
            if len(group.batches) < 2 and not (final and group.only_at(phase.batches) is None):
                continue
            self._unwarned.remove(group)
            site = group.attribution.site
            where = dataclasses.replace(site, code=group.code) if site else None
            title = group.title(phase.checked - group.first_checked, so_far=True)
            self._warn(trainer, f"SyncGuard: {title}. {group.fix()}", where)
        if final:
            self._unwarned = []

    def _on_sync(self, pattern: str, frame: FrameType | None) -> None:
        assert self._packages is not None  # set with the watch that calls this, at train start
        attribution = attribute(frames_from(frame), self._packages)
        if attribution is not None and self._averaging and _cause(attribution) == "batchnorm_cumulative":
            attribution = dataclasses.replace(attribution, framework=True)  # SWA's, not the user's
        if attribution is None or (not attribution.framework and self._allowed(attribution)):
            return
        key = SyncGroup.key(self._phase, attribution)
        group = self._groups.get(key)
        if group is None:
            code = code_at(attribution.site) if attribution.site else ""
            checked = self._phases[self._phase].checked  # before this step's: it counts from here
            group = self._groups[key] = SyncGroup(self._phase, attribution, code, first_checked=checked)
            if not attribution.framework:
                self._unwarned.append(group)
        group.add(pattern, attribution=attribution)
        group.batches.add(self._batch)
        if self.mode == "error" and not group.framework and self._error is None:
            self._error = _error_message(group, pattern)
            if self._world_size == 1:  # alone: stop right at the user's line
                raise SyncError(self._error)

    def _allowed(self, attribution: Attribution) -> bool:
        site = attribution.site
        return bool(self.allow) and site is not None and site.location.endswith(self.allow)

    def _raise_if_found(self, trainer: L.Trainer, phase: _Phase) -> None:
        if self._agree(trainer, self._error is not None, phase.sampler):
            self._finish(trainer.lightning_module)
            raise SyncError(self._error or "SyncGuard: another rank found a host-device sync in its step.")

    def _stop_watch(self, new_shape: bool = True) -> None:
        """Add the allocator's syncs (CUDA) since the watch started. Under ``cudnn.benchmark``,
        cuDNN empties the cache to try its algorithms on each input shape it has not seen: a
        stream sync in a step with a new shape is that (a whole fit's watch: assumed so)."""
        if self._watch is None:
            return
        counts = self._watch.stop()
        if new_shape and torch.backends.cudnn.benchmark and "sync_all_streams" in counts:
            counts["cudnn_autotune"] = counts.pop("sync_all_streams")
        for pattern, count in counts.items():
            self._allocator[pattern] = self._allocator.get(pattern, 0) + count

    @override
    def _finish(self, pl_module: L.LightningModule | None) -> None:
        self._stop_watch()
        self._watch = None  # a later `trainer.validate` is not checked: the guard watches fits
        self._window = None
        self.findings = self._make_findings()

    # -- findings ------------------------------------------------------------------------------

    def _make_findings(self) -> list[Finding]:
        source = type(self).__name__
        findings = []
        for group in sorted(self._groups.values(), key=lambda g: (g.framework, g.phase, g.location or "")):
            phase = self._phases[group.phase]
            steps, once = phase.checked, None if group.framework else group.only_at(phase.batches)
            findings.append(
                Finding(
                    source,
                    "syncs",
                    Severity.INFO if group.framework or once is not None else Severity.WARN,
                    group.title(steps) if once is None else group.once_title(steps, once),
                    group.detail(steps, cpu_run=not self._cuda, batch=once, checked_batches=phase.batches),
                    group.fix(steps) if once is None else "",
                    group.location,
                    data=group.to_data(steps),
                )
            )
        steps = self._phases["training"].checked
        for pattern, count in self._allocator.items():
            findings.append(
                Finding(
                    source,
                    "syncs",
                    Severity.INFO if pattern == "cudnn_autotune" else Severity.WARN,
                    f"{PATTERNS[pattern].what} ({count / max(steps, 1):.3g}x per checked step)",
                    f"{count} time(s) over {steps} checked training step(s), by the CUDA allocator's"
                    " counters.",
                    PATTERNS[pattern].fix,
                    data={"pattern": pattern, "count": count, "checked_steps": steps},
                )
            )
        if self._compiled:
            findings.append(
                Finding(
                    source,
                    "syncs",
                    Severity.INFO,
                    "Compiled code (torch.compile) was checked where it runs eagerly",
                    "A sync in a compiled step breaks the graph and runs eagerly, where the guard sees it"
                    " (`.item()`, `print(tensor)`, `if tensor:`). Inside a compiled graph it is not seen:"
                    " there syncs are ops such as `nonzero` or a boolean mask, or `.item()` captured with"
                    " `capture_scalar_outputs`.",
                    "To list every graph break, run once with `TORCH_LOGS=graph_breaks`.",
                )
            )
        return findings


def _cause(attribution: Attribution) -> str | None:
    return attribution.cause.key if attribution.cause is not None else None


def _compiled(module: torch.nn.Module) -> bool:
    """Whether `module` or a submodule runs through ``torch.compile`` (Lightning's unwrapped
    ``fit(torch.compile(model))``, a compiled submodule, or ``Module.compile()``)."""
    return any(
        getattr(m, "_compiler_ctx", None)
        or type(m).__name__ == "OptimizedModule"
        or getattr(m, "_compiled_call_impl", None)
        for m in module.modules()
    )


def _error_message(group: SyncGroup, pattern: str) -> str:
    site = group.attribution.site
    where = f" at {site.location} in {group.attribution.hook}: `{group.code}`" if site else ""
    return f"SyncGuard: {PATTERNS[pattern].what}{where}. {group.fix()}"


def batch_shapes(batch: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of the tensors in `batch` (nested in tuples, lists and dicts), in order.

    Example:
        >>> batch_shapes({"x": torch.zeros(4, 3), "y": [torch.zeros(4), "label"]})
        ((4, 3), (4,))
    """
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape),)
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, dict):
        return tuple(shape for item in items for shape in batch_shapes(item))
    return ()
