"""`AutoMicroBatch`: a step that runs out of memory is run again as micro-batches, not lost."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_boost._lightning import (
    backward_piece,
    finish_backward,
    is_lightning,
    zeroes_gradients_this_step,
)
from lightning_boost._validation import PositiveInt, validated
from lightning_boost.callbacks.base import BoostCallback
from lightning_boost.micro_batch.rounds import (
    NoSampleFits,
    Rounds,
    Shrink,
    alone,
    growing_retries,
    run_rounds,
)
from lightning_boost.micro_batch.split import (
    Logged,
    batch_length,
    combine_logged,
    combine_outputs,
    slice_batch,
)
from lightning_boost.report import Finding, Severity
from lightning_boost.step_probe import is_oom

#: The loop stage -> the module's step method it runs.
STEPS = {
    "train": "training_step",
    "validate": "validation_step",
    "test": "test_step",
    "predict": "predict_step",
}
_STAGES_OF = {
    "fit": ("train", "validate"),
    "validate": ("validate",),
    "test": ("test",),
    "predict": ("predict",),
}
_NAMES = {"train": "Training", "validate": "Validation", "test": "Test", "predict": "Prediction"}
_SUPPORTED = ("SingleDeviceStrategy", "DDPStrategy")  # autograd's own backward, one model copy per process
_UNSUPPORTED = ("DeepSpeedStrategy",)  # a DDPStrategy whose engine runs the backward
_MISSING = object()
_PEAK = "allocated_bytes.all.peak"


class AutoMicroBatch(BoostCallback):
    """Runs a step that ran out of memory again as micro-batches, with the batch and its result kept.

    When a training step raises an out-of-memory error (``torch.OutOfMemoryError``, or a CUDA,
    cuDNN or cuBLAS allocation failure), the same batch runs again as micro-batches of half the
    size, with the gradients accumulated over them: the optimizer step, the effective batch, the
    learning rate, the gradient (up to float summation order) and the logged values are the
    batch's. No sample is skipped or seen twice. Later steps keep the smaller micro-batch (halved
    again if needed); validation, test and predict steps are retried the same way. Gradient
    clipping, AMP's grad scaler and ``accumulate_grad_batches`` keep working, with any DataLoader.

    Under DDP every rank learns of an out-of-memory error on any rank in the same step (one small
    all-reduce per step, over gloo, with no device sync) and all switch together, so no rank hangs
    or runs ahead. Once a step is split, every micro-batch runs its backward within the step, where
    the ranks agree, and DDP's gradient all-reduce runs on a backward of zeros. Until then, an
    out-of-memory error inside DDP's own backward of a whole batch cannot be retried: the other
    ranks are already in its gradient all-reduce (the error says so), unless `retry_ddp_backward`.

    What changes when a step is split, and is reported: batch-norm layers normalize each
    micro-batch with its own statistics; the losses are combined as a mean over samples
    (``loss_reduction``); a step that fails in its backward runs its forward again. Manual
    optimization is not retried (the pack cannot split your optimizer calls): it gets a finding.

    On CUDA, allocator retries (``num_alloc_retries``: the caching allocator freeing its cache to
    satisfy a request) that grow check after check are a finding with the steps and bytes; with
    ``shrink_on_pressure`` the micro-batch is halved then, before anything fails.

    ====================================== ==============================================
    logged key (at each halving)           meaning
    ====================================== ==============================================
    ``boost/micro_batch_size/<stage>``     the micro-batch size the stage runs at now
    ====================================== ==============================================

    Args:
        evaluation: retry validation, test and predict steps too.
        loss_reduction: how a step's loss depends on its batch: ``"mean"`` over samples (each
            micro-batch's loss weighs its share of samples) or ``"sum"`` (added as they are).
        pressure_every_n_steps: read the CUDA allocator's retries every this many steps.
        shrink_on_pressure: halve the micro-batch when the retries keep growing.
        retry_ddp_backward: under DDP, run every training step's backward within the step, where
            the ranks agree, so that an out-of-memory error in any backward is retried (by default
            only steps already split, and forwards, are): DDP's gradient all-reduce then runs after
            the backward instead of overlapping it.

    Example::

        trainer = L.Trainer(callbacks=[AutoMicroBatch()])  # also in boost_callbacks()
    """

    @validated
    def __init__(
        self,
        *,
        evaluation: bool = True,
        loss_reduction: Literal["mean", "sum"] = "mean",
        pressure_every_n_steps: PositiveInt = 25,
        shrink_on_pressure: bool = False,
        retry_ddp_backward: bool = False,
    ) -> None:
        self.evaluation = evaluation
        self.loss_reduction = loss_reduction
        self.pressure_every_n_steps = pressure_every_n_steps
        self.shrink_on_pressure = shrink_on_pressure
        self.retry_ddp_backward = retry_ddp_backward
        self.sizes: dict[str, int | None] = dict.fromkeys(STEPS)
        self.events: list[dict[str, Any]] = []
        self.findings: list[Finding] = []
        self._notes: dict[str, Finding] = {}
        self._pressure: list[tuple[int, int]] = []
        self._set_state_key()
        self._reset()

    def _reset(self) -> None:
        self._trainer: L.Trainer | None = None
        self._group: Any = None
        self._params: list[torch.nn.Parameter] = []  # all of them: which train is read each step
        self._current: _Step | None = None
        self._on_cuda = False
        self._wrapped: list[tuple[object, str, object]] = []
        self._signatures: dict[str, inspect.Signature] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_trainer", "_group", "_params", "_current", "_on_cuda", "_wrapped", "_signatures"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._trainer = trainer
        strategy = trainer.strategy
        if is_lightning(strategy, *_UNSUPPORTED) or not is_lightning(strategy, *_SUPPORTED):
            self._note("strategy", _unsupported(type(strategy).__name__))
            return
        stages = [s for s in _STAGES_OF.get(stage, ()) if self.evaluation or s == "train"]
        if "train" in stages and not pl_module.automatic_optimization:
            self._note("manual", _manual_optimization())
            stages.remove("train")
        if trainer.world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        for name in stages:
            self._wrap(strategy, STEPS[name], functools.partial(self._step, name))
        if "train" in stages:
            self._wrap(strategy, "backward", self._backward)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._params = list(pl_module.parameters())  # once: it walks every submodule
        self._on_cuda = pl_module.device.type == "cuda"  # read once: the step's end is a hot path

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        current, self._current = self._current, None
        if not (self._wrapped and self._on_cuda):  # the allocator's retries exist on CUDA only
            return
        step = trainer.global_step
        checked = self._pressure[-1][0] if self._pressure else None  # one check per optimizer step
        if step % self.pressure_every_n_steps == 0 and step != checked:
            self._check_pressure(trainer, pl_module.device, step, current)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for owner, name, previous in reversed(self._wrapped):
            _restore(owner, name, previous)
        group = self._group
        self._reset()
        self._group = group

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"sizes": dict(self.sizes), "events": list(self.events)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sizes.update(state_dict.get("sizes", {}))
        self.events = list(state_dict.get("events", []))
        self._refresh_findings()

    # -- the step, as micro-batches when it does not fit -------------------------------------------

    def _wrap(self, owner: object, name: str, runner: Callable[..., Any]) -> None:
        previous = vars(owner).get(name, _MISSING)
        setattr(owner, name, functools.partial(runner, getattr(owner, name)))
        self._wrapped.append((owner, name, previous))

    def _step(self, stage: str, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The strategy's step: the module's step method is replaced for this one call by the runner,
        so the pieces run inside whatever the strategy wraps the step in (DDP's forward, autocast)."""
        assert self._trainer is not None
        module = self._trainer.lightning_module
        name = STEPS[stage]
        previous = vars(module).get(name, _MISSING)
        step = getattr(module, name)

        def runner(*args: Any, **kwargs: Any) -> Any:
            return self._run(stage, step, *args, **kwargs)

        # the step's own signature: Lightning's `log` inspects the running step's on every call
        runner.__signature__ = self._signatures.get(name) or self._signatures.setdefault(  # type: ignore[attr-defined]
            name, inspect.signature(step)
        )
        module.__dict__[name] = runner
        try:
            return original(*args, **kwargs)
        finally:
            _restore(module, name, previous)

    def _run(self, stage: str, step: Callable[..., Any], batch: Any, *rest: Any, **kwargs: Any) -> Any:
        length = batch_length(batch)
        if length is None:  # nothing to split: an out-of-memory error says why it is not retried
            try:
                return step(batch, *rest, **kwargs)
            except BaseException as error:
                if is_oom(error):
                    _add_note(error, _unsplittable(batch))
                raise
        assert self._trainer is not None
        size = min(self.sizes[stage] or length, length)
        pieces = _Pieces(self._trainer, stage, step, batch, rest, kwargs, length, self.loss_reduction)
        if stage == "train":  # each step's: a backbone may unfreeze during the fit
            pieces.params = _trainable(self._params)
        # under DDP every backward of a split step runs within it, where the ranks agree on
        # out-of-memory errors; DDP's own backward (its gradient all-reduce) then has nothing to fail
        pieces.local_final = self._agreeing
        pieces.always_local = self._agreeing and self.retry_ddp_backward and stage == "train"
        rounds = run_rounds(length, size, pieces.attempt, self._agree)
        self._record(stage, rounds, "forward" if stage == "train" else "step")
        result = pieces.result()
        if stage == "train":
            self._current = _Step(pieces, rounds.size, pieces.stash())
        return result

    def _backward(self, original: Callable[..., Any], closure_loss: Tensor, *args: Any, **kwargs: Any) -> Any:
        """Lightning's backward; on out-of-memory in a single process, the step's last piece runs
        again as smaller micro-batches, each with its own forward and backward."""
        current = self._current
        if current is None or not current.pieces.final:
            return original(closure_loss, *args, **kwargs)
        if current.stashed is not None:  # the earlier pieces' gradients, kept from Lightning's zero_grad
            for p, grad in zip(current.pieces.params, current.stashed, strict=True):
                p.grad = grad
            current.stashed = None
        if self._agreeing:  # DDP's own backward: the other ranks are in its all-reduce, no retry
            return self._ddp_backward(original, closure_loss, *args, **kwargs)
        marks = _grad_marks(current.pieces.params)
        try:
            return original(closure_loss, *args, **kwargs)
        except BaseException as error:
            if not is_oom(error):
                raise
        # outside the `except`: the error's traceback (and the graph it holds) is gone
        _release(closure_loss)
        assert self._trainer is not None
        touched = _changed(current.pieces.params, marks)
        start, stop = current.pieces.final
        if stop - start == 1:
            raise NoSampleFits([current.size], here=True)
        retry = _Pieces.for_backward(current.pieces, start, stop, touched)
        after = max(1, (stop - start) // 2)
        with self._trainer.strategy.precision_plugin.train_step_context():
            rounds = run_rounds(stop - start, after, retry.attempt)
        rounds.shrinks.insert(0, Shrink(current.size, after, start, stop))
        self._record("train", rounds, "backward")
        return finish_backward(self._trainer, closure_loss)

    @staticmethod
    def _ddp_backward(original: Callable[..., Any], closure_loss: Tensor, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(closure_loss, *args, **kwargs)
        except BaseException as error:
            if is_oom(error):
                _add_note(error, _DDP_BACKWARD)
            raise

    @property
    def _agreeing(self) -> bool:
        return self._trainer is not None and self._trainer.world_size > 1

    def _agree(self, failed: bool, done: bool, stuck: bool) -> tuple[bool, bool, bool]:
        """Every rank's round, reduced (any failed, all done, any stuck): one all-reduce of three
        ints on the CPU, so the device is not waited for."""
        if not self._agreeing:
            return alone(failed, done, stuck)
        flags = torch.tensor([int(failed), int(not done), int(stuck)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        any_failed, any_pending, any_stuck = flags.tolist()
        return bool(any_failed), not any_pending, bool(any_stuck)

    def _manual(
        self, module: L.LightningModule, batch: Any, length: int, loss_fn: Callable[[Any], Tensor]
    ) -> Tensor:
        """`micro_batches` for a single process: each piece's forward and ``manual_backward``."""
        if self._notes.pop("manual", None) is not None:  # the step opted in: it is retried
            self._refresh_findings()
        params = _trainable(self._params)
        frozen: list[tuple[list[torch.nn.Parameter], int]] = []
        losses: list[tuple[Tensor, int]] = []
        logged: list[Logged] = []

        def attempt(start: int, stop: int, final: bool) -> bool:
            whole = start == 0 and stop == length
            piece = batch if whole else slice_batch(batch, start, stop, length)
            marks = _grad_marks(params)
            ran, calls = False, list[Logged]()
            try:
                with _frozen(frozen, start), _captured(module, calls):
                    loss = loss_fn(piece)
                    share = (stop - start) / length if self.loss_reduction == "mean" else 1.0
                    module.manual_backward(loss * share)
                ran = True
            except BaseException as error:
                if not is_oom(error):
                    raise
                frozen.append((_changed(params, marks), stop))  # a backward that failed part-way
            if not ran:
                _collect()
                return False
            losses.append((loss.detach(), stop - start))
            logged.extend(Logged(c.name, c.value, c.options, stop - start) for c in calls)
            return True

        rounds = run_rounds(length, min(self.sizes["train"] or length, length), attempt)
        self._record("train", rounds, "manual")
        _log_combined(module, logged)
        if self.loss_reduction == "sum":
            return torch.stack([loss for loss, _ in losses]).sum()
        return torch.stack([loss * n for loss, n in losses]).sum() / length

    # -- what is reported ---------------------------------------------------------------------------

    def _record(self, stage: str, rounds: Rounds, where: str) -> None:
        if not rounds.shrinks:
            return
        assert self._trainer is not None
        trainer = self._trainer
        self.sizes[stage] = rounds.size
        for shrink in rounds.shrinks:
            here = "this rank" if shrink.start is not None else "another rank"
            if where == "pressure":  # decided together, before anything failed
                here = "every rank"
            self.events.append(
                {
                    "stage": stage,
                    "step": trainer.global_step,
                    "before": shrink.before,
                    "after": shrink.after,
                    "where": where,
                    "rank": here,
                }
            )
        if stage == "train":
            self._note("changes", _what_changes(trainer.lightning_module, self.loss_reduction))
        self._refresh_findings()
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {f"boost/micro_batch_size/{stage}": float(rounds.size)}, step=trainer.global_step
                )

    def _note(self, key: str, finding: Finding | None) -> None:
        if finding is not None and key not in self._notes:
            self._notes[key] = finding
            self._refresh_findings()

    def _refresh_findings(self) -> None:
        shrunk = [
            _shrunk_finding(stage, [e for e in self.events if e["stage"] == stage], self.sizes[stage])
            for stage in STEPS
            if any(e["stage"] == stage for e in self.events)
        ]
        self.findings = [*shrunk, *self._notes.values()]

    def _check_pressure(
        self, trainer: L.Trainer, device: torch.device, step: int, current: _Step | None
    ) -> None:
        stats = torch.cuda.memory_stats(device)
        self._pressure.append((step, int(stats.get("num_alloc_retries", 0))))
        growing = growing_retries(self._pressure)
        if self.shrink_on_pressure and trainer.strategy.reduce_boolean_decision(
            growing is not None, all=False
        ):
            size = self.sizes["train"] or (current.pieces.length if current is not None else None)
            if size is not None and size > 1:
                self._record(
                    "train", Rounds(max(1, size // 2), [Shrink(size, max(1, size // 2))]), "pressure"
                )
                self._pressure.clear()
        if growing is not None:
            self._note("pressure", _pressure_finding(growing, stats, self.shrink_on_pressure))


@dataclass
class _Step:
    """The training step in flight: its pieces (for a retry of the last piece's backward) and size."""

    pieces: _Pieces
    size: int
    stashed: list[Tensor | None] | None = None


@dataclass
class _Pieces:
    """One step's batch, run a piece at a time: what each piece returned and logged.

    A piece that is the whole batch runs as the step would without the pack (nothing captured). A
    training piece that is not the last runs its backward here (Lightning runs the last one's).
    """

    trainer: L.Trainer
    stage: str
    step: Callable[..., Any]
    batch: Any
    rest: tuple[Any, ...]
    kwargs: dict[str, Any]
    length: int
    loss_reduction: str
    backward_all: bool = False  # every piece's backward runs here (a retried backward)
    local_final: bool = False  # under DDP: a split step's last piece runs its backward here too
    always_local: bool = False  # under DDP: a whole batch too (`retry_ddp_backward`)
    scale: float = 1.0  # the share of the step's loss this batch carries (a retried piece's)
    frozen: list[tuple[list[torch.nn.Parameter], int]] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    logged: list[Logged] = field(default_factory=list)
    final: tuple[int, int] | None = None
    whole: bool = False
    params: list[torch.nn.Parameter] = field(default_factory=list)  # the trainable ones
    backward_ran: bool = False

    @classmethod
    def for_backward(cls, step: _Pieces, start: int, stop: int, touched: list[torch.nn.Parameter]) -> _Pieces:
        """Samples ``start:stop`` of `step`'s batch again, forward and backward, after their backward
        ran out of memory: the parameters whose gradients that backward had already completed
        (`touched`) are frozen, so no gradient is added twice; what the pieces log is dropped (the
        step logged already)."""
        batch = slice_batch(step.batch, start, stop, step.length)
        scale = (stop - start) / step.length if step.loss_reduction == "mean" else 1.0
        return cls(
            step.trainer,
            "train",
            step.step,
            batch,
            step.rest,
            step.kwargs,
            stop - start,
            step.loss_reduction,
            backward_all=True,
            scale=scale,
            frozen=[(touched, stop - start)],
            params=step.params,
        )

    def attempt(self, start: int, stop: int, final: bool) -> bool:
        """Run samples ``start:stop``; ``False`` when they ran out of memory."""
        ran = False
        whole = start == 0 and stop == self.length and not (self.backward_all or self.always_local)
        logged: list[Logged] = []
        try:
            if whole:  # the step as it is without the pack
                output = self.step(self.batch, *self.rest, **self.kwargs)
            else:
                output = self._piece(start, stop, final, logged)
            ran = True
        except BaseException as error:
            if not is_oom(error):
                raise
        if not ran:  # outside the `except`: the error's traceback (and what it holds) is gone
            _collect()
            return False
        self.whole = whole
        self.outputs.append(output)
        self.samples.append(stop - start)
        self.logged.extend(Logged(c.name, c.value, c.options, stop - start) for c in logged)
        if final and self.stage == "train":
            self.final = (start, stop)
        return True

    def _piece(self, start: int, stop: int, final: bool, logged: list[Logged]) -> Any:
        """Samples ``start:stop`` through the step, what it logs recorded into `logged`; a training
        piece other than the last one (or any, in a retried backward or under DDP) runs its backward
        here."""
        with _frozen(self.frozen, start), _captured(self.trainer.lightning_module, logged):
            output = self.step(slice_batch(self.batch, start, stop, self.length), *self.rest, **self.kwargs)
            if self.stage == "train" and (not final or self.backward_all or self.local_final):
                output = self._backward(output, start, stop)
        return output

    def _backward(self, output: Any, start: int, stop: int) -> Any:
        loss = _loss_of(output)
        if loss is None:
            return output
        weight = self._weight(stop - start) / self.trainer.accumulate_grad_batches
        if not self.backward_ran and not self.backward_all and zeroes_gradients_this_step(self.trainer):
            for p in self.params:  # the last step's gradients: Lightning zeroes them after this step
                p.grad = None
        self.backward_ran = True
        marks = _grad_marks(self.params)
        try:
            backward_piece(self.trainer, loss * weight)
        except BaseException as error:
            if is_oom(error):  # the parameters this backward completed are not given their gradient again
                self.frozen.append((_changed(self.params, marks), stop))
            raise
        return _detached(output)

    def stash(self) -> list[Tensor | None] | None:
        """On a step where Lightning zeroes the gradients (after ``training_step``, before the
        backward), the gradients the earlier pieces accumulated, taken off the parameters (moved,
        not copied) until the backward puts them back."""
        if not self.backward_ran or self.backward_all or not zeroes_gradients_this_step(self.trainer):
            return None
        stashed = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return stashed

    def _weight(self, samples: int) -> float:
        return self.scale * (samples / self.length if self.loss_reduction == "mean" else 1.0)

    def result(self) -> Any:
        """What the step returns: the whole batch's output when it ran whole, else the pieces'
        combined (the loss's gradient flows through the last piece only: the others' backward ran)."""
        if self.whole:
            return self.outputs[-1]
        _log_combined(self.trainer.lightning_module, self.logged)
        if self.stage != "train":
            return combine_outputs(self.outputs, self.samples)
        return self._training_output()

    def _training_output(self) -> Any:
        outputs = [o for o in self.outputs if _loss_of(o) is not None]
        samples = [n for o, n in zip(self.outputs, self.samples, strict=True) if _loss_of(o) is not None]
        if not outputs:
            return None
        losses: list[Tensor] = [_loss_of(o) for o in outputs]  # type: ignore[misc]
        last = losses[-1] * self._weight(samples[-1])
        if self.local_final:  # every backward ran: DDP's all-reduce runs on a backward of zeros
            last = last.detach() + _zero_link(self.params)
        loss = last + sum(
            (
                earlier.detach() * self._weight(n)
                for earlier, n in zip(losses[:-1], samples[:-1], strict=True)
            ),
            torch.zeros_like(last),
        )
        if isinstance(outputs[-1], Tensor):
            return loss
        combined = combine_outputs([{k: v for k, v in o.items() if k != "loss"} for o in outputs], samples)
        return {**combined, "loss": loss}


def _trainable(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Those of `params` that train at this step: read each step, since a fine-tuning callback
    (`BackboneFinetuning`) or the module's own hook unfreezes some during the fit, and the earlier
    pieces' gradients of one left out were lost to Lightning's ``zero_grad``."""
    return [p for p in params if p.requires_grad]


@contextmanager
def _frozen(frozen: Sequence[tuple[list[torch.nn.Parameter], int]], start: int) -> Iterator[None]:
    """The parameters of each ``(params, stop)`` with ``start < stop`` frozen inside: their gradient
    for those samples is already complete."""
    params = [p for group, stop in frozen if start < stop for p in group if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _log_combined(module: L.LightningModule, logged: Sequence[Logged]) -> None:
    """The pieces' ``self.log`` calls, logged once each as the batch's."""
    for call in combine_logged(logged):
        options = dict(call.options)
        if options.get("batch_size") is not None:
            options["batch_size"] = call.samples
        module.log(call.name, call.value, **options)


@validated
def micro_batches(module: torch.nn.Module, batch: Any, loss_fn: Callable[[Any], Tensor]) -> Tensor:
    """The opt-in retry for manual optimization: `module`'s loss on `batch` (a LightningModule of
    either namespace), computed by ``loss_fn(piece)`` and backpropagated here (``manual_backward``,
    each piece's loss weighted by its share of samples) one micro-batch at a time; a piece that
    runs out of memory runs again in halves, and later steps start at the smaller size. Returns
    the batch's loss, detached. Call the optimizer step yourself after it, as before::

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = micro_batches(self, batch, lambda piece: F.cross_entropy(self(piece[0]), piece[1]))
            optimizer.step()
            return loss

    Without an `AutoMicroBatch` in the trainer's callbacks, or under DDP (where a rank's
    ``manual_backward`` is already in its gradient all-reduce when another rank fails), the batch
    runs whole, as ``loss_fn(batch)`` then ``manual_backward``.
    """
    lightning_module: L.LightningModule = module  # type: ignore[assignment]  # either namespace's
    trainer = lightning_module.trainer
    callback = next((c for c in trainer.callbacks if isinstance(c, AutoMicroBatch)), None)  # type: ignore[attr-defined]
    length = batch_length(batch)
    if callback is None or length is None or trainer.world_size > 1:
        loss = loss_fn(batch)
        lightning_module.manual_backward(loss)
        return loss.detach()
    return callback._manual(lightning_module, batch, length, loss_fn)


def _zero_link(params: Sequence[torch.nn.Parameter]) -> Tensor:
    """Zero, with every parameter in its graph: its backward adds nothing to the gradients and
    makes DDP all-reduce each of them (its hooks fire as each parameter's gradient is ready)."""
    return sum((p.sum() * 0 for p in params), torch.zeros((), device=params[0].device))


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


def _detached(output: Any) -> Any:
    if isinstance(output, Tensor):
        return output.detach()
    if isinstance(output, Mapping):
        return {k: v.detach() if isinstance(v, Tensor) else v for k, v in output.items()}
    return output


_LOG_SIGNATURES: dict[type, inspect.Signature] = {}


def _log_signature(cls: type) -> inspect.Signature:
    if cls not in _LOG_SIGNATURES:
        _LOG_SIGNATURES[cls] = inspect.signature(cls.log)  # type: ignore[attr-defined]
    return _LOG_SIGNATURES[cls]


@contextmanager
def _captured(module: L.LightningModule, logged: list[Logged]) -> Iterator[None]:
    """``module.log`` calls made inside, recorded into `logged` instead of logged."""
    signature = _log_signature(type(module))
    previous = vars(module).get("log", _MISSING)

    def record(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(module, *args, **kwargs).arguments
        options = {k: v for k, v in bound.items() if k not in ("self", "name", "value")}
        logged.append(Logged(bound["name"], bound["value"], options))

    module.__dict__["log"] = record
    try:
        yield
    finally:
        _restore(module, "log", previous)


def _collect() -> None:
    """Free what the failed attempt left in reference cycles: the young generations only, where
    the step's objects are (a full collection of a Lightning process takes a tenth of a second)."""
    gc.collect(1)


def _restore(owner: object, name: str, previous: object) -> None:
    if previous is _MISSING:
        vars(owner).pop(name, None)
    else:
        vars(owner)[name] = previous


def _grad_marks(params: Sequence[torch.nn.Parameter]) -> list[tuple[Tensor | None, int]]:
    """Each parameter's gradient tensor and its version: what a backward changes."""
    return [(g, g._version if g is not None else -1) for g in (p.grad for p in params)]


def _changed(
    params: Sequence[torch.nn.Parameter], marks: Sequence[tuple[Tensor | None, int]]
) -> list[torch.nn.Parameter]:
    """The parameters whose gradient a backward completed since `marks` (autograd accumulates each
    parameter's gradient once, whole, per backward)."""
    return [
        p
        for p, (grad, version) in zip(params, marks, strict=True)
        if p.grad is not grad or (grad is not None and grad._version != version)
    ]


def _release(loss: Tensor) -> None:
    """Drop the graph behind `loss` (its backward failed; the retry needs the memory)."""
    with contextlib.suppress(RuntimeError):  # a view: its graph goes with the step
        loss.detach_()
    _collect()


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)
    else:  # Python 3.10: where the `exceptiongroup` backport (pytest's too) prints them
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


def _unsplittable(batch: Any) -> str:
    return (
        f"lightning-boost (AutoMicroBatch): this step was not retried as micro-batches: its batch, a"
        f" `{type(batch).__name__}`, holds no tensor with a batch dimension to cut (micro-batches are cut"
        " from tensors and from tuples, lists, dicts and dataclasses of them). Have the DataLoader's"
        " `collate_fn` return one of those (and build the object in the step), or start with a"
        " smaller batch."
    )


_DDP_BACKWARD = (
    "lightning-boost (AutoMicroBatch): this out-of-memory error came from DDP's backward, whose gradient "
    "all-reduce the other ranks are already in, so it cannot be retried. Steps that ran out of memory in "
    "their forward are retried on every rank, and once a step is split every backward is; to make this "
    "one retryable, start with a smaller batch."
)


def _shrunk_finding(stage: str, events: list[dict[str, Any]], size: int | None) -> Finding:
    first, last = events[0], events[-1]
    steps = "; ".join(
        f"step {e['step']}: {e['before']} → {e['after']} ({e['where']}, {e['rank']})" for e in events[:6]
    ) + ("; …" if len(events) > 6 else "")
    kept = (
        "gradients are accumulated over the micro-batches, so the optimizer step, the effective batch, the "
        "learning rate and the logged values are the batch's"
        if stage == "train"
        else "the outputs and logged values are combined into the batch's"
    )
    return Finding(
        "AutoMicroBatch",
        "batch size",
        Severity.WARN,
        f"{_NAMES[stage]} ran out of memory: batches of {first['before']} now run as micro-batches of {size}",
        f"{steps}. No sample was skipped or repeated; {kept}. Each halving cost one failed attempt; the "
        "smaller micro-batches may run slower per sample.",
        fix=f"To skip the retries next time, start from batches of {size}"
        + (" with `accumulate_grad_batches` for the same effective batch" if stage == "train" else "")
        + ", or lower the memory a sample needs (`precision='bf16-mixed'`, activation checkpointing).",
        data={"stage": stage, "micro_batch_size": size, "events": events, "steps": [last["step"]]},
    )


def _what_changes(module: torch.nn.Module, loss_reduction: str) -> Finding:
    norms = sorted(
        {type(m).__name__ for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    )
    other = "sum" if loss_reduction == "mean" else "mean"
    combined = "a mean over samples" if loss_reduction == "mean" else "a sum"
    detail = (
        f"The losses of the micro-batches are combined as {combined} (`loss_reduction={loss_reduction!r}`); "
        f"if your loss is a {other} over the batch, pass `AutoMicroBatch(loss_reduction={other!r})`."
        " A loss that compares the batch's samples with each other (a contrastive loss's in-batch"
        " negatives, hard-example mining) is neither: each micro-batch compares fewer samples, which"
        " changes the loss, as a smaller batch would."
    )
    if norms:
        return Finding(
            "AutoMicroBatch",
            "batch size",
            Severity.WARN,
            f"Micro-batches change what {', '.join(norms)} computes",
            "Batch-norm layers normalize each micro-batch with its own mean and variance and update their "
            f"running statistics once per micro-batch, so steps differ a little from whole batches. {detail}",
            fix="Keep the batch whole on this device (a smaller batch with `accumulate_grad_batches`, or "
            "`precision='bf16-mixed'`), or use `torch.nn.SyncBatchNorm`/`GroupNorm`.",
        )
    return Finding(
        "AutoMicroBatch", "batch size", Severity.INFO, "How micro-batched steps combine their losses", detail
    )


def _manual_optimization() -> Finding:
    return Finding(
        "AutoMicroBatch",
        "batch size",
        Severity.INFO,
        "Training steps are not retried under manual optimization",
        "`training_step` calls its optimizers itself, so the pack cannot split it into micro-batches with "
        "one optimizer step on its own; validation, test and predict steps are still retried on "
        "out-of-memory. `micro_batches` opts a manual step into the same retry.",
        fix="Compute the loss and its backward with `lightning_boost.micro_batches(self, batch, loss_fn)`.",
    )


def _unsupported(strategy: str) -> Finding:
    return Finding(
        "AutoMicroBatch",
        "batch size",
        Severity.INFO,
        f"Out-of-memory steps are not retried under {strategy}",
        "AutoMicroBatch retries steps on one device and under DDP, where autograd runs the backward and "
        "every process holds the whole model; sharded and engine-run strategies manage memory themselves.",
    )


def _pressure_finding(growing: list[tuple[int, int]], stats: Mapping[str, Any], shrinking: bool) -> Finding:
    steps = ", ".join(f"step {s}: {r}" for s, r in growing)
    peak = stats.get(_PEAK, 0) / 2**30
    reserved = stats.get("reserved_bytes.all.current", 0) / 2**30
    return Finding(
        "AutoMicroBatch",
        "batch size",
        Severity.WARN,
        "CUDA memory is close to running out: the allocator retries more at every check",
        f"Allocator retries so far ({steps}); peak allocated {peak:.2f} GiB, reserved {reserved:.2f} GiB. "
        "Each retry frees the allocator's cache to satisfy a request, which is slow, and an "
        "out-of-memory error usually follows." + (" The micro-batch was halved." if shrinking else ""),
        fix=""
        if shrinking
        else "Pass `AutoMicroBatch(shrink_on_pressure=True)` to halve the micro-batch now, or start smaller.",
        data={"alloc_retries": [list(g) for g in growing], "peak_allocated_bytes": stats.get(_PEAK)},
    )
