"""Real training steps at a batch size, taken on a copy of the model: throughput and peak memory.

Each trial deep-copies the module (detached from the trainer) and its optimizers, so the weights,
gradients, optimizer state, buffers and metrics of the run are untouched; RNG states are restored
by the caller. Peak memory is the CUDA allocator's peak on CUDA; elsewhere no allocator reports a
peak, so it is estimated from the live tensors of the step: weights, gradients, optimizer state,
the tensors autograd saves for backward and the batch (temporaries inside one operation are not
counted).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence, Sized
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.memory import is_oom_error
from lightning_utilities.core.apply_func import is_dataclass_instance
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_boost._lightning import answer_optimizers, call_step, detached_copy, preserved_rng
from lightning_boost.batch_size.finetuning import make_trainable
from lightning_boost.batch_size.gradients import flat_dot
from lightning_boost.instrumented import own_steps
from lightning_boost.micro_batch.split import listed_length, slice_batch
from lightning_boost.trials import StepSkipped, Trial, cautious_grad_sq

#: Timed steps per trial stop short of `steps` when they would take longer than this (seconds).
TIMED_S = 2.0

#: Most bytes of samples' tensors a search's trials keep loaded between trials (`RememberedSamples`).
REMEMBERED_BYTES = 512 * 2**20

#: Messages of out-of-memory errors that arrive as a plain ``RuntimeError`` (CPU allocator, MPS).
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")


def is_oom(error: BaseException) -> bool:
    """The error is the device or host running out of memory (CUDA, CPU allocator, MPS).

    Example:
        >>> is_oom(torch.OutOfMemoryError("CUDA out of memory.")), is_oom(ValueError("shape"))
        (True, False)
    """
    if isinstance(error, torch.OutOfMemoryError) or is_oom_error(error):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OOM_MESSAGES)


def first_batch(dataset: Dataset[Any], collate_fn: Callable[[list[Any]], Any] | None, size: int) -> Any:
    """The first `size` samples of `dataset` collated as the run's loader collates them."""
    loader = DataLoader(dataset, batch_size=size, shuffle=False, collate_fn=collate_fn, num_workers=0)
    return next(iter(loader))


def sample_batches(
    dataset: Dataset[Any], collate_fn: Callable[[list[Any]], Any] | None, size: int, seed: int = 0
) -> Iterator[Any]:
    """Batches of `size` samples drawn at random without replacement (a fixed `seed`, not the
    global generator: every size starts with the same samples, and the run's RNG is not touched),
    endlessly; an iterable dataset's batches in its own order."""
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        length = None
    while True:
        if length is None:
            loader = DataLoader(dataset, batch_size=size, collate_fn=collate_fn, num_workers=0)
        else:
            generator = torch.Generator().manual_seed(seed)
            sampler = torch.utils.data.RandomSampler(range(length), generator=generator)
            loader = DataLoader(
                dataset, batch_size=size, sampler=sampler, collate_fn=collate_fn, num_workers=0
            )
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return


class RememberedSamples(Dataset[Any]):
    """`dataset` with each sample loaded once while the remembered ones' tensors take at most
    `max_bytes`. A search's trials draw their batches from the same samples first
    (`sample_batches`' fixed seed; `first_batch`'s order), and they load on this one process: at a
    size twice the last, half of what a trial needs is loaded already. A sample with random
    augmentation is the same draw each time it comes back: the trials time the step, and the
    first trial's independent batches hold other samples each."""

    def __init__(self, dataset: Dataset[Any], max_bytes: int = REMEMBERED_BYTES) -> None:
        self.dataset = dataset
        self.max_bytes = max_bytes
        self.samples: dict[int, Any] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        if index in self.samples:
            return self.samples[index]
        sample = self.dataset[index]
        size = sum(t.nelement() * t.element_size() for t in _tensors(sample))
        if size and self.bytes + size <= self.max_bytes:  # held tensors only: their size is known
            self.samples[index] = sample
            self.bytes += size
        return sample


def remembered(dataset: Dataset[Any]) -> Dataset[Any]:
    """`dataset` as `RememberedSamples` when it has a length (an iterable dataset has no index
    to remember a sample by: it is returned as it is)."""
    indexed = isinstance(dataset, Sized) and not isinstance(dataset, IterableDataset)
    return RememberedSamples(dataset) if indexed else dataset


class Alternation(Protocol):
    """Settings a trial's steps alternate between until their times decide which to keep (the
    CPU's bf16 autocast trial, `presets.autocast.AutocastTrial`)."""

    def context(self, step: int) -> Callable[[], AbstractContextManager[Any]]:
        """The context step `step` runs under (0: the warm-up)."""
        ...

    def add(self, seconds: float) -> bool:
        """The next step's time; whether the alternation has decided."""
        ...

    def kept_times(self) -> list[float]:
        """The times of the timed steps at the setting it keeps."""
        ...


