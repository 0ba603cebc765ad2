"""channels_last (NHWC) for a convolutional model, kept where its own training step is faster.

A convolution whose weights are laid out channels-last runs NHWC kernels (oneDNN's on a CPU,
cuDNN's tensor-core ones on a GPU) without converting each input from NCHW first: PyTorch's
performance tuning guide advises it for convolutional networks, and Composer's ``ChannelsLast``
applies it to every model. Whether it pays depends on the model (on this project's 2-CPU host
EfficientNet-B0 stepped 2.16x as fast with it, the demo's small CNN 1.34x, ResNet-18 0.92x:
`python -m benchmarks channels_last`), so, as for bf16
autocast (`presets.autocast`), before the first training step two copies of the model, one of them
converted, train on one of the run's batches in alternating steps under the run's precision, and
channels_last is kept only when measurably faster (`decide_channels_last`) and when the model's
evaluation steps run with it as without it (``.view`` of an NHWC activation fails).

Only the weights move (``Module.to(memory_format=...)``, in place: the optimizers keep their
parameters); a convolution with NHWC weights gives NHWC outputs, so the batches stay as they are.
Timed on one device only: DDP takes it by hand, laid out just before DDP wraps the model, whose
gradient buckets take the weights' layout then.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import lightning as L
import torch

from lightning_boost import cache
from lightning_boost._lightning import callbacks_of, is_lightning, preserved_rng
from lightning_boost.precision import AUTOCAST_MAX_LOSS, autocast_setting, budget_spent, decide_autocast
from lightning_boost.presets.autocast import one_batch, step_cache_parts
from lightning_boost.report import Finding, Severity
from lightning_boost.step_probe import StepProbe, evaluation_failure

#: The decisions of earlier runs, in the cache directory: a warm run does not time the step again.
CACHE_FILE = "memory_format.json"


class MemoryFormatChoice(NamedTuple):
    """Whether the run's convolution weights are laid out channels-last, and why.

    Args:
        channels_last: NHWC weights; else the model is left as built (NCHW).
        speedup: the NCHW step's time over the NHWC one's, the median of adjacent pairs (>1:
            channels_last faster); ``None`` when nothing was timed.
        pairs: timed pairs behind it.
        why_not: why NCHW was kept without a timed verdict, or despite one (a step that fails in
            NHWC), or ``"set by hand"``; else ``""``.
        cached: taken from the cache, where an earlier run on this machine stored it.

    The fields are `AutocastChoice`'s, whose pair rule decides this one (`decide_channels_last`).
    """

    channels_last: bool
    speedup: float | None
    pairs: int
    why_not: str = ""
    cached: bool = False


def channels_last_setting(step: int) -> bool:
    """Whether trial step `step` runs on the channels-last copy: bf16's schedule
    (`autocast_setting`) with NCHW in bf16's place, the setting kept unless the other is faster.

    Example:
        >>> [channels_last_setting(step) for step in range(6)]
        [True, False, True, False, False, True]
    """
    return not autocast_setting(step)


def decide_channels_last(seconds: Sequence[float], final: bool = False) -> MemoryFormatChoice | None:
    """The choice once the steps timed so far (run as `channels_last_setting` says) settle it, else
    ``None``: `decide_autocast`'s rule with NCHW as the kept setting, so channels_last must be
    faster by more than `AUTOCAST_MAX_LOSS` in the median pair. A first pair of long steps in which
    it is not that much faster keeps NCHW at once: on a model it does not speed up the trial is all
    cost (the demo's ResNet-18 on 2 CPUs read 1.01x over 2 pairs, 1.2 s, in one demo by hand), and
    the gain a pair that
    close could hide is small.

    Example:
        >>> decide_channels_last([0.2, 0.3, 0.07, 0.10, 0.10, 0.07])  # 1.43x: channels_last
        MemoryFormatChoice(channels_last=True, speedup=1.429, pairs=2, why_not='', cached=False)
        >>> decide_channels_last([0.2, 0.3, 0.098, 0.10]).channels_last  # 1.02x at once: NCHW
        False
    """
    choice = decide_autocast(seconds, final, keep_at_once=1 - AUTOCAST_MAX_LOSS)
    if choice is None:
        return None
    if choice.speedup is None:
        return MemoryFormatChoice(False, None, 0, choice.why_not)
    return MemoryFormatChoice(not choice.bf16, round(1 / choice.speedup, 3), choice.pairs)


def has_conv_weights(module: torch.nn.Module) -> bool:
    """Whether `module` has a 4-D weight (a 2-D convolution's), the tensors channels_last lays out."""
    return any(parameter.dim() == 4 for parameter in module.parameters())


def is_channels_last(module: torch.nn.Module) -> bool:
    """Whether `module`'s 4-D weights are all laid out channels-last already (set by hand)."""
    weights = [p for p in module.parameters() if p.dim() == 4 and not p.is_contiguous()]
    return bool(weights) and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)


def flattening_pruning(callbacks: Sequence[object]) -> str | None:
    """The first `ModelPruning` among `callbacks` whose pruning reads each weight as one flat row,
    which fails on channels_last weights; ``None`` when none does. torch's unstructured pruning
    does (``.view(-1)``; the global one, which Lightning runs by default, ``parameters_to_vector``);
    structured pruning masks whole slices in the weight's own shape.

    Example:
        >>> from lightning.pytorch.callbacks import ModelPruning
        >>> flattening_pruning([ModelPruning("l1_unstructured")])
        "ModelPruning's global L1Unstructured pruning"
        >>> rows = ModelPruning("ln_structured", pruning_dim=0, pruning_norm=2, use_global_unstructured=False)
        >>> flattening_pruning([rows]) is None
        True
    """
    for callback in callbacks:
        if not is_lightning(callback, "ModelPruning"):
            continue
        method = getattr(callback, "pruning_fn", None)
        if isinstance(method, type):  # a `BasePruningMethod` class: global, always unstructured
            return f"ModelPruning's global {method.__name__} pruning"
        name = getattr(getattr(method, "func", method), "__name__", "")  # a partial of torch's function
        if name.endswith("_unstructured"):
            return f"ModelPruning's {name} pruning"
    return None


def choose_memory_format(trainer: L.Trainer, wanted: bool | None) -> MemoryFormatChoice | None:
    """Lay the model's weights out as `wanted` (the preset's ``channels_last``), or as timed when it
    is ``None``; ``None`` when the model has no convolution weights or lays them out itself. A
    pruning callback that flattens weights keeps NCHW untimed, and refuses NHWC set by hand: it
    would stop the fit at its first pruning, an epoch in."""
    module = trainer.lightning_module
    if not has_conv_weights(module) or is_channels_last(module):
        return None
    pruning = flattening_pruning(callbacks_of(trainer))
    if pruning is not None and wanted:
        raise ValueError(
            f"preset(channels_last=True) lays the convolution weights out NHWC, but the trainer's"
            f" {pruning} flattens each weight with `.view(-1)`, which fails on NHWC weights at its"
            " first pruning (an epoch in). Fix: preset(..., channels_last=False) (or None: NCHW is"
            " kept), or structured pruning (`ModelPruning('ln_structured', pruning_dim=0,"
            " pruning_norm=2, use_global_unstructured=False)`), which runs on NHWC weights."
        )
    if wanted is not None:
        choice = MemoryFormatChoice(wanted, None, 0, "set by hand")
    elif pruning is not None:
        why = f"{pruning} flattens each weight with `.view(-1)`, which fails on channels_last weights"
        choice = MemoryFormatChoice(False, None, 0, why)
    else:
        choice = _measured(trainer, module)
    if choice.channels_last:
        module.to(memory_format=torch.channels_last)
    return choice


def _measured(trainer: L.Trainer, module: L.LightningModule) -> MemoryFormatChoice:
    """An earlier run's choice for this machine, model, precision and batch shape, else the
    trial's (stored for the next run)."""
    if not module.automatic_optimization:
        return MemoryFormatChoice(
            False, None, 0, "manual optimization (the trial needs the step's optimizer)"
        )
    with preserved_rng():  # the batch's loader draws a seed, its transforms and the steps their own
        choice, key = _timed(trainer, module)
    if trainer.is_global_zero and not choice.why_not and not choice.cached:
        cache.store_entry(cache.default_cache_dir() / CACHE_FILE, key, {"result": choice._asdict()})
    return choice


def _timed(trainer: L.Trainer, module: L.LightningModule) -> tuple[MemoryFormatChoice, str]:
    """The choice for the run's first batch, from the cache or a trial, and its cache key (none
    without a batch)."""
    batch = one_batch(trainer)
    if batch is None:
        return MemoryFormatChoice(False, None, 0, "no training batch to time the step on"), ""
    parts = step_cache_parts(trainer, batch) | {"kind": "channels_last", "precision": str(trainer.precision)}
    key = cache.fingerprint(parts)
    cached = _cached(key)
    if cached is not None:
        return cached, key
    context = trainer.precision_plugin.forward_context
    probe = StepProbe(module, trainer.optimizers, 1, contextlib.nullcontext, context)
    choice = _trial(probe, batch, context, trainer.estimated_stepping_batches)
    return (_evaluation_agrees(probe, batch, choice) if choice.channels_last else choice), key


def _trial(probe: StepProbe, batch: Any, context: Callable[[], Any], run_steps: float) -> MemoryFormatChoice:
    """Steps alternating an NCHW and an NHWC copy until `decide_channels_last` settles, or the
    trial's time (`autocast_budget`) is spent. A failing NHWC step keeps NCHW, with its error."""
    contexts = itertools.repeat(context)
    copies = {
        False: probe.time_steps(batch, contexts),
        True: probe.time_steps(batch, contexts, torch.channels_last),
    }
    seconds: list[float] = []
    with contextlib.closing(copies[False]), contextlib.closing(copies[True]):  # frees the copies on return
        for step in itertools.count():
            nhwc = channels_last_setting(step)
            try:
                seconds.append(next(copies[nhwc]))
            except Exception as error:  # an NCHW failure is the run's own, and the run says it itself
                copy = "a channels_last copy" if nhwc else "a copy"
                return MemoryFormatChoice(
                    False, None, 0, f"the step failed on {copy} of the model ({error!r})"
                )
            choice = decide_channels_last(seconds, final=budget_spent(seconds, run_steps))
            if choice is not None:
                return choice
    raise AssertionError("unreachable: the steps never end, only a decision does")


def _evaluation_agrees(probe: StepProbe, batch: Any, choice: MemoryFormatChoice) -> MemoryFormatChoice:
    """`choice`, unless an evaluation step on a training batch runs on an NCHW copy and fails on an
    NHWC one: ``validation_step``, and ``test_step`` and ``predict_step`` where the model defines
    them. A step that fails on both (its batches differ from the training ones) tells nothing."""

    def attempt(hook: str, nhwc: bool) -> None:
        probe.evaluate(batch, hook, torch.channels_last if nhwc else torch.contiguous_format)

    failed = evaluation_failure(probe.module, attempt)
    if failed is None:
        return choice
    hook, error = failed
    why = f"{hook} failed on a channels_last copy of the model ({error!r})"
    return MemoryFormatChoice(False, choice.speedup, choice.pairs, why)


def _cached(key: str) -> MemoryFormatChoice | None:
    """The choice an earlier run stored under `key`; ``None`` when there is none or it is malformed."""
    entry, _ = cache.load_entry(cache.default_cache_dir() / CACHE_FILE, key)
    result = entry.get("result") if entry else None
    if not isinstance(result, dict) or not isinstance(result.get("channels_last"), bool):
        return None
    speedup = result.get("speedup")
    return MemoryFormatChoice(
        result["channels_last"],
        float(speedup) if isinstance(speedup, (int, float)) else None,
        int(result.get("pairs", 0)),
        cached=True,
    )


def memory_format_finding(choice: MemoryFormatChoice) -> Finding:
    """What the run's convolution weights are laid out as, and from what.

    Example:
        >>> memory_format_finding(MemoryFormatChoice(True, 1.43, 2)).title
        'channels_last: the convolutions stepped 1.43x as fast in NHWC'
    """
    data = {"channels_last": choice.channels_last, "speedup": choice.speedup, "pairs": choice.pairs}
    if choice.why_not == "set by hand":
        layout = "channels_last (NHWC)" if choice.channels_last else "NCHW"
        return _finding(f"{layout} weights, set by hand", "", "", data)
    if choice.speedup is None:
        return _finding("NCHW kept: channels_last not timed", choice.why_not, _fix(choice), data)
    source = "as an earlier run timed (cache)" if choice.cached else f"{choice.pairs} timed pair(s)"
    detail = (
        f"before training, a copy of the model in NHWC and one in NCHW alternated training steps on one"
        f" of the run's batches under its precision; median NCHW/NHWC step time {choice.speedup:.2f}"
        f" ({source}); NHWC is kept only when over {1 / (1 - AUTOCAST_MAX_LOSS):.2f}"
    )
    if choice.why_not:
        hook = choice.why_not.split(" ", 1)[0]
        title = f"NCHW kept: NHWC stepped {choice.speedup:.2f}x as fast, but {hook} fails in it"
        return _finding(title, f"{detail}; but {choice.why_not}", _fix(choice), data)
    if choice.channels_last:
        title = f"channels_last: the convolutions stepped {choice.speedup:.2f}x as fast in NHWC"
        return _finding(title, detail, "preset(..., channels_last=False)", data)
    return _finding(f"NCHW kept: channels_last steps ran {choice.speedup:.2f}x as fast", detail, "", data)


def _fix(choice: MemoryFormatChoice) -> str:
    """For pruning that flattens weights: structured pruning; for a model that fails in NHWC:
    flatten without ``.view``; else set the layout by hand."""
    if choice.why_not.startswith("ModelPruning"):
        return (
            "structured pruning (`ModelPruning('ln_structured', pruning_dim=0, pruning_norm=2,"
            " use_global_unstructured=False)`) runs on NHWC weights, which are then timed"
        )
    if "view" in choice.why_not:
        return (
            "flatten activations with `.flatten(1)` or `.reshape(...)`: `.view` cannot reshape an NHWC"
            " tensor; or preset(..., channels_last=False) to skip the trial"
        )
    return "preset(..., channels_last=True) sets it by hand"


def _finding(title: str, detail: str, fix: str, data: dict[str, Any]) -> Finding:
    return Finding("preset", "precision and strategy", Severity.INFO, title, detail, fix, data=data)