def evaluation_hooks(module: torch.nn.Module) -> list[str]:
    """``validation_step`` (run by the fit), then the test and predict steps `module`'s own class
    defines (Lightning's defaults are not the model's code)."""
    own = [
        hook
        for hook in ("test_step", "predict_step")
        if not getattr(type(module), hook).__qualname__.startswith("LightningModule.")
    ]
    return ["validation_step", *own]


def evaluation_failure(
    module: torch.nn.Module, attempt: Callable[[str, bool], None]
) -> tuple[str, Exception] | None:
    """The first of `module`'s `evaluation_hooks` that runs as it is (``attempt(hook, False)``) and
    fails changed (``attempt(hook, True)``: another memory layout, bf16 autocast), with its error;
    ``None`` when none does. A step that fails both ways (its batches differ from the training
    ones it is tried on) tells nothing."""
    for hook in evaluation_hooks(module):
        errors: list[Exception | None] = []
        for changed in (False, True):
            try:
                attempt(hook, changed)
                errors.append(None)
            except Exception as error:
                errors.append(error)
        if errors[0] is None and errors[1] is not None:
            return hook, errors[1]
    return None


class StepProbe:
    """Times training (and validation) steps of copies of `module` at given batches.

    Args:
        module: the LightningModule of the run (not changed).
        optimizers: its optimizers; each copy gets copies of them, mapped to the copy's parameters.
        steps: timed steps per trial, after one warm-up step; the fastest counts. Fewer when the
            warm-up step says they would take more than `TIMED_S` (at least one).
        train_context: the precision plugin's training context (autocast for mixed precision).
        eval_context: the same for validation.
        move: moves a batch from the host to the module's device as the run's loop does
            (``trainer.strategy.batch_to_device``); the batches of `train`'s `following` are loaded
            before the timed steps and moved in them. Without it they are used as they come.
        unfreeze: names of frozen parameters each copy trains (in the first optimizer), as a
            fine-tuning callback will train them later in the run (`finetuning.unfrozen_later`).
        resize: sets a copy's batch-size attribute to the size a trial's steps train at, as the run
            sets the module's (a step that reads it, say for a contrastive loss's labels, then
            runs at that size as it will in the run).
    """

    def __init__(
        self,
        module: L.LightningModule,
        optimizers: Sequence[Optimizer],
        steps: int,
        train_context: Callable[[], AbstractContextManager[Any]],
        eval_context: Callable[[], AbstractContextManager[Any]],
        move: Callable[[Any], Any] | None = None,
        unfreeze: Sequence[str] = (),
        resize: Callable[[L.LightningModule, int], None] | None = None,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.steps = steps
        self.train_context = train_context
        self.eval_context = eval_context
        self.move = move or _as_it_comes
        self.unfreeze = list(unfreeze)
        self.resize = resize
        self.device = module.device

    def train(
        self,
        batch: Any,
        size: int,
        following: Iterator[Any] | None = None,
        split: bool = False,
        alternate: Alternation | None = None,
        cross: int = 0,
    ) -> Trial:
        """Warm-up at `batch`, then `steps` timed steps (forward, backward, optimizer step), each at
        the next batch of `following` (`batch` again without it). Those batches are loaded before the
        clock starts and moved to the device in their step, as the run's loop moves what its workers
        loaded: the time is the step's, not that of loading on this one process. The trial's
        ``grad_sq`` is the warm-up's squared gradient norm, at the module's own parameters (later
        steps move the copy's, and the noise scale compares sizes at the same point); ``spread`` is
        how far the median timed step lies above the fastest, and ``losses`` the timed steps' training
        losses (after 1, 2, ... optimizer steps: where the module's settings take the loss). With
        `split`, the warm-up's batch is first also run as its two halves (gradients only, untimed):
        ``half_grad_sq``, the noise scale's second size from one trial; and the next batch of
        `following`'s gradient is added to the warm-up's before its optimizer step (one more pass,
        untimed): ``double_grad_sq``, the squared norm of the two batches' mean gradient, a third size
        (twice `size`) at the same parameters. With `alternate`, the warm-up and the timed steps run
        under its settings, as many as it takes to decide, and the step's time is that of the steps at
        the setting it keeps (the warm-up's when its budget left none): one trial times both the size
        and, say, bf16 autocast against fp32. With `cross`, that many batches of `following` first
        give their gradients at the same parameters (passes without optimizer steps, untimed):
        ``batch_grad_sq``, ``cross_grad_sq`` and ``cross_se`` (`cross_products`); where their cautious
        ``|G|^2`` is positive, the noise scale is theirs, and `split`'s three passes (the halves' new
        shape among them) are skipped.
        """
        record: dict[str, Any] = {}

        def run(clone: L.LightningModule, optimizers: list[Optimizer], peak: _Peak) -> float:
            second = None
            if cross and following is not None:
                crossed = map(self.move, itertools.islice(following, cross))
                record.update(self._cross_products(clone, crossed))
            if split and not _resolved(record):
                record["half_grad_sq"] = self._half_grad_sq(clone, batch, size)
                second = next(following, None) if following is not None else None
                second = self.move(second) if split_batch(second, size) is not None else None  # a full batch
            return self._train_steps(clone, optimizers, batch, following, peak, record, second, alternate)

        trial = self._trial(size, run, size)
        return dataclasses.replace(trial, **record) if not trial.oom else trial

    def rates(
        self,
        batch: Any,
        size: int,
        threads: Sequence[int],
        rounds: int = 2,
        budget_s: float = 5.0,
        hook: str = "training_step",
    ) -> dict[int, float]:
        """Samples/s of the training step at `batch` per intra-op thread count (a CPU run's split
        between the model and the DataLoader workers): on one copy, `rounds` rounds over the counts
        of `steps` timed steps each (after one warm-up step per count), the fastest kept, so a busy
        moment does not hit one count alone. Once `budget_s` is spent, counts already measured are
        not measured again. Torch's thread count is put back. With an evaluation `hook`
        (``"validation_step"``, ``"test_step"``, ``"predict_step"``) that step is timed instead,
        without gradients, in evaluation mode under `eval_context`.
        """
        before = torch.get_num_threads()
        clone, optimizers = self._copies()
        clone.train(hook == "training_step")
        rates: dict[int, float] = {}

        def step() -> None:
            if hook == "training_step":
                self._train_step(clone, optimizers, batch, None, skips=True)
            else:
                self._eval_step(clone, hook, batch)

        start = time.perf_counter()
        try:
            with own_steps():
                for _ in range(rounds):
                    for count in threads:
                        if count in rates and time.perf_counter() - start > budget_s:
                            continue
                        torch.set_num_threads(count)
                        if count not in rates:
                            step()  # warm-up, once a count: first-call allocations, kernel choices
                        fastest = fastest_step(step, self.steps, self.device)
                        rates[count] = max(rates.get(count, 0.0), size / fastest)  # the least disturbed
        finally:
            torch.set_num_threads(before)
        return rates

    def time_steps(
        self,
        batch: Any,
        contexts: Iterable[Callable[[], AbstractContextManager[Any]]],
        memory_format: torch.memory_format | None = None,
    ) -> Generator[float, None, None]:
        """Training steps of one copy at `batch`, each under the next of `contexts` (instead of
        `train_context`): yields each step's seconds, the device synced, so the caller compares
        contexts step by step and stops when it has seen enough. With `memory_format`, the copy's
        weights are laid out in it first (``torch.channels_last``: NHWC convolutions)."""
        clone, optimizers = self._copies(memory_format)
        clone.train()
        for context in contexts:
            start = time.perf_counter()
            with own_steps():  # not across the yield: the caller's code runs there
                self._train_step(clone, optimizers, batch, None, context=context, skips=True)
                _synchronize(self.device)
            yield time.perf_counter() - start

    def stepper(self) -> Callable[[Any, int | None], float]:
        """Training steps of one copy, each at its own batch: ``step(batch, threads)`` takes one
        on `threads` intra-op threads (``None``: torch's count as it is) and returns its seconds,
        the device synced. The batch's tensors are cloned first (a step may change them in place)
        and the RNG states and torch's thread count are put back, so the run's next step is the
        one it would have taken: a CPU run's worker search times the model on fewer threads this
        way without training any of the run's own steps on them (`lightning_boost.workers.segments`)."""
        clone, optimizers = self._copies()
        clone.train()

        def step(batch: Any, threads: int | None) -> float:
            before = torch.get_num_threads()
            loaded = self.move(apply_to_collection(batch, Tensor, Tensor.clone))
            try:
                with preserved_rng(), own_steps():
                    torch.set_num_threads(threads or before)
                    start = time.perf_counter()
                    self._train_step(clone, optimizers, loaded, None, skips=True)
                    _synchronize(self.device)
                    return time.perf_counter() - start
            finally:
                torch.set_num_threads(before)

        return step

    def evaluate(self, batch: Any, hook: str, memory_format: torch.memory_format | None = None) -> None:
        """One evaluation step (`hook`: ``"validation_step"``, ...) of a copy at `batch`, its weights
        in `memory_format` when given: raises what the step raises."""
        clone, _ = self._copies(memory_format)
        clone.eval()
        with own_steps():
            self._eval_step(clone, hook, batch)

    def halves_ratio(self, batch: Any, size: int) -> float | None:
        """The training loss at `batch` over the mean of its two halves' (`split_batch`), on a copy
        in training mode without gradients: 1 for a loss averaged over the batch, 2 for one summed
        over it (`batch_size.reduction`). ``None`` when the batch cannot be halved, a step fails or
        runs out of memory (the trials report both) or the halves' mean is not positive."""
        halves = split_batch(batch, size)
        if halves is None:
            return None
        clone, _ = self._copies()
        clone.train()
        losses = []
        try:
            with torch.no_grad(), own_steps(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a copy's warnings are the run's to give
                for part, samples in ((batch, size), (halves[0], size // 2), (halves[1], size - size // 2)):
                    if self.resize is not None:
                        self.resize(clone, samples)
                    losses.append(float(self._loss(clone, part, None).float().sum()))
        except Exception:  # an OOM too: the trials find what fits
            return None
        full, mean = losses[0], (losses[1] + losses[2]) / 2
        ratio = full / mean if mean > 0 else math.nan
        return ratio if math.isfinite(ratio) else None

    def validate(self, batch: Any, size: int, train_size: int | None = None) -> Trial:
        """One ``validation_step`` without gradients at `batch`: does it fit. The copy's batch-size
        attribute is `train_size` (default: `size`), as the run's is while it validates."""
        return self._trial(
            size,
            lambda clone, optimizers, peak: self._validation_step(clone, batch, peak),
            train_size or size,
        )

    def _trial(
        self, size: int, run: Callable[[L.LightningModule, list[Optimizer], _Peak], float], attribute: int
    ) -> Trial:
        start = time.perf_counter()
        clone, optimizers = self._copies()
        if self.resize is not None:
            self.resize(clone, attribute)
        peak = _Peak(self.device)
        try:
            with own_steps():
                seconds = run(clone, optimizers, peak)
            trial = Trial(size, samples_per_s=size / seconds, peak_bytes=peak.bytes(clone, optimizers))
        except Exception as error:
            if not is_oom(error):
                raise
            trial = Trial(size, oom=True)  # the traceback and its tensors go with `error` here
        del clone, optimizers, peak
        _free(self.device, trial.oom)
        return dataclasses.replace(trial, seconds=time.perf_counter() - start)

    def _copies(
        self, memory_format: torch.memory_format | None = None
    ) -> tuple[L.LightningModule, list[Optimizer]]:
        clone = detached_copy(self.module)
        memo: dict[int, Any] = {
            id(p): q for p, q in zip(self.module.parameters(), clone.parameters(), strict=True)
        }
        optimizers = [_copied_optimizer(optimizer, memo) for optimizer in self.optimizers]
        answer_optimizers(clone, optimizers, self.module._trainer, memo)
        make_trainable(clone, optimizers, self.unfreeze)
        if memory_format is not None:  # in place: the optimizers' copies hold the same parameters
            clone.to(memory_format=memory_format)
        return clone, optimizers

    def _cross_products(self, clone: L.LightningModule, batches: Iterable[Any]) -> dict[str, float]:
        """`cross_products` of the gradients of `batches` at `clone`'s parameters (one backward
        each, no optimizer step; two gradient-sized buffers besides the step's own), as the trial's
        fields; none when a pass fails, runs out of memory with the buffers (the warm-up then tells
        whether the size fits) or a value is not finite."""
        clone.train()
        params = [p for p in clone.parameters() if p.requires_grad]
        total: list[Tensor] = []
        previous: list[Tensor] = []
        squares: list[Tensor] = []
        crossed: list[Tensor] = []  # each gradient's product with the sum of those before it
        pairs: list[Tensor] = []
        try:
            for batch in batches:
                clone.zero_grad(set_to_none=True)  # the next backward makes new tensors: kept ones stay
                with torch.enable_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a copy's warnings are the run's to give
                    self._backward(clone, batch, None, None)
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                squares.append(_dot(grads, grads))
                if total:
                    crossed.append(_dot(total, grads))
                    torch._foreach_add_(total, grads)
                else:
                    total = [grad.detach().clone() for grad in grads]
                if len(squares) % 2 == 0:
                    pairs.append(_dot(previous, grads))
                previous = grads
        except Exception:  # an OOM too: the buffers may be what did not fit
            return {}
        finally:
            clone.zero_grad(set_to_none=True)
        read = cross_products([float(q) for q in squares], float(sum(crossed)), [float(q) for q in pairs])
        fields = ("batch_grad_sq", "cross_grad_sq", "cross_se")
        return {} if read is None else dict(zip(fields, read, strict=True))

    def _half_grad_sq(self, clone: L.LightningModule, batch: Any, size: int) -> float | None:
        """The mean squared gradient norm of `batch`'s two halves, at the parameters the warm-up
        step's full-batch gradient is then taken at (``E|G_B|^2 = |G|^2 + tr(Σ)/B`` at B/2 and B:
        McCandlish et al. 2018, appendix A). ``None`` when the batch cannot be halved along its
        first dimension, or a half-size step fails (the full-size warm-up reports real errors)."""
        halves = split_batch(batch, size)
        if halves is None:
            return None
        clone.train()
        squares: list[Tensor] = []
        try:
            for half in halves:
                self._train_step(clone, [], half, None, squares)  # no optimizers: gradients cleared
        except Exception as error:
            if is_oom(error):
                raise
            return None  # e.g. a step that reshapes by a fixed batch size
        finally:
            clone.zero_grad(set_to_none=True)
        values = [float(square) for square in squares]
        return sum(values) / len(values) if all(map(math.isfinite, values)) else None

    def _train_steps(
        self,
        clone: L.LightningModule,
        optimizers: list[Optimizer],
        batch: Any,
        following: Iterator[Any] | None,
        peak: _Peak,
        record: dict[str, Any],
        second: Any = None,
        alternate: Alternation | None = None,
    ) -> float:
        clone.train()
        peak.reset(batch)
        grads: list[Tensor] = []
        first = None if alternate is None else alternate.context(0)
        warm_up = time.perf_counter()
        with peak.saved_tensors():  # warm-up: allocations, kernels
            self._train_step(clone, optimizers, batch, peak, grads, context=first, then=second)
        _synchronize(self.device)
        slow = (time.perf_counter() - warm_up) / (1 if second is None else 2)
        batches = iter(following if following is not None else ())
        losses: list[Tensor] = []

        def step(loaded: Any, context: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
            taken = batch if loaded is None else self.move(loaded)
            self._train_step(clone, optimizers, taken, None, losses=losses, context=context)

        if alternate is None:
            count = max(1, min(self.steps, int(TIMED_S / slow)))  # slow steps: fewer, not less precise
            ready = iter(_loaded(batches, count, self.device))  # before the clock starts
            times = step_times(lambda: step(next(ready)), count, self.device)
        else:
            times = self._alternated(step, alternate, slow, batches)
        record["losses"] = tuple(float(loss) for loss in losses)  # one read each, after the timing
        squares = [float(square) for square in grads]  # fp16 without its scaler can overflow: then none
        if math.isfinite(squares[0]):
            record["grad_sq"] = squares[0]
        if second is not None and math.isfinite(squares[1]):
            record["double_grad_sq"] = squares[1] / 4  # |g_a + g_b|^2 / 4: the squared norm of their mean
        record["spread"] = statistics.median(times) / min(times) - 1.0
        return min(times)

    def _alternated(
        self,
        step: Callable[[Any, Callable[[], AbstractContextManager[Any]]], None],
        alternate: Alternation,
        warm_up: float,
        batches: Iterator[Any],
    ) -> list[float]:
        """Steps under `alternate`'s settings (its step 0, the warm-up, took `warm_up` seconds),
        each at the next of `batches` (loaded before its clock starts), until it decides; the times
        of those at the setting it keeps, else the warm-up's."""
        index, decided = 1, alternate.add(warm_up)
        while not decided:
            (loaded,) = _loaded(batches, 1, self.device)
            started = time.perf_counter()
            step(loaded, alternate.context(index))
            _synchronize(self.device)
            decided, index = alternate.add(time.perf_counter() - started), index + 1
        return alternate.kept_times() or [warm_up]

    def _train_step(
        self,
        clone: L.LightningModule,
        optimizers: list[Optimizer],
        batch: Any,
        peak: _Peak | None,
        grads: list[Tensor] | None = None,
        losses: list[Tensor] | None = None,
        context: Callable[[], AbstractContextManager[Any]] | None = None,
        then: Any = None,
        skips: bool = False,
    ) -> None:
        """One step at `batch`; with `then`, that batch's gradient is added to `batch`'s before
        the optimizer steps (outside the peak's count: `grads` gets the sum's squared norm too).
        A ``training_step`` that returns ``None`` raises `StepSkipped`, or with `skips` is taken as
        the run takes it: its forward, no backward (a probe that only times steps). Each optimizer
        steps with a closure, as Lightning's do: its first call gives the loss just computed, and
        any later one (LBFGS evaluates the step again along its line search) runs the step again."""
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a copy's warnings are the run's to give
            loss = self._backward(clone, batch, context, losses, skips)
            if peak is not None:
                peak.add_grads(clone)
            if grads is not None:
                grads.append(_grad_sq(clone))
            if then is not None:
                with peak.paused() if peak is not None else nullcontext():
                    loss = _added(loss, self._backward(clone, then, context, None, skips))
                if grads is not None:
                    grads.append(_grad_sq(clone))
            computed: list[Tensor | None] = []  # the loss each optimizer's first call gives

            def closure() -> Tensor | None:
                if computed:
                    return computed.pop()
                clone.zero_grad(set_to_none=True)
                again = self._backward(clone, batch, context, None, skips)
                if then is not None:
                    again = _added(again, self._backward(clone, then, context, None, skips))
                return again

            for optimizer in optimizers:
                computed[:] = [loss]
                optimizer.step(closure)  # type: ignore[arg-type]  # a tensor, as Lightning's closure gives
                optimizer.zero_grad(set_to_none=True)
            if not optimizers:  # timed without them: the gradients must not pile up between steps
                clone.zero_grad(set_to_none=True)

    def _backward(
        self,
        clone: L.LightningModule,
        batch: Any,
        context: Callable[[], AbstractContextManager[Any]] | None,
        losses: list[Tensor] | None,
        skips: bool = False,
    ) -> Tensor | None:
        """``training_step`` at `batch` and its loss's backward (gradients accumulate); the loss,
        detached (``None`` for a step skipped under `skips`)."""
        try:
            loss = self._loss(clone, batch, context)
        except StepSkipped:
            if skips:
                return None
            raise
        if losses is not None:
            losses.append(loss.detach().float().sum())
        loss.backward()
        return loss.detach()

    def _loss(
        self, clone: L.LightningModule, batch: Any, context: Callable[[], AbstractContextManager[Any]] | None
    ) -> Tensor:
        """The loss ``training_step`` returns at `batch`."""
        with (context or self.train_context)():
            output = call_step(clone, "training_step", batch)
        if output is None:  # Lightning skips the batch: no loss to time
            raise StepSkipped()
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, Tensor):
            raise TypeError(f"`training_step` returned {type(output).__name__}, expected a loss tensor.")
        return loss

    def _validation_step(self, clone: L.LightningModule, batch: Any, peak: _Peak) -> float:
        clone.eval()
        peak.reset(batch)
        begin = time.perf_counter()
        self._eval_step(clone, "validation_step", batch)
        _synchronize(self.device)
        return time.perf_counter() - begin

    def _eval_step(self, clone: L.LightningModule, hook: str, batch: Any) -> None:
        with torch.no_grad(), warnings.catch_warnings(), self.eval_context():
            warnings.simplefilter("ignore")  # a copy's warnings are the run's to give
            call_step(clone, hook, batch)


def _copied_optimizer(optimizer: Optimizer, memo: dict[int, Any]) -> Optimizer:
    """A deep copy of `optimizer` over the parameters `memo` maps it to, with the data its
    ``__getstate__`` leaves out (LBFGS keeps its parameters in ``_params``, set in ``__init__``);
    not the functions set on it (a scheduler wraps ``step`` to step this optimizer), nor what
    cannot be copied. A `ZeroRedundancyOptimizer`, whose process group cannot be copied, is
    copied as the optimizer it shards, over every parameter: a copy steps on this process alone.

        >>> p, q = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
        >>> _copied_optimizer(torch.optim.LBFGS([p]), {id(p): q})._params[0] is q
        True
        >>> import threading
        >>> class Locked(torch.optim.SGD):
        ...     def __init__(self, params):
        ...         super().__init__(params, lr=0.1)
        ...         self.lock = threading.Lock()
        >>> hasattr(_copied_optimizer(Locked([p]), {id(p): q}), "lock")
        False
    """
    if _is_zero(optimizer):
        groups = [
            {**group, "params": [memo[id(p)] for p in group["params"]]} for group in optimizer.param_groups
        ]
        local: Optimizer = type(optimizer.optim)(groups, **optimizer._optim_defaults)  # type: ignore[attr-defined]
        memo[id(optimizer)] = local  # a scheduler over it is copied over this one
        return local
    copied = copy.deepcopy(optimizer, memo)
    for name, value in vars(optimizer).items():
        if name not in vars(copied) and not callable(value):
            try:
                setattr(copied, name, copy.deepcopy(value, memo))
            except (TypeError, RuntimeError):  # a lock, a process group: left out, as its state leaves it
                continue
    return copied


def _is_zero(optimizer: Optimizer) -> bool:
    """Whether `optimizer` is a ``torch.distributed.optim.ZeroRedundancyOptimizer`` (its module is
    imported where one was made: not here, where torch 2.5 warns at the import)."""
    zero = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", None)
    return zero is not None and isinstance(optimizer, zero)


def _added(loss: Tensor | None, other: Tensor | None) -> Tensor | None:
    """Two batches' losses as one, for an optimizer's closure; ``None`` where a step skipped."""
    return None if loss is None or other is None else loss + other


class _Peak:
    """Peak memory of a trial: the CUDA allocator's, or an estimate from live tensors elsewhere.

    The estimate sums three groups of storages, each counted once: what lives through the step
    (weights, buffers, optimizer state, the batch), what autograd saves for backward, and the
    gradients. Within a group the tensors are alive together, so a shared storage counts once.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.groups: dict[str, dict[int, int]] = {"resident": {}, "saved": {}, "grads": {}}
        self.counting = True

    def reset(self, batch: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._add("resident", _tensors(batch))

    @contextmanager
    def saved_tensors(self) -> Iterator[None]:
        if self.cuda:
            yield
            return

        def pack(tensor: Tensor) -> Tensor:
            if self.counting:
                self._add("saved", [tensor])
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Tensors saved for backward in here are not counted (a pass the run never makes)."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def add_grads(self, clone: torch.nn.Module) -> None:
        self._add("grads", (p.grad for p in clone.parameters() if p.grad is not None))

    def bytes(self, clone: torch.nn.Module, optimizers: list[Optimizer]) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_reserved(self.device))
        self._add("resident", [*clone.parameters(), *clone.buffers()])
        self._add(
            "resident", (t for optimizer in optimizers for t in _tensors(list(optimizer.state.values())))
        )
        resident = self.groups["resident"]
        saved = {ptr: size for ptr, size in self.groups["saved"].items() if ptr not in resident}
        return sum(resident.values()) + sum(saved.values()) + sum(self.groups["grads"].values())

    def _add(self, group: str, tensors: Iterable[Tensor]) -> None:
        for tensor in tensors:
            for part in _strided_parts(tensor):
                storage = part.untyped_storage()
                self.groups[group][storage.data_ptr()] = storage.nbytes()


def _strided_parts(tensor: Tensor) -> tuple[Tensor, ...]:
    """The dense tensors that hold `tensor`'s memory: its own storage, or a sparse tensor's (the
    gradient of an ``nn.Embedding(sparse=True)``) indices and values, which have none of their own.

    Example:
        >>> sparse = torch.eye(3).to_sparse()
        >>> [part.shape for part in _strided_parts(sparse)]
        [torch.Size([2, 3]), torch.Size([3])]
    """
    if tensor.layout == torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return tensor.ccol_indices(), tensor.row_indices(), tensor.values()
    return (tensor,)


def split_batch(batch: Any, size: int) -> tuple[Any, Any] | None:
    """`batch` as two batches of its first and second halves: every tensor in it (in tuples,
    lists, mappings and dataclasses) of first dimension `size` is cut (a batch with a list of
    samples, `listed_length`, as detection batches have, is cut per sample: `slice_batch`); ``None``
    for an odd or tiny `size`, or a batch holding anything else (a per-sample list of strings
    cannot be told from a setting).

    Example:
        >>> first, second = split_batch((torch.arange(4), {"y": torch.zeros(4, 2)}), 4)
        >>> first[0].tolist(), second[1]["y"].shape
        ([0, 1], torch.Size([2, 2]))
    """
    if size < 4 or size % 2:
        return None
    half = size // 2
    if listed_length(batch) == size:  # a list of samples (detection targets, ragged sequences)
        return slice_batch(batch, 0, half, size), slice_batch(batch, half, size, size)

    def cut(value: Any) -> tuple[Any, Any] | None:
        if isinstance(value, Tensor):
            return (value[:half], value[half:]) if value.dim() and value.shape[0] == size else None
        if isinstance(value, Mapping):
            keys = list(value)
            parts = [cut(value[key]) for key in keys]
            if any(part is None for part in parts):
                return None
            return _rebuild(parts, lambda items: dict(zip(keys, items, strict=True)))
        if isinstance(value, (list, tuple)) and value:
            pieces = [cut(item) for item in value]
            if any(piece is None for piece in pieces):
                return None
            kind: Any = type(value)
            return _rebuild(pieces, kind._make if hasattr(kind, "_fields") else kind)  # namedtuples
        if is_dataclass_instance(value):  # built again through its constructor, from its init fields
            names = [f.name for f in dataclasses.fields(value) if f.init]
            parts = [cut(getattr(value, name)) for name in names]
            if any(part is None for part in parts):
                return None
            return _rebuild(parts, lambda items: _with_fields(value, names, items))
        return None

    return cut(batch)


def _rebuild(parts: list[Any], make: Callable[[Iterator[Any]], Any]) -> tuple[Any, Any]:
    """The two halves of a container whose items' halves are `parts`, made by `make`."""
    return make(part[0] for part in parts), make(part[1] for part in parts)


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif is_dataclass_instance(value):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))


def _with_fields(instance: Any, names: list[str], values: Iterable[Any]) -> Any:
    """The dataclass `instance` built again through its constructor with its fields `names` set to
    `values` (fields ``__post_init__`` derives are derived again)."""
    return dataclasses.replace(instance, **dict(zip(names, values, strict=True)))


def cross_products(
    squares: Sequence[float], crossed: float, pairs: Sequence[float]
) -> tuple[float, float, float] | None:
    """From the gradients ``g_1 .. g_k`` of independent batches: each one's squared norm
    (`squares`), the sum of every pair's product (`crossed`) and the products of disjoint pairs
    ``g_1.g_2, g_3.g_4, ...``, the mean squared norm, the mean product of a pair (an unbiased
    ``|G|^2``) and its standard error, read from the disjoint pairs (their spread over the root of
    their count: wider than the all-pairs mean's, so cautious). ``None`` with fewer than two pairs
    or a value that is not finite.

    Example (4 gradients: (2, 0), (0, 2), (2, 2), (2, 2); their 6 products sum to 24):
        >>> cross_products([4.0, 4.0, 8.0, 8.0], 24.0, [0.0, 8.0])
        (6.0, 4.0, 4.0)
    """
    k = len(squares)
    if len(pairs) < 2 or not all(map(math.isfinite, [crossed, *squares, *pairs])):
        return None
    return sum(squares) / k, crossed / (k * (k - 1) / 2), statistics.stdev(pairs) / math.sqrt(len(pairs))


def _resolved(record: Mapping[str, Any]) -> bool:
    """The cross products in `record` resolve ``|G|^2`` on its cautious side (`cautious_grad_sq`)."""
    if "cross_grad_sq" not in record:
        return False
    return cautious_grad_sq(record["cross_grad_sq"], record["cross_se"]) > 0


def _dot(first: Sequence[Tensor], second: Sequence[Tensor]) -> Tensor:
    """The dot product of two gradients given as tensor lists (each term in float32, summed in
    float64), on their device."""
    if not first:
        return torch.zeros((), dtype=torch.float64)
    terms = [flat_dot(a, b) for a, b in zip(first, second, strict=True)]  # an embedding's may be sparse
    return torch.stack(terms).double().sum()


def _grad_sq(module: torch.nn.Module) -> Tensor:
    """The squared norm of `module`'s gradient, on its device (read by the caller once, at the end)."""
    found = [p.grad for p in module.parameters() if p.grad is not None]
    dense = [grad for grad in found if grad.layout == torch.strided]
    squares = [norm.double().pow(2) for norm in torch._foreach_norm(dense)] if dense else []
    # a sparse gradient (an embedding's) apart: torch 2.5's `_foreach_norm` does not take one
    squares += [flat_dot(grad, grad).double() for grad in found if grad.layout != torch.strided]
    if not squares:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(squares).sum()


def fastest_step(step: Callable[[], None], count: int, device: torch.device) -> float:
    """Seconds of the fastest of `count` calls of `step` on `device` (`step_times`' minimum).

    Example:
        >>> fastest_step(lambda: None, 3, torch.device("cpu")) < 0.01
        True
    """
    return min(step_times(step, count, device))


def step_times(step: Callable[[], None], count: int, device: torch.device) -> list[float]:
    """Seconds of each of `count` calls of `step` on `device`.

    On CUDA each call is bracketed by CUDA events and the host waits once, at the end: the steps
    queue back to back as in training, and no host clock or per-step sync pads the figure.
    Elsewhere each call is timed with the host clock.

    Example:
        >>> len(step_times(lambda: None, 3, torch.device("cpu")))
        3
    """
    if device.type != "cuda":
        times = []
        for _ in range(count):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        return times
    with torch.cuda.device(device):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)
        ]
        for begin, end in events:
            begin.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
    return [begin.elapsed_time(end) / 1000 for begin, end in events]


def _loaded(batches: Iterator[Any], count: int, device: torch.device) -> list[Any]:
    """The next `count` of `batches`, loaded on the host (pinned for a CUDA device, as the pack's
    loaders pin there, so the step's copy is the run's); ``None`` for each one `batches` lacks."""
    taken: list[Any] = list(itertools.islice(batches, count))
    if device.type == "cuda":
        taken = [apply_to_collection(b, Tensor, _pinned) for b in taken]
    return taken + [None] * (count - len(taken))


def _pinned(tensor: Tensor) -> Tensor:
    return tensor.pin_memory() if tensor.device.type == "cpu" else tensor


def _as_it_comes(batch: Any) -> Any:
    return batch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device, after_oom: bool) -> None:
    """Release what a trial left, so the next one starts clean (an OOM may leave reference cycles)."""
    if after_oom:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
